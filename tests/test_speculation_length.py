"""How many tokens a step drafts (specdec.speculation_length): the table, the limit, and the throughput choice."""
from __future__ import annotations

import pytest

from specdec.speculation_length import (
    SpeculationLength,
    StepCosts,
    choose_k,
    expected_tokens,
    parse_per_batch_size,
)


def test_expected_tokens_matches_the_sum_of_acceptance_powers():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in range(6):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    with pytest.raises(ValueError, match="acceptance_rate"):
        expected_tokens(1.5, 2)


def test_a_memory_bound_target_drafts_deep_and_a_compute_bound_one_not_at_all():
    flat = StepCosts(verify_fixed_s=5e-3, verify_per_row_s=1e-5, propose_fixed_s=3e-4, propose_per_row_s=1e-5)
    assert choose_k(1, 0.8, flat, max_k=8) >= 4
    steep = StepCosts(verify_fixed_s=1e-3, verify_per_row_s=1e-3, propose_fixed_s=3e-4, propose_per_row_s=1e-4)
    assert choose_k(16, 0.8, steep, max_k=8) == 0


def test_choose_k_is_the_argmax_of_tokens_per_second():
    costs = StepCosts(verify_fixed_s=4e-3, verify_per_row_s=3e-4, propose_fixed_s=8e-4, propose_per_row_s=1e-4)
    for batch in (1, 2, 4, 8, 16):
        for alpha in (0.2, 0.5, 0.9):
            rates = [batch * expected_tokens(alpha, k) / costs.step_seconds(batch, k) for k in range(6)]
            assert choose_k(batch, alpha, costs, 5) == max(range(6), key=lambda k: (rates[k], -k))


def test_useless_drafts_are_not_made_and_the_maximum_caps_the_choice():
    costs = StepCosts(verify_fixed_s=5e-3, verify_per_row_s=1e-5, propose_fixed_s=1e-4)
    assert choose_k(1, 0.0, costs, max_k=4) == 0
    assert choose_k(1, 1.0, costs, max_k=3) == 3
    with pytest.raises(ValueError, match="batch_size"):
        choose_k(0, 0.5, costs, 3)


def test_the_table_applies_from_each_batch_size_up_to_the_next():
    length = SpeculationLength(4, per_batch_size=parse_per_batch_size("1:4, 3:2, 5:0"))
    assert [length.k_for(n) for n in range(1, 8)] == [4, 4, 2, 2, 0, 0, 0]


def test_disable_by_batch_size_stops_drafting_above_it():
    length = SpeculationLength(3, disable_by_batch_size=2)
    assert [length.k_for(n) for n in (1, 2, 3, 8)] == [3, 3, 0, 0]
    assert [SpeculationLength(3).k_for(n) for n in (1, 64)] == [3, 3]


@pytest.mark.parametrize(
    "text, message",
    [
        ("1:4,x", "'x' is not 'batch_size:k'"),
        ("1:4,0:2", "'0:2' is not"),
        ("1:-1", "'1:-1' is not"),
        ("1:4,4:2,3:0", "batch sizes must increase"),
        ("2:4", "first entry must be for batch size 1"),
    ],
)
def test_a_bad_table_is_refused_naming_the_entry(text, message):
    with pytest.raises(ValueError, match=message):
        parse_per_batch_size(text)


def test_a_table_asking_for_more_than_k_is_refused():
    with pytest.raises(ValueError, match="k = 6, more than num_speculative_tokens = 4"):
        SpeculationLength(4, per_batch_size=((1, 6),))
    assert parse_per_batch_size("") == ()
