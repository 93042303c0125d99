"""The real gRPC client against a fake Triton: readiness, a Triton that starts late, and one that is down.

The fake speaks Triton's gRPC service (server and model readiness, model config, one
streamed response), enough for :class:`specdec_openai.triton.TritonBackend` to run a
request through the same channel code that serves. Its reconnect backoff is set to
1 s here, so a call made right after a failed connect lands inside the backoff window
every time, where gRPC fails it at once unless the backend waits for the channel.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from bench.server import free_port
from specdec_openai import triton
from specdec_openai.app import MODELS, ServerConfig, create_app
from specdec_openai.triton import TritonBackend, TritonUnavailable


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Ready (or not) as told; every stream answers one final response with ``text``."""

    def __init__(self, ready_models: tuple[str, ...] = MODELS, server_ready: bool = True, text: str = "hi"):
        self.ready_models, self.server_ready, self.text = ready_models, server_ready, text

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.server_ready)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name in self.ready_models)

    async def ModelConfig(self, request, context):
        return service_pb2.ModelConfigResponse(config={"name": request.name, "max_batch_size": 0})

    async def ModelStreamInfer(self, request_iterator, context):
        await anext(aiter(request_iterator))
        outputs = {"text_output": ("BYTES", serialize_byte_tensor(np.array([self.text.encode()], np.object_)).item()),
                   "finish_reason": ("BYTES", serialize_byte_tensor(np.array([b"stop"], np.object_)).item()),
                   "num_output_tokens": ("INT32", np.array([1], np.int32).tobytes())}  # fmt: skip
        response = service_pb2.ModelInferResponse(
            outputs=[{"name": name, "datatype": datatype, "shape": [1]} for name, (datatype, _) in outputs.items()],
            raw_output_contents=[raw for _, raw in outputs.values()],
        )  # fmt: skip
        yield service_pb2.ModelStreamInferResponse(infer_response=response)


async def serve(fake: FakeTriton, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


@pytest.fixture
def long_backoff(monkeypatch):
    """Reconnect backoff fixed at 1 s (the production maximum), so the window cannot be missed."""
    args = [(k, v) for k, v in triton.channel_args() if "backoff" not in k]
    backoff = [(f"grpc.{k}_reconnect_backoff_ms", 1000) for k in ("initial", "min", "max")]
    monkeypatch.setattr(triton, "channel_args", lambda: args + backoff)


async def drain(backend: TritonBackend, model: str = "speculative_decoding") -> list:
    return [step async for step in backend.generate(model, {"text_input": "a", "stream": True})]


def test_a_request_right_after_triton_starts_listening_waits_for_the_channel(long_backoff):
    async def run():
        port = free_port()
        backend = TritonBackend(f"127.0.0.1:{port}", connect_timeout_s=5)
        with pytest.raises(TritonUnavailable):  # nothing listens yet: the channel fails and backs off
            await backend.ready_models(MODELS)
        server = await serve(FakeTriton(text="first"), port)
        try:
            steps = await drain(backend)
        finally:
            await backend.close()
            await server.stop(None)
        return steps

    steps = asyncio.run(run())
    assert [(s.text, s.finish_reason) for s in steps] == [("first", "stop")]


def test_readiness_is_the_servers_and_each_models():
    async def run():
        port = free_port()
        fake = FakeTriton(ready_models=("speculative_decoding",))
        server = await serve(fake, port)
        backend = TritonBackend(f"127.0.0.1:{port}")
        try:
            partly = await backend.ready_models(MODELS)
            fake.ready_models = MODELS
            fully = await backend.ready_models(MODELS)
            fake.server_ready = False
            with pytest.raises(TritonUnavailable, match=f"Triton at 127.0.0.1:{port} is not ready"):
                await backend.ready_models(MODELS)
        finally:
            await backend.close()
            await server.stop(None)
        return partly, fully

    assert asyncio.run(run()) == (["speculative_decoding"], list(MODELS))


def test_a_triton_that_is_down_fails_a_request_within_the_bound_in_openais_shape():
    async def run():  # the app made inside the loop that serves it, as python -m specdec_openai does
        port = free_port()
        app = create_app(ServerConfig(triton_url=f"127.0.0.1:{port}", connect_timeout_s=0.5))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://openai") as client:
            started = time.monotonic()
            response = await client.post("/v1/completions", json={"model": "ensemble", "prompt": "a"})
            elapsed = time.monotonic() - started
            health = await client.get("/health")
        await app.state.server.backend.close()
        return port, response, elapsed, health

    port, response, elapsed, health = asyncio.run(run())
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "triton_unavailable"
    assert f"Triton at 127.0.0.1:{port} did not accept a gRPC connection within 0.5 s" in error["message"]
    assert 0.4 < elapsed < 5, elapsed  # waited for the bound, not for gRPC's own connect timeout
    assert health.status_code == 503 and health.json()["error"]["code"] == "triton_unavailable"
