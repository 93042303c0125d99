"""The OpenAI face's ``logit_bias`` and ``top_logprobs`` / ``logprobs: N`` against a scripted Triton."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from test_openai_sampling import TOKENIZER, ScriptedBackend, completion, token_steps
from test_openai_server import SHIPPED_TOKENIZER, TEMPLATE, FakeBackend, client_for, events

from specdec_openai.protocol import RequestError
from specdec_openai.triton import step_of

ALTERNATIVES = ((" y", -0.3), (" z", -1.7))


def with_alternatives(steps):
    """Each token gets two alternatives; the ids of ``ALTERNATIVES``' texts."""
    ids = [TOKENIZER(text, add_special_tokens=False).input_ids[0] for text, _ in ALTERNATIVES]
    top = tuple(zip(ids, (lp for _, lp in ALTERNATIVES)))
    return [replace(step, top=(top,) * len(step.token_ids)) for step in steps]


def test_logit_bias_reaches_triton_as_two_inputs_and_a_vocabulary_refusal_names_the_field():
    backend = FakeBackend(token_steps(" hi"))
    completion(backend, logit_bias={"17": -100, "5": 2.5})
    assert backend.requests[0][1]["logit_bias_ids"] == [17, 5]
    assert backend.requests[0][1]["logit_bias_values"] == [-100.0, 2.5]
    completion(backend, logit_bias={})
    assert "logit_bias_ids" not in backend.requests[1][1]
    refused = ScriptedBackend(lambda i, inputs: RequestError(
        "speculative_decoding: input 'logit_bias_ids' must hold token ids in [0, 4096), got [99999]"))
    error = completion(refused, logit_bias={"99999": 1}).json()["error"]
    assert error["param"] == "logit_bias" and "99999" in error["message"]


def test_chat_top_logprobs_lists_the_alternatives_of_each_token():
    backend = FakeBackend(with_alternatives(token_steps(" one two")))
    client = client_for(backend, tokenizer_dir=SHIPPED_TOKENIZER, chat_template=TEMPLATE)
    body = {"model": "ensemble", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert backend.requests[0][1]["num_top_log_probs"] == 2 and backend.requests[0][1]["return_log_probs"]
    assert content and all([t["token"] for t in c["top_logprobs"]] == [" y", " z"] for c in content)
    assert content[0]["top_logprobs"][1] == {"token": " z", "logprob": -1.7, "bytes": list(b" z")}
    again = client_for(FakeBackend(with_alternatives(token_steps(" one two"))), tokenizer_dir=SHIPPED_TOKENIZER,
                       chat_template=TEMPLATE)  # fmt: skip
    streamed = events(again.post("/v1/chat/completions", json={**body, "stream": True}))
    pieces = [c for chunk in streamed[:-1] for choice in chunk["choices"] if choice["logprobs"]
              for c in choice["logprobs"]["content"]]  # fmt: skip
    assert pieces == content


def test_completions_logprobs_n_maps_the_chosen_and_the_likeliest_tokens():
    backend = FakeBackend(with_alternatives(token_steps(" one two")))
    out = completion(backend, logprobs=2).json()["choices"][0]["logprobs"]
    assert backend.requests[0][1]["num_top_log_probs"] == 2
    assert out["top_logprobs"][0] == {out["tokens"][0]: -0.5, " y": -0.3, " z": -1.7}


def test_alternatives_are_read_from_the_triton_outputs():
    step = step_of({"text_output": np.array([b"ab"], object), "output_token_ids": np.array([[4, 7]], np.int32),
                    "output_log_probs": np.array([[-0.5, -0.1]], np.float32),
                    "output_top_token_ids": np.array([[[[4, 2], [7, 4]]]], np.int32),
                    "output_top_log_probs": np.array([[[[-0.5, -1.0], [-0.25, -3.0]]]], np.float32)})  # fmt: skip
    assert step.top == (((4, -0.5), (2, -1.0)), ((7, -0.25), (4, -3.0)))
    assert step_of({"text_output": np.array([b"ab"], object),
                    "output_top_token_ids": np.zeros((1, 2, 0), np.int32)}).top == ()  # fmt: skip
