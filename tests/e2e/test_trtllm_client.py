"""A TensorRT-LLM-style client against the real server: batch dimension, beam_width 1, penalties, bad words, log probs.

Greedy output with penalties and bad words must equal Hugging Face ``generate`` of the
target alone with the same processors (``tests/test_penalties.py``), and each output
log probability the target's own (penalised, temperature-scaled) one. Inputs this
server does not implement get an error that names them, and the server goes on serving.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException
from transformers import GenerationConfig
from trtllm_client import prepare_inputs, run_inference

from client.generate import generate_grpc, generate_http
from specdec.penalties import Penalties
from test_penalties import reference_processors

pytestmark = pytest.mark.server

MAX_TOKENS = 24
PROMPTS = ["Once upon a time", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "The mitochondria is the powerhouse of the cell. The mitochondria is"]  # fmt: skip
BAD_WORDS = [" the", " return"]
SETTINGS = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)


def penalised_reference(reference, prompt: str, penalties: Penalties) -> tuple[list[int], list[float]]:
    """The target's greedy ids with ``penalties`` (Hugging Face generate) and each one's log probability."""
    prompt_ids = reference.codec.encode_prompt(prompt)
    eos = reference.codec.eos_token_ids
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos or None,
                              pad_token_id=eos[0] if eos else 0, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        out = reference.model.generate(torch.tensor([prompt_ids]), generation_config=config,
                                       logits_processor=reference_processors(penalties, len(prompt_ids)))
    ids = out.sequences[0, len(prompt_ids):].tolist()
    log_probs = [float(torch.log_softmax(scores[0].float(), -1)[t]) for scores, t in zip(out.scores, ids)]
    return ids, log_probs


def bad_word_ids(reference) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(reference.codec.encode_stop_words([w])[0]) for w in BAD_WORDS)


@pytest.mark.parametrize("model, batch_dim", [("ensemble", True), ("speculative_decoding", False)])
def test_greedy_with_penalties_and_bad_words_equals_the_targets(server, reference, model, batch_dim):
    penalties = Penalties(**SETTINGS, bad_words=bad_word_ids(reference))
    changed = 0
    for prompt in PROMPTS:
        ids, log_probs = penalised_reference(reference, prompt, penalties)
        inputs = prepare_inputs(prompt, MAX_TOKENS, beam_width=1, bad_words=BAD_WORDS, return_log_probs=True,
                                exclude_input_in_output=True, pad_id=0, **SETTINGS)  # fmt: skip
        output = run_inference(server.grpc_url, model, inputs, batch_dim=batch_dim)
        assert output.text == reference.codec.decode(ids), prompt
        assert output.output_log_probs == pytest.approx(log_probs, abs=2e-3)
        assert output.cum_log_probs == pytest.approx(sum(log_probs), abs=1e-2)
        plain_ids, _ = penalised_reference(reference, prompt, Penalties())
        changed += plain_ids != ids
    assert changed, "the penalties must change some prompt's greedy output"


def test_streamed_with_batch_dimension_adds_up(server):
    inputs = dict(bad_words=BAD_WORDS, return_log_probs=True, **SETTINGS)
    whole = run_inference(server.grpc_url, "ensemble", prepare_inputs(PROMPTS[0], MAX_TOKENS, **inputs,
                                                                      exclude_input_in_output=True))  # fmt: skip
    streamed = run_inference(server.grpc_url, "ensemble", prepare_inputs(PROMPTS[0], MAX_TOKENS, streaming=True,
                                                                         **inputs))  # fmt: skip
    assert streamed.responses > 1 and streamed.text == whole.text
    assert streamed.output_log_probs == pytest.approx(whole.output_log_probs, abs=1e-5)
    assert len(whole.output_log_probs) > 0 and streamed.cum_log_probs == pytest.approx(whole.cum_log_probs, abs=1e-4)


def test_sampled_random_seed_is_seed(server):
    """On the suffix server, whose drafts change as its tree learns: a seed still repeats the text."""
    prompt, url = PROMPTS[0], server.grpc_url
    settings = dict(temperature=0.8, return_log_probs=True, exclude_input_in_output=True, **SETTINGS)
    first = run_inference(url, "ensemble", prepare_inputs(prompt, 16, random_seed=11, **settings))
    again = run_inference(url, "ensemble", prepare_inputs(prompt, 16, random_seed=11, **settings))
    by_seed = run_inference(url, "ensemble", prepare_inputs(prompt, 16, extra={"seed": np.array([[11]], np.uint64)},
                                                            **settings))  # fmt: skip
    assert first.text == again.text == by_seed.text
    # the same tokens; the forwards that scored them differ in shape (the tree drafts each repeat
    # differently), so the log probabilities agree to float rounding
    assert first.output_log_probs == pytest.approx(by_seed.output_log_probs, abs=1e-4)
    assert 0 < len(first.output_log_probs) <= 16 and all(lp <= 0 for lp in first.output_log_probs)
    assert first.cum_log_probs == pytest.approx(sum(first.output_log_probs), abs=1e-3)


@pytest.mark.parametrize("extra, message", [
    ({"beam_width": np.array([[2]], np.int32)}, "unsupported input 'beam_width' = 2: beam search is not supported"),
    ({"lora_task_id": np.array([[1]], np.uint64)}, "unsupported input 'lora_task_id'"),
    ({"embedding_bias_words": np.array([["a"]], object)}, "unsupported input 'embedding_bias_words'"),
    ({"return_context_logits": np.array([[True]], bool)}, "unsupported input 'return_context_logits' = True"),
    ({"num_return_sequences": np.array([[2]], np.int32)}, "unsupported input 'num_return_sequences' = 2"),
])  # fmt: skip
def test_unsupported_inputs_are_named_and_the_server_serves_on(server, extra, message):
    inputs = prepare_inputs("Hello", 4)
    inputs.update(extra)
    with pytest.raises(InferenceServerException, match=message):
        run_inference(server.grpc_url, "ensemble", inputs)
    assert run_inference(server.grpc_url, "ensemble", prepare_inputs("Hello", 4)).text.startswith("Hello")


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_the_command_line_clients_requests_agree(server, model):
    """client.generate shapes its tensors to each model's batch dimension; gRPC, HTTP and this client agree."""
    params = dict(max_tokens=MAX_TOKENS, bad_words=BAD_WORDS, return_log_probs=True, exclude_input_in_output=True,
                  **SETTINGS)  # fmt: skip
    expected = run_inference(server.grpc_url, "ensemble", prepare_inputs(PROMPTS[1], MAX_TOKENS, bad_words=BAD_WORDS,
                             return_log_probs=True, exclude_input_in_output=True, **SETTINGS))  # fmt: skip
    for result in (generate_grpc(server.grpc_url, model, PROMPTS[1], {**params, "stream": True}),
                   generate_http(server.http_url, model, PROMPTS[1], params)):  # fmt: skip
        assert result.text == expected.text
        assert result.output_log_probs == pytest.approx(expected.output_log_probs, abs=1e-5)
        assert len(result.output_log_probs) == result.num_output_tokens
