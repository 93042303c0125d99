"""process_logits and friends: hand-computed cases, and the same kept set as Hugging Face's warpers."""
import math

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.sampling import derive_seed, greedy_tokens, make_generator, process_logits, sample_from_probs
from specdec.types import SamplingParams

# log-probabilities of [0.5, 0.3, 0.15, 0.05]: softmax at temperature 1 gives them back.
PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])
    torch.testing.assert_close(process_logits(logits, SamplingParams(temperature=1.0)), torch.tensor([[1, 2, 4]]) / 7)
    # T = 2 takes square roots of the odds: 1 : sqrt(2) : 2.
    expected = torch.tensor([[1.0, math.sqrt(2.0), 2.0]]) / (3.0 + math.sqrt(2.0))
    torch.testing.assert_close(process_logits(logits, SamplingParams(temperature=2.0)), expected)


def test_top_k_keeps_the_k_largest_and_renormalizes():
    probs = process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, [1.0, 0.0, 0.0, 0.0]),  # the most likely token is always kept
        (0.7, [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.7 keeps the second token, 0.8 >= 0.7 drops the third
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    probs = process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([expected]))


def test_temperature_applies_before_top_p():
    # At T = 1 top_p = 0.7 keeps two tokens; T = 4 flattens the distribution so it needs three.
    kept_t1 = process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.7)) > 0
    kept_t4 = process_logits(LOGITS, SamplingParams(temperature=4.0, top_p=0.7)) > 0
    assert kept_t1.sum() == 2
    assert kept_t4.sum() == 3


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
@pytest.mark.parametrize("top_k", [0, 5, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3.0  # [rows, vocab]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(dim=-1)
    probs = process_logits(logits, params)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1)])
def test_greedy_gives_one_hot_at_argmax(params):
    logits = torch.randn(5, 33, generator=torch.Generator().manual_seed(1))
    probs = process_logits(logits, params)
    expected = torch.nn.functional.one_hot(logits.argmax(dim=-1), 33).float()
    assert torch.equal(probs, expected)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)])
def test_banned_tokens_get_zero_probability_in_the_first_rows_only(params):
    logits = torch.zeros(3, 6)
    logits[:, 2] = 10.0  # token 2 is the argmax of every row
    probs = process_logits(logits, params, num_banned_rows=2, banned_token_ids=(2, 5))
    assert torch.all(probs[:2, [2, 5]] == 0)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))
    assert probs[2, 2] > 0.9
    assert greedy_tokens(logits, num_banned_rows=2, banned_token_ids=(2, 5)).tolist() == [0, 0, 2]


def test_banned_rows_beyond_the_tensor_are_clipped():
    logits = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    probs = process_logits(logits, SamplingParams(temperature=1.0), num_banned_rows=5, banned_token_ids=(0,))
    assert torch.all(probs[:, 0] == 0)


def test_sample_from_probs_is_seeded_and_stays_in_support():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).expand(200, 4)
    first = sample_from_probs(probs, make_generator(7))
    assert torch.equal(first, sample_from_probs(probs, make_generator(7)))
    assert set(first.tolist()) == {1, 2}


def test_derive_seed_is_deterministic_distinct_and_in_range():
    seeds = {derive_seed(base, step, stream) for base in range(-2, 2) for step in range(50) for stream in range(3)}
    assert len(seeds) == 4 * 50 * 3
    assert all(0 <= s < 2**63 for s in seeds)  # what torch.Generator.manual_seed accepts
    assert derive_seed(123, 4, 1) == derive_seed(123, 4, 1)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(temperature):
    """logits / T overflows long before T reaches 0; such a request is greedy, not a NaN distribution."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = torch.randn(2, 11)
    probs = process_logits(logits, params)
    assert torch.isfinite(probs).all() and torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert not SamplingParams(temperature=1e-3).greedy


def test_min_p_drops_tokens_under_a_share_of_the_likeliest_after_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    assert torch.allclose(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    hot = process_logits(logits, SamplingParams(temperature=0.5, min_p=0.2))  # sharper: 0.15 falls under
    assert (hot[0] > 0).tolist() == [True, True, False, False]
    assert torch.equal(process_logits(logits, SamplingParams(temperature=1.0, min_p=0.0)),
                       process_logits(logits, SamplingParams(temperature=1.0)))
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=1.5).validate()
