"""A k that follows each sequence's acceptance (specdec.follow_acceptance), with fake costs: no test reads a clock.

The costs are two machines' worth: ``GPU`` (a verify position nearly free, a draft token a
twentieth of a step) and ``COMPUTE_BOUND`` (every verify position costs a fifth of the
step's fixed part, as on a CPU or under load).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace

import pytest
import torch

from specdec.follow_acceptance import (
    DRAFT_MARGIN,
    IDLE_STEPS,
    PRIOR_WEIGHT,
    PROBE_SHARE,
    AcceptanceEstimate,
    DraftLengths,
    StepLengths,
    catch_up_share,
    choose_ks,
    goodput_ks,
    probe_every,
)
from specdec.scheduler import StepScheduler
from specdec.speculation_length import SpeculationLength
from specdec.step_costs import DraftCosts
from specdec.types import Proposal
from test_scheduler import VOCAB, ScriptedStages, greedy_reference, make_state, next_token, run_all

GPU = DraftCosts(step_s=10e-3, verify_row_s=2e-5, draft_s=5e-4)
COMPUTE_BOUND = DraftCosts(step_s=5e-3, verify_row_s=1e-3, draft_s=5e-5)
CAP = 8


def step_k(estimate: AcceptanceEstimate, costs=GPU, cap=CAP, population_rate=0.8) -> int:
    return choose_ks([estimate], [cap], costs, population_rate)[0]


def goodput(values, ks, costs) -> float:
    tokens = sum(1 + sum(row[:k]) for row, k in zip(values, ks))
    return tokens / costs.seconds(len(values), sum(ks), max(ks, default=0))


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


SERVED_DRAFT = DraftCosts(step_s=5e-3, verify_row_s=1e-4, draft_s=5e-4, call_s=2e-3)  # a hop to the draft's model
# a draft model at many streams: each depth is a forward over the batch, a further sequence at that depth nearly free
DRAFT_FORWARDS = DraftCosts(step_s=5e-3, verify_row_s=1e-4, draft_s=2e-5, call_s=1e-4, depth_s=1.2e-3)


@pytest.mark.parametrize("costs", [GPU, COMPUTE_BOUND, DraftCosts(1e-3, 1e-3, 1e-3), DraftCosts(0.0, 1e-3, 0.0),
                                   SERVED_DRAFT, DraftCosts(1e-3, 1e-4, 1e-4, call_s=5e-3), DRAFT_FORWARDS])  # fmt: skip
def test_goodput_ks_maximise_expected_tokens_per_second(costs):
    rng = random.Random(1)
    for _ in range(40):
        caps = [rng.randint(0, 3) for _ in range(3)]
        values = [[rate**j for j in range(1, cap + 1)] for rate, cap in zip((rng.random() for _ in caps), caps)]
        ks = goodput_ks(values, costs)
        best = max(goodput(values, c, costs) for c in itertools.product(*(range(cap + 1) for cap in caps)))
        assert goodput(values, ks, costs) == pytest.approx(best, rel=1e-12)
        assert all(0 <= k <= cap for k, cap in zip(ks, caps))


def test_a_call_cost_is_paid_once_so_a_few_drafts_may_lose_where_more_win():
    values = [[0.8**j for j in range(1, 9)]]
    per_token = DraftCosts(5e-3, 1e-4, 5e-4 + 2e-3 / 4)  # the call's 2 ms charged to each of 4 drafts
    assert goodput_ks(values, SERVED_DRAFT) == [6] and goodput_ks(values, per_token) == [4]
    assert goodput_ks([[0.3, 0.09]], SERVED_DRAFT) == [0]  # worth a draft's cost, not the call's too
    assert goodput_ks([[0.3, 0.09]], replace(SERVED_DRAFT, call_s=0.0)) == [1]


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


@pytest.mark.parametrize("costs", [GPU, COMPUTE_BOUND, DraftCosts(10e-3, 0.0, 5e-3), SERVED_DRAFT])
def test_failing_drafts_cost_no_more_than_the_probe_share(costs):
    estimate, seconds, steps = AcceptanceEstimate(0.0, 20.0), 0.0, 2000
    for _ in range(steps):
        k = step_k(estimate, costs, population_rate=0.0)
        seconds += costs.seconds(1, k, k)
        estimate = estimate.after(k, 0)
    assert steps * costs.seconds(1, 0, 0) / seconds >= 1 - 1.5 * PROBE_SHARE  # tokens/s against k = 0


def test_a_probe_that_must_catch_a_draft_up_on_a_prompt_waits_longer():
    costs = replace(SERVED_DRAFT, feed_s=1e-4)
    assert probe_every(costs, 1, unsent=500) > 5 * probe_every(costs, 1, unsent=1)
    failing = AcceptanceEstimate(0.0, 30.0, steps_without_drafts=probe_every(costs, 2, unsent=1))
    assert choose_ks([failing, failing], [CAP, CAP], costs, 0.0, unsent=[1, 500]) == [1, 0]


def test_a_catch_up_is_shared_by_the_steps_left_to_the_request():
    costs = replace(SERVED_DRAFT, feed_s=2e-5)
    values = [0.8, 0.6]  # a drafting step then emits 2.4 tokens
    assert catch_up_share(costs, unsent=3, cap=2, tokens_left=60, values=values) == 0.0  # what a step feeds anyway
    assert catch_up_share(replace(costs, feed_s=0.0), 500, 2, 60, values) == 0.0
    assert catch_up_share(costs, 203, 2, tokens_left=60, values=values) == pytest.approx(2e-5 * 200 / 25)
    assert catch_up_share(costs, 203, 2, tokens_left=2, values=values) == pytest.approx(2e-5 * 200)  # one step left


def test_a_first_draft_not_worth_its_catch_up_is_skipped_and_the_others_still_draft():
    values = [[0.9, 0.8], [0.9, 0.8]]
    assert goodput_ks(values, SERVED_DRAFT, catch_up_s=[0.0, 0.0]) == [2, 2]
    assert goodput_ks(values, SERVED_DRAFT, catch_up_s=[0.0, 50e-3]) == [2, 0]
    assert goodput_ks(values, SERVED_DRAFT, catch_up_s=[50e-3, 50e-3]) == [0, 0]


def test_sequences_that_missed_many_tokens_near_their_end_do_not_start_drafting_together():
    """Four sequences at k = 0 for a while, a few tokens left: catching their drafter up costs more than it earns."""
    costs = replace(GPU, feed_s=1e-4)
    passing = [AcceptanceEstimate(6.0, 4.0)] * 4
    assert choose_ks(passing, [4] * 4, costs, 0.6, unsent=[3] * 4, tokens_left=[12] * 4) == [2] * 4
    assert choose_ks(passing, [4] * 4, costs, 0.6, unsent=[190] * 4, tokens_left=[12] * 4) == [0] * 4
    assert choose_ks(passing, [4] * 4, costs, 0.6, unsent=[190] * 4, tokens_left=[400] * 4) == [2] * 4  # a prompt


def test_the_population_probes_its_cheapest_sequence_once_no_one_has_drafted_for_a_probe_s_interval():
    costs = replace(SERVED_DRAFT, feed_s=1e-4)
    lengths = DraftLengths(SpeculationLength(CAP, follows_acceptance=True), costs=costs)
    lengths.population = AcceptanceEstimate(0.0, 50.0)  # every recent draft failed
    states = [FakeState(AcceptanceEstimate(0.0, 0.0, prior_weight=PRIOR_WEIGHT), unsent=u) for u in (300, 40)]
    chosen = [lengths.choose(states).ks for _ in range(probe_every(costs, 2, 40))]
    assert chosen[:-1] == [(0, 0)] * (len(chosen) - 1) and chosen[-1] == (0, 1)  # new requests: none probes alone
    assert lengths.choose(states).ks == (0, 0)


def test_a_choice_of_no_drafts_stands_until_the_batch_changes_or_idle_steps_pass():
    """Without drafts no estimate moves: the choice is kept, not made again each step, while the batch keeps its
    sequences and caps; a new sequence, a cap that changed, or IDLE_STEPS steps (costs drift) make it afresh."""
    costs = replace(SERVED_DRAFT, feed_s=1e-4)  # probes of a 300-token catch-up: hundreds of steps apart
    lengths = DraftLengths(SpeculationLength(CAP, follows_acceptance=True), costs=costs)
    lengths.population = AcceptanceEstimate(0.0, 50.0)
    failing = FakeState(AcceptanceEstimate(0.0, 30.0, prior_weight=PRIOR_WEIGHT), unsent=300)
    assert lengths.choose([failing]).ks == (0,)
    failing.acceptance = AcceptanceEstimate(90.0, 10.0)  # as if its drafts now passed: seen only once re-chosen
    kept = [lengths.choose([failing]).ks for _ in range(IDLE_STEPS)]
    assert kept[:-1] == [(0,)] * (IDLE_STEPS - 1) and kept[-1][0] > 0
    failing.acceptance = AcceptanceEstimate(0.0, 30.0, prior_weight=PRIOR_WEIGHT)
    assert lengths.choose([failing]).ks == (0,)
    passing = FakeState(AcceptanceEstimate(90.0, 10.0), unsent=300)  # a request joins: chosen afresh at once
    assert lengths.choose([failing, passing]).ks[1] > 0
    assert lengths.choose([failing]).ks == (0,)
    failing.drafts_left, failing.acceptance = 2, AcceptanceEstimate(90.0, 10.0)  # its cap changed
    assert lengths.choose([failing]).ks[0] > 0


def test_where_a_verify_position_is_dear_a_batch_drafts_less():
    estimates = [AcceptanceEstimate(35.0, 15.0)] * 16  # 0.7 per draft
    assert choose_ks(estimates[:1], [CAP], COMPUTE_BOUND, 0.8)[0] > 0
    assert choose_ks(estimates, [CAP] * 16, COMPUTE_BOUND, 0.8) == [0] * 16
    batched_draft = DraftCosts(step_s=10e-3, verify_row_s=2e-5, draft_s=3e-5)  # a draft pass over 16 rows
    assert min(choose_ks(estimates, [CAP] * 16, batched_draft, 0.7)) >= 4


def test_a_depth_is_paid_once_so_a_batch_drafts_to_one_depth():
    estimates = [AcceptanceEstimate(90.0, 10.0)] + [AcceptanceEstimate(35.0, 15.0)] * 15  # 0.9, and 0.7 per draft
    ks = choose_ks(estimates, [CAP] * 16, DRAFT_FORWARDS, 0.7)
    assert ks == [1] * 16  # a second forward over all sixteen is worth less than its seconds
    per_token = replace(DRAFT_FORWARDS, depth_s=0.0, draft_s=DRAFT_FORWARDS.depth_s / 16)  # its cost shared out
    assert choose_ks(estimates, [CAP] * 16, per_token, 0.7) == [5] + [1] * 15  # the 0.9 one: 4 forwards for all


def test_drafts_must_promise_more_than_the_margin_over_plain_decoding():
    values, costs = [[0.3]], DraftCosts(step_s=5e-3, verify_row_s=1e-4, draft_s=1e-3)
    gain = goodput(values, [1], costs) / goodput(values, [0], costs) - 1  # about 7 %: within the margin
    assert 0 < gain < DRAFT_MARGIN and goodput_ks(values, costs) == [1]
    assert choose_ks([AcceptanceEstimate(300.0, 700.0)], [1], costs, 0.3) == [0]


SEQ_IDS = itertools.count()


@dataclass
class FakeState:
    acceptance: AcceptanceEstimate = AcceptanceEstimate()
    drafts_left: int = CAP
    unsent: int = 1
    tokens_left: int = 64
    seq_id: str = field(default_factory=lambda: f"seq-{next(SEQ_IDS)}")

    def num_draft_tokens(self) -> int:
        return self.drafts_left

    def num_unsent_to_proposer(self) -> int:
        return self.unsent

    def num_tokens_left(self) -> int:
        return self.tokens_left


def test_with_the_knob_off_every_sequence_drafts_the_table_s_k():
    table = SpeculationLength(4, per_batch_size=((1, 4), (3, 1)))
    lengths = DraftLengths(table, costs=GPU)
    failing = [FakeState(AcceptanceEstimate(0.0, 30.0)) for _ in range(4)]
    for n in (1, 2, 3, 4):
        assert lengths.choose(failing[:n]).ks == (table.k_for(n),) * n
    before = (lengths.meter, lengths.population)
    lengths.observe([(4, 0)], 5, StepLengths(4, (4,)), 1e-3, 2e-3)
    assert (lengths.meter, lengths.population) == before


def test_until_both_costs_are_read_each_sequence_drafts_one_every_other_step():
    lengths = DraftLengths(SpeculationLength(CAP, follows_acceptance=True))
    assert [lengths.choose([FakeState()] * 2).ks for _ in range(3)] == [(1, 1), (0, 0), (1, 1)]
    lengths.observe([(0, 0)], 100, StepLengths(CAP, (0,)), 0.0, 20e-3)  # a prefill: no row's cost read off it
    assert lengths.meter.costs() is None
    lengths.choose([FakeState()])
    prompt_fed = lengths.choose([FakeState(unsent=50)])
    assert not prompt_fed.steady and prompt_fed.ks == (1,)
    lengths.observe([(1, 1)], 2, StepLengths(CAP, (1,), steady=False), 30e-3, 40e-3)  # the draft read a prompt
    assert not lengths.meter.measured_drafts and lengths.choose([FakeState()]).ks == (0,)
    lengths.observe([(1, 1)], 2, StepLengths(CAP, (1,)), 1e-4, 10e-3)
    costs = lengths.meter.costs()  # one sequence: its depth and its drafts are one number, read as depth
    assert lengths.meter.measured_drafts and (costs.depth_s, costs.draft_s) == (pytest.approx(1e-4), 0.0)
    assert lengths.meter.rows_read is None and lengths.choose([FakeState()]).ks == (1,)  # still exploring
    lengths.observe([(0, 0)], 1, StepLengths(CAP, (0,)), 0.0, 9.0e-3)  # rows 2, 2, 1: now they varied, at a cost
    assert lengths.meter.rows_read is not None and lengths.choose([FakeState()]).ks == (CAP,)
    assert lengths.population.rate(0.8) > 0.8


@pytest.mark.parametrize("num_sequences", [1, 16])
@pytest.mark.parametrize("passing", [False, True])
def test_costs_read_off_the_steps_bring_failing_drafts_to_probes_and_passing_ones_to_the_cap(num_sequences, passing):
    """The whole loop on measured (made-up) seconds: a row 0.1 ms, a draft forward 1.5 ms, at 1 and 16 streams."""
    lengths, states = DraftLengths(SpeculationLength(CAP, follows_acceptance=True)), []
    states = [FakeState(AcceptanceEstimate()) for _ in range(num_sequences)]
    lengths.observe([(0, 0)] * num_sequences, 100 * num_sequences, StepLengths(CAP, (0,) * num_sequences), 0.0, 0.05)
    drafted = []
    for step in range(400):
        chosen = lengths.choose(states)
        ks = list(chosen.ks)
        accepted = [k if passing else 0 for k in ks]
        rows, depth = num_sequences + sum(ks), max(ks)
        propose_s = (0.2e-3 + 1.5e-3 * depth) if depth else 0.0
        lengths.observe(list(zip(ks, accepted)), rows, chosen, propose_s, propose_s + 5e-3 + 1e-4 * rows)
        states = [replace(s, acceptance=s.acceptance.after(k, a)) for s, k, a in zip(states, ks, accepted)]
        drafted.append(sum(ks))
    late = drafted[100:]
    if passing:  # every draft passes: each sequence drafts the cap, at one stream and at sixteen
        assert min(late) == CAP * num_sequences
    else:  # a probe now and then: well under the probe share of the steps' seconds
        assert sum(late) <= len(late) * num_sequences * 0.05


@pytest.mark.parametrize("seed", range(20))
def test_any_timings_and_outcomes_give_a_choice_never_an_error(seed):
    """The rule runs inside the step loop, where an exception stops every request: requests joining and leaving,
    drafts passing and failing at random, step times of any size (zero included) never make it raise."""
    rng = random.Random(seed)
    lengths = DraftLengths(SpeculationLength(CAP, per_batch_size=((1, CAP), (5, 2)), follows_acceptance=True))
    states = []
    for _ in range(300):
        while len(states) < rng.randint(1, 8):
            states.append(FakeState(drafts_left=rng.randint(0, CAP), unsent=rng.choice([1, 3, 200])))
        if rng.random() < 0.1:
            states.pop(rng.randrange(len(states)))
        if not states:
            continue
        chosen = lengths.choose(states)
        assert len(chosen.ks) == len(states) and all(0 <= k <= chosen.cap for k in chosen.ks)
        judged = [(k, rng.randint(0, k)) for k in chosen.ks]
        rows = len(states) + sum(chosen.ks) + (rng.choice([0, 0, 0, 100]))  # now and then a prompt among them
        propose_s = rng.choice([0.0, rng.uniform(0, 5e-3)]) if any(chosen.ks) else 0.0
        lengths.observe(judged, rows, chosen, propose_s, propose_s + rng.choice([0.0, rng.uniform(0, 2e-2)]))
        states = [replace(s, acceptance=s.acceptance.after(n, a), unsent=rng.choice([1, 3, 200]))
                  for s, (n, a) in zip(states, judged)]  # fmt: skip


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
