"""The adaptive speculation length: how many drafts a step asks for, from what they cost and earn now.

With ``speculative_length_policy: adaptive`` each step drafts the ``k`` in
``[0, num_speculative_tokens]`` that gives the most expected tokens per second of a
decoding round, for as many sequences as are live:

    k* = argmax_k  E[tokens | k, alpha] / (O + V(n, k + 1) + c_v + [k > 0] (P(n, k) + c_p))

- ``E[tokens | k, alpha] = 1 + alpha + ... + alpha^k``: accepted drafts plus the
  recovered or bonus token, with ``alpha`` the per-position acceptance rate;
- ``V(n, s)`` and ``P(n, k)``: a verify call of ``n`` sequences scoring ``s`` rows each
  and a propose call drafting ``k`` each, as the models measured themselves
  (:mod:`specdec.call_costs`);
- ``c_v`` and ``c_p``: what a call of that stage costs on top of its model's measured
  time here and now (the BLS round trip, queueing in the model, cores shared under
  load), and ``O`` the step's own time outside its stage calls; both tracked as
  moving averages.

So a lone sequence with a good draft speculates deeply, speculation shrinks as the
target's forward fills up with concurrent sequences, and stops where verifying drafts
costs more than they save: the load point vLLM's ``speculative_disable_by_batch_size``
asks the user to guess. The choice only sets how many drafts are verified; every step
stays a lossless speculative step, so greedy output does not change. ``alpha`` is
estimated over all sequences' recent steps (one estimate, one ``k`` for every
sequence, so the batched calls keep one shape).
"""
from __future__ import annotations

from specdec.call_costs import CallCosts

ACCEPTANCE_WINDOW_STEPS = 256  # steps over which the acceptance rate is averaged (exponential decay)
MIN_POSITIONS_OBSERVED = 16  # draft positions seen before the rate is trusted; until then k = the maximum
OVERHEAD_SMOOTHING = 0.05  # weight of the newest observation in the overhead averages
PROBE_INTERVAL = 256  # while k* = 0, every this many choices drafts one token to keep the rate current


class AdaptiveSpeculationLength:
    def __init__(self, verify_costs: CallCosts, propose_costs: CallCosts):
        self.verify_costs = verify_costs
        self.propose_costs = propose_costs
        self._accepted = 0.0  # decayed count of accepted draft positions
        self._positions = 0.0  # decayed count of draft positions the target judged
        self.verify_overhead_s = 0.0  # c_v
        self.propose_overhead_s = 0.0  # c_p
        self.step_overhead_s = 0.0  # O
        self._seen: dict[str, bool] = {}  # which averages have had their first observation
        self._choices_at_zero = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Per-position acceptance over recent steps; None until enough positions were judged."""
        if self._positions < MIN_POSITIONS_OBSERVED:
            return None
        return self._accepted / self._positions

    def record_step(self, num_drafts: int, num_accepted: int) -> None:
        """A step's outcome. Drafts past the first rejection were never judged, so they do not count."""
        if num_drafts == 0:
            return
        decay = 1.0 - 1.0 / ACCEPTANCE_WINDOW_STEPS
        self._accepted = self._accepted * decay + num_accepted
        self._positions = self._positions * decay + min(num_accepted + 1, num_drafts)

    def record_call(self, stage: str, num_sequences: int, tokens_per_sequence: float, seconds: float) -> None:
        """A verify or propose call as the orchestrator saw it; calls of shapes outside the grid are skipped.

        Prefills (whole prompts) are far outside the measured shapes, so they would only
        test the extrapolation.
        """
        costs = self.verify_costs if stage == "verify" else self.propose_costs
        if num_sequences < 1 or tokens_per_sequence > costs.tokens[-1]:
            return
        extra = seconds - costs(num_sequences, tokens_per_sequence)
        self._average(f"{stage}_overhead_s", max(0.0, extra))

    def record_step_overhead(self, seconds: float) -> None:
        """A step's wall time less the time it awaited its stage calls."""
        self._average("step_overhead_s", max(0.0, seconds))

    def _average(self, name: str, value: float) -> None:
        if not self._seen.get(name):
            self._seen[name] = True
            setattr(self, name, value)
        else:
            setattr(self, name, getattr(self, name) + OVERHEAD_SMOOTHING * (value - getattr(self, name)))

    def round_seconds(self, num_sequences: int, k: int) -> float:
        """Expected seconds of one step of ``num_sequences`` sequences drafting ``k`` each."""
        seconds = self.step_overhead_s + self.verify_costs(num_sequences, k + 1) + self.verify_overhead_s
        if k > 0:
            seconds += self.propose_costs(num_sequences, k) + self.propose_overhead_s
        return seconds

    def choose(self, num_sequences: int, max_k: int) -> int:
        """The number of drafts for the next step of one of ``num_sequences`` sequences stepping together."""
        alpha = self.acceptance_rate
        if max_k <= 0 or alpha is None:
            return max(0, max_k)
        best_k, best_rate = 0, 0.0
        tokens = 0.0
        for k in range(max_k + 1):
            tokens += alpha**k  # E[tokens | k] = 1 + alpha + ... + alpha^k
            rate = tokens / max(self.round_seconds(num_sequences, k), 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k > 0:
            return best_k
        self._choices_at_zero += 1
        return 1 if self._choices_at_zero % PROBE_INTERVAL == 0 else 0
