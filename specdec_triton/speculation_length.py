"""The adaptive speculation length: how many drafts a step asks for, from what they cost and earn now.

With ``speculative_length_policy: adaptive`` each step drafts the ``k`` in
``[0, num_speculative_tokens]`` that gives the most expected tokens per second of a
decoding round (every live sequence one step), for the ``n`` sequences live now:

    k* = argmax_k  E[tokens | k, alpha] / round(n, k)
    round(n, 0) = O + t_v(V(n, 1)) + c
    round(n, k) = O + g(n) (t_v(V(n / g(n), k + 1)) + t_p(P(n / g(n), k)) + 2 c)

- ``E[tokens | k, alpha] = 1 + alpha + ... + alpha^k``: accepted drafts plus the
  recovered or bonus token, with ``alpha`` the per-position acceptance rate;
- ``V(m, s)`` and ``P(m, k)``: a verify call of ``m`` sequences scoring ``s`` rows each
  and a propose call drafting ``k`` each, as the models measured themselves, alone
  (:mod:`specdec.call_costs`);
- ``c``: a BLS round trip, timed once on calls that do no work;
- ``t_v(x)`` and ``t_p(x) = f + r x``: what a call whose work measured ``x`` alone takes
  here and now, less ``c``. ``r`` is how much slower the work runs (queueing, the cores
  shared with the other models under load); ``f`` is what a real call pays besides its
  work and the bare round trip (its tensors in and out, the model's own bookkeeping),
  the same for one draft or four. One line per stage and number of live sequences (an
  unseen one takes the closest seen), so what the load taught does not linger when it
  falls: through the average observed time of the call shape used last, with the slope
  fitted over the averages of every shape seen (:class:`CallTime`). Without ``f``, a
  ratio learned at ``k = 2`` charges a ``k = 4`` call its fixed part twice, and deep
  drafts look dearer than they are;
- ``g(n)``: the groups that ``n`` drafting sequences split into. A plain decoding step
  goes from verify straight back to verify, so every sequence shares each forward; a
  drafting sequence alternates between the draft and the target, and under load the
  sequences settle into groups that take turns, each call carrying ``n / g`` of them.
  Observed while the choice at that load is to draft (trusted after ``MIN_GROUP_CALLS``
  such calls at that load; until then the groups of the nearest load that has them,
  at most ``n``, or 1 where none has);
- ``O``: a step's own time outside its stage calls, from the end of the sequence's
  previous step (so the work between steps counts too), also per number of live
  sequences.

So a lone sequence with a good draft drafts deeply, and drafting stops where
verifying drafts, and splitting the batch to draft them, costs more than they save:
the load point vLLM's ``speculative_disable_by_batch_size`` asks the user to guess.
The choice only sets how many drafts are verified; every step stays a lossless
speculative step, so greedy output does not change. ``alpha`` is estimated over all
sequences' recent steps (one estimate, one ``k`` for every sequence, so the batched
calls keep one shape).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

from specdec.call_costs import CallCosts

ACCEPTANCE_WINDOW_STEPS = 256  # steps over which the acceptance rate is averaged (exponential decay)
MIN_POSITIONS_OBSERVED = 16  # draft positions seen before the rate is trusted; until then k = the maximum
SMOOTHING = 0.05  # weight of the newest observation in the moving averages
# while k* = 0, one step drafts one token once no step has drafted for this long, to keep the rate
# current; rare, since a probing sequence leaves its batch for a step and its draft has tokens to catch up
PROBE_INTERVAL_S = 5.0
LOG_INTERVAL_S = 10.0  # a load's changed choice is logged at most this often
REUSE_CHOICE = 8  # a choice is worked out again after this many steps at the same load and maximum
# verify calls with drafts seen at a load before its g(n) is trusted; until then 1, so the policy drafts
# there and finds out, rather than keeping what the first calls of a ramp showed (one sequence alone)
MIN_GROUP_CALLS = 16
MIN_SPREAD = 0.1  # relative spread of call costs needed to tell a call's fixed part from its work
MIN_SLOWDOWN = 0.5  # the work runs at most this much faster than measured alone; a flatter fit is noise

Estimate = TypeVar("Estimate")


class MovingAverage:
    """The mean of the observations so far, then, after ``1 / SMOOTHING`` of them, exponentially weighted.

    So the first observations, often from a ramp (sequences arriving one by one), weigh
    no more than those after them; until the first one, the initial value.
    """

    def __init__(self, initial: float):
        self.value = initial
        self.count = 0  # observations so far

    def update(self, observation: float) -> None:
        self.count += 1
        self.value += max(SMOOTHING, 1.0 / self.count) * (observation - self.value)


class CallTime:
    """``t(x) = f + r x``: a stage call's observed time (less the round trip) for work measured at ``x`` alone.

    Observed times are averaged per call shape (sequences, tokens each; moving
    averages), which takes the noise of single calls out. The line goes through the
    shape called last, so the calls in use are predicted as observed; its slope ``r``
    is a least-squares fit over the averages of every shape seen, kept between
    ``MIN_SLOWDOWN`` and the last shape's own ratio (so ``f`` is never negative). With
    one shape seen, or shapes whose measured costs differ by less than ``MIN_SPREAD``,
    ``r`` is that ratio and ``f`` is 0. So a change of speed at the shape in use moves
    the level at once, while the slope, how much a deeper draft adds, comes from
    every depth the sequences have drafted.
    """

    def __init__(self):
        self._shapes: dict[tuple[int, int], tuple[float, MovingAverage]] = {}  # shape -> (measured, observed)
        # over the shapes: count, sums of measured x, observed average y, x^2 and x y (kept as they change)
        self._count, self._sum_x, self._sum_y, self._sum_xx, self._sum_xy = 0, 0.0, 0.0, 0.0, 0.0
        self.slowdown = 1.0  # r
        self.fixed_s = 0.0  # f

    def update(self, shape: tuple[int, int], measured_s: float, observed_s: float) -> None:
        """A call of ``shape`` whose work measured ``measured_s`` (> 0) alone took ``observed_s`` here."""
        if shape not in self._shapes:
            self._shapes[shape] = (measured_s, MovingAverage(0.0))
            self._count += 1
            self._sum_x += measured_s
            self._sum_xx += measured_s**2
        x, average = self._shapes[shape]
        before = average.value
        average.update(observed_s)
        self._sum_y += average.value - before
        self._sum_xy += x * (average.value - before)
        ratio, slope = average.value / x, self._slope()
        self.slowdown = ratio if slope is None else min(max(slope, MIN_SLOWDOWN), ratio)
        self.fixed_s = max(0.0, average.value - self.slowdown * x)  # >= 0 by the clamp; no rounding to -0.00

    def _slope(self) -> float | None:
        """The least-squares slope over the shapes' averages; None while they are too alike to give one."""
        if self._count < 2:
            return None
        mean_x, mean_y = self._sum_x / self._count, self._sum_y / self._count
        variance = self._sum_xx / self._count - mean_x**2
        if variance <= (MIN_SPREAD * mean_x) ** 2:
            return None
        return (self._sum_xy / self._count - mean_x * mean_y) / variance

    def seconds(self, measured_s: float) -> float:
        return self.fixed_s + self.slowdown * measured_s

    def describe(self) -> str:
        return f"{self.slowdown:.2f} x measured + {1e3 * self.fixed_s:.2f} ms"


class ByLoad(Generic[Estimate]):
    """One estimate per number of live sequences."""

    def __init__(self, make: Callable[[], Estimate]):
        self._make = make
        self._by_load: dict[int, Estimate] = {}

    def update(self, num_live: int, *observation) -> None:
        self._by_load.setdefault(num_live, self._make()).update(*observation)

    def at(self, num_live: int) -> Estimate:
        """The estimate for ``num_live`` live sequences, else that of the closest load seen; a fresh one if none."""
        if num_live in self._by_load:
            return self._by_load[num_live]
        found = self.nearest_where(num_live, lambda _: True)
        return found[1] if found is not None else self._make()

    def nearest_where(self, num_live: int, usable: Callable[[Estimate], bool]) -> tuple[int, Estimate] | None:
        """The load closest to ``num_live`` (itself first, then the lower) whose estimate is usable, with it."""
        loads = [load for load, estimate in self._by_load.items() if usable(estimate)]
        if not loads:
            return None
        load = min(loads, key=lambda seen: (abs(seen - num_live), seen))
        return load, self._by_load[load]


class AdaptiveSpeculationLength:
    def __init__(
        self,
        verify_costs: CallCosts,
        propose_costs: CallCosts,
        call_overhead_s: float = 0.0,
        log: Callable[[str], None] | None = None,  # told when the choice at a load changes
    ):
        self.verify_costs = verify_costs
        self.propose_costs = propose_costs
        self.call_overhead_s = call_overhead_s  # c
        self._accepted = 0.0  # decayed count of accepted draft positions
        self._positions = 0.0  # decayed count of draft positions the target judged
        # t_v, t_p by load: a call's observed time against its time measured alone
        self.call_times = {"verify": ByLoad(CallTime), "propose": ByLoad(CallTime)}
        self.step_overhead_s = ByLoad(lambda: MovingAverage(0.0))  # O
        self._groups = ByLoad(lambda: MovingAverage(1.0))  # g(n), for the n seen while drafting; read by groups()
        self._drafting: dict[int, bool] = {}  # load -> whether its last choice other than a probe was k > 0
        self._last_drafted = time.monotonic()  # when a step last drafted (or the policy started)
        self._log = log
        self._logged: dict[int, tuple[int, float]] = {}  # live count -> (choice, when) last logged
        self._recent: dict[tuple[int, int], tuple[int, int]] = {}  # (live, max k) -> (k*, uses left)

    @property
    def acceptance_rate(self) -> float | None:
        """Per-position acceptance over recent steps; None until enough positions were judged."""
        if self._positions < MIN_POSITIONS_OBSERVED:
            return None
        return self._accepted / self._positions

    def groups(self, num_sequences: int) -> float:
        """g(n): how many calls of each stage a round of ``num_sequences`` drafting sequences takes.

        A load without ``MIN_GROUP_CALLS`` drafting verify calls of its own takes the
        groups of the nearest load that has them, at most one group per sequence: under
        steady load the live count dips by one whenever a request ends, and a load that
        does not draft never learns its own groups, so without this it would draft there
        on the guess of one group. The groups carry over, not the sequences per call:
        one live sequence always makes calls of one, which says nothing of how eight
        group. 1 while no load has them.
        """
        found = self._groups.nearest_where(num_sequences, lambda groups: groups.count >= MIN_GROUP_CALLS)
        if found is None:
            return 1.0
        _, groups = found  # at the load itself, its own average, which lies in [1, n]
        return min(float(num_sequences), groups.value)

    def record_step(self, num_drafts: int, num_accepted: int) -> None:
        """A step's outcome. Drafts past the first rejection were never judged, so they do not count."""
        if num_drafts == 0:
            return
        self._last_drafted = time.monotonic()
        decay = 1.0 - 1.0 / ACCEPTANCE_WINDOW_STEPS
        self._accepted = self._accepted * decay + num_accepted
        self._positions = self._positions * decay + min(num_accepted + 1, num_drafts)

    def record_call(
        self, stage: str, num_sequences: int, tokens_per_sequence: int, seconds: float, num_live: int
    ) -> None:
        """A verify or propose call as the orchestrator saw it, with ``num_live`` sequences live.

        Calls of shapes outside the measured grid are skipped: prefills (whole prompts)
        would only test the extrapolation. A verify call that scores drafts while the
        policy drafts at that load tells how many groups the live sequences formed (not a
        probe's, nor one made while that load's last choice was not to draft).
        """
        costs = self.verify_costs if stage == "verify" else self.propose_costs
        if num_sequences < 1 or tokens_per_sequence > costs.tokens[-1]:
            return
        measured = costs(num_sequences, tokens_per_sequence)
        if measured > 0:
            observed = max(0.0, seconds - self.call_overhead_s)
            self.call_times[stage].update(num_live, (num_sequences, tokens_per_sequence), measured, observed)
        drafting = self._drafting.get(num_live, True)  # until a choice there, the steps draft the maximum
        if stage == "verify" and tokens_per_sequence > 1 and drafting and num_live >= num_sequences:
            self._groups.update(num_live, num_live / num_sequences)

    def record_step_overhead(self, seconds: float, num_live: int) -> None:
        """A step's time since the previous one ended, less what it awaited in stage calls, at ``num_live``."""
        self.step_overhead_s.update(num_live, max(0.0, seconds))

    def round_seconds(self, num_sequences: int, k: int) -> float:
        """Expected seconds of one step of each of ``num_sequences`` sequences drafting ``k``."""
        n = num_sequences
        t_v, t_p = self.call_times["verify"].at(n), self.call_times["propose"].at(n)
        overhead = self.step_overhead_s.at(n).value
        c = self.call_overhead_s
        if k == 0:
            return overhead + t_v.seconds(self.verify_costs(n, 1)) + c
        g = self.groups(n)
        per_call = n / g
        verify, propose = t_v.seconds(self.verify_costs(per_call, k + 1)), t_p.seconds(self.propose_costs(per_call, k))
        return overhead + g * (verify + propose + 2 * c)

    def choose(self, num_sequences: int, max_k: int) -> int:
        """The number of drafts for the next step of one of ``num_sequences`` sequences stepping together.

        Each step of every live sequence asks, so a choice is reused for ``REUSE_CHOICE``
        steps at the same load before it is worked out again: the figures it comes from
        move slowly, and the orchestrator's loop is on every step's path.
        """
        alpha = self.acceptance_rate
        if max_k <= 0 or alpha is None:
            return max(0, max_k)
        best_k, uses_left = self._recent.get((num_sequences, max_k), (0, 0))
        if uses_left > 0:
            self._recent[(num_sequences, max_k)] = (best_k, uses_left - 1)
        else:
            best_k = self._best(num_sequences, max_k, alpha)
            self._recent[(num_sequences, max_k)] = (best_k, REUSE_CHOICE - 1)
        self._drafting[num_sequences] = best_k > 0
        if best_k > 0:
            return best_k
        now = time.monotonic()
        if now - self._last_drafted < PROBE_INTERVAL_S:
            return 0
        self._last_drafted = now  # one probe; the next only after another interval without drafts
        return 1

    def _best(self, num_sequences: int, max_k: int, alpha: float) -> int:
        best_k, best_rate = 0, 0.0
        tokens = 0.0
        rates = []
        for k in range(max_k + 1):
            tokens += alpha**k  # E[tokens | k] = 1 + alpha + ... + alpha^k
            rates.append(tokens / max(self.round_seconds(num_sequences, k), 1e-9))
            if rates[-1] > best_rate:
                best_k, best_rate = k, rates[-1]
        self._tell(num_sequences, best_k, alpha, rates)
        return best_k

    def _tell(self, num_sequences: int, k: int, alpha: float, rates: list[float]) -> None:
        """Log a load's choice when it changed, at most every ``LOG_INTERVAL_S``: what an operator tunes by."""
        if self._log is None:
            return
        now = time.monotonic()
        last_k, last_time = self._logged.get(num_sequences, (None, -LOG_INTERVAL_S))
        if k == last_k or now - last_time < LOG_INTERVAL_S:
            return
        self._logged[num_sequences] = (k, now)
        n = num_sequences
        verify, propose = self.call_times["verify"].at(n), self.call_times["propose"].at(n)
        self._log(
            f"adaptive speculation length: {n} live -> k = {k}; acceptance {alpha:.2f}, expected tokens/s per "
            f"sequence for k = 0..{len(rates) - 1}: {' '.join(f'{r:.0f}' for r in rates)}; verify call "
            f"{verify.describe()}, propose call {propose.describe()}, groups {self.groups(n):.2f}, step overhead "
            f"{1e3 * self.step_overhead_s.at(n).value:.2f} ms, BLS round trip "
            f"{1e3 * self.call_overhead_s:.2f} ms"
        )
