"""Rejection sampler (torch path): losslessness by convergence, exact greedy cases, edge cases.

The convergence test follows vLLM's tests/v1/sample/test_rejection_sampler.py: with random
``p`` and ``q``, the empirical distribution of the emitted tokens approaches ``p`` as the
number of samples grows, while a sampler that trusts the draft stays far from it.
"""
import os

import pytest
import torch
from scipy.stats import chisquare

from specdec.rejection_sampler import (
    METHODS,
    RejectionSampler,
    draw_randoms,
    match_greedy,
    rejection_sample,
    rejection_sample_batch,
)
from specdec.sampling import make_generator
from specdec.types import PLACEHOLDER_TOKEN_ID, VerifyResult

VOCAB = 10
K = 3
SAMPLE_SIZES = (10, 100, 1_000, 10_000, 100_000)


def random_probs(generator: torch.Generator, *shape: int, sparse: bool = False) -> torch.Tensor:
    """Rows of random distributions; ``sparse`` zeroes about a third of the entries (as top-k/top-p do)."""
    weights = torch.rand(*shape, generator=generator) ** 2  # [..., vocab]
    if sparse:
        weights = weights * (torch.rand(*shape, generator=generator) > 0.35)
        weights[..., 0] += 0.01  # no row is all zero
    return weights / weights.sum(dim=-1, keepdim=True)


def l1_to_target(tokens: torch.Tensor, target: torch.Tensor) -> float:
    """L1 distance between the histogram of ``tokens`` [n] and the distribution ``target`` [vocab]."""
    counts = torch.bincount(tokens, minlength=target.shape[0]).double()
    return float((counts / counts.sum() - target.double()).abs().sum())


@pytest.mark.parametrize("method", ["probabilistic", "strict"])
@pytest.mark.parametrize("one_hot_q", [False, True], ids=["q", "one_hot_q"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_emitted_tokens_converge_to_target(method, one_hot_q, sparse):
    generator = torch.Generator().manual_seed(1234)
    p = random_probs(generator, K + 1, VOCAB, sparse=sparse)  # [k + 1, vocab], the same for every request
    q = random_probs(generator, K, VOCAB, sparse=sparse)  # [k, vocab]
    n = SAMPLE_SIZES[-1]
    drafts = torch.multinomial(q, n, replacement=True, generator=generator).T  # [n, k], drafts ~ q
    output, num_accepted = rejection_sample_batch(
        drafts,
        None if one_hot_q else q.expand(n, K, VOCAB),
        p.expand(n, K + 1, VOCAB),
        None,
        method,
        draw_randoms(n, K, VOCAB, generator),
    )
    assert torch.all((output >= 0) & (output < VOCAB) | (output == PLACEHOLDER_TOKEN_ID))
    for position in range(K + 1):
        # Token `position` exists where at least `position` drafts were accepted, and follows p[position].
        emitted = output[num_accepted >= position, position]  # [n_position]
        assert torch.all(p[position, emitted] > 0), "a token outside the support of p was emitted"
        support = p[position] > 0  # [vocab]
        expected = p[position][support].double()
        chi2 = chisquare(
            torch.bincount(emitted, minlength=VOCAB)[support].double().numpy(),
            (expected / expected.sum() * emitted.numel()).numpy(),
        )
        assert chi2.pvalue > 1e-4, f"position {position}: emitted tokens do not follow p"

    distances = [l1_to_target(output[:size, 0], p[0]) for size in SAMPLE_SIZES]
    trust_draft = [l1_to_target(drafts[:size, 0], p[0]) for size in SAMPLE_SIZES]  # accept every draft
    assert distances[-1] < 0.02
    assert distances[-1] < distances[2] < distances[0]
    assert min(trust_draft) > 0.2 and trust_draft[-1] > 10 * distances[-1]


def greedy(draft: list[int], argmax: list[int], method: str = "strict", **kwargs):
    result = rejection_sample(
        torch.tensor(draft, dtype=torch.long), None, None, torch.tensor(argmax), method, make_generator(0), **kwargs
    )
    return result.output_token_ids.tolist(), result.num_accepted


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_greedy_target_matches_drafts_against_argmax(method):
    assert greedy([5, 6, 7], [5, 6, 7, 8], method) == ([5, 6, 7, 8], 3)  # all accepted: bonus
    assert greedy([5, 9, 7], [5, 6, 7, 8], method) == ([5, 6], 1)  # first mismatch: target token
    assert greedy([1, 6, 7], [5, 6, 7, 8], method) == ([5], 0)
    assert greedy([], [4], method) == ([4], 0)  # nothing proposed: just the bonus


@pytest.mark.parametrize("k", [0, 1, 4])
def test_match_greedy_is_the_sampler_against_a_greedy_target(k):
    """The plain-Python comparison the orchestrator runs equals every lossless method, draw for draw."""
    generator = torch.Generator().manual_seed(k)
    for case in range(50):
        target = torch.randint(0, 3, (k + 1,), generator=generator)  # small range: long accepted runs happen
        drafts = torch.randint(0, 3, (k,), generator=generator)
        got = match_greedy(drafts.tolist(), target.tolist())
        for method in ("probabilistic", "strict"):
            want = rejection_sample(drafts, None, None, target, method, make_generator(case))
            assert got.num_accepted == want.num_accepted
            assert got.output_token_ids.tolist() == want.output_token_ids.tolist()
    with pytest.raises(ValueError, match="target_argmax must hold k \\+ 1 = 3 ids, got 2"):
        match_greedy([1, 2], [1, 2])


def test_probabilistic_with_one_hot_target_is_strict():
    argmax = torch.tensor([3, 1, 4, 1])
    p = torch.nn.functional.one_hot(argmax, VOCAB).float()  # [k + 1, vocab]
    q = random_probs(torch.Generator().manual_seed(0), K, VOCAB)
    for draft in ([3, 1, 4], [3, 1, 5], [0, 1, 4]):
        draft = torch.tensor(draft)
        sampled = rejection_sample(draft, q, p, None, "probabilistic", make_generator(1))
        matched = rejection_sample(draft, None, None, argmax, "strict", make_generator(1))
        assert torch.equal(sampled.output_token_ids, matched.output_token_ids)


def sampled_case(seed: int, k: int = K, vocab: int = VOCAB, sparse: bool = False):
    generator = torch.Generator().manual_seed(seed)
    q = random_probs(generator, k, vocab, sparse=sparse)  # [k, vocab]
    p = random_probs(generator, k + 1, vocab, sparse=sparse)  # [k + 1, vocab]
    draft = torch.multinomial(q, 1, generator=generator).squeeze(-1) if k else torch.empty(0, dtype=torch.long)
    return draft, q, p


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_same_output_different_seeds_differ(method):
    draft, q, p = sampled_case(0)

    def run(seed):
        result = rejection_sample(draft, q, p, None, method, make_generator(seed), synthetic_acceptance_rate=0.5)
        return tuple(result.output_token_ids.tolist())

    assert run(42) == run(42)
    assert len({run(seed) for seed in range(30)}) > 1


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [0, 1, 4])
def test_output_ids_stay_in_vocabulary_and_support(method, k):
    for seed in range(40):
        draft, q, p = sampled_case(seed, k=k, vocab=7, sparse=True)
        result = rejection_sample(draft, q, p, None, method, make_generator(seed), synthetic_acceptance_rate=0.5)
        tokens = result.output_token_ids
        assert tokens.shape == (result.num_accepted + 1,)
        assert torch.all((tokens >= 0) & (tokens < 7))
        assert torch.equal(tokens[:-1], draft[: result.num_accepted])
        if method != "synthetic":
            assert torch.all(p[torch.arange(tokens.numel()), tokens] > 0)


def test_vocabulary_boundary_ids():
    vocab = 6
    last = torch.nn.functional.one_hot(torch.tensor([vocab - 1, vocab - 1]), vocab).float()  # [2, vocab]
    q = torch.full((1, vocab), 1.0 / vocab)
    for method in ("strict", "probabilistic"):
        # The last id is drafted and is all of p's mass: accepted, and the bonus is the last id too.
        kept = rejection_sample(torch.tensor([vocab - 1]), q, last, None, method, make_generator(3))
        assert kept.output_token_ids.tolist() == [vocab - 1, vocab - 1] and kept.num_accepted == 1
        # Id 0 is drafted but p has no mass there: rejected, and the last id is recovered.
        rejected = rejection_sample(torch.tensor([0]), q, last, None, method, make_generator(3))
        assert rejected.output_token_ids.tolist() == [vocab - 1] and rejected.num_accepted == 0


def test_empty_proposal_samples_the_bonus_from_p():
    p = torch.tensor([[0.0, 0.7, 0.0, 0.3]])  # [1, vocab]
    tokens = [
        rejection_sample(torch.empty(0, dtype=torch.long), None, p, None, "probabilistic", make_generator(s))
        .output_token_ids.item()
        for s in range(400)
    ]
    assert set(tokens) == {1, 3}
    assert 0.6 < tokens.count(1) / len(tokens) < 0.8


def test_missing_draft_probs_mean_one_hot_q_judged_as_strict():
    """Against a one-hot q, probabilistic accepts x with p(x), as strict does; strict emits the target's own draws."""
    for seed in range(20):
        draft, _, p = sampled_case(seed, sparse=True)
        implicit = rejection_sample(draft, None, p, None, "probabilistic", make_generator(seed))
        strict = rejection_sample(draft, None, p, None, "strict", make_generator(seed))
        assert torch.equal(implicit.output_token_ids, strict.output_token_ids)
    draft, _, p = sampled_case(0, sparse=True)
    one_hot = torch.nn.functional.one_hot(draft, VOCAB).float()  # [k, vocab]
    runs = 3000
    implicit = sum(rejection_sample(draft, None, p, None, "probabilistic", make_generator(s)).num_accepted
                   for s in range(runs)) / runs  # fmt: skip
    explicit = sum(rejection_sample(draft, one_hot, p, None, "probabilistic", make_generator(s)).num_accepted
                   for s in range(runs)) / runs  # fmt: skip
    expected = sum(float(torch.prod(p[torch.arange(i + 1), draft[: i + 1]])) for i in range(len(draft)))
    assert implicit == pytest.approx(expected, abs=0.06) and explicit == pytest.approx(expected, abs=0.06)


def test_zero_residual_falls_back_to_p():
    # q = 2p (unnormalized) rejects the draft half the time while max(0, p - q) is all zero.
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = 2 * p[:1]
    recovered = set()
    for seed in range(100):
        result = rejection_sample(torch.tensor([0]), q, p, None, "probabilistic", make_generator(seed))
        if result.num_accepted == 0:
            recovered.add(result.output_token_ids.item())
    assert recovered == {0, 1}


def test_synthetic_rate_zero_and_one_are_exact():
    draft, q, p = sampled_case(5)
    argmax = torch.tensor([9, 8, 7, 6])
    for seed in range(10):
        none = rejection_sample(draft, q, None, argmax, "synthetic", make_generator(seed), 0.0)
        assert none.output_token_ids.tolist() == [9] and none.num_accepted == 0
        every = rejection_sample(draft, q, None, argmax, "synthetic", make_generator(seed), 1.0)
        assert every.output_token_ids.tolist() == draft.tolist() + [6] and every.num_accepted == K
        sampled = rejection_sample(draft, q, p, None, "synthetic", make_generator(seed), 1.0)
        assert sampled.num_accepted == K and p[K, sampled.output_token_ids[-1]] > 0


def test_synthetic_rate_sets_per_position_acceptance():
    n, k, rate = 20_000, 4, 0.8
    draft = torch.zeros(n, k, dtype=torch.long)
    argmax = torch.ones(n, k + 1, dtype=torch.long)  # never equal to the drafts
    randoms = draw_randoms(n, k, 1, torch.Generator().manual_seed(0), categorical=False)
    _, num_accepted = rejection_sample_batch(draft, None, None, argmax, "synthetic", randoms, rate)
    for position in range(k):
        reached = (num_accepted >= position).sum()
        accepted = (num_accepted >= position + 1).sum()
        assert abs(float(accepted / reached) - rate) < 0.02


def test_invalid_method_and_rate_name_the_parameter():
    draft, q, p = sampled_case(0)
    with pytest.raises(ValueError, match="method"):
        rejection_sample(draft, q, p, None, "typical", make_generator(0))
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        rejection_sample(draft, q, p, None, "synthetic", make_generator(0), synthetic_acceptance_rate=1.5)
    with pytest.raises(ValueError, match="method"):
        RejectionSampler(method="greedy")
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        RejectionSampler(method="synthetic", synthetic_acceptance_rate=-0.1)
    with pytest.raises(ValueError, match="method"):
        RejectionSampler()(draft, q, VerifyResult(argmax=p.argmax(-1), probs=p), seed=0, method="nope")


def test_invalid_shapes_and_ids_name_the_argument():
    draft, q, p = sampled_case(0)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(draft, q, p[:-1], None, "probabilistic", make_generator(0))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(draft, q[:, :-1], p, None, "probabilistic", make_generator(0))
    with pytest.raises(ValueError, match="target_argmax"):
        rejection_sample(draft, q, None, None, "strict", make_generator(0))
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(torch.tensor([0, VOCAB, 1]), q, p, None, "probabilistic", make_generator(0))


@pytest.mark.parametrize("method", METHODS)
def test_sampler_class_is_the_function_with_a_seeded_generator(method):
    draft, q, p = sampled_case(3)
    sampler = RejectionSampler(method=method, synthetic_acceptance_rate=0.5)
    for seed in range(10):
        got = sampler(draft, q, VerifyResult(argmax=p.argmax(dim=-1), probs=p), seed=seed)
        want = rejection_sample(draft, q, p, None, method, make_generator(seed), synthetic_acceptance_rate=0.5)
        assert torch.equal(got.output_token_ids, want.output_token_ids) and got.num_accepted == want.num_accepted


def test_sampler_class_reduces_greedy_requests_to_strict_and_honours_method_override():
    verify = VerifyResult(argmax=torch.tensor([2, 3, 4]))
    sampler = RejectionSampler(method="probabilistic")
    assert sampler(torch.tensor([2, 3]), None, verify, seed=0).output_token_ids.tolist() == [2, 3, 4]
    assert sampler(torch.tensor([2, 5]), None, verify, seed=0).output_token_ids.tolist() == [2, 3]
    assert sampler(torch.tensor([2, 5]), None, verify, seed=0, method="synthetic").output_token_ids.tolist() == [2]


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="the kernel can run here"
)
def test_triton_kernel_unavailable_is_a_clear_error():
    with pytest.raises(RuntimeError, match="use_triton_kernel"):
        RejectionSampler(use_triton_kernel=True)


@pytest.mark.parametrize(
    "corrupt, name",
    [
        (lambda p, q: p.__setitem__((1, 3), float("nan")), "target_probs rows \\[1\\]"),
        (lambda p, q: p.__setitem__((0, 2), -0.5), "target_probs rows \\[0\\]"),
        (lambda p, q: p[2].zero_(), "target_probs rows \\[2\\]"),
        (lambda p, q: q.__setitem__((0, 0), float("inf")), "draft_probs rows \\[0\\]"),
    ],
)
def test_probabilities_that_are_not_distributions_are_refused(corrupt, name):
    """A NaN, negative or massless row would draw token 0 (often EOS) and end the output without an error."""
    p = torch.softmax(torch.randn(3, 8), dim=-1)  # [k + 1, vocab]
    q = torch.softmax(torch.randn(2, 8), dim=-1)  # [k, vocab]
    corrupt(p, q)
    with pytest.raises(ValueError, match=name + " are not distributions"):
        RejectionSampler()(torch.tensor([1, 2]), q, VerifyResult(p.argmax(-1), p), seed=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("one_hot_q", [False, True])
def test_a_row_padded_with_placeholders_samples_as_its_real_drafts_alone(method, one_hot_q):
    """vLLM's ragged-batch convention: -1 pads a row's drafts; it is never accepted, and the bonus follows.

    The padded row must give what the same row gives with only its real drafts, under the
    same random draws: the padding changes nothing.
    """
    generator = torch.Generator().manual_seed(3)
    vocab, k, real = 50, 4, 2
    p = torch.softmax(torch.randn(1, k + 1, vocab, generator=generator), dim=-1)  # [1, k + 1, vocab]
    q = torch.softmax(torch.randn(1, k, vocab, generator=generator), dim=-1)  # [1, k, vocab]
    drafts = p[:, :k].argmax(-1)  # [1, k]: likely accepted, so the walk reaches the padding
    drafts[:, real:] = PLACEHOLDER_TOKEN_ID
    for seed in range(20):
        randoms = draw_randoms(1, k, vocab, torch.Generator().manual_seed(seed), categorical=True)
        short = type(randoms)(randoms.uniforms[:, :real], randoms.inv_exponentials[:, : real + 1])
        args = (None if one_hot_q else q, p, p.argmax(-1), method)
        padded_out, padded_n = rejection_sample_batch(drafts, args[0], args[1], args[2], method, randoms, 0.5)
        short_q = None if one_hot_q else q[:, :real]
        short_out, short_n = rejection_sample_batch(drafts[:, :real], short_q, p[:, : real + 1],
                                                    p[:, : real + 1].argmax(-1), method, short, 0.5)  # fmt: skip
        assert int(padded_n) == int(short_n) <= real
        assert padded_out[0, : int(padded_n) + 1].tolist() == short_out[0, : int(short_n) + 1].tolist()
        assert PLACEHOLDER_TOKEN_ID not in padded_out[0, : int(padded_n) + 1].tolist()


def test_draws_by_position_are_the_same_from_whichever_row_reaches_the_position():
    from specdec.rejection_sampler import draw_randoms_by_position

    whole = draw_randoms_by_position(7, 10, 3, VOCAB)  # rows at output positions 10 .. 13
    for row in range(4):
        alone = draw_randoms_by_position(7, 10 + row, 0, VOCAB)  # the same position as a bonus row
        assert torch.equal(alone.inv_exponentials[0, 0], whole.inv_exponentials[0, row])
    later = draw_randoms_by_position(7, 11, 2, VOCAB)
    assert torch.equal(later.uniforms[0], whole.uniforms[0, 1:])
    assert not torch.equal(draw_randoms_by_position(8, 10, 3, VOCAB).uniforms, whole.uniforms)  # another seed
    assert draw_randoms_by_position(7, 10, 3, VOCAB, categorical=False).inv_exponentials is None
