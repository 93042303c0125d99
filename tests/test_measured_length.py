"""The measured policy drafts where drafting has earned more tokens per second, and keeps checking."""
from __future__ import annotations

import pytest

from specdec.measured_length import MIN_TRIES, RETRY_EVERY, MeasuredSpeculationLength
from specdec.speculation_length import SpeculationLength


def run_steps(policy, batch_size: int, n: int, tokens_per_s: dict[bool, float]) -> list[int]:
    """``n`` steps at ``batch_size``, each reporting the tokens/s of what it chose; the ks chosen."""
    ks = []
    for _ in range(n):
        k = policy.k_for(batch_size)
        ks.append(k)
        policy.observe(int(tokens_per_s[k > 0]), 1.0)
    return ks


def test_both_choices_are_tried_in_turn_before_one_is_preferred():
    policy = MeasuredSpeculationLength(SpeculationLength(4))
    ks = run_steps(policy, 1, 2 * MIN_TRIES, {True: 300, False: 200})
    assert ks == [4, 0] * MIN_TRIES


@pytest.mark.parametrize("drafting_wins", [True, False])
def test_the_better_choice_runs_and_the_other_is_retried_one_step_in_retry_every(drafting_wins):
    policy = MeasuredSpeculationLength(SpeculationLength(4))
    rates = {True: 300, False: 200} if drafting_wins else {True: 150, False: 200}
    run_steps(policy, 2, 2 * MIN_TRIES, rates)
    ks = run_steps(policy, 2, 4 * RETRY_EVERY, rates)
    better, other = (4, 0) if drafting_wins else (0, 4)
    assert ks.count(other) == 4 and ks.count(better) == 4 * RETRY_EVERY - 4
    assert policy.choices() == {2: {"draft": rates[True], "plain": rates[False]}}


def test_a_change_in_what_drafting_earns_is_followed():
    policy = MeasuredSpeculationLength(SpeculationLength(3))
    run_steps(policy, 1, 2 * MIN_TRIES, {True: 300, False: 200})
    # any RETRY_EVERY steps in a row hold one retry of the other choice
    assert run_steps(policy, 1, RETRY_EVERY, {True: 300, False: 200}).count(3) == RETRY_EVERY - 1
    later = run_steps(policy, 1, 8 * RETRY_EVERY, {True: 100, False: 200})  # acceptance fell: drafting now loses
    assert later[-RETRY_EVERY:].count(0) == RETRY_EVERY - 1


def test_each_batch_size_learns_apart_and_the_table_bounds_k():
    table = SpeculationLength(4, per_batch_size=((1, 4), (3, 2), (5, 0)))
    policy = MeasuredSpeculationLength(table)
    run_steps(policy, 1, 2 * MIN_TRIES, {True: 300, False: 200})
    run_steps(policy, 4, 2 * MIN_TRIES, {True: 500, False: 800})
    assert policy.k_for(1) == 4
    policy.observe(300, 1.0)
    assert policy.k_for(4) == 0
    policy.observe(800, 1.0)
    assert run_steps(policy, 6, 10, {True: 0, False: 900}) == [0] * 10  # the table's 0: nothing to choose
    assert set(policy.choices()) == {1, 4}


def test_an_observation_without_a_decision_or_time_is_ignored():
    policy = MeasuredSpeculationLength(SpeculationLength(2))
    policy.observe(10, 1.0)  # no k_for before it
    policy.k_for(1)
    policy.observe(10, 0.0)  # no time measured
    assert policy.choices() == {1: {}}
