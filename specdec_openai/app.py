"""The FastAPI app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

Each choice of a request becomes one streamed Triton request (:mod:`specdec_openai.triton`),
run together (:mod:`specdec_openai.generation`). Each one's
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
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from specdec_openai.auth import ApiKeyMiddleware
from specdec_openai.chat import ChatTemplate
from specdec_openai.metrics import LatencyMetrics, RequestTimer
from specdec_openai.generation import ChoiceStream, Generation, error_of
from specdec_openai.logprobs import Vocabulary
from specdec_openai.protocol import (
    ChatCompletionRequest, CompletionRequest, Plan, RequestError, chat_plan, completion_plan, name_logit_bias,
)  # fmt: skip
from specdec_openai.responses import Envelope, error_body
from specdec_openai.structured import Guide, name_guide_field, with_guide
from specdec_openai.tools import tool_choice_of
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
        self._vocabulary: Vocabulary | None = None
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

    async def vocabulary(self) -> Vocabulary:
        """Token ids -> OpenAI's token texts and bytes, for logprobs: the chat template's tokenizer, or the same."""
        async with self._lock:
            if self._vocabulary is None:
                tokenizer = getattr(self._template, "tokenizer", None)
                if tokenizer is None:
                    from specdec.tokenizer import load_tokenizer

                    directory = self.config.tokenizer_dir or await self.backend.tokenizer_dir()
                    tokenizer = await asyncio.to_thread(load_tokenizer, directory)
                self._vocabulary = Vocabulary(tokenizer)
            return self._vocabulary

    async def answer(self, request: Request, envelope: Envelope, plan: Plan, stream: bool,
                     include_usage: bool, guide: Guide | None = None) -> Response:  # fmt: skip
        """Start every choice's Triton request, await each one's first response, then answer.

        ``guide``: the request's structured output guide, whose field a refusal of it names."""
        vocabulary = await self.vocabulary() if plan.needs_tokens else None
        timers = [self.metrics.timer(envelope.model) for _ in plan.choices]
        streams = [self.backend.generate(envelope.model, params.triton_inputs()) for params in plan.choices]
        try:
            firsts = await _unless_disconnected(request, _first_responses(streams))
        except BaseException as err:
            await asyncio.gather(*(steps.aclose() for steps in streams), return_exceptions=True)
            if isinstance(err, RequestError):
                raise name_logit_bias(name_guide_field(err, guide)) from None
            raise
        if any(first is None for first in firsts):
            await asyncio.gather(*(steps.aclose() for steps in streams), return_exceptions=True)
            raise TritonUnavailable(f"{envelope.model} answered no response")
        choices = [ChoiceStream(params, first, steps, timer, vocabulary)
                   for params, first, steps, timer in zip(plan.choices, firsts, streams, timers)]  # fmt: skip
        generation = Generation(envelope, plan, choices, vocabulary, await self.num_spec_tokens())
        if stream:
            events = generation.events(include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        body = await _unless_disconnected(request, generation.whole())
        return JSONResponse(body)


async def _first_responses(streams: list[AsyncIterator[Step]]) -> list[Step | None]:
    """Each stream's first response, awaited together; one failing cancels the rest's wait."""
    tasks = [asyncio.ensure_future(anext(steps, None)) for steps in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
        status, body = error_of(err)
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
        plan, guide = with_guide(completion_plan(body), body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await server.answer(request, Envelope.new("completion", body.model), plan, body.stream, include_usage,
                                   guide)  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        tools = tool_choice_of(body.tools, body.tool_choice, body.parallel_tool_calls)
        template = await server.chat_template()
        prompt = template.render(body.messages, body.add_generation_prompt, body.chat_template_kwargs or {},
                                 list(tools.tools) if tools else None)  # fmt: skip
        tool_guide = tools.guide() if tools else None
        plan, guide = with_guide(chat_plan(body, prompt), body,
                                 Guide("structural_tag", tool_guide, "tools") if tool_guide else None)  # fmt: skip
        plan = replace(plan, tools=tools if tools is not None and tools.parses else None)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await server.answer(request, Envelope.new("chat", body.model), plan, body.stream, include_usage, guide)

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
