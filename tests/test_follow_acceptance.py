"""A k that follows each sequence's acceptance (specdec.follow_acceptance), with fake costs: no test reads a clock.

The costs are two machines' worth: ``GPU`` (a verify position nearly free, a draft token a
twentieth of a step) and ``COMPUTE_BOUND`` (every verify position costs a fifth of the
step's fixed part, as on a CPU or under load).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from specdec.follow_acceptance import (
    PROBE_SHARE,
    AcceptanceEstimate,
    CostMeter,
    DraftCosts,
    DraftLengths,
    StepLengths,
    StepTiming,
    choose_ks,
    goodput_ks,
    probe_every,
)
from specdec.scheduler import StepScheduler
from specdec.speculation_length import SpeculationLength
from specdec.types import Proposal
from test_scheduler import VOCAB, ScriptedStages, greedy_reference, make_state, next_token, run_all

GPU = DraftCosts(step_s=10e-3, verify_row_s=2e-5, draft_s=5e-4)
COMPUTE_BOUND = DraftCosts(step_s=5e-3, verify_row_s=1e-3, draft_s=5e-5)
CAP = 8


def step_k(estimate: AcceptanceEstimate, costs=GPU, cap=CAP, population_rate=0.8) -> int:
    return choose_ks([estimate], [cap], costs, population_rate)[0]


def goodput(values, ks, costs) -> float:
    tokens = sum(1 + sum(row[:k]) for row, k in zip(values, ks))
    return tokens / costs.seconds(len(values), sum(ks))


def test_a_step_counts_its_accepted_drafts_and_at_most_one_rejection():
    start = AcceptanceEstimate()
    assert (start.after(8, 3).accepted, start.after(8, 3).rejected) == (3, 1)
    assert start.after(4, 4).rejected == 0  # every draft passed: none was rejected
    assert AcceptanceEstimate(10.0, 2.0, steps_without_drafts=3).after(0, 0) == AcceptanceEstimate(10.0, 2.0, 4)
    assert AcceptanceEstimate(10.0, 2.0, 3).after(2, 0).steps_without_drafts == 0
    with pytest.raises(ValueError, match=r"num_accepted must be in \[0, num_drafts=2\], got 3"):
        start.after(2, 3)


def test_the_rate_is_the_per_draft_acceptance_not_accepted_over_drafted():
    rng, estimate, rates = random.Random(0), AcceptanceEstimate(), []
    for _ in range(3000):
        accepted = next(i for i in range(CAP + 1) if i == CAP or rng.random() >= 0.8)
        estimate = estimate.after(CAP, accepted)
        rates.append(estimate.rate(0.5))
    assert sum(rates[500:]) / len(rates[500:]) == pytest.approx(0.8, abs=0.03)  # accepted / drafted: about 0.42


def test_draft_values_are_the_chance_that_every_draft_up_to_each_passes():
    estimate = AcceptanceEstimate(6.0, 2.0)
    values = estimate.draft_values(0.5, 4)
    assert values[0] == pytest.approx(estimate.rate(0.5))
    assert all(a > b for a, b in zip(values, values[1:]))
    assert all(v > estimate.rate(0.5) ** (j + 1) for j, v in enumerate(values[1:], 1))  # an uncertain rate
    sure = AcceptanceEstimate(7000.0, 3000.0).draft_values(0.5, 4)
    assert sure == pytest.approx([0.7**j for j in range(1, 5)], rel=1e-3)
    assert AcceptanceEstimate(0.0, 50.0).draft_values(0.0, 3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("costs", [GPU, COMPUTE_BOUND, DraftCosts(1e-3, 1e-3, 1e-3), DraftCosts(0.0, 1e-3, 0.0)])
def test_goodput_ks_maximise_expected_tokens_per_second(costs):
    rng = random.Random(1)
    for _ in range(40):
        caps = [rng.randint(0, 3) for _ in range(3)]
        values = [[rate**j for j in range(1, cap + 1)] for rate, cap in zip((rng.random() for _ in caps), caps)]
        ks = goodput_ks(values, costs)
        best = max(goodput(values, c, costs) for c in itertools.product(*(range(cap + 1) for cap in caps)))
        assert goodput(values, ks, costs) == pytest.approx(best, rel=1e-12)
        assert all(0 <= k <= cap for k, cap in zip(ks, caps))


def test_the_cap_bounds_k_and_free_drafts_fill_it():
    assert goodput_ks([[1.0] * 3, [0.9] * 5, []], GPU) == [3, 5, 0]
    assert goodput_ks([[0.5, 0.25]], DraftCosts(1e-3, 0.0, 0.0)) == [2]  # drafts that cost nothing
    assert goodput_ks([[0.0, 0.0]], DraftCosts(1e-3, 0.0, 0.0)) == [0]  # and are worth nothing
    with pytest.raises(ValueError, match="between 0 and 1 expected tokens"):
        goodput_ks([[1.5]], GPU)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        DraftCosts(1e-3, -1e-4, 0.0)


def test_drafts_that_fail_fall_to_zero_and_drafts_that_pass_rise_to_the_cap():
    estimate, ks = AcceptanceEstimate(), []
    for _ in range(60):  # in a workload whose drafts pass: the population's rate weighs, less and less
        ks.append(step_k(estimate))
        estimate = estimate.after(ks[-1], 0)
    first_zero = ks.index(0)
    assert ks[0] == CAP and ks[:first_zero] == sorted(ks[:first_zero], reverse=True) and max(ks[first_zero:]) <= 1
    assert ks[-20:].count(1) <= 20 // probe_every(GPU, 1)  # probes alone
    estimate, ks = AcceptanceEstimate(), []
    for _ in range(12):
        ks.append(step_k(estimate, population_rate=0.3))  # a workload whose drafts mostly fail
        estimate = estimate.after(ks[-1], ks[-1])
    assert ks[0] < CAP and ks[-1] == CAP


def test_a_sequence_at_zero_probes_and_drafts_more_again_once_its_drafts_pass():
    estimate, ks = AcceptanceEstimate(), []
    for _ in range(100):  # drafts that fail, in a workload whose drafts fail
        ks.append(step_k(estimate, population_rate=0.02))
        estimate = estimate.after(ks[-1], 0)
    probes = [i for i, k in enumerate(ks) if i > 40 and k]
    assert {k for k in ks[40:]} == {0, 1} and {b - a for a, b in zip(probes, probes[1:])} == {probe_every(GPU, 1) + 1}
    for _ in range(60):  # now its drafts pass
        k = step_k(estimate, population_rate=0.02)
        estimate = estimate.after(k, k)
    assert step_k(estimate, population_rate=0.02) == CAP


@pytest.mark.parametrize("costs", [GPU, COMPUTE_BOUND, DraftCosts(10e-3, 0.0, 5e-3)])
def test_failing_drafts_cost_no_more_than_the_probe_share(costs):
    estimate, seconds, steps = AcceptanceEstimate(0.0, 20.0), 0.0, 2000
    for _ in range(steps):
        k = step_k(estimate, costs, population_rate=0.0)
        seconds += costs.seconds(1, k)
        estimate = estimate.after(k, 0)
    assert steps * costs.seconds(1, 0) / seconds >= 1 - 1.5 * PROBE_SHARE  # tokens/s against k = 0


def test_where_a_verify_position_is_dear_a_batch_drafts_less():
    estimates = [AcceptanceEstimate(35.0, 15.0)] * 16  # 0.7 per draft
    assert choose_ks(estimates[:1], [CAP], COMPUTE_BOUND, 0.8)[0] > 0
    assert choose_ks(estimates, [CAP] * 16, COMPUTE_BOUND, 0.8) == [0] * 16
    batched_draft = DraftCosts(step_s=10e-3, verify_row_s=2e-5, draft_s=3e-5)  # a draft pass over 16 rows
    assert min(choose_ks(estimates, [CAP] * 16, batched_draft, 0.7)) >= 4


def test_the_meter_reads_the_costs_off_the_steps():
    assert CostMeter().costs() is None
    meter = CostMeter()
    for i in range(200):  # rows of 4 .. 36 and some prefills; a propose call of 0.5 ms a draft
        rows, drafts = (4 + 8 * (i % 5), 8 * (i % 5)) if i % 20 else (300, 0)
        meter = meter.after(StepTiming(rows, drafts, 5e-4 * drafts, 10e-3 + 2e-5 * rows))
    costs = meter.costs()
    assert costs.step_s == pytest.approx(10e-3) and costs.verify_row_s == pytest.approx(2e-5)
    assert costs.draft_s == pytest.approx(5e-4)
    unspread = CostMeter().after(StepTiming(100, 0, 0.0, 20e-3))  # one prefill: nothing tells rows from the rest
    assert unspread.costs() == DraftCosts(step_s=0.0, verify_row_s=2e-4, draft_s=0.0)
    with pytest.raises(ValueError, match="at least one row"):
        CostMeter().after(StepTiming(0, 0, 0.0, 1e-3))


@dataclass
class FakeState:
    acceptance: AcceptanceEstimate = AcceptanceEstimate()
    drafts_left: int = CAP
    unsent: int = 1

    def num_draft_tokens(self) -> int:
        return self.drafts_left

    def num_unsent_to_proposer(self) -> int:
        return self.unsent


def test_with_the_knob_off_every_sequence_drafts_the_table_s_k():
    table = SpeculationLength(4, per_batch_size=((1, 4), (3, 1)))
    lengths = DraftLengths(table, costs=GPU)
    failing = [FakeState(AcceptanceEstimate(0.0, 30.0)) for _ in range(4)]
    for n in (1, 2, 3, 4):
        assert lengths.choose(failing[:n]).ks == (table.k_for(n),) * n
    before = (lengths.meter, lengths.population)
    lengths.observe([(4, 0)], 5, StepLengths(4, (4,)), 1e-3, 2e-3)
    assert (lengths.meter, lengths.population) == before


def test_the_cap_applies_until_a_step_is_measured_and_one_draft_until_a_draft_is():
    lengths = DraftLengths(SpeculationLength(CAP, follows_acceptance=True))
    assert lengths.choose([FakeState()]).ks == (CAP,)
    lengths.observe([(0, 0)], 100, StepLengths(CAP, (CAP,)), 0.0, 20e-3)  # a prefill
    lengths.observe([(0, 0)], 1, StepLengths(CAP, (0,)), 0.0, 10e-3)
    assert lengths.choose([FakeState()]).ks == (1,)
    prompt_fed = lengths.choose([FakeState(unsent=50)])
    assert not prompt_fed.steady
    lengths.observe([(1, 1)], 2, prompt_fed, 30e-3, 40e-3)  # the draft read a prompt: not a draft's cost
    assert lengths.meter.num_drafts == 0 and lengths.choose([FakeState()]).ks == (1,)
    lengths.observe([(1, 1)], 2, lengths.choose([FakeState()]), 1e-4, 10e-3)
    assert lengths.meter.costs().draft_s == pytest.approx(1e-4) and lengths.choose([FakeState()]).ks == (CAP,)
    assert lengths.population.rate(0.8) > 0.8


class RightAndWrongDrafts(ScriptedStages):
    """Drafts the target's own tokens for every sequence but those in ``wrong``, whose drafts never pass."""

    wrong = {"bad"}

    async def propose(self, requests):
        self.calls.append(("propose", len(requests)))
        proposals = []
        for request in requests:
            tokens, drafts = list(self.states[request.seq_id].token_ids), []
            for _ in range(request.num_tokens):
                drafts.append(next_token(tokens + drafts))
            if request.seq_id in self.wrong:
                drafts = [(t + 1) % VOCAB for t in drafts]
            proposals.append(Proposal(torch.tensor(drafts, dtype=torch.long)))
        return proposals


def test_the_scheduler_gives_each_sequence_the_k_its_drafts_earn_and_output_is_unchanged():
    stages, reports = RightAndWrongDrafts(), []
    scheduler = StepScheduler(stages, SpeculationLength(4, follows_acceptance=True), max_num_seqs=None,
                              on_step=reports.append)  # fmt: skip
    scheduler.lengths = DraftLengths(scheduler.lengths.speculation, costs=GPU)
    states = [make_state(stages, name, [i + 1, 2], max_tokens=120, k=4) for i, name in enumerate(("good", "bad"))]
    outcomes = run_all(scheduler, states)
    for state, steps in zip(states, outcomes):
        assert [t for step in steps for t in step.output.new_token_ids] == greedy_reference(state.prompt_ids, 120)
    together = [tuple(s.num_draft_tokens for s in r.sequences) for r in reports if r.num_sequences == 2][1:]
    good, bad = [g for g, _ in together], [b for _, b in together]
    assert good[:-1] == [4] * (len(good) - 1) and all(r.k == 4 for r in reports)
    assert bad[0] == 4 and max(bad[bad.index(0):]) <= 1  # after its first zero: no more than a probe
    assert states[1].stats.num_draft_tokens < 60  # of its 120 steps
