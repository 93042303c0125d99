"""The Triton side: one streamed generate request over gRPC, and what the server is asked once.

Every request goes to Triton with ``stream`` set, also when the OpenAI client asked for
one response: the pieces concatenate to the non-streamed text byte for byte (the
model's contract), and only a stream shows when the first token came, which the
latency histograms need. Closing the stream early (a client that went away) cancels the
gRPC call, and Triton cancels the request: through ``speculative_decoding`` the
sequence stops within a step; through ``ensemble`` Triton 2.51 drops the responses but
the sequence runs on (``docs/scheduling.md#why-the-ensemble-is-one-step``).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from specdec_openai.protocol import RequestError

# Public inputs and their Triton datatypes (docs/serving.md#inputs-and-outputs).
INPUT_TYPES = {
    "text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32",
    "top_k": "INT32", "min_p": "FP32", "seed": "UINT64", "stop_words": "BYTES", "min_tokens": "INT32",
    "num_speculative_tokens": "INT32", "presence_penalty": "FP32", "frequency_penalty": "FP32",
    "repetition_penalty": "FP32", "return_log_probs": "BOOL", "num_top_log_probs": "INT32", "logit_bias_ids": "INT32",
    "logit_bias_values": "FP32", "guided_decoding_guide_type": "BYTES", "guided_decoding_guide": "BYTES",
}  # fmt: skip
_NUMPY = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
ORCHESTRATOR = "speculative_decoding"  # holds num_speculative_tokens; the ensemble's one step
CONNECT_TIMEOUT_S = 5.0  # a request's wait for the channel: the 1 s reconnect backoff, and slack for a loaded host
HEALTH_TIMEOUT_S = 2.0  # a readiness probe's calls: below uvicorn's and most probes' patience


@dataclass(frozen=True)
class Step:
    """One streamed Triton response: the new text and the request's counts so far."""

    text: str
    finish_reason: str | None  # "stop" | "length" on the last response, else None
    num_input_tokens: int
    num_output_tokens: int
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    token_ids: tuple[int, ...] = ()  # the tokens this response adds (output_token_ids)
    log_probs: tuple[float, ...] = ()  # theirs, with return_log_probs (output_log_probs)
    cum_log_prob: float = 0.0  # of the output so far, with return_log_probs (cum_log_probs)
    # each token's likeliest alternatives, with num_top_log_probs (output_top_token_ids, output_top_log_probs)
    top: tuple[tuple[tuple[int, float], ...], ...] = ()


class TritonUnavailable(RuntimeError):
    """Triton could not be reached or did not answer (HTTP 503 to the client)."""


class Backend(Protocol):
    """What the OpenAI server needs from Triton; a fake implements it in the tests."""

    def generate(self, model: str, inputs: dict[str, Any]) -> AsyncIterator[Step]: ...
    async def ready_models(self, models: tuple[str, ...]) -> list[str]: ...
    async def tokenizer_dir(self) -> str: ...
    async def num_speculative_tokens(self) -> int | None: ...
    async def close(self) -> None: ...


def step_of(outputs: dict[str, Any]) -> Step:
    """A :class:`Step` from one response's outputs (name -> value)."""
    return Step(
        text=_text(outputs["text_output"]),
        finish_reason=_text(outputs.get("finish_reason", "")) or None,
        num_input_tokens=int(_scalar(outputs.get("num_input_tokens", 0))),
        num_output_tokens=int(_scalar(outputs.get("num_output_tokens", 0))),
        total_draft_tokens=int(_scalar(outputs.get("total_draft_tokens", 0))),
        total_accepted_draft_tokens=int(_scalar(outputs.get("total_accepted_draft_tokens", 0))),
        token_ids=tuple(int(t) for t in _flat(outputs.get("output_token_ids"))),
        log_probs=tuple(float(p) for p in _flat(outputs.get("output_log_probs"))),
        cum_log_prob=float(_scalar(outputs.get("cum_log_probs", 0.0))),
        top=_alternatives(outputs.get("output_top_token_ids"), outputs.get("output_top_log_probs")),
    )


def _alternatives(ids: Any, values: Any) -> tuple[tuple[tuple[int, float], ...], ...]:
    """``[..., tokens, n]`` ids and log probabilities as one tuple of (id, log prob) pairs per token."""
    if ids is None or values is None or np.asarray(ids).size == 0:
        return ()
    ids, values = np.asarray(ids), np.asarray(values)
    n = ids.shape[-1]
    return tuple(tuple(zip(map(int, i), map(float, v))) for i, v in zip(ids.reshape(-1, n), values.reshape(-1, n)))


def _flat(value: Any) -> list:
    return [] if value is None else np.asarray(value).reshape(-1).tolist()


def _scalar(value: Any) -> Any:
    return np.asarray(value).reshape(-1)[0] if isinstance(value, np.ndarray) else value


def _text(value: Any) -> str:
    value = _scalar(value)
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TritonBackend:
    """``tritonclient.grpc.aio`` against one Triton server (``host:port`` of its gRPC endpoint).

    Every call on a request's path first waits, at most ``connect_timeout_s``, for the
    channel to be connected (:meth:`_connected`); the health answers do not wait.
    """

    def __init__(self, url: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        import tritonclient.grpc.aio as grpcclient  # here: the unit tests use a fake backend

        self._grpc = grpcclient
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.client = grpcclient.InferenceServerClient(url, channel_args=channel_args())
        self._batched: dict[str, bool] = {}  # model -> whether it takes a leading batch dimension

    async def _connected(self) -> None:
        """Return once the channel to Triton is connected; :class:`TritonUnavailable` after ``connect_timeout_s``.

        gRPC fails a call at once while its channel waits out a reconnect backoff (calls are
        not ``wait_for_ready``, and tritonclient offers no way to ask for it), so the first
        request after Triton started listening could get "failed to connect to all
        addresses" although Triton was up. Waiting for the channel instead costs nothing
        once it is connected and at most the (1 s) backoff when it is not; a Triton that is
        really down fails the request after the bound, naming the address.
        """
        import grpc

        channel = self.client._channel  # tritonclient's own; it exposes no readiness call
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(channel.channel_ready(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            state = channel.get_state().name
            raise TritonUnavailable(f"Triton at {self.url} did not accept a gRPC connection within "
                                    f"{self.connect_timeout_s:g} s (channel {state})") from None  # fmt: skip

    async def _takes_batch_dimension(self, model: str) -> bool:
        """``ensemble`` (``max_batch_size`` 1, as TensorRT-LLM's) wants ``[1, n]``; ``speculative_decoding`` ``[n]``."""
        if model not in self._batched:
            config = await _call(self.client.get_model_config(model))
            self._batched[model] = config.config.max_batch_size > 0
        return self._batched[model]

    async def generate(self, model: str, inputs: dict[str, Any]) -> AsyncIterator[Step]:
        """The request's responses until the final one; leaving early cancels the request."""
        await self._connected()
        done = asyncio.Event()
        tensors = self._inputs(inputs, await self._takes_batch_dimension(model))

        async def requests():
            yield {"model_name": model, "inputs": tensors}
            await done.wait()  # keep the stream open until the last response: closing it may end the call

        responses = self.client.stream_infer(requests())
        try:
            async for result, error in _guarded(responses):
                if error is not None:
                    raise RequestError(f"{model}: {error.message()}")
                raw = result.get_response()
                if not raw.outputs:  # an empty final response
                    return
                step = step_of({out.name: result.as_numpy(out.name) for out in raw.outputs})
                yield step
                if step.finish_reason is not None or _is_final(raw):
                    return
        finally:
            done.set()
            responses.cancel()  # a no-op once the call has ended; else Triton cancels the request

    def _inputs(self, values: dict[str, Any], batched: bool) -> list:
        tensors = []
        for name, value in values.items():
            datatype = INPUT_TYPES[name]
            items = value if isinstance(value, (list, tuple)) else [value]
            if datatype == "BYTES":
                items = [item.encode("utf-8") for item in items]
            array = np.array(items, dtype=_NUMPY[datatype])  # [1], or [num stop words]
            array = array.reshape(1, -1) if batched else array  # [1, 1], or [1, num stop words]
            tensor = self._grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    async def ready_models(self, models: tuple[str, ...]) -> list[str]:
        """Those of ``models`` that Triton, asked over this client's channel, reports ready.

        :class:`TritonUnavailable` when the server does not answer within ``HEALTH_TIMEOUT_S``
        or answers that it is not ready. Nothing waits for the channel: a probe wants the
        state now, and a channel between connection attempts is a 503 for at most the 1 s
        backoff, after which it connects or Triton is really not there.
        """
        try:
            ready = await _call(self.client.is_server_ready(client_timeout=HEALTH_TIMEOUT_S))
        except TritonUnavailable as err:
            raise TritonUnavailable(f"Triton at {self.url} does not answer: {err}") from None
        if not ready:
            raise TritonUnavailable(f"Triton at {self.url} is not ready")
        answers = await asyncio.gather(*(self._model_ready(model) for model in models))
        return [model for model, ready in zip(models, answers) if ready]

    async def _model_ready(self, model: str) -> bool:
        """Triton's answer for ``model``; an error (a model it does not know) is not ready."""
        try:
            return bool(await _call(self.client.is_model_ready(model, client_timeout=HEALTH_TIMEOUT_S)))
        except TritonUnavailable:
            return False

    async def tokenizer_dir(self) -> str:
        """The directory the ``tokenizer`` model loaded (its ``describe`` answer)."""
        await self._connected()
        describe = self._grpc.InferInput("describe", [1], "BOOL")
        describe.set_data_from_numpy(np.array([True]))
        output = self._grpc.InferRequestedOutput("describe_model")
        result = await _call(self.client.infer("tokenizer", [describe], outputs=[output]))
        return _text(result.as_numpy("describe_model"))

    async def num_speculative_tokens(self) -> int | None:
        """The orchestrator's configured k, the longest acceptance histogram; None if not readable."""
        await self._connected()
        config = await _call(self.client.get_model_config(ORCHESTRATOR, as_json=True))
        value = config.get("config", {}).get("parameters", {}).get("num_speculative_tokens", {})
        text = value.get("string_value", "")
        return int(text) if text.isdigit() else None

    async def close(self) -> None:
        await self.client.close()


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's own channel options, and a reconnect backoff of at most a second.

    Under serve.sh this server starts while Triton is still loading its models, and asks
    it for the chat template's tokenizer meanwhile. gRPC's default backoff grows to two
    minutes between connection attempts, and calls fail at once while it waits, so
    requests would fail long after Triton is ready.
    """
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _is_final(raw) -> bool:
    param = raw.parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)


async def _guarded(responses) -> AsyncIterator:
    """The stream's (result, error) pairs, with transport failures as :class:`TritonUnavailable`."""
    import grpc

    iterator = responses.__aiter__()
    while True:
        try:
            item = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                raise asyncio.CancelledError() from err
            raise TritonUnavailable(f"Triton at the gRPC endpoint: {err.code().name}: {err.details()}") from None
        yield item


async def _call(awaitable):
    """Await a unary Triton call; a server that cannot be reached becomes :class:`TritonUnavailable`."""
    from tritonclient.utils import InferenceServerException

    try:
        return await awaitable
    except InferenceServerException as err:
        raise TritonUnavailable(str(err)) from None
