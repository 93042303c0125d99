"""The OpenAI sampling surface against a scripted Triton: stop strings on the text, penalties, seeds, logprobs,
several choices (``n``, ``best_of``, prompt lists), ``echo``."""
from __future__ import annotations

import pytest
from test_openai_server import SHIPPED_TOKENIZER, TEMPLATE, FakeBackend, client_for, events

from specdec.tokenizer import load_tokenizer
from specdec_openai.logprobs import TokenLog, Vocabulary
from specdec_openai.protocol import choice_seed
from specdec_openai.triton import Step

TOKENIZER = load_tokenizer(SHIPPED_TOKENIZER)


def token_steps(text: str, per_step: int = 2, finish: str = "length", log_prob: float = -0.5) -> list[Step]:
    """``text`` as Triton streams it: ``per_step`` tokens per response, with their ids and log probabilities."""
    ids = TOKENIZER(text, add_special_tokens=False).input_ids
    out = []
    for i in range(0, len(ids), per_step):
        piece = TOKENIZER.decode(ids[: i + per_step])[len(TOKENIZER.decode(ids[:i])) :]
        last = i + per_step >= len(ids)
        chunk = ids[i : i + per_step]
        count = min(i + per_step, len(ids))
        out.append(Step(piece, finish if last else None, 3, count, 2 * (i + 1), i + 1, tuple(chunk),
                        tuple([log_prob] * len(chunk)), log_prob * count))  # fmt: skip
    return out


class ScriptedBackend(FakeBackend):
    """Answers each request with ``script(request number, inputs)``."""

    def __init__(self, script, hang_after=None):
        super().__init__([], hang_after)
        self.scripted = script

    async def generate(self, model, inputs):
        self.script = self.scripted(len(self.requests), inputs)
        async for step in super().generate(model, inputs):
            yield step


def completion(backend, **body):
    return client_for(backend).post("/v1/completions", json={"model": "speculative_decoding", "prompt": "a", **body})


def test_a_stop_string_the_tokenizer_merges_ends_the_output_and_the_triton_request():
    """Triton's token match misses "END" inside "xEND." (one merged piece); the text match finds it, and the
    stream is closed at once: reading on would hang on the third response."""
    backend = FakeBackend(token_steps(" one xEND. two three four", per_step=3), hang_after=2)
    whole = completion(backend, stop="END", logprobs=0).json()["choices"][0]
    assert whole["text"] == " one x" and whole["finish_reason"] == "stop"
    assert "".join(whole["logprobs"]["tokens"]).startswith(" one x")  # the tokens that begin before the cut
    assert all(offset < len(" one x") for offset in whole["logprobs"]["text_offset"])
    assert backend.closed == [True] and backend.requests[0][1]["stop_words"] == ["END"]
    streamed = events(completion(FakeBackend(token_steps(" one xEND. two", per_step=3), hang_after=2),
                                 stop="END", stream=True))  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == " one x"
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"


def test_penalties_and_the_seed_reach_triton_and_neutral_ones_are_left_out():
    backend = FakeBackend(token_steps(" hi"))
    completion(backend, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, seed=7, min_p=0.05)
    completion(backend, presence_penalty=0, frequency_penalty=0, min_p=0)
    first, second = backend.requests[0][1], backend.requests[1][1]
    assert (first["presence_penalty"], first["frequency_penalty"], first["repetition_penalty"]) == (0.5, -1, 1.2)
    assert first["seed"] == 7 and first["min_p"] == 0.05 and "return_log_probs" not in first
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "min_p"} & set(second)


def test_n_runs_choices_concurrently_with_seeds_derived_from_the_requests():
    backend = ScriptedBackend(lambda i, inputs: token_steps(f" choice {i}"))
    out = completion(backend, n=3, seed=11, temperature=0.7).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert sorted(c["text"] for c in out["choices"]) == [" choice 0", " choice 1", " choice 2"]
    seeds = [inputs["seed"] for _, inputs in backend.requests]
    assert seeds == [11, choice_seed(11, 1), choice_seed(11, 2)] and len(set(seeds)) == 3
    num_tokens = sum(len(TOKENIZER(f" choice {i}", add_special_tokens=False).input_ids) for i in range(3))
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == num_tokens
    assert all(backend.closed)


def test_streamed_choices_carry_their_index_and_each_finishes():
    backend = ScriptedBackend(lambda i, inputs: token_steps(f" the choice number {i}", per_step=1))
    chunks = events(completion(backend, n=2, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-2]:
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert texts == {0: " the choice number 0", 1: " the choice number 1"}
    finished = [c["choices"][0]["index"] for c in chunks[:-2] if c["choices"][0]["finish_reason"]]
    num_tokens = sum(len(TOKENIZER(text, add_special_tokens=False).input_ids) for text in texts.values())
    assert sorted(finished) == [0, 1] and chunks[-2]["usage"]["completion_tokens"] == num_tokens


def test_best_of_keeps_the_choice_with_the_highest_cumulative_log_probability():
    backend = ScriptedBackend(lambda i, inputs: token_steps(f" text {i}", log_prob=-1.0 - abs(i - 1)))
    out = completion(backend, best_of=3, temperature=1).json()
    assert [c["text"] for c in out["choices"]] == [" text 1"] and out["choices"][0]["logprobs"] is None
    assert all(inputs["return_log_probs"] for _, inputs in backend.requests) and len(backend.requests) == 3


def test_a_list_of_prompts_and_echo():
    backend = ScriptedBackend(lambda i, inputs: token_steps(" out"))
    out = completion(backend, prompt=["first", "second"], n=2, echo=True).json()
    assert [inputs["text_input"] for _, inputs in backend.requests] == ["first", "first", "second", "second"]
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (0, "first out"), (1, "first out"), (2, "second out"), (3, "second out")]
    assert out["usage"]["prompt_tokens"] == 2 * 3  # each prompt once
    chunks = events(completion(ScriptedBackend(lambda i, inputs: token_steps(" out")), echo=True, stream=True,
                               prompt="say"))  # fmt: skip
    assert chunks[0]["choices"][0]["text"] == "say"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "say out"


def test_chat_logprobs_have_openais_shape_and_streamed_ones_add_up():
    text = " Hello there, friend."
    client = client_for(FakeBackend(token_steps(text, per_step=3)), tokenizer_dir=SHIPPED_TOKENIZER,
                        chat_template=TEMPLATE)  # fmt: skip
    body = {"model": "speculative_decoding", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 0}  # fmt: skip
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == text == whole["message"]["content"]
    assert all(entry["logprob"] == -0.5 and entry["top_logprobs"] == [] for entry in content)
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    plain = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None
    chunks = events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [e for c in chunks[1:-1] for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed == content


def test_completion_logprobs_give_tokens_offsets_and_the_chosen_token_as_its_own_top():
    text = " one two three"
    out = completion(FakeBackend(token_steps(text, per_step=2)), logprobs=0).json()["choices"][0]["logprobs"]
    assert "".join(out["tokens"]) == text and out["token_logprobs"] == [-0.5] * len(out["tokens"])
    assert out["top_logprobs"] == [{token: -0.5} for token in out["tokens"]]
    assert [text[offset:] for offset in out["text_offset"]] == [
        text[len("".join(out["tokens"][:i])):] for i in range(len(out["tokens"]))]  # fmt: skip


@pytest.mark.parametrize("body, param, message", [
    ({"top_logprobs": 0}, "top_logprobs", "needs 'logprobs' true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
])  # fmt: skip
def test_chat_refusals_name_the_field_and_the_reason(body, param, message):
    backend = FakeBackend(token_steps(" x"))
    client = client_for(backend, tokenizer_dir=SHIPPED_TOKENIZER, chat_template=TEMPLATE)
    response = client.post("/v1/chat/completions", json={"model": "ensemble", "messages": [
        {"role": "user", "content": "hi"}], **body})  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert message in response.json()["error"]["message"] and backend.requests == []


def test_a_refusal_of_one_choice_ends_them_all():
    from specdec_openai.protocol import RequestError

    def script(i, inputs):
        return RequestError("speculative_decoding: refused") if i == 1 else token_steps(" fine")

    backend = ScriptedBackend(script, hang_after=0)
    response = completion(backend, n=3)
    assert response.status_code == 400 and "refused" in response.json()["error"]["message"]
    assert backend.closed == [True, True, True]


def test_token_log_places_multibyte_tokens_and_hands_each_out_once():
    vocabulary = Vocabulary(TOKENIZER)
    ids = TOKENIZER("Grüße", add_special_tokens=False).input_ids
    log = TokenLog(vocabulary)
    log.add("Grüße", ids, [-1.0] * len(ids))
    assert b"".join(vocabulary.token_bytes(i) for i in ids) == "Grüße".encode()
    first = log.release(2)
    assert all(token.start < 2 for token in first) and first
    assert log.release(None) and log.release(None) == []
    assert vocabulary.token(TOKENIZER.eos_token_id) == ""  # left out of the text, as the detokenizer leaves it
