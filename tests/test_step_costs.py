"""The costs of a step's parts, fitted to measured steps (specdec.step_costs), with made-up timings: no clock."""
from __future__ import annotations

import random

import pytest

from specdec.step_costs import CostMeter, DraftCosts, StepTiming


def metered(timings) -> CostMeter:
    meter = CostMeter()
    for timing in timings:
        meter = meter.after(timing)
    return meter


def test_the_rest_is_a_line_in_the_rows_of_decode_steps_only():
    assert CostMeter().costs() is None
    steps = [StepTiming(4 + 8 * (i % 5), 8 * (i % 5), 1 if i % 5 else 0, 5e-4 * 8 * (i % 5), 10e-3 + 2e-5 * (4 + 8 * (i % 5)))
             for i in range(200)]  # fmt: skip
    costs = metered(steps).costs()
    assert costs.step_s == pytest.approx(10e-3) and costs.verify_row_s == pytest.approx(2e-5)
    # prompts of 2,000 rows at a tenth of a decode row's cost each: a prefill would set the slope alone
    prompts = [StepTiming(2000, 0, 0, 0.0, 10e-3 + 2e-6 * 2000, decode=False)] * 20
    assert metered(steps + prompts).costs() == costs
    still = [StepTiming(20, 16, 1, 0.0, 10e-3 + 2e-5 * 20)] * 500  # one k for long: the spread fades, the slope stands
    assert metered(steps + still).costs().verify_row_s == pytest.approx(2e-5)
    unspread = metered([StepTiming(2, 0, 0, 0.0, 20e-3)])  # one step: nothing tells rows from the rest
    assert unspread.costs() == DraftCosts(step_s=0.0, verify_row_s=10e-3, draft_s=0.0)
    assert metered([StepTiming(100, 0, 0, 0.0, 20e-3, decode=False)]).costs() is None
    with pytest.raises(ValueError, match="at least one row"):
        CostMeter().after(StepTiming(0, 0, 0, 0.0, 1e-3))


def test_a_row_cost_within_noise_of_zero_is_not_read():
    """A few noisy steps can fit a row at nearly nothing; the drafts would then look free to verify."""
    rng = random.Random(0)

    def steps(row_s: float, n: int) -> list[StepTiming]:
        return [StepTiming(4 + 4 * (i % 2), 4 * (i % 2), i % 2, 1e-3 * (i % 2),
                           6e-3 + row_s * 4 * (i % 2) + rng.gauss(0, 1e-3)) for i in range(n)]  # fmt: skip

    assert metered(steps(2e-5, 10)).rows_read is None  # 0.08 ms a step's rows against 1 ms of noise: unread
    read = metered(steps(2e-4, 200)).rows_read  # enough steps tell 0.8 ms from the noise
    assert read is not None and read[1] == pytest.approx(2e-4, rel=0.3)
    assert metered(steps(2e-4, 200) + steps(0.0, 6)).rows_read[1] > 0  # a flat stretch leaves the reading standing
    flat = [StepTiming(4 + 4 * (i % 2), 4 * (i % 2), i % 2, 0.0, 6e-3) for i in range(20)]
    assert metered(flat).rows_read is None


def test_the_propose_call_is_its_own_cost_a_cost_per_depth_and_one_per_draft():
    rng, steps = random.Random(0), []
    for _ in range(300):  # 16 sequences of mixed k: a 1 ms call, 3 ms a depth (a forward), 0.1 ms a draft token
        most = rng.randint(1, 4)
        ks = [rng.randint(0, most) for _ in range(16)]
        depth, drafts = max(ks), sum(ks)
        if drafts:
            steps.append(StepTiming(16 + drafts, drafts, depth, 1e-3 + 3e-3 * depth + 1e-4 * drafts, 8e-3))
    costs = metered(steps).costs()
    assert (costs.call_s, costs.depth_s, costs.draft_s) == (pytest.approx(1e-3), pytest.approx(3e-3),
                                                            pytest.approx(1e-4))  # fmt: skip
    one_stream = [StepTiming(1 + k, k, k, 2e-3 + 5e-4 * k, 5e-3) for k in (1, 2, 3, 4) * 50]
    costs = metered(one_stream).costs()  # depth and drafts are one number: read as depth, the call apart
    assert (costs.call_s, costs.depth_s, costs.draft_s) == (pytest.approx(2e-3), pytest.approx(5e-4), 0.0)
    parallel = [StepTiming(1 + k, k, k, 2e-3, 5e-3) for k in (1, 2, 3, 4) * 50]  # one forward whatever k
    assert metered(parallel).costs().depth_s == pytest.approx(0.0, abs=1e-12)
    at_the_cap = [StepTiming(16 + n, n, 4, 1e-3 + 3e-3 * 4 + 1e-4 * n, 8e-3) for n in (20, 40, 64) * 50]
    costs = metered(at_the_cap).costs()  # the depth never varied: what the drafts leave is charged to it
    assert (costs.call_s, costs.depth_s, costs.draft_s) == (0.0, pytest.approx(13e-3 / 4), pytest.approx(1e-4))


def test_a_call_that_read_a_prompt_gives_the_cost_of_a_token_read():
    steps = [StepTiming(1 + k, k, k, 2e-3 + 5e-4 * k, 5e-3) for k in (1, 2, 3, 4) * 50]
    prompts = [StepTiming(2, 0, 1, 2e-3 + 5e-4 + 2e-5 * n, 5e-3, fed=n) for n in (100, 300) * 5]
    assert metered(steps + prompts).costs().feed_s == pytest.approx(2e-5)
    first = metered(prompts[:1] + steps).costs().feed_s  # before a steady call, all of it: a token looks dearer
    assert first == pytest.approx((2e-3 + 5e-4 + 2e-5 * 100) / 100)


def test_noise_never_gives_a_negative_cost():
    rng, steps = random.Random(1), []
    for _ in range(100):
        k = rng.randint(1, 4)
        steps.append(StepTiming(1 + k, k, k, max(0.0, 2e-3 - 1e-4 * k + rng.gauss(0, 1e-4)), 5e-3 - 1e-4 * k))
    costs = metered(steps).costs()
    assert min(costs.step_s, costs.verify_row_s, costs.draft_s, costs.call_s, costs.depth_s) >= 0.0


@pytest.mark.parametrize("seed", range(40))
def test_costs_read_at_any_step_of_a_noisy_batch_are_never_negative(seed):
    """Several sequences at varied k (depth and drafts vary apart), timings that fall as often as they rise:
    every fit along the way gives costs a step can be priced with (a negative one would stop the scheduler)."""
    rng, meter = random.Random(seed), CostMeter()
    for _ in range(60):
        ks = [rng.randint(0, 4) for _ in range(rng.randint(1, 4))]
        drafts, depth = sum(ks), max(ks)
        propose_s = max(0.0, 1e-3 + rng.gauss(0, 2e-4) - 2e-5 * drafts) if drafts else 0.0
        meter = meter.after(StepTiming(len(ks) + drafts, drafts, depth, propose_s, max(0.0, rng.gauss(5e-3, 1e-3))))
        assert meter.costs() is not None  # DraftCosts refuses a negative part
        assert min(meter.rest.fit()) >= 0.0 and (meter.propose.weight == 0 or min(meter.propose.fit()) >= 0.0)


def test_a_step_s_seconds_add_its_parts():
    costs = DraftCosts(step_s=5.0, verify_row_s=1.0, draft_s=0.5, call_s=2.0, depth_s=3.0)
    assert costs.seconds(4, 0, 0) == 9.0
    assert costs.seconds(4, 6, 3) == 5.0 + 2.0 + 9.0 + 10.0 + 3.0
    with pytest.raises(ValueError, match="cannot reach depth"):
        costs.seconds(4, 2, 3)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        DraftCosts(1e-3, -1e-4, 0.0)
