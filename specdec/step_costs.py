"""What a step's parts cost, read off the steps themselves: the inputs of the goodput rule.

A step is a propose call and the rest (the verify forward, the sampler, the loop). The
parts scale with different things, and a k chosen from a wrong shape of cost spirals:

* **the rest** grows with the rows the target verifies (each sequence's last token and its
  drafts): a line in the rows, its intercept the step's fixed cost;
* **the propose call** has its own cost (the hop to the drafter's model and back, paid
  once by a step that drafts at all), then, for a chain drafter, one forward per draft
  position, each over the sequences drafting that far: a cost per *depth* reached by any
  sequence, and a cost per draft token. A draft model at sixteen streams pays for its
  fourth forward whether one sequence drafts four or all do; charged per token, four
  drafts of one sequence look sixteen times cheaper than they are. A drafter that makes
  its whole block in one forward (PARD, DFlash) or none (n-gram, suffix) reads a depth
  cost of about nothing.

:class:`CostMeter` fits both from measured steps (older ones fading by :data:`COST_DECAY`);
where nothing has varied yet (one batch size, one k) it charges every second to what
varies (rows; depth), the reading under which nothing looks free; once the rows have
varied, the last slope read stands while they keep still. A row slope within noise of zero
(``Moments.slope_stands_out``) is not taken as read: verifying drafts would look free.
"""
from __future__ import annotations

from dataclasses import dataclass

COST_DECAY = 0.98  # a step's timing weighs this much of the one before: the costs of about the last 50 steps
MIN_SPREAD = 0.1  # variance of a regressor (rows, depth, drafts) below which no slope can be read off the steps


@dataclass(frozen=True)
class DraftCosts:
    """What a step's parts cost, in seconds."""

    step_s: float  # the step's cost that no draft or sequence changes: fixed verify cost, calls, the loop
    verify_row_s: float  # each position the target verifies: a sequence's last token, and each draft
    draft_s: float  # each draft token one sequence is proposed, beyond its depth's forward
    call_s: float = 0.0  # the propose call's own cost, paid once by a step that drafts at all
    depth_s: float = 0.0  # each draft position any sequence reaches: a chain drafter's sequential forward
    # each token a drafter reads before its drafts beyond the last one and the accepted: a
    # prompt, or what a sequence missed at k = 0 (a draft model's catch-up; nothing for n-gram)
    feed_s: float = 0.0

    def __post_init__(self) -> None:
        parts = (self.step_s, self.verify_row_s, self.draft_s, self.call_s, self.depth_s, self.feed_s)
        if min(parts) < 0 or self.step_s + self.verify_row_s <= 0:
            raise ValueError(f"costs must be >= 0 and a step must take time, got {self}")

    def seconds(self, num_sequences: int, num_drafts: int, depth: int) -> float:
        """A step of ``num_sequences`` making ``num_drafts`` drafts, the longest chain ``depth`` long."""
        if (num_drafts > 0) != (depth > 0) or depth > num_drafts:
            raise ValueError(f"{num_drafts} drafts cannot reach depth {depth}")
        call = self.call_s if num_drafts else 0.0
        return (self.step_s + call + self.depth_s * depth + self.verify_row_s * (num_sequences + num_drafts)
                + self.draft_s * num_drafts)  # fmt: skip


@dataclass(frozen=True)
class StepTiming:
    """What one step fed and took: the meter's one observation."""

    rows: int  # positions the target verified: prompts, and each sequence's last token and drafts
    num_drafts: int  # draft tokens proposed (0: the propose call read a prompt, and is no draft's cost)
    depth: int  # the most drafts one sequence was proposed
    propose_s: float  # the propose call's seconds (0 where the draft runs inside the verify call)
    rest_s: float  # the rest of the step: the verify call, the sampler, the loop
    # no prompt was verified: the rows are each sequence's last token and its drafts. A prompt's
    # rows cost far less each than a decode row's (one wide matrix product), and one prefill of
    # thousands of rows would set the slope alone: the rows' cost is read off decode steps only
    decode: bool = True
    # tokens a call that read prompts or a catch-up fed its drafter (num_drafts is then 0):
    # the seconds it took beyond a steady call of its depth are theirs
    fed: int = 0


@dataclass(frozen=True)
class Moments:
    """Decayed sums of points ``(x1, x2, y)``: what a least-squares fit of ``y`` in ``x1`` and ``x2`` needs."""

    weight: float = 0.0
    sums: tuple[float, ...] = (0.0,) * 9  # x1, x2, y, x1^2, x2^2, x1 x2, x1 y, x2 y, y^2

    def after(self, x1: float, x2: float, y: float) -> Moments:
        d, s = COST_DECAY, self.sums  # written out: the rule's meter updates once a step, on the step's time
        return Moments(d * self.weight + 1, (d * s[0] + x1, d * s[1] + x2, d * s[2] + y, d * s[3] + x1 * x1,
                                             d * s[4] + x2 * x2, d * s[5] + x1 * x2, d * s[6] + x1 * y,
                                             d * s[7] + x2 * y, d * s[8] + y * y))  # fmt: skip

    def means(self) -> tuple[float, float, float]:
        return self.sums[0] / self.weight, self.sums[1] / self.weight, self.sums[2] / self.weight

    def covariances(self) -> tuple[float, float, float, float, float]:
        """var x1, var x2, cov x1 x2, cov x1 y, cov x2 y."""
        m1, m2, my = self.means()
        w = self.weight
        return (self.sums[3] / w - m1 * m1, self.sums[4] / w - m2 * m2, self.sums[5] / w - m1 * m2,
                self.sums[6] / w - m1 * my, self.sums[7] / w - m2 * my)  # fmt: skip

    def spread(self) -> bool:
        """Whether ``x1`` has varied enough for a slope to be read."""
        return self.weight > 0 and self.covariances()[0] > MIN_SPREAD

    def slope_stands_out(self) -> bool:
        """Whether ``y``'s slope in ``x1`` alone is above zero by more than twice its standard error.

        A few noisy steps can fit a slope near zero where the true one is not: read as a
        row's cost, verifying drafts would look free.
        """
        if not self.spread():
            return False
        v1, _, _, c1y, _ = self.covariances()
        my = self.means()[2]
        slope = c1y / v1
        residual = max(0.0, self.sums[8] / self.weight - my * my - slope * c1y)  # var y less what x1 explains
        if slope * v1**0.5 <= 1e-9 * abs(my):  # flat to float precision
            return False
        return slope > 2.0 * (residual / (v1 * self.weight)) ** 0.5

    def fit(self) -> tuple[float, float, float]:
        """(intercept, slope in x1, slope in x2), none negative.

        Both slopes where both regressors varied, and not together (one stream: depth and
        drafts are one number); else the one that varied, what it leaves charged to x1 (the
        cautious reading: no depth looks free). A negative slope (noise) drops its
        regressor; a negative intercept is read as none.
        """
        m1, m2, my = self.means()
        v1, v2, c12, c1y, c2y = self.covariances()
        det = v1 * v2 - c12 * c12
        if v1 > MIN_SPREAD and v2 > MIN_SPREAD and det > 0.05 * v1 * v2:
            b1, b2 = (c1y * v2 - c2y * c12) / det, (c2y * v1 - c1y * c12) / det
            if b1 >= 0 and b2 >= 0:
                return max(0.0, my - b1 * m1 - b2 * m2), b1, b2
            if b2 >= 0 > b1:  # x2 alone explains what varies
                b2 = min(max(c2y / v2, 0.0), my / m2)
                return max(0.0, my - b2 * m2), 0.0, b2
        if v1 <= MIN_SPREAD and v2 > MIN_SPREAD:  # only x2 varied: its slope, and the rest charged to x1
            b2 = min(max(c2y / v2, 0.0), my / m2)
            return 0.0, max(0.0, (my - b2 * m2) / m1), b2
        b1 = min(max(c1y / v1, 0.0), my / m1) if v1 > MIN_SPREAD else my / m1
        return max(0.0, my - b1 * m1), b1, 0.0


@dataclass(frozen=True)
class CostMeter:
    """:class:`DraftCosts` as running fits of measured steps (see the module's docstring)."""

    rest: Moments = Moments()  # decode steps: the rest's seconds in the rows verified
    propose: Moments = Moments()  # drafting steps: the propose call's seconds in its depth and its drafts
    # the last (intercept, slope) read while the rows varied: a batch that keeps one k for a while
    # lets the spread fade, and the rows cost no less for it
    rows_read: tuple[float, float] | None = None
    fed: tuple[float, float] = (0.0, 0.0)  # decayed sums over calls that read prompts: tokens read, seconds beyond drafts

    def after(self, timing: StepTiming) -> CostMeter:
        """The meter with one more step measured."""
        if timing.rows < 1 or timing.num_drafts < 0 or min(timing.propose_s, timing.rest_s) < 0:
            raise ValueError(f"a step verifies at least one row and takes no negative time, got {timing}")
        rest, propose, rows_read, fed = self.rest, self.propose, self.rows_read, self.fed
        if timing.decode:
            rest = rest.after(float(timing.rows), 0.0, timing.rest_s)
            if rest.slope_stands_out():  # else the last reading stands (or none: the rule keeps exploring)
                rows_read = rest.fit()[:2]
        if timing.num_drafts > 0:
            propose = propose.after(float(timing.depth), float(timing.num_drafts), timing.propose_s)
        elif timing.fed > 0:  # what the call took beyond a steady call of its depth (before one: all of it)
            call_s, depth_s, _ = propose.fit() if propose.weight > 0 and propose.means()[2] > 0 else (0.0, 0.0, 0.0)
            beyond = max(0.0, timing.propose_s - call_s - depth_s * max(1, timing.depth))
            fed = (COST_DECAY * fed[0] + timing.fed, COST_DECAY * fed[1] + beyond)
        return CostMeter(rest, propose, rows_read, fed)

    @property
    def measured_drafts(self) -> bool:
        """Whether a drafting step's propose call has been measured."""
        return self.propose.weight > 0

    def costs(self) -> DraftCosts | None:
        """The costs measured so far; None before a decode step."""
        if self.rest.weight == 0 or self.rest.means()[2] <= 0:
            return None
        step_s, verify_row_s = self.rows_read or self.rest.fit()[:2]
        call_s, depth_s, draft_s = 0.0, 0.0, 0.0
        if self.propose.weight > 0 and self.propose.means()[2] > 0:
            call_s, depth_s, draft_s = self.propose.fit()
        feed_s = self.fed[1] / self.fed[0] if self.fed[0] > 0 else 0.0
        return DraftCosts(step_s, verify_row_s, draft_s, call_s, depth_s, feed_s)
