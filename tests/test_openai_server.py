"""The OpenAI server against a scripted Triton stream: bodies, streaming, errors, stop strings, cancellation."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from specdec_openai.app import ServerConfig, _unless_disconnected, create_app
from specdec_openai.protocol import RequestError
from specdec_openai.triton import Step, TritonUnavailable

SHIPPED_TOKENIZER = "models/tiny-target"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def steps(*pieces: str, finish: str = "length", drafted: int = 8, accepted: int = 5) -> list[Step]:
    """One step per piece, counts growing as a real stream's do; the last one finishes."""
    out = []
    for i, piece in enumerate(pieces, 1):
        out.append(Step(piece, finish if i == len(pieces) else None, 3, 2 * i, drafted * i // len(pieces),
                        accepted * i // len(pieces)))  # fmt: skip
    return out


class FakeBackend:
    """Answers every request with ``script``; records the inputs and whether each stream was closed."""

    def __init__(self, script: list[Step] | Exception | str, hang_after: int | None = None,
                 unready: tuple[str, ...] = ()):  # fmt: skip
        self.script, self.hang_after, self.unready = script, hang_after, unready
        self.requests: list[tuple[str, dict]] = []
        self.closed: list[bool] = []

    async def generate(self, model, inputs):
        self.requests.append((model, inputs))
        self.closed.append(False)
        index = len(self.closed) - 1
        try:
            if isinstance(self.script, Exception):
                raise self.script
            for i, step in enumerate(self.script):
                if self.hang_after is not None and i == self.hang_after:
                    await asyncio.Event().wait()  # a long generation
                yield step
        finally:
            self.closed[index] = True

    async def ready_models(self, models):
        if self.script == "down":
            raise TritonUnavailable("Triton at the fake endpoint did not accept a gRPC connection")
        return [model for model in models if model not in self.unready]

    async def tokenizer_dir(self):
        return SHIPPED_TOKENIZER

    async def num_speculative_tokens(self):
        return 4

    async def close(self):
        pass


def client_for(backend, **config) -> TestClient:
    return TestClient(create_app(ServerConfig(**config), backend))


def events(response) -> list:
    """The SSE data of a streamed response, ``[DONE]`` kept as a string."""
    data = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def test_completion_maps_openai_fields_onto_the_triton_inputs():
    backend = FakeBackend(steps("Hello", " world"))
    body = {"model": "speculative_decoding", "prompt": "Say", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
            "seed": 3, "stop": ["\n\n", "END"], "top_k": 2, "min_tokens": 1, "num_speculative_tokens": 2}  # fmt: skip
    response = client_for(backend).post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    model, inputs = backend.requests[0]
    assert model == "speculative_decoding"
    assert inputs == {"text_input": "Say", "stream": True, "max_tokens": 7, "temperature": 0.0, "top_p": 0.5,
                      "top_k": 2, "seed": 3, "stop_words": ["\n\n", "END"], "min_tokens": 1,
                      "num_speculative_tokens": 2}  # fmt: skip
    out = response.json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == "Hello world"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert out["metrics"]["speculative_decoding"] == {
        "draft_acceptance_rate": 5 / 8, "num_accepted_draft_tokens": 5, "num_draft_tokens": 8, "num_spec_tokens": 4}


def test_absent_temperature_samples_as_openai_does():
    backend = FakeBackend(steps("x"))
    client_for(backend).post("/v1/completions", json={"model": "ensemble", "prompt": "a"})
    assert backend.requests[0][1] == {"text_input": "a", "stream": True, "temperature": 1.0}


def test_streamed_completion_ends_with_done_and_carries_usage_and_acceptance():
    backend = FakeBackend(steps("Hel", "lo", "!", finish="stop"))
    body = {"model": "ensemble", "prompt": "a", "stream": True, "stream_options": {"include_usage": True}}
    response = client_for(backend).post("/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
    assert chunks[-1] == "[DONE]"
    texts = [c["choices"][0]["text"] for c in chunks[:-2]]
    assert "".join(texts) == "Hello!" and chunks[-3]["choices"][0]["finish_reason"] == "stop"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-3]] == [None] * (len(chunks) - 3)
    assert chunks[-3]["metrics"]["speculative_decoding"]["num_draft_tokens"] == 8
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 6


def test_stop_string_is_left_out_streamed_and_whole():
    script = steps("one E", "N", "D", finish="stop")  # Triton includes the stop word; OpenAI leaves it out
    whole = client_for(FakeBackend(script)).post("/v1/completions", json={"model": "ensemble", "prompt": "a",
                                                                          "stop": "END"})  # fmt: skip
    assert whole.json()["choices"][0]["text"] == "one "
    streamed = events(client_for(FakeBackend(script)).post(
        "/v1/completions", json={"model": "ensemble", "prompt": "a", "stop": "END", "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == "one "
    assert all("E" not in c["choices"][0]["text"] for c in streamed[:-1])  # held back, never sent then cut


def test_chat_renders_the_template_and_streams_deltas():
    backend = FakeBackend(steps("Hi", " there", finish="stop"))
    client = client_for(backend, tokenizer_dir=SHIPPED_TOKENIZER, chat_template=TEMPLATE)
    body = {"model": "ensemble", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello"}], "stream": True}  # fmt: skip
    chunks = events(client.post("/v1/chat/completions", json=body))
    assert backend.requests[0][1]["text_input"] == "<system>Be brief.\n<user>Hello\n<assistant>"
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hi there"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"
    whole = client.post("/v1/chat/completions", json={**body, "stream": False, "max_completion_tokens": 5}).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert backend.requests[1][1]["max_tokens"] == 5


def test_chat_without_a_template_is_refused_with_the_way_out():
    response = client_for(FakeBackend(steps("x"))).post(
        "/v1/chat/completions", json={"model": "ensemble", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, status, param, message", [
    ({"n": 17}, 400, "n", "less than or equal to 16"),
    ({"max_token": 5}, 400, "max_token", "unknown parameter 'max_token'"),
    ({"logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", "'presence_penalty'"),
    ({"frequency_penalty": -3}, 400, "frequency_penalty", "'frequency_penalty'"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", "'repetition_penalty'"),
    ({"logit_bias": {"50256": -101}}, 400, "logit_bias", "value -101.0 of key '50256' is outside [-100, 100]"),
    ({"logit_bias": {"a5": 1}}, 400, "logit_bias", "key 'a5' is not a token id"),
    ({"echo": True, "logprobs": 0}, 400, "echo", "prompt's tokens"),
    ({"best_of": 1, "n": 2}, 400, "best_of", "at least 'n'"),
    ({"best_of": 3, "stream": True}, 400, "best_of", "cannot be streamed"),
    ({"prompt": ["a"] * 5, "n": 4}, 400, "n", "5 prompt(s) x 4 choices is more than 16"),
    ({"prompt": [1, 2, 3]}, 400, "prompt", "token ids is not supported"),
    ({"suffix": "x"}, 400, "suffix", "fill-in-the-middle"),
    ({"temperature": 3}, 400, "temperature", "'temperature'"),
    ({"max_tokens": 0}, 400, "max_tokens", "'max_tokens'"),
    ({"prompt": []}, 400, "prompt", "empty list"),
    ({"stop": ["x", ""]}, 400, "stop", "empty string"),
    ({"model": "gpt-4"}, 404, "model", "model 'gpt-4' does not exist; served models: ensemble, speculative_decoding"),
])  # fmt: skip
def test_bad_requests_get_openai_errors_naming_the_field(body, status, param, message):
    backend = FakeBackend(steps("x"))
    response = client_for(backend).post("/v1/completions", json={"model": "ensemble", "prompt": "a", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert backend.requests == []  # refused before Triton


def test_triton_refusal_is_a_400_before_the_stream_starts():
    message = "speculative_decoding: prompt (300 tokens) + max_tokens (16) exceeds max_model_len=256"
    backend = FakeBackend(RequestError(message))
    response = client_for(backend).post("/v1/completions", json={"model": "ensemble", "prompt": "a", "stream": True})
    assert response.status_code == 400
    assert "exceeds max_model_len" in response.json()["error"]["message"]


def test_health_is_tritons_readiness_and_every_served_models():
    assert client_for(FakeBackend(steps("x"))).get("/health").status_code == 200
    down = client_for(FakeBackend("down")).get("/health")
    assert down.status_code == 503 and "did not accept" in down.json()["error"]["message"]
    loading = client_for(FakeBackend(steps("x"), unready=("ensemble",)), triton_url="t:1").get("/health")
    assert loading.status_code == 503
    assert loading.json()["error"] == {"message": "Triton at t:1: ensemble not ready", "type": "server_error",
                                       "param": None, "code": "triton_unavailable"}  # fmt: skip
    only_served = client_for(FakeBackend(steps("x"), unready=("ensemble",)), models=("speculative_decoding",))
    assert only_served.get("/health").status_code == 200  # a model this server does not serve does not count


def test_models_lists_the_ready_ones_and_is_a_503_while_triton_is_down():
    listed = client_for(FakeBackend(steps("x"), unready=("ensemble",))).get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["speculative_decoding"]
    down = client_for(FakeBackend("down")).get("/v1/models")
    assert down.status_code == 503 and down.json()["error"]["code"] == "triton_unavailable"


def test_unknown_route_and_models_list():
    client = client_for(FakeBackend(steps("x")), models=("speculative_decoding",))
    assert client.get("/v1/models").json()["data"][0]["id"] == "speculative_decoding"
    missing = client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_latency_histograms_count_requests_and_tokens():
    client = client_for(FakeBackend(steps("a", "b", "c")))
    for stream in (False, True):
        client.post("/v1/completions", json={"model": "ensemble", "prompt": "a", "stream": stream})
    text = client.get("/metrics").text
    assert 'specdec_openai_time_to_first_token_seconds_count{model="ensemble"} 2.0' in text
    assert 'specdec_openai_e2e_request_latency_seconds_count{model="ensemble"} 2.0' in text
    # 6 output tokens per request, 2 in the first response: 4 inter-token latencies each
    assert 'specdec_openai_inter_token_latency_seconds_count{model="ensemble"} 8.0' in text
    assert 'specdec_openai_request_success_total{finish_reason="length",model="ensemble"} 2.0' in text


class _Request:
    """A Starlette request whose client disconnects after ``delay`` seconds."""

    def __init__(self, delay: float):
        self.delay = delay

    async def receive(self):
        await asyncio.sleep(self.delay)
        return {"type": "http.disconnect"}


def test_client_disconnect_cancels_the_triton_stream():
    backend = FakeBackend(steps("a", "b", "c"), hang_after=1)

    async def run():
        stream = backend.generate("ensemble", {})

        async def drain():
            return [step async for step in stream]

        with pytest.raises(Exception) as raised:
            await _unless_disconnected(_Request(0.05), drain())
        return raised.type.__name__

    assert asyncio.run(run()) == "ClientGone"
    assert backend.closed == [True]


def test_warm_up_loads_the_chat_template_once_triton_answers(monkeypatch):
    """Under serve.sh Triton is still loading when this server starts: warm-up asks again until it answers."""
    from specdec_openai import app as app_module
    from specdec_openai.triton import TritonUnavailable

    answers = [TritonUnavailable("not yet"), TritonUnavailable("not yet"), SHIPPED_TOKENIZER]

    class LoadingBackend(FakeBackend):
        async def tokenizer_dir(self):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    loaded = []
    monkeypatch.setattr(app_module.ChatTemplate, "load", staticmethod(lambda d, t: loaded.append(d) or object()))
    server = app_module.OpenAIServer(ServerConfig(), LoadingBackend(steps("x")))
    asyncio.run(server.warm_up(retry_s=0.01))
    assert loaded == [SHIPPED_TOKENIZER] and answers == []


def test_a_chat_template_path_to_no_file_is_refused_not_rendered(tmp_path):
    from specdec_openai.chat import read_template

    path = tmp_path / "chat.jinja"
    with pytest.raises(ValueError, match="no such file"):
        read_template(str(path))
    path.write_text(TEMPLATE)
    assert read_template(str(path)) == TEMPLATE == read_template(TEMPLATE)


def test_chat_text_parts_are_joined_and_other_parts_refused():
    backend = FakeBackend(steps("x"))
    client = client_for(backend, tokenizer_dir=SHIPPED_TOKENIZER, chat_template=TEMPLATE)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "again"}]
    ok = client.post("/v1/chat/completions",
                     json={"model": "ensemble", "messages": [{"role": "user", "content": parts}]})
    assert ok.status_code == 200 and backend.requests[0][1]["text_input"] == "<user>Hello\nagain\n<assistant>"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    refused = client.post("/v1/chat/completions",
                          json={"model": "ensemble", "messages": [{"role": "user", "content": image}]})
    assert refused.status_code == 400 and "'image_url'" in refused.json()["error"]["message"]
