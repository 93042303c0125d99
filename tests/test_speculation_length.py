"""specdec_triton.speculation_length: the draft count that earns the most tokens per second."""
from __future__ import annotations

import random

import pytest

from specdec.call_costs import CallCosts
from specdec_triton import speculation_length
from specdec_triton.speculation_length import AdaptiveSpeculationLength

MS = 1e-3
SEQUENCES = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Every choice worked out anew, so a test sees the effect of what it just recorded."""
    monkeypatch.setattr(speculation_length, "REUSE_CHOICE", 1)


def grid(fixed_ms: float, per_row_ms: float, tokens=(1, 2, 3, 5, 9)) -> CallCosts:
    """A call of n sequences x s tokens: fixed + per_row * n * s (a compute-bound model grows with rows)."""
    return CallCosts(SEQUENCES, tokens, tuple(tuple((fixed_ms + per_row_ms * n * s) * MS for s in tokens)
                                             for n in SEQUENCES))


def policy_with_acceptance(alpha: float, verify: CallCosts, propose: CallCosts) -> AdaptiveSpeculationLength:
    policy = AdaptiveSpeculationLength(verify, propose)
    for i in range(400):  # one-draft steps, a fraction alpha of them accepted, evenly spread
        policy.record_step(1, int((i + 1) * alpha) - int(i * alpha))
    return policy


def best_k_by_enumeration(policy: AdaptiveSpeculationLength, n: int, max_k: int, alpha: float) -> int:
    rates = [sum(alpha**i for i in range(k + 1)) / policy.round_seconds(n, k) for k in range(max_k + 1)]
    return max(range(max_k + 1), key=rates.__getitem__)


def test_until_enough_positions_are_judged_the_maximum_is_drafted():
    policy = AdaptiveSpeculationLength(grid(5, 100), grid(1, 1))  # rows so dear that k = 0 would win
    assert policy.acceptance_rate is None and policy.choose(8, 4) == 4
    for _ in range(3):
        policy.record_step(4, 0)  # one position judged each
    assert policy.acceptance_rate is None and policy.choose(8, 4) == 4
    policy.record_step(0, 0)  # a plain decoding step judges nothing
    for _ in range(speculation_length.MIN_POSITIONS_OBSERVED):
        policy.record_step(4, 0)
    assert policy.acceptance_rate == 0.0 and policy.choose(8, 4) == 0


def test_acceptance_counts_only_judged_positions():
    policy = AdaptiveSpeculationLength(grid(1, 1), grid(1, 1))
    for _ in range(10):
        policy.record_step(4, 1)  # accepted 1, rejected the 2nd: 2 positions judged, 2 never reached
        policy.record_step(2, 2)  # both accepted: 2 judged
    assert policy.acceptance_rate == pytest.approx(30 / 40, rel=0.01)


def test_acceptance_follows_recent_steps():
    policy = AdaptiveSpeculationLength(grid(1, 1), grid(1, 1))
    for _ in range(1000):
        policy.record_step(4, 4)
    for _ in range(5 * speculation_length.ACCEPTANCE_WINDOW_STEPS):
        policy.record_step(4, 0)
    assert policy.acceptance_rate < 0.05


def test_a_lone_sequence_with_a_good_draft_drafts_deep_and_load_stops_it():
    """Fixed costs dominate alone, so deep drafts pay; at 8 sequences every row counts and they do not."""
    policy = policy_with_acceptance(0.75, verify=grid(4, 0.4), propose=grid(0.5, 0.1))
    alone, loaded = policy.choose(1, 8), policy.choose(8, 8)
    assert alone >= 4 and loaded < alone
    for n in SEQUENCES:
        assert policy.choose(n, 8) == best_k_by_enumeration(policy, n, 8, policy.acceptance_rate)


def test_a_poor_draft_is_not_used_and_a_perfect_one_to_the_maximum():
    poor = policy_with_acceptance(0.0, verify=grid(4, 0.4), propose=grid(0.5, 0.1))
    assert poor.choose(1, 4) == 0
    perfect = policy_with_acceptance(1.0, verify=grid(4, 0.4), propose=grid(0.5, 0.1))
    assert perfect.choose(1, 4) == 4


def test_the_request_maximum_caps_the_choice():
    policy = policy_with_acceptance(1.0, verify=grid(4, 0.4), propose=grid(0.5, 0.1))
    assert policy.choose(1, 2) == 2 and policy.choose(1, 0) == 0


def test_observed_slowdowns_and_step_overhead_enter_the_round_time():
    """Propose calls far slower than measured make drafting pay less; a dear step overhead, more."""
    policy = policy_with_acceptance(0.6, verify=grid(4, 0.2), propose=grid(0.5, 0.2))
    base = policy.choose(4, 8)
    assert base > 0
    for _ in range(200):
        policy.record_call("propose", 4, 2, 20 * policy.propose_costs(4, 2), num_live=4)
    assert policy.call_times["propose"].at(4).slowdown == pytest.approx(20, rel=0.01)
    assert policy.choose(4, 8) == 0
    for _ in range(200):
        policy.record_step_overhead(1.0, num_live=4)  # a second a step outside the calls: tokens per step count
    assert policy.choose(4, 8) > 0
    for n in SEQUENCES:
        assert policy.choose(n, 8) == best_k_by_enumeration(policy, n, 8, policy.acceptance_rate)


def test_calls_outside_the_grid_are_skipped_and_the_first_observations_are_averaged_alike():
    policy = AdaptiveSpeculationLength(grid(2, 0.5), grid(0.5, 0.2))
    policy.record_call("verify", 1, 100, 1.0, num_live=1)  # a prefill: far beyond the measured rows, skipped
    assert policy.call_times["verify"].at(1).slowdown == 1.0
    policy.record_call("verify", 2, 3, 3 * policy.verify_costs(2, 3), num_live=2)
    assert policy.call_times["verify"].at(2).slowdown == pytest.approx(3.0)
    policy.record_call("verify", 2, 3, policy.verify_costs(2, 3), num_live=2)
    assert policy.call_times["verify"].at(2).slowdown == pytest.approx(2.0)  # the mean of 3 and 1


def test_a_moving_average_is_the_mean_at_first_then_weights_the_newest_by_the_smoothing():
    average = speculation_length.MovingAverage(7.0)
    assert average.value == 7.0
    for observation in (1.0, 2.0, 3.0):
        average.update(observation)
    assert average.value == pytest.approx(2.0)
    for _ in range(1000):
        average.update(10.0)
    before = average.value
    average.update(0.0)
    assert average.value == pytest.approx(before * (1 - speculation_length.SMOOTHING))


def test_the_round_trip_is_taken_out_of_the_slowdown_and_paid_once_per_call():
    policy = policy_with_acceptance(0.6, verify=grid(4, 0.2), propose=grid(0.5, 0.2))
    policy.call_overhead_s = 3 * MS
    policy.record_call("propose", 2, 4, 3 * MS + 2 * policy.propose_costs(2, 4), num_live=2)
    assert policy.call_times["propose"].at(2).slowdown == pytest.approx(2.0)
    r_v = policy.call_times["verify"].at(2).slowdown
    assert policy.round_seconds(2, 0) == pytest.approx(r_v * policy.verify_costs(2, 1) + 3 * MS)
    assert policy.round_seconds(2, 4) == pytest.approx(
        r_v * policy.verify_costs(2, 5) + 2 * policy.propose_costs(2, 4) + 6 * MS)


def test_slowdowns_are_kept_per_load_and_an_unseen_load_takes_the_closest():
    """What 8 live sequences taught (slow calls) must not stop a lone sequence from drafting."""
    policy = policy_with_acceptance(0.6, verify=grid(4, 0.2), propose=grid(0.5, 0.2))
    for _ in range(100):
        policy.record_call("propose", 8, 2, 30 * policy.propose_costs(8, 2), num_live=8)
        policy.record_call("propose", 1, 2, policy.propose_costs(1, 2), num_live=1)
    assert policy.call_times["propose"].at(8).slowdown == pytest.approx(30, rel=0.01)
    assert policy.call_times["propose"].at(1).slowdown == pytest.approx(1.0)
    assert policy.call_times["propose"].at(6).slowdown == policy.call_times["propose"].at(8).slowdown  # closest seen
    assert policy.call_times["propose"].at(3).slowdown == policy.call_times["propose"].at(1).slowdown
    assert policy.choose(8, 4) == 0 and policy.choose(1, 4) > 0


def test_sequences_that_split_into_groups_while_drafting_stop_drafting_under_load():
    """Eight sequences drafting in two groups of four pay two verify calls a round; plain decoding pays one."""
    policy = policy_with_acceptance(0.6, verify=grid(10, 0.5), propose=grid(0.5, 0.1))
    assert policy.groups(8) == 1.0 and policy.choose(8, 4) > 0  # alone in one call, drafting would pay
    for _ in range(50):
        policy.record_call("verify", 4, 3, policy.verify_costs(4, 3), num_live=8)  # calls carry half of them
    assert policy.groups(8) == pytest.approx(2.0)
    assert policy.choose(8, 4) == 0
    assert policy.groups(1) == 1.0 and policy.choose(1, 4) > 0  # a lone sequence still drafts
    policy.record_call("verify", 1, 2, policy.verify_costs(1, 2), num_live=8)  # a probe's call at 8 live
    for _ in range(50):  # sequences that chose at 1 live, verifying their drafts as the load rose
        policy.record_call("verify", 2, 5, policy.verify_costs(2, 5), num_live=8)
    assert policy.groups(8) == pytest.approx(2.0)  # neither tells how drafting sequences group at 8


def test_a_load_without_groups_of_its_own_takes_the_groups_of_the_nearest_that_has_them():
    """Eight streams dip to seven live whenever a request ends; seven must not draft on a guess of one group."""
    policy = policy_with_acceptance(0.6, verify=grid(10, 0.5), propose=grid(0.5, 0.1))
    for _ in range(50):
        policy.record_call("verify", 1, 3, policy.verify_costs(1, 3), num_live=1)  # one live: calls of one
    assert policy.groups(1) == 1.0
    assert policy.groups(7) == 1.0 and policy.choose(7, 4) > 0  # which says nothing of how seven group
    for _ in range(50):
        policy.record_call("verify", 4, 3, policy.verify_costs(4, 3), num_live=8)  # four per call at 8
    assert policy.groups(8) == pytest.approx(2.0)
    assert policy.groups(7) == pytest.approx(2.0) and policy.groups(6) == pytest.approx(2.0)
    assert policy.groups(2) == 1.0  # the nearest is one live, alone in its calls
    assert policy.choose(7, 4) == 0
    for _ in range(speculation_length.MIN_GROUP_CALLS):
        policy.record_call("verify", 6, 3, policy.verify_costs(6, 3), num_live=6)  # six's own, once trusted
    assert policy.groups(6) == pytest.approx(1.0)
    assert policy.groups(7) == pytest.approx(1.0)  # as near to six as to eight: the lower load


def test_the_groups_of_a_load_are_trusted_only_after_enough_calls():
    """A ramp's first calls carry one sequence each; judged on them, drafting at that load would never be tried."""
    policy = policy_with_acceptance(0.6, verify=grid(10, 0.5), propose=grid(0.5, 0.1))
    for _ in range(speculation_length.MIN_GROUP_CALLS - 1):
        policy.record_call("verify", 1, 3, policy.verify_costs(1, 3), num_live=8)
    assert policy.groups(8) == 1.0 and policy.choose(8, 4) > 0
    for _ in range(speculation_length.MIN_GROUP_CALLS):
        policy.record_call("verify", 8, 3, policy.verify_costs(8, 3), num_live=8)  # then all of them together
    assert 1.0 < policy.groups(8) < 8.0
    for _ in range(200):
        policy.record_call("verify", 8, 3, policy.verify_costs(8, 3), num_live=8)
    assert policy.groups(8) == pytest.approx(1.0, abs=0.01)


def test_while_nothing_pays_one_step_drafts_after_an_interval_without_drafts(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(speculation_length.time, "monotonic", lambda: clock[0])
    policy = policy_with_acceptance(0.0, verify=grid(4, 0.4), propose=grid(0.5, 0.1))
    assert [policy.choose(1, 4) for _ in range(100)] == [0] * 100
    clock[0] += speculation_length.PROBE_INTERVAL_S
    assert [policy.choose(1, 4) for _ in range(3)] == [1, 0, 0]  # one probe, then an interval again
    clock[0] += speculation_length.PROBE_INTERVAL_S / 2
    policy.record_step(1, 0)  # a step drafted (a request asked for it): the interval restarts
    clock[0] += speculation_length.PROBE_INTERVAL_S * 0.75
    assert policy.choose(1, 4) == 0


def test_a_changed_choice_is_logged_with_what_it_was_made_from():
    lines: list[str] = []
    policy = AdaptiveSpeculationLength(grid(4, 0.4), grid(0.5, 0.1), log=lines.append)
    for i in range(400):
        policy.record_step(1, int((i + 1) * 0.75) - int(i * 0.75))
    policy.choose(1, 8)
    policy.choose(1, 8)  # the same choice again: nothing new to say
    assert len(lines) == 1 and "1 live -> k = " in lines[0] and "acceptance 0.75" in lines[0]
    policy.choose(8, 8)  # another load is logged on its own
    assert len(lines) == 2 and "8 live" in lines[1]


def test_a_choice_is_reused_for_a_few_steps_at_the_same_load(monkeypatch):
    monkeypatch.setattr(speculation_length, "REUSE_CHOICE", 4)
    policy = policy_with_acceptance(1.0, verify=grid(4, 0.4), propose=grid(0.5, 0.1))
    assert policy.choose(1, 4) == 4
    policy._accepted = 0.0  # the rate collapses: the next choices still reuse k = 4 ...
    assert [policy.choose(1, 4) for _ in range(3)] == [4, 4, 4]
    assert policy.choose(1, 4) == 0  # ... until it is worked out again
    assert policy.choose(1, 2) == 0  # another maximum is a choice of its own


def feed_propose_calls(policy, drafts_per_call, law, times=100, num_live=1):
    """Propose calls of one sequence drafting each of ``drafts_per_call`` in turn, taking ``law(measured)``."""
    for _ in range(times):
        for k in drafts_per_call:
            measured = policy.propose_costs(1, k)
            policy.record_call("propose", 1, k, policy.call_overhead_s + law(measured), num_live=num_live)


def test_a_calls_fixed_part_is_told_from_its_work_by_calls_of_several_sizes():
    policy = policy_with_acceptance(0.7, verify=grid(4, 0.01), propose=grid(0, 0.9))
    feed_propose_calls(policy, (1, 4), lambda x: 1.6 * MS + 1.3 * x)
    fit = policy.call_times["propose"].at(1)
    assert fit.fixed_s == pytest.approx(1.6 * MS) and fit.slowdown == pytest.approx(1.3)
    feed_propose_calls(policy, (2,), lambda x: 1.6 * MS + 1.3 * x)  # one size from now on: the line stays
    assert fit.fixed_s == pytest.approx(1.6 * MS) and fit.slowdown == pytest.approx(1.3)


def test_the_size_in_use_is_predicted_as_observed_when_its_calls_change_speed():
    policy = policy_with_acceptance(0.7, verify=grid(4, 0.01), propose=grid(0, 0.9))
    feed_propose_calls(policy, (1, 2, 4), lambda x: 1.6 * MS + 1.3 * x)
    feed_propose_calls(policy, (2,), lambda x: 2 * (1.6 * MS + 1.3 * x))  # twice as slow, at two drafts
    fit, two_drafts = policy.call_times["propose"].at(1), policy.propose_costs(1, 2)
    assert fit.seconds(two_drafts) == pytest.approx(2 * (1.6 * MS + 1.3 * two_drafts), rel=0.01)
    assert speculation_length.MIN_SLOWDOWN <= fit.slowdown and fit.fixed_s >= 0.0


def test_calls_of_one_size_or_a_flat_fit_charge_everything_to_the_work():
    policy = policy_with_acceptance(0.7, verify=grid(4, 0.01), propose=grid(0, 0.9))
    feed_propose_calls(policy, (2,), lambda x: 1.6 * MS + 1.3 * x)
    fit = policy.call_times["propose"].at(1)
    assert fit.fixed_s == 0.0 and fit.slowdown == pytest.approx(1.3 + 1.6 * MS / policy.propose_costs(1, 2))
    flat = policy_with_acceptance(0.7, verify=grid(4, 0.01), propose=grid(0, 0.9))
    feed_propose_calls(flat, (1, 4), lambda x: 5 * MS)  # the same time whatever the size: not a work rate
    fit = flat.call_times["propose"].at(1)
    assert fit.slowdown == speculation_length.MIN_SLOWDOWN
    assert fit.seconds(flat.propose_costs(1, 4)) == pytest.approx(5 * MS)


def test_a_fixed_part_per_call_does_not_make_deep_drafts_look_dear():
    """The shipped pair alone (the 21:31 run's log): verify 1.5x its flat 4 ms, 0.9 ms a draft, 1.6 ms a call besides.

    Learned as a ratio from two-draft calls, the fixed part is charged twice to a
    four-draft call and the policy stops at two drafts; fitted from calls of several
    sizes, it is charged once, and three or four drafts pay more (as fixed k = 4 did).
    """
    def observed(x):
        return 1.6 * MS + 1.3 * x

    policies = []
    for sizes_seen in (((2,),), ((1, 4), (2,))):
        policy = policy_with_acceptance(0.7, verify=grid(4, 0.01), propose=grid(0, 0.9))
        policy.call_overhead_s = 0.65 * MS
        for _ in range(50):
            policy.record_call("verify", 1, 3, policy.call_overhead_s + 1.5 * policy.verify_costs(1, 3), num_live=1)
        for sizes in sizes_seen:
            feed_propose_calls(policy, sizes, observed)
        policies.append(policy)
    ratio_only, fitted = policies
    assert ratio_only.call_times["propose"].at(1).fixed_s == 0.0
    assert ratio_only.choose(1, 4) == 2 and fitted.choose(1, 4) >= 3
    for policy in policies:
        assert policy.choose(1, 4) == best_k_by_enumeration(policy, 1, 4, policy.acceptance_rate)


def test_the_slope_is_the_least_squares_fit_over_the_shapes_averages():
    """Kept incrementally as the averages move; checked against a direct fit (r unclamped: between the bounds)."""
    rng = random.Random(0)
    fit = speculation_length.CallTime()
    shapes = {(m, s): (m * s * MS, 0.0) for m in (1, 2, 4) for s in (1, 3, 5)}
    for _ in range(2000):
        shape = rng.choice(list(shapes))
        measured, _ = shapes[shape]
        fit.update(shape, measured, 2 * MS + 1.5 * measured + rng.uniform(-0.5, 0.5) * MS)
    points = [(x, average.value) for x, average in fit._shapes.values()]
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    assert fit.slowdown == pytest.approx(slope, rel=1e-9)
    assert slope == pytest.approx(1.5, rel=0.1)
