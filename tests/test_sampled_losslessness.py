"""System-level losslessness under sampling: a chi-square test of the whole engine.

With temperature 1 and top-k 3 on a 16-token vocabulary, the target-only joint
distribution of the first three generated tokens has 27 outcomes and is computed
exactly by enumeration. Speculative generation with a draft model whose ``q`` is
clearly different from ``p`` must reproduce it (Leviathan et al. 2023, Theorem 1).
The same statistic must reject a sampler that accepts every draft, which shows the
test has the power to see a lossy sampler.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.models import CachedCausalLM
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.proposers import DraftModelProposer, ParallelDraftProposer, SuffixConfig, SuffixProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import make_generator, process_logits, sample_from_probs
from specdec.types import SampleResult, SamplingParams, VerifyResult
from specdec.verifier import TargetVerifier

PROMPT = [3, 7, 1, 12]
SAMPLING = SamplingParams(temperature=1.0, top_k=3)
NUM_TOKENS = 3  # the joint of the first three outputs is checked
K = 4  # drafts per step: the first step after the prefill drafts tokens 2 .. 5
NUM_SAMPLES = 3000
NUM_SAMPLES_LOSSY = 500
MIN_EXPECTED = 5.0  # cells expected fewer times are merged, the usual chi-square rule

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tiny_llama):
    target = tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():  # perturb the output layer: q overlaps p but clearly differs from it
        draft.lm_head.weight.add_(0.15 * torch.randn_like(draft.lm_head.weight))
    return target, draft


def exact_joint(target) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS outputs) under target-only sampling, by enumerating the support."""
    joint = {(): 1.0}
    for _ in range(NUM_TOKENS):
        extended = {}
        for prefix, mass in joint.items():
            with torch.inference_mode():
                logits = target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:]  # [1, vocab]
            p = process_logits(logits, SAMPLING)[0]  # [vocab]
            for token in torch.nonzero(p).flatten().tolist():
                extended[prefix + (token,)] = mass * float(p[token])
        joint = extended
    return joint


class CountingSampler:
    """Wraps a sampler to count drafted and accepted tokens, so the test can see both paths ran."""

    def __init__(self, inner):
        self.inner = inner
        self.drafted = 0
        self.accepted = 0

    def __call__(self, draft_token_ids, draft_probs, verify: VerifyResult, seed: int, position=None) -> SampleResult:
        result = self.inner(draft_token_ids, draft_probs, verify, seed, position=position)
        self.drafted += len(draft_token_ids)
        self.accepted += result.num_accepted
        return result


def accept_every_draft(draft_token_ids, draft_probs, verify: VerifyResult, seed: int, position=None) -> SampleResult:
    """A lossy sampler: keeps all drafts, then draws the bonus token from p."""
    bonus = sample_from_probs(verify.probs[-1:], make_generator(seed))  # [1]
    return SampleResult(output_token_ids=torch.cat([draft_token_ids, bonus]), num_accepted=len(draft_token_ids))


def sample_first_tokens(target, draft, sampler, num_samples: int, base: GenerationParams | None = None,
                        proposer=None, max_tokens: int = NUM_TOKENS + K - 1) -> Counter:  # fmt: skip
    """First NUM_TOKENS outputs of ``num_samples`` generations seeded 0 .. num_samples - 1; ``base`` adds settings.

    ``max_tokens``: by default room for K drafts right after the prefill.
    """
    verifier = TargetVerifier(CachedCausalLM(target))
    proposer = proposer if proposer is not None else DraftModelProposer(CachedCausalLM(draft))
    counts: Counter = Counter()
    for seed in range(num_samples):
        params = dataclasses.replace(
            base or GenerationParams(),
            max_tokens=max_tokens,
            num_speculative_tokens=K,
            sampling=dataclasses.replace(SAMPLING, seed=seed),
        )
        out: list[int] = []
        steps = generate(proposer, verifier, sampler, PROMPT, params)
        for step in steps:
            out += step.new_token_ids
            if len(out) >= NUM_TOKENS:
                break
        steps.close()
        counts[tuple(out[:NUM_TOKENS])] += 1
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0
    return counts


def chisquare_pvalue(counts: Counter, joint: dict[tuple[int, ...], float]) -> float:
    """Pearson's test; cells expected < MIN_EXPECTED times and unexpected outcomes share one cell."""
    n = sum(counts.values())
    total = sum(joint.values())  # 1 up to float rounding; chisquare wants matching sums
    observed, expected = [], []
    rest_observed = sum(c for outcome, c in counts.items() if outcome not in joint)
    rest_expected = 0.0
    for outcome, mass in joint.items():
        prob = mass / total
        if n * prob >= MIN_EXPECTED:
            observed.append(counts[outcome])
            expected.append(n * prob)
        else:
            rest_observed += counts[outcome]
            rest_expected += n * prob
    if rest_expected == 0.0:
        if rest_observed:
            return 0.0  # an outcome the target can never produce
    else:
        observed.append(rest_observed)
        expected.append(rest_expected)
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("method", ["probabilistic", "strict"])
def test_speculative_sampling_matches_target_distribution(models, method):
    target, draft = models
    joint = exact_joint(target)
    assert len(joint) == SAMPLING.top_k**NUM_TOKENS and sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
    sampler = CountingSampler(RejectionSampler(method))
    counts = sample_first_tokens(target, draft, sampler, NUM_SAMPLES)
    assert 0.05 < sampler.accepted / sampler.drafted < 0.95, "both accepted and rejected drafts must occur"
    assert chisquare_pvalue(counts, joint) > 1e-3


def test_parallel_drafts_keep_target_distribution(models):
    """PARD: draft j is drawn from its own mask row's q_j, which does not see drafts 1 .. j - 1; given that q_j
    the sampler stays lossless (Leviathan et al.'s argument needs only that the draft was drawn from it)."""
    target, draft = models
    proposer = ParallelDraftProposer(CachedCausalLM(draft), mask_token_id=5)
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, draft, sampler, NUM_SAMPLES, proposer=proposer)
    assert 0.05 < sampler.accepted / sampler.drafted < 0.95, "both accepted and rejected drafts must occur"
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_suffix_drafts_keep_target_distribution(models):
    """Suffix drafts come from earlier samples' responses (the global tree), so they follow
    the target's own frequencies and change as samples accumulate; one-hot q, any draft,
    the output distribution must not move."""
    target, _ = models
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=4.0, min_token_prob=0.0))
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    # requests run to max_tokens and complete, so each response joins the global tree
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer, max_tokens=NUM_TOKENS)
    assert proposer.stats().cached_responses == NUM_SAMPLES
    assert sampler.drafted > NUM_SAMPLES // 2 and 0.05 < sampler.accepted / sampler.drafted < 0.95
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_min_p_sampling_matches_the_min_p_target(models, monkeypatch):
    """min_p shapes p in the verifier and q in the draft model alike: the output follows the min-p target."""
    target, draft = models
    monkeypatch.setattr(__import__(__name__), "SAMPLING", SamplingParams(temperature=1.0, min_p=0.1))
    joint = exact_joint(target)
    full = len(joint) ** (1 / NUM_TOKENS)
    assert 3 < full < 16, "min_p must cut the support, but not to one token"
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, draft, sampler, NUM_SAMPLES)
    assert 0.05 < sampler.accepted / sampler.drafted < 0.95
    assert chisquare_pvalue(counts, joint) > 1e-3


def test_chi_square_rejects_a_sampler_that_accepts_every_draft(models):
    target, draft = models
    counts = sample_first_tokens(target, draft, accept_every_draft, NUM_SAMPLES_LOSSY)
    assert chisquare_pvalue(counts, exact_joint(target)) < 1e-6
