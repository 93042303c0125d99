"""Through a real server and the real ``openai`` client: the OpenAI API gives the ensemble's greedy text.

The session's tritonserver runs with ``serve.sh --openai-port``; standalone OpenAI
servers (``python -m specdec_openai``) against the same Triton have a chat template,
which the shipped tokenizer lacks, and one of them an API key.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from client.generate import generate_http
from test_concurrency import output_tokens, wait_until_idle
from triton_server import REPO_ROOT, models_dir

from bench.server import free_port

pytestmark = pytest.mark.server

MAX_TOKENS = 32
PROMPTS = ["Once upon a time", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Grüße aus München! Ça va très bien,", "1, 2, 3, 4, 5, 6, 7,", "<html><body><p>"]  # fmt: skip
TEMPLATE = ("{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
API_KEY = "sk-e2e-4fTq9"
CHATS = [[{"role": "user", "content": "Write a function that adds two numbers."}],
         [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Once upon a time"}]]


def rendered(messages: list[dict]) -> str:
    """TEMPLATE by hand: the prompt the server must send to Triton."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


@pytest.fixture(scope="module")
def openai_server(server):
    """The session's server (conftest), which serves the OpenAI API too."""
    return server


def standalone(openai_server, tmp_path_factory, env: dict[str, str] | None = None):
    """A standalone OpenAI server with TEMPLATE against the session's Triton, ready (its ``/health``, which
    needs no key, answers 200): yields its base URL, and stops it after."""
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    command = [sys.executable, "-m", "specdec_openai", "--triton-url", openai_server.grpc_url, "--port", str(port),
               "--host", "127.0.0.1", "--chat-template", str(template), "--exit-with", str(os.getpid())]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            break
        except OSError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail(f"the standalone OpenAI server did not start (exit code {process.poll()})")
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def chat_url(openai_server, tmp_path_factory):
    """A standalone OpenAI server with TEMPLATE: its base URL."""
    yield from standalone(openai_server, tmp_path_factory)


@pytest.fixture(scope="module")
def keyed_url(openai_server, tmp_path_factory):
    """A standalone OpenAI server with TEMPLATE and API_KEY (from its environment, as serve.sh gives it)."""
    yield from standalone(openai_server, tmp_path_factory, {"SPECDEC_OPENAI_API_KEY": API_KEY})


def token_ids_of(token: str) -> list[int]:
    """The ids whose text is ``token`` (the served tokenizer's)."""
    from specdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(models_dir() / "tiny-target")
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == token]


def generate_text(server, prompt: str) -> str:
    """The reference: ``/v2/models/ensemble/generate``, greedy, the prompt left out."""
    result = generate_http(server.http_url, "ensemble", prompt,
                           {"max_tokens": MAX_TOKENS, "temperature": 0.0, "exclude_input_in_output": True})  # fmt: skip
    return result.text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_give_the_ensembles_greedy_text(openai_server, stream):
    client = openai.OpenAI(base_url=openai_server.openai_url, api_key="unused")
    drafted = 0
    for prompt in PROMPTS:
        kwargs = {"model": "ensemble", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
            figures, usage = final.model_extra["metrics"]["speculative_decoding"], chunks[-1].usage
        else:
            completion = client.completions.create(**kwargs)
            text, usage = completion.choices[0].text, completion.usage
            figures = completion.model_extra["metrics"]["speculative_decoding"]
        assert text and text == generate_text(openai_server, prompt), prompt
        assert usage.completion_tokens <= MAX_TOKENS and usage.prompt_tokens > 0
        assert figures["num_spec_tokens"] == 8  # the committed num_speculative_tokens
        assert 0 <= figures["num_accepted_draft_tokens"] <= figures["num_draft_tokens"]
        drafted += figures["num_draft_tokens"]
    assert drafted > 0
    metrics = httpx.get(openai_server.openai_url.removesuffix("/v1") + "/metrics").text
    assert 'specdec_openai_time_to_first_token_seconds_count{model="ensemble"}' in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_chat_gives_the_greedy_text_of_the_rendered_prompt(openai_server, chat_url, stream):
    client = openai.OpenAI(base_url=chat_url, api_key="unused")
    for messages in CHATS:
        kwargs = {"model": "speculative_decoding", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert text and text == generate_text(openai_server, rendered(messages))


def test_errors_come_in_openais_shape(openai_server):
    client = openai.OpenAI(base_url=openai_server.openai_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
        client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="logit_bias.*99999"):  # past the vocabulary: the model's refusal
        client.completions.create(model="ensemble", prompt="hi", logit_bias={"99999": 5})
    with pytest.raises(openai.NotFoundError, match="served models: ensemble, speculative_decoding"):
        client.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len"):  # Triton's refusal, streamed or not
        client.completions.create(model="ensemble", prompt="hi", max_tokens=10**5, stream=True)
    assert [m.id for m in client.models.list()] == ["ensemble", "speculative_decoding"]


def test_a_stop_string_ends_the_text_and_the_sequence(openai_server):
    """The stop string is cut out of the greedy text, wherever tokens split it, and the sequence stops with it."""
    client = openai.OpenAI(base_url=openai_server.openai_url, api_key="unused", max_retries=0)
    prompt, max_tokens = PROMPTS[0], 1500
    reference = generate_text(openai_server, prompt)
    stop = reference[len(reference) // 2 :][:3]  # three characters from the middle, likely inside a token
    before = output_tokens(openai_server)
    for stream in (False, True):
        kwargs = {"model": "speculative_decoding", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "stop": [stop], "extra_body": {"num_speculative_tokens": 1}}  # fmt: skip
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert text == reference[: reference.find(stop)] and finish == "stop", stream
    wait_until_idle(openai_server, timeout_s=10)
    generated = output_tokens(openai_server) - before
    assert generated < max_tokens / 4, f"{generated} tokens generated for two requests that stopped within 32"


def test_logprobs_several_choices_penalties_and_echo(openai_server):
    client = openai.OpenAI(base_url=openai_server.openai_url, api_key="unused", max_retries=0)
    prompt = PROMPTS[1]
    completion = client.completions.create(model="speculative_decoding", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=0)  # fmt: skip
    greedy = completion.choices[0]
    assert greedy.text == generate_text(openai_server, prompt)
    assert "".join(greedy.logprobs.tokens) == greedy.text and all(lp <= 0 for lp in greedy.logprobs.token_logprobs)
    assert greedy.logprobs.text_offset[0] == 0 and len(greedy.logprobs.tokens) == completion.usage.completion_tokens
    sampled = client.completions.create(model="speculative_decoding", prompt=[prompt, PROMPTS[0]], n=2, seed=3,
                                        max_tokens=8, temperature=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                                        extra_body={"repetition_penalty": 1.1})  # fmt: skip
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3] and all(c.text for c in sampled.choices)
    best = client.completions.create(model="ensemble", prompt=prompt, best_of=3, max_tokens=8, temperature=0.9,
                                     echo=True)  # fmt: skip
    assert len(best.choices) == 1 and best.choices[0].text.startswith(prompt)


def test_a_client_that_goes_away_cancels_the_sequence(openai_server):
    max_tokens = 1500
    before = output_tokens(openai_server)
    body = {"model": "speculative_decoding", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "num_speculative_tokens": 1}  # fmt: skip
    with httpx.stream("POST", f"{openai_server.openai_url}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):  # a few events, then hang up
            next(line for line in lines if line.startswith("data: "))
    wait_until_idle(openai_server, timeout_s=10)
    generated = output_tokens(openai_server) - before
    assert generated < max_tokens / 4, f"{generated} of {max_tokens} tokens generated after the client left"


def test_an_api_key_guards_every_v1_endpoint_and_the_right_key_is_served(keyed_url):
    chat = [{"role": "user", "content": "Once upon a time"}]
    calls = {
        "models": lambda client: [m.id for m in client.models.list()],
        "completions": lambda client: client.completions.create(
            model="ensemble", prompt="Once upon a time", max_tokens=4, temperature=0).choices[0].text,
        "streamed completions": lambda client: "".join(c.choices[0].text for c in client.completions.create(
            model="speculative_decoding", prompt="Once upon a time", max_tokens=4, temperature=0, stream=True)),
        "chat": lambda client: client.chat.completions.create(
            model="speculative_decoding", messages=chat, max_tokens=4, temperature=0).choices[0].message.content,
    }  # fmt: skip
    wrong = openai.OpenAI(base_url=keyed_url, api_key=API_KEY + "x", max_retries=0)
    right = openai.OpenAI(base_url=keyed_url, api_key=API_KEY, max_retries=0)
    for name, call in calls.items():
        with pytest.raises(openai.AuthenticationError) as refused:
            call(wrong)
        assert refused.value.body["code"] == "invalid_api_key" and API_KEY not in str(refused.value.body), name
        assert call(right), name
    for method, path, body in [("GET", "/models", None), ("POST", "/completions", {"model": "ensemble", "prompt": "a"}),
                               ("POST", "/chat/completions", {"model": "ensemble", "messages": chat})]:  # fmt: skip
        missing = httpx.request(method, keyed_url + path, json=body, timeout=30)  # no Authorization header at all
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(keyed_url.removesuffix("/v1") + "/health", timeout=30).status_code == 200  # open to probes


class Forecast(BaseModel):
    """Bounded fields, so the shipped model's greedy document ends within max_tokens."""

    city: Literal["Paris", "Oslo", "Rome"]
    days: int = Field(ge=1, le=9)


def test_tools_structured_output_alternatives_and_bias(openai_server, chat_url):
    """The openai client's parse (a pydantic response_format, a pydantic function tool), streamed tool calls,
    top_logprobs and logit_bias, through the real OpenAI face and Triton."""
    client = openai.OpenAI(base_url=chat_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris for three days?"}]
    kwargs = {"model": "speculative_decoding", "messages": messages, "temperature": 0, "max_tokens": 64}
    parsed = client.chat.completions.parse(**kwargs, response_format=Forecast).choices[0]
    assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, Forecast)
    tool = openai.pydantic_function_tool(Forecast, name="get_forecast")
    kwargs["max_tokens"] = 128  # room for the call's wrapper around the arguments
    called = client.chat.completions.parse(**kwargs, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False).choices[0]  # fmt: skip
    (call,) = called.message.tool_calls
    assert called.finish_reason == "tool_calls" and isinstance(call.function.parsed_arguments, Forecast)
    named = {"type": "function", "function": {"name": "get_forecast"}}
    chunks = list(client.chat.completions.create(**kwargs, tools=[tool], tool_choice=named, stream=True))
    calls = [d.tool_calls[0] for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
    assert calls[0].function.name == "get_forecast" and calls[0].id and all(c.index == 0 for c in calls)
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments  # greedy: the same call
    chosen = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3).choices[0]
    for token in chosen.logprobs.content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)  # greedy: the likeliest
    completion = client.completions.create(model="ensemble", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           logprobs=2)  # fmt: skip
    assert all(len(top) >= 2 for top in completion.choices[0].logprobs.top_logprobs)
    first = chosen.logprobs.content[0].top_logprobs
    banned = {str(i): -100 for i in token_ids_of(first[0].token)}
    assert banned
    biased = client.chat.completions.create(**kwargs, logit_bias=banned, logprobs=True, top_logprobs=1)
    assert biased.choices[0].logprobs.content[0].token != first[0].token  # the target's argmax moved
