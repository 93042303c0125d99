"""``logit_bias`` is part of the target's distribution: speculation stays lossless with it.

Greedy: the output equals Hugging Face ``generate`` with a logits processor that adds the
same bias, at every k, with a draft model (which biases its own ``q`` too: a draft equal to
the target still has almost every draft accepted) and with n-gram drafts (which know
nothing of it). Sampled: the chi-square test of ``test_sampled_losslessness`` against the
biased target's exact joint, which the same samples must fail against the unbiased one.
Served: the bias crosses to both stages on the wire and comes in as two public inputs.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from specdec.engine import GenerationParams
from specdec.generate import check_token_ids
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import apply_logit_bias, process_logits
from specdec.types import ProposeRequest, SamplingParams, VerifyRequest
from specdec_triton import wire
from specdec_triton.plumbing import RequestError
from specdec_triton.request import GenerateRequest
from test_greedy_equality import PROMPTS, assert_equal_up_to_ties, text_to_ids
from test_sampled_losslessness import (
    NUM_SAMPLES, NUM_TOKENS, PROMPT, CountingSampler, chisquare_pvalue, models, sample_first_tokens,
)  # fmt: skip

__all__ = ["models"]  # the fixture, shared with test_sampled_losslessness
NUM_NEW = 16


class AddBias(LogitsProcessor):
    """The reference: the bias added to the scores of every step."""

    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token, value in self.bias:
            scores[:, token] += value
        return scores


def hf_biased_greedy(model, prompt_ids: list[int], bias) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=NUM_NEW, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config,
                             logits_processor=LogitsProcessorList([AddBias(bias)]))  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def biased_decode(proposer, target, prompt_ids: list[int], k: int, bias) -> tuple[list[int], int, int]:
    from specdec.generate import generate
    from specdec.verifier import TargetVerifier

    params = GenerationParams(max_tokens=NUM_NEW, num_speculative_tokens=k, sampling=SamplingParams(logit_bias=bias))
    out: list[int] = []
    for step in generate(proposer, TargetVerifier(CachedCausalLM(target)), RejectionSampler(), prompt_ids, params):
        out += step.new_token_ids
    return out, step.stats.num_draft_tokens, step.stats.num_accepted_tokens


def a_bias_that_changes_the_output(model, prompt_ids: list[int]) -> tuple[tuple[int, float], ...]:
    """Ban the plain greedy output's second token and push up one the model rarely picks."""
    plain = hf_biased_greedy(model, prompt_ids, ())
    return ((plain[1], -math.inf), (7, 2.5))


@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("method", ["draft_equal", "draft_random", "ngram"])
def test_greedy_output_is_the_biased_targets(method, k, target_model, draft_model):
    vocab = target_model.config.vocab_size
    drafted = accepted = 0
    for prompt in PROMPTS[:6]:
        prompt_ids = text_to_ids(prompt, vocab)
        bias = a_bias_that_changes_the_output(target_model, prompt_ids)
        reference = hf_biased_greedy(target_model, prompt_ids, bias)
        assert reference != hf_biased_greedy(target_model, prompt_ids, ()), "the bias must change the output"
        draft = {"draft_equal": target_model, "draft_random": draft_model}.get(method)
        proposer = DraftModelProposer(CachedCausalLM(draft)) if draft is not None else NgramProposer(1, 4)
        ours, d, a = biased_decode(proposer, target_model, prompt_ids, k, bias)
        assert_equal_up_to_ties(target_model, prompt_ids, ours, reference)
        drafted, accepted = drafted + d, accepted + a
    assert drafted > 0
    if method == "draft_equal":  # its q is biased as p is: a draft that ignored the bias would be rejected there
        assert accepted / drafted > 0.95


def biased_joint(target, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS outputs) of the biased target alone, by enumeration."""
    joint = {(): 1.0}
    for _ in range(NUM_TOKENS):
        extended = {}
        for prefix, mass in joint.items():
            with torch.inference_mode():
                logits = target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:]  # [1, vocab]
            p = process_logits(apply_logit_bias(logits, sampling.logit_bias), sampling)[0]  # [vocab]
            for token in torch.nonzero(p).flatten().tolist():
                extended[prefix + (token,)] = mass * float(p[token])
        joint = extended
    return joint


@pytest.mark.slow
def test_sampled_output_follows_the_biased_target(models, monkeypatch):
    target, draft = models
    with torch.inference_mode():
        first = target(torch.tensor([PROMPT])).logits[0, -1]  # [vocab]
    order = first.argsort(descending=True).tolist()
    bias = ((order[0], -math.inf), (order[8], 4.0), (order[3], 1.5))  # ban the likeliest, lift an unlikely one
    sampling = SamplingParams(temperature=1.0, top_k=3, logit_bias=bias)
    monkeypatch.setattr(__import__("test_sampled_losslessness"), "SAMPLING", sampling)
    joint = biased_joint(target, sampling)
    assert all(order[0] not in outcome for outcome in joint), "a -inf bias bans the token"
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, draft, sampler, NUM_SAMPLES // 2)
    assert 0.05 < sampler.accepted / sampler.drafted < 0.95, "both accepted and rejected drafts must occur"
    assert chisquare_pvalue(counts, joint) > 1e-3
    unbiased = biased_joint(target, dataclasses.replace(sampling, logit_bias=()))
    assert chisquare_pvalue(counts, unbiased) < 1e-6, "the bias must matter"


def test_the_bias_crosses_to_both_stages():
    bias = ((3, 1.5), (9, -math.inf))
    sampling = [SamplingParams(logit_bias=bias), SamplingParams(temperature=0.5)]
    verify = [VerifyRequest(f"s{i}", 0, [1, 2], 1, s) for i, s in enumerate(sampling)]
    assert [r.sampling for r in wire.verify_requests_of(wire.verify_inputs(verify))] == sampling
    propose = [ProposeRequest(f"s{i}", 0, [1, 2], 2, s, seed=5) for i, s in enumerate(sampling)]
    assert [r.sampling for r in wire.propose_requests_of(wire.propose_inputs(propose))] == sampling
    plain = wire.verify_inputs([VerifyRequest("s", 0, [1], 1, SamplingParams())])
    assert "num_logit_bias" not in plain and "logit_bias_ids" not in plain  # a step without a bias carries nothing


def test_public_inputs_and_their_refusals():
    inputs = {"text_input": np.array([b"hi"], object), "logit_bias_ids": np.array([5, 17], np.int32),
              "logit_bias_values": np.array([-100.0, 2.0], np.float32)}  # fmt: skip
    request = GenerateRequest.from_inputs(inputs)
    assert request.sampling.logit_bias == ((5, -100.0), (17, 2.0))
    with pytest.raises(RequestError, match=r"'logit_bias_ids' must hold token ids in \[0, 16\), got \[17\]"):
        request.generation_params(16, 4, (0,), (), vocab_size=16)
    with pytest.raises(RequestError, match="one value per id"):
        GenerateRequest.from_inputs({**inputs, "logit_bias_values": np.array([1.0], np.float32)})
    with pytest.raises(RequestError, match="names a token twice"):
        GenerateRequest.from_inputs({**inputs, "logit_bias_ids": np.array([5, 5], np.int32)})
    with pytest.raises(ValueError, match=r"logit_bias must lie in \[0, 16\), got \[17\]"):
        check_token_ids([1], GenerationParams(sampling=request.sampling), 16)


def test_a_bias_moves_logits_before_any_processing():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    biased = apply_logit_bias(logits, ((0, 5.0), (3, -math.inf)))
    assert biased.tolist() == [[5.0, 1.0, 2.0, -math.inf]]
    assert apply_logit_bias(logits, ()) is logits
    with pytest.raises(ValueError, match=r"logit_bias token 4 is not a token id in \[0, 4\)"):
        apply_logit_bias(logits, ((4, 1.0),))
