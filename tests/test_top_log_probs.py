"""Each output token's likeliest alternatives come from the target's modified distribution at its position.

The reference is computed from the target alone: ``log_softmax`` of its logits after the
logit bias, divided by the temperature (1 when greedy), at the context of each output
token. Speculation at any k, drafts accepted or rejected, must give the same alternatives
as k = 0, and the chosen token's own log probability must agree with its entry.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import apply_logit_bias
from specdec.types import RequestStats, SamplingParams, VerifyRequest, VerifyResult
from specdec.verifier import TargetVerifier
from specdec_triton import wire
from specdec_triton.plumbing import RequestError
from specdec_triton.request import GenerateRequest, generate_outputs

PROMPT = [5, 17, 3, 99, 42, 8]
N = 4
BIAS = ((11, 3.0), (7, -2.0))


def run(target, draft, k: int, sampling: SamplingParams) -> tuple[list[int], list[float], list, int]:
    params = GenerationParams(max_tokens=12, num_speculative_tokens=k, sampling=sampling, return_log_probs=True,
                              num_top_log_probs=N)  # fmt: skip
    tokens, log_probs, tops = [], [], []
    proposer = DraftModelProposer(CachedCausalLM(draft)) if k else None
    for step in generate(proposer, TargetVerifier(CachedCausalLM(target)), RejectionSampler(), PROMPT, params):
        tokens += step.new_token_ids
        log_probs += step.new_log_probs
        tops += step.new_top_log_probs
    return tokens, log_probs, tops, step.stats.num_accepted_tokens


def reference(target, tokens: list[int], sampling: SamplingParams) -> list[list[tuple[int, float]]]:
    with torch.inference_mode():
        logits = target(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()  # [len(tokens), vocab]
    divisor = sampling.temperature if not sampling.greedy else 1.0
    values, ids = torch.log_softmax(apply_logit_bias(logits, sampling.logit_bias) / divisor, -1).topk(N, -1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@pytest.mark.parametrize("sampling", [SamplingParams(logit_bias=BIAS),
                                      SamplingParams(temperature=0.8, top_k=5, seed=3, logit_bias=BIAS)],
                         ids=["greedy", "sampled"])  # fmt: skip
@pytest.mark.parametrize("k", [0, 3])
def test_alternatives_are_the_modified_targets_at_each_position(target_model, draft_model, sampling, k):
    tokens, log_probs, tops, accepted = run(target_model, draft_model, k, sampling)
    assert len(tops) == len(tokens) == len(log_probs) == 12 and all(len(alts) == N for alts in tops)
    for ours, want in zip(tops, reference(target_model, tokens, sampling)):
        assert [t for t, _ in ours] == [t for t, _ in want]
        assert [v for _, v in ours] == pytest.approx([v for _, v in want], abs=1e-4)
    for token, log_prob, alts in zip(tokens, log_probs, tops):
        if token in dict(alts):
            assert dict(alts)[token] == pytest.approx(log_prob, abs=1e-4)
    if sampling.greedy:
        assert [alts[0][0] for alts in tops] == tokens  # greedy: the chosen token is the likeliest
    if k:
        assert accepted > 0


def test_alternatives_cross_the_wire_with_the_log_masses():
    requests = [VerifyRequest("a", 0, [1, 2], 2, SamplingParams(), log_probs=True, num_top_log_probs=2),
                VerifyRequest("b", 0, [1], 1, SamplingParams(), log_probs=True)]  # fmt: skip
    assert [r.num_top_log_probs for r in wire.verify_requests_of(wire.verify_inputs(requests))] == [2, 0]
    ids, values = torch.tensor([[4, 1], [2, 3]]), torch.tensor([[-0.1, -2.5], [-0.2, -1.9]])
    results = [VerifyResult(torch.tensor([4, 2]), None, torch.tensor([0.0, 0.0]), top_token_ids=ids,
                            top_log_probs=values), VerifyResult(torch.tensor([9]), None, torch.tensor([-1.0]))]
    back = wire.verify_results_of(wire.verify_outputs(results), [2, 1])
    assert torch.equal(back[0].top_token_ids, ids) and torch.equal(back[0].top_log_probs, values)
    assert back[1].top_token_ids is None and back[1].top_log_probs is None


def test_public_input_and_outputs():
    inputs = {"text_input": np.array([b"hi"], object), "num_top_log_probs": np.array([3], np.int32)}
    with pytest.raises(RequestError, match="'num_top_log_probs' .* needs 'return_log_probs' true"):
        GenerateRequest.from_inputs(inputs).generation_params(16, 4, (0,), (), vocab_size=16)
    request = GenerateRequest.from_inputs({**inputs, "return_log_probs": np.array([True])})
    assert request.generation_params(16, 4, (0,), (), vocab_size=16).num_top_log_probs == 3
    with pytest.raises(RequestError, match=r"'num_top_log_probs' must be in \[0, 20\]"):
        GenerateRequest.from_inputs({**inputs, "num_top_log_probs": np.array([21], np.int32),
                                     "return_log_probs": np.array([True])}).generation_params(16, 4, (0,), (), 16)
    tops = [((4, -0.5), (2, -1.0)), ((7, -0.1), (4, -3.0))]
    out = generate_outputs("ab", None, 3, 2, RequestStats(), [-0.5, -0.1], -0.6, [4, 7], tops)
    assert out["output_top_token_ids"].tolist() == [[[4, 2], [7, 4]]]  # [beams, tokens, n]
    assert out["output_top_log_probs"].shape == (1, 2, 2)
    assert generate_outputs("ab", None, 3, 2, RequestStats(), token_ids=[4, 7])["output_top_token_ids"].shape == (1, 2, 0)
