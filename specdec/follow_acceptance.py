"""Each sequence's k from its own acceptance: the goodput rule of SmartSpec, under the batch-size table's cap.

A step is worth what it yields per second (*goodput*, Liu et al. 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput"). A sequence's
``j``-th draft adds to the step's expected tokens the chance that drafts 1 .. j all pass
(``a^j`` at a per-draft acceptance rate ``a``, as in ``specdec.speculation_length``) and
costs one draft token and one verify position, ``c`` seconds (the propose call, and a chain
drafter's forward per depth, are paid once a step: ``specdec.step_costs``). So the step's goodput is
highest when it makes exactly the drafts worth more than the seconds they take at that
goodput: each sequence drafts the largest ``k <= cap`` whose ``k``-th draft is worth more
than ``c * N / T``, where ``N / T`` is the step's expected tokens per second with those
drafts (:func:`goodput_ks` finds it). A sequence whose drafts fail drafts less, down to
none; one whose drafts pass, up to the table's cap; and under load, where a verify
position costs more, every sequence drafts less.

The parts, each pure:

* :class:`AcceptanceEstimate` -- a sequence's accepted drafts and rejections, older
  steps fading (:data:`DECAY`), started from the rate of every sequence's recent drafts
  (the *population*), so that a new request starts where the workload is;
* :func:`goodput_ks` -- the rule above, given each draft's worth and :class:`DraftCosts`;
* :func:`probe_every` -- a sequence at k = 0 learns nothing of its drafts, so every so
  many steps it drafts one (a *probe*), no more often than costs :data:`PROBE_SHARE` of
  its tokens: drafts that pass again are seen, and drafted more;
* ``specdec.step_costs.CostMeter`` -- the costs, fitted to the steps' measured seconds.

:class:`DraftLengths` is the thin stateful layer the step scheduler holds: the
population's estimate and the meter. Each sequence's estimate is its state's
(``SequenceState.acceptance``). Output never depends on k (``specdec.scheduler``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.speculation_length import SpeculationLength
from specdec.step_costs import CostMeter, DraftCosts, StepTiming

if TYPE_CHECKING:  # the state imports this module for its estimate
    from specdec.engine import SequenceState

# Each drafting step's evidence weighs this much of the one before's: about the last twenty
# count, enough to average a step's luck, few enough that a request whose drafts stop
# passing drafts less within a few steps. A step without drafts changes nothing.
DECAY = 0.95
# Drafts' worth of the population's rate in a sequence's estimate: at first enough that a
# step's luck gives no early verdict; fading with the sequence's own evidence (by DECAY) to
# a floor small enough that drafts which keep failing drive its rate to about nothing.
PRIOR_WEIGHT = 4.0
PRIOR_FLOOR = 0.5
INITIAL_RATE = 0.8  # the population's rate before any step: the first requests draft up to the table's k
# How much more than plain decoding's goodput a step's drafts must promise. The rule's model
# leaves costs out: a draft model reads each prompt (and what it missed while at k = 0) before
# its first draft, and the measured costs carry a busy machine's noise. Drafts that promise
# less than this are as likely to lose as to win, and k = 0 never loses to itself.
DRAFT_MARGIN = 0.15
PROBE_SHARE = 0.01  # the most of the tokens that probes of sequences at k = 0 may cost
# A choice of no drafts stands this many steps while the batch keeps its sequences and no
# probe falls due: without drafts no sequence's estimate moves, only the measured costs,
# which drift by a few percent in that time. Choosing afresh every step costs about as much
# as the probes do (~50 us more Python a step, measured in the engine: 1 % of a one-stream step on a CPU).
IDLE_STEPS = 8


@dataclass(frozen=True)
class AcceptanceEstimate:
    """What a sequence's drafts did: decayed counts of drafts accepted and of rejections.

    A step that drafted ``n`` and accepted ``a`` saw ``a`` drafts pass and, if ``a < n``,
    one fail; the drafts after the first rejection were never judged. So the per-draft rate
    is accepted / (accepted + rejected), not accepted / drafted, which would read 0.42 for
    a draft accepted 80% of the time at k = 8.
    """

    accepted: float = 0.0
    rejected: float = 0.0
    steps_without_drafts: int = 0  # steps since the sequence last had drafts judged
    prior_weight: float = PRIOR_WEIGHT  # drafts' worth of its prior

    def after(self, num_drafts: int, num_accepted: int) -> AcceptanceEstimate:
        """The estimate after a step that judged ``num_drafts`` drafts and accepted ``num_accepted``."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"num_accepted must be in [0, num_drafts={num_drafts}], got {num_accepted}")
        if num_drafts == 0:  # no evidence: only a probe can tell whether its drafts pass again
            return AcceptanceEstimate(self.accepted, self.rejected, self.steps_without_drafts + 1, self.prior_weight)
        return self.observed(num_accepted, float(num_accepted < num_drafts))

    def observed(self, accepted: float, rejected: float) -> AcceptanceEstimate:
        """Older evidence fades by :data:`DECAY`, this step's is added (the population: several sequences' at once)."""
        return AcceptanceEstimate(DECAY * self.accepted + accepted, DECAY * self.rejected + rejected, 0,
                                  max(PRIOR_FLOOR, DECAY * self.prior_weight))  # fmt: skip

    def rate(self, prior: float) -> float:
        """The per-draft acceptance rate, ``prior`` counting as :attr:`prior_weight` drafts."""
        return (self.accepted + prior * self.prior_weight) / (self.accepted + self.rejected + self.prior_weight)

    def draft_values(self, prior: float, cap: int) -> list[float]:
        """What each of ``cap`` drafts adds to the step's expected tokens: the chance that drafts 1 .. j all pass.

        The rate is known only as well as the evidence tells: with ``A`` drafts accepted and
        ``R`` rejections (the prior's share included) it is Beta(A, R)-distributed, and the
        chance that ``j`` drafts pass is ``E[a^j] = prod_{i<j} (A + i) / (A + R + i)``, more
        than ``(A / (A + R))^j``: an estimate from few drafts does not undervalue long drafts.
        """
        accepted = self.accepted + prior * self.prior_weight
        judged = accepted + self.rejected + (1 - prior) * self.prior_weight
        values, chance = [], 1.0
        for i in range(cap):
            chance *= (accepted + i) / (judged + i)
            values.append(chance)
        return values


def goodput_ks(values: Sequence[Sequence[float]], costs: DraftCosts, margin: float = 0.0,
               catch_up_s: Sequence[float] | None = None) -> list[int]:  # fmt: skip
    """Each sequence's k (at most ``len(values[i])``) that together maximise the step's expected tokens per second.

    ``values[i][j - 1]`` is what sequence ``i``'s ``j``-th draft adds to the step's expected
    tokens, falling with ``j`` (``a^j`` at a known rate ``a``). For a depth ``D`` (the longest
    chain, whose forwards and call are paid once, ``DraftCosts.depth_s``), every further
    draft costs the same, so the best ``m`` drafts are the ``m`` most valuable, and since a
    sequence's values fall with ``j`` they are its drafts ``1 .. k_i``. Among those, drafts
    raise ``N / T`` exactly while each is worth more than its seconds at the goodput so far
    (``value / c > N / T``): the first that is not is where to stop. Each depth's best is
    compared with the others' and with no drafts at all, which drafts must beat by
    ``margin`` (a share of its goodput). Ties draft less.

    ``catch_up_s[i]``: what sequence ``i``'s first draft costs beyond a draft's, the share of
    its drafter's catch-up this step bears (:func:`catch_up_share`). A first draft not worth
    that is skipped, and the sequence with it; any other draft that is not worth its cost
    ends the search, as every later one is worth less and costs no less.
    """
    if any(v < 0 or v > 1 for row in values for v in row):
        raise ValueError(f"a draft adds between 0 and 1 expected tokens, got {[list(row) for row in values]}")
    n = len(values)
    plain_s = costs.seconds(n, 0, 0)
    best_ks, best = [0] * n, (1 + margin) * n / plain_s  # each sequence's recovered or bonus token
    per_draft = costs.verify_row_s + costs.draft_s
    deepest = max(map(len, values), default=0)
    # the likeliest draft not worth its seconds even in the dearest step: no draft is (drafts that
    # keep failing, every step of them: the rule's common case where it matters that it is cheap)
    most = max((row[0] for row in values if row), default=0.0)
    if most * (plain_s + costs.call_s + costs.depth_s * deepest) <= n * per_draft:
        return best_ks
    # most valuable first; a sequence's drafts in their order where their values tie
    ranked = sorted(((v, j, i) for i, row in enumerate(values) for j, v in enumerate(row)),
                    key=lambda d: (-d[0], d[1], -d[2]))  # fmt: skip
    # without a cost per depth, the deepest allowed is no dearer than any other: one pass is the best
    catch_up_s = catch_up_s or [0.0] * n
    for depth in range(1, deepest + 1) if costs.depth_s > 0 else range(deepest, deepest + 1):
        tokens, seconds = float(n), plain_s + costs.call_s + costs.depth_s * depth  # the depth's fixed part
        ks = [0] * n
        for value, j, i in ranked:
            if j >= depth or ks[i] < j:  # a draft past this depth, or after a first draft that was skipped
                continue
            cost = per_draft + (catch_up_s[i] if j == 0 else 0.0)
            if value * seconds <= tokens * cost:  # value / cost <= tokens / seconds: no gain
                if cost > per_draft:
                    continue
                break
            tokens, seconds = tokens + value, seconds + cost
            ks[i] += 1
        if (max(ks) == depth or costs.depth_s == 0) and tokens / seconds > best:  # else priced at its own depth
            best_ks, best = ks, tokens / seconds
    return best_ks


def probe_every(costs: DraftCosts, num_sequences: int, unsent: int = 0) -> int:
    """Steps between a non-drafting sequence's one-draft probes: a probe then spends at most :data:`PROBE_SHARE`.

    A probe that fails yields nothing for its seconds, which the step would have turned
    into ``G * c`` tokens at its goodput without drafts ``G``; one probe per sequence every
    ``n`` steps (each yielding about a token per sequence) so loses ``G * c / n`` of the
    tokens. Its seconds are a draft's, and, alone in its step, the call's and a depth's; and
    the ``unsent`` tokens its drafter must read first (``DraftCosts.feed_s``): a draft model
    that never drafted for a sequence reads its whole prompt, which makes the first probe
    of a long prompt the dearest.
    """
    goodput = num_sequences / costs.seconds(num_sequences, 0, 0)
    probe_s = costs.seconds(num_sequences, 1, 1) - costs.seconds(num_sequences, 0, 0) + costs.feed_s * unsent
    return max(1, math.ceil(goodput * probe_s / PROBE_SHARE))


def catch_up_share(costs: DraftCosts, unsent: int, cap: int, tokens_left: int, values: Sequence[float]) -> float:
    """The seconds of a drafter's catch-up that one step starting to draft bears.

    A drafter that has not drafted for a sequence for a while (or ever: a new request's
    prompt) reads what it missed before its first draft, ``DraftCosts.feed_s`` a token beyond
    the ``cap + 1`` a drafting step feeds anyway. Four sequences starting at once after a
    stretch at k = 0 read hundreds of tokens each, a step several times a plain one's. The
    catch-up is paid once and serves every later step the sequence drafts, so a step bears
    it over the steps left to the request at the tokens a step then emits
    (``1 + sum(values)``): a new request's prompt weighs little, a catch-up near the end of
    a request much.
    """
    missed = max(0, unsent - (cap + 1))
    if missed == 0 or costs.feed_s == 0:
        return 0.0
    steps_left = max(1.0, tokens_left / (1.0 + sum(values)))
    return costs.feed_s * missed / steps_left


def choose_ks(estimates: Sequence[AcceptanceEstimate], caps: Sequence[int], costs: DraftCosts,
              population_rate: float, unsent: Sequence[int] | None = None,
              tokens_left: Sequence[int] | None = None) -> list[int]:  # fmt: skip
    """The goodput rule over each sequence's rate, and a probe of one draft for a sequence long at k = 0.

    ``unsent``: the tokens each sequence's drafter has not read (its catch-up, charged as
    :func:`catch_up_share` says where ``tokens_left`` is given, and its probe's).
    """
    values = [e.draft_values(population_rate, cap) for e, cap in zip(estimates, caps)]
    unsent = unsent or [0] * len(estimates)
    catch_up = None
    if tokens_left is not None:
        catch_up = [catch_up_share(costs, u, cap, left, v) for u, cap, left, v in zip(unsent, caps, tokens_left, values)]
    ks = goodput_ks(values, costs, DRAFT_MARGIN, catch_up)
    return [1 if k == 0 and cap > 0 and e.steps_without_drafts >= probe_every(costs, len(estimates), u) else k
            for k, cap, e, u in zip(ks, caps, estimates, unsent)]  # fmt: skip


@dataclass(frozen=True)
class StepLengths:
    """A step's drafts as :class:`DraftLengths` chose them."""

    cap: int  # the table's k at the step's batch size
    ks: tuple[int, ...]  # each sequence's k, at most the cap
    # no drafting sequence feeds its proposer more than cap + 1 tokens (its prompt, or what
    # it missed at k = 0): the propose call then costs what its drafts cost, and is measured
    steady: bool = True
    fed: int = 0  # tokens the drafting sequences feed their proposer


class DraftLengths:
    """Each sequence's k in a step: the table's cap, or under it the goodput rule when speculation follows acceptance.

    Holds what no one sequence owns: the population's estimate and the cost meter. With
    ``speculation.follows_acceptance`` false every sequence gets the table's k, exactly.
    ``costs``: fixed costs instead of measured ones, so that a test does not depend on timing.
    """

    def __init__(self, speculation: SpeculationLength, costs: DraftCosts | None = None):
        self.speculation = speculation
        self.fixed_costs = costs
        # every sequence's drafts; its rate starts at INITIAL_RATE, outweighed after a step or two
        self.population = AcceptanceEstimate(prior_weight=1.0)
        self.meter = CostMeter()
        self.steps_exploring = 0
        self._costs: DraftCosts | None = None  # the meter's, read since its last step
        self.steps_without_drafts = 0  # steps in which no sequence drafted: the population's own probe
        # after a choice of no drafts: the batch (each sequence and its cap) and the steps the choice still stands
        self._idle: tuple[tuple[tuple[str, int], ...], int] | None = None

    def choose(self, states: Sequence[SequenceState]) -> StepLengths:
        """Each ``SequenceState``'s k in a step.

        Until a draft's cost and a verify row's have been read (a draft made, and the rows
        varied), each sequence drafts one every other step: a step at the cap could cost
        many plain steps where drafts are dear, a step without drafts teaches nothing of
        them, and steps that alternate between no draft and one vary the rows, which is what
        lets a row's cost be read. A choice of no drafts stands while the batch does, for at
        most :data:`IDLE_STEPS` and never past a probe's step.
        """
        cap = self.speculation.k_for(len(states))
        if not self.speculation.follows_acceptance:  # the table alone: nothing else to read per step
            return StepLengths(cap, (cap,) * len(states), True)
        if self._idle is not None:
            batch, stands = self._idle
            self._idle = None
            if stands > 0 and batch == tuple((s.seq_id, min(cap, s.num_draft_tokens())) for s in states):
                self._idle, self.steps_without_drafts = (batch, stands - 1), self.steps_without_drafts + 1
                return StepLengths(cap, (0,) * len(states))
        if self._costs is None and self.fixed_costs is None:  # read once a step measured, not once a choice
            self._costs = self.meter.costs()
        costs = self.fixed_costs or self._costs
        if cap == 0:
            ks = [0] * len(states)
        elif costs is None or not (self.fixed_costs or (self.meter.rows_read and self.meter.measured_drafts)):
            self.steps_exploring += 1
            ks = [min(self.steps_exploring % 2, state.num_draft_tokens()) for state in states]
        else:
            caps = [min(cap, state.num_draft_tokens()) for state in states]
            prior = self.population.rate(INITIAL_RATE)
            unsent = [state.num_unsent_to_proposer() for state in states]
            left = [state.num_tokens_left() for state in states]
            ks = choose_ks([state.acceptance for state in states], caps, costs, prior, unsent, left)
            ks = self._population_probe(ks, caps, unsent, costs)
            if not any(ks):
                batch = tuple((state.seq_id, c) for state, c in zip(states, caps))
                self._idle = (batch, self._idle_steps(states, caps, unsent, costs))
        feeds = [s.num_unsent_to_proposer() for s, k in zip(states, ks) if k and s.num_draft_tokens()]
        return StepLengths(cap, tuple(ks), max(feeds, default=0) <= cap + 1, sum(feeds))

    def _idle_steps(self, states: Sequence[SequenceState], caps: list[int], unsent: list[int],
                    costs: DraftCosts) -> int:  # fmt: skip
        """The steps after this one for which a choice of no drafts stands: :data:`IDLE_STEPS`, less where a probe
        falls due sooner (a sequence's, or the population's of its cheapest)."""
        able = [i for i, cap in enumerate(caps) if cap > 0]
        due = [probe_every(costs, len(states), unsent[i]) - states[i].acceptance.steps_without_drafts for i in able]
        if able:
            cheapest = min(unsent[i] for i in able)
            due.append(probe_every(costs, len(states), cheapest) - self.steps_without_drafts)
        return max(0, min([IDLE_STEPS, *due]) - 1)

    def _population_probe(self, ks: list[int], caps: list[int], unsent: list[int], costs: DraftCosts) -> list[int]:
        """One draft for the sequence cheapest to probe, once no sequence has drafted for its probe's interval.

        A sequence's own probes can be rarer than its life (its catch-up is long); requests
        come and go, so without this, drafts that failed once would never be tried again.
        """
        self.steps_without_drafts = 0 if any(ks) else self.steps_without_drafts + 1
        able = [i for i, cap in enumerate(caps) if cap > 0]
        if any(ks) or not able:
            return ks
        cheapest = min(able, key=lambda i: unsent[i])
        if self.steps_without_drafts >= probe_every(costs, len(ks), unsent[cheapest]):
            ks, self.steps_without_drafts = [1 if i == cheapest else 0 for i in range(len(ks))], 0
        return ks

    def observe(self, judged: Sequence[tuple[int, int]], rows: int, lengths: StepLengths, propose_s: float,
                step_s: float) -> None:  # fmt: skip
        """A step done: each sequence's (drafts judged, accepted), the rows verified, the propose call's and the
        step's seconds."""
        if not self.speculation.follows_acceptance:
            return
        drafting = [(n, a) for n, a in judged if n]
        if drafting:
            self.population = self.population.observed(sum(a for _, a in drafting),
                                                       sum(float(a < n) for n, a in drafting))  # fmt: skip
        num_drafts = sum(n for n, _ in drafting) if lengths.steady else 0  # a prompt fed costs more than drafts
        depth = max((n for n, _ in drafting), default=0)
        decode = rows == len(judged) + sum(n for n, _ in drafting)  # else a prompt was among the rows
        fed = 0 if lengths.steady else lengths.fed  # a catch-up: every token the propose call read
        timing = StepTiming(rows, num_drafts, depth, propose_s if drafting else 0.0, max(0.0, step_s - propose_s),
                            decode, fed)  # fmt: skip
        self.meter, self._costs = self.meter.after(timing), None
