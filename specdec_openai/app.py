"""The FastAPI app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

Each request becomes one streamed Triton request (:mod:`specdec_openai.triton`). Its
first response is awaited before the HTTP response starts, so a request Triton refuses
(a prompt past ``max_model_len``, a bad ``top_p``) gets a 400 with Triton's message in
OpenAI's error shape, streamed or not. A client that goes away cancels the Triton
request: a streamed one when Starlette sees the disconnect, a whole one through a task
that waits for it beside the generation.

``/health`` and ``/v1/models`` reflect Triton's readiness, asked each time: the server
and every served model ready (``/v1/models`` lists the ready ones), so a load balancer
sends nothing here before a request could be served. With ``api_key`` set, every
``/v1`` request must carry it (:mod:`specdec_openai.auth`).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from specdec_openai.auth import ApiKeyMiddleware
from specdec_openai.chat import ChatTemplate
from specdec_openai.metrics import LatencyMetrics, RequestTimer
from specdec_openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateParams,
    RequestError,
    chat_params,
    completion_params,
)
from specdec_openai.responses import Envelope, error_body, sse
from specdec_openai.stops import StopTrimmer
from specdec_openai.triton import CONNECT_TIMEOUT_S, Backend, Step, TritonBackend, TritonUnavailable

MODELS = ("ensemble", "speculative_decoding")
T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    triton_url: str = "localhost:8001"  # Triton's gRPC endpoint
    models: tuple[str, ...] = MODELS  # served names = the Triton models they call
    tokenizer_dir: str | None = None  # for the chat template; None: the directory Triton's tokenizer model loaded
    chat_template: str | None = None  # a Jinja template or a file; None: the tokenizer's own
    connect_timeout_s: float = CONNECT_TIMEOUT_S  # a request's wait for the gRPC channel to Triton
    api_key: str | None = field(default=None, repr=False)  # required on /v1 requests; None: open. Never printed


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class OpenAIServer:
    """The state behind the routes: the Triton backend, the chat template (loaded on first use), the metrics."""

    def __init__(self, config: ServerConfig, backend: Backend):
        self.config, self.backend = config, backend
        self.metrics = LatencyMetrics()
        self._template: ChatTemplate | None = None
        self._k: int | None = None
        self._lock = asyncio.Lock()

    async def chat_template(self) -> ChatTemplate:
        async with self._lock:
            if self._template is None:
                directory = self.config.tokenizer_dir or await self.backend.tokenizer_dir()
                self._template = await asyncio.to_thread(ChatTemplate.load, directory, self.config.chat_template)
            return self._template

    async def warm_up(self, retry_s: float = 2.0) -> None:
        """Load the chat template before the first chat request needs it (importing transformers takes
        seconds), asking Triton again until it answers: under serve.sh it is still loading its models."""
        while True:
            try:
                await self.chat_template()
                return
            except TritonUnavailable:
                await asyncio.sleep(retry_s)
            except Exception as err:  # a bad --tokenizer or template: each chat request will name it
                print(f"[specdec_openai] chat template not loaded: {err}", flush=True)
                return

    async def num_spec_tokens(self) -> int | None:
        if self._k is None:
            try:
                self._k = await self.backend.num_speculative_tokens()
            except TritonUnavailable:
                return None
        return self._k

    async def not_ready(self) -> str | None:
        """Why this server cannot serve now (Triton, or a served model, not ready); None when it can."""
        try:
            ready = await self.backend.ready_models(self.config.models)
        except TritonUnavailable as err:
            return str(err)
        missing = [model for model in self.config.models if model not in ready]
        return f"Triton at {self.config.triton_url}: {', '.join(missing)} not ready" if missing else None

    def check_model(self, model: str) -> None:
        if model not in self.config.models:
            raise RequestError(
                f"model '{model}' does not exist; served models: {', '.join(self.config.models)}",
                "model", status=404, code="model_not_found",
            )  # fmt: skip

    async def answer(self, request: Request, envelope: Envelope, params: GenerateParams, stream: bool,
                     include_usage: bool) -> Response:  # fmt: skip
        timer = self.metrics.timer(envelope.model)
        steps = self.backend.generate(envelope.model, params.triton_inputs())
        try:
            first = await _unless_disconnected(request, anext(steps, None))
        except BaseException:
            await steps.aclose()
            raise
        if first is None:
            raise TritonUnavailable(f"{envelope.model} answered no response")
        k = await self.num_spec_tokens()
        generation = Generation(envelope, StopTrimmer(params.stop_words), timer, k)
        if stream:
            events = generation.events(first, steps, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        body = await _unless_disconnected(request, generation.whole(first, steps))
        return JSONResponse(body)


class Generation:
    """One request's Triton steps turned into OpenAI text: stop strings cut, latencies timed."""

    def __init__(self, envelope: Envelope, trimmer: StopTrimmer, timer: RequestTimer, k: int | None):
        self.envelope, self.trimmer, self.timer, self.k = envelope, trimmer, timer, k

    async def _steps(self, first: Step, rest: AsyncIterator[Step]) -> AsyncIterator[tuple[str, Step]]:
        """(text that may be sent now, step) per step; the last step's text includes what was held back."""
        try:
            step = first
            while True:
                self.timer.on_response(step.num_output_tokens)
                text = self.trimmer.push(step.text)
                if step.finish_reason is not None:
                    yield text + self.trimmer.finish(step.finish_reason), step
                    self.timer.finish(step.finish_reason)
                    return
                yield text, step
                step = await anext(rest, None)
                if step is None:
                    raise TritonUnavailable("the Triton stream ended without a final response")
        finally:
            await rest.aclose()  # early exit (disconnect, error): cancels the Triton request

    async def whole(self, first: Step, rest: AsyncIterator[Step]) -> dict[str, Any]:
        pieces, last = [], first
        async for text, last in self._steps(first, rest):
            pieces.append(text)
        return self.envelope.response("".join(pieces), last.finish_reason, last, self.k)

    async def events(self, first: Step, rest: AsyncIterator[Step], include_usage: bool) -> AsyncIterator[bytes]:
        opening = self.envelope.first_chunk()
        if opening is not None:
            yield sse(opening)
        try:
            async for text, step in self._steps(first, rest):
                if step.finish_reason is not None:
                    yield sse(self.envelope.final_chunk(text, step.finish_reason, step, self.k))
                    if include_usage:
                        yield sse(self.envelope.usage_chunk(step))
                elif text:
                    yield sse(self.envelope.chunk(text))
        except (RequestError, TritonUnavailable) as err:  # after the stream started: the error is an event
            yield sse(_error_of(err)[1])
        yield sse("[DONE]")


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # its clean-up (closing the Triton stream) runs before we go on
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_of(err: Exception) -> tuple[int, dict[str, Any]]:
    if isinstance(err, RequestError):
        return err.status, error_body(err.message, param=err.param, code=err.code)
    return 503, error_body(str(err), "server_error", code="triton_unavailable")


def create_app(config: ServerConfig = ServerConfig(), backend: Backend | None = None) -> FastAPI:
    """The app; ``backend`` defaults to a gRPC client of ``config.triton_url``."""
    server = OpenAIServer(config, backend or TritonBackend(config.triton_url, config.connect_timeout_s))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        warm_up = asyncio.ensure_future(server.warm_up())
        try:
            yield
        finally:
            warm_up.cancel()
            await server.backend.close()

    app = FastAPI(title="specdec OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key)

    @app.exception_handler(RequestError)
    @app.exception_handler(TritonUnavailable)
    async def _request_error(_: Request, err: Exception) -> JSONResponse:
        status, body = _error_of(err)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(err), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), code=str(err.status_code)), status_code=err.status_code)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for a client that closed

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The served models Triton reports ready; 503 while Triton itself is not."""
        ready = await server.backend.ready_models(config.models)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "specdec"}
                for name in config.models if name in ready]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        params = completion_params(body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await server.answer(request, Envelope.new("completion", body.model), params, body.stream, include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        template = await server.chat_template()
        prompt = template.render(body.messages, body.add_generation_prompt, body.chat_template_kwargs or {})
        params = chat_params(body, prompt)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await server.answer(request, Envelope.new("chat", body.model), params, body.stream, include_usage)

    @app.get("/health")
    async def health() -> Response:
        """200 once Triton and every served model answer ready through this server's connection, else 503."""
        reason = await server.not_ready()
        if reason is None:
            return Response(status_code=200)
        return JSONResponse(error_body(reason, "server_error", code="triton_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def validation_error_body(err: RequestValidationError) -> dict[str, Any]:
    """The first problem pydantic found, named as OpenAI names parameters."""
    first = err.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        message = f"unknown parameter '{param}'"
    elif param:
        message = f"'{param}': {first.get('msg')} (got {first.get('input')!r})"
    else:
        message = str(first.get("msg"))
    return error_body(message, param=param)
