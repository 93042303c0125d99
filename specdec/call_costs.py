"""What one verify or propose call costs, measured on the model itself: a grid over its shape.

A call's shape is how many sequences it carries and how many tokens each one asks
for: ``k + 1`` rows to score for a verify call, ``k`` drafts for a propose call.
:func:`measure_verify_costs` and :func:`measure_propose_costs` time a few calls of
each shape on scratch sequences (released afterwards) and return a
:class:`CallCosts` grid, which interpolates between the measured shapes and
extrapolates linearly beyond them. The orchestrator's adaptive speculation length
(``specdec_triton.speculation_length``) weighs drafts against these costs.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.proposers.base import Proposer
from specdec.types import ProposeRequest, SamplingParams, VerifyRequest

VERIFY_TOKENS = (1, 2, 3, 5, 9)  # rows per sequence measured: k + 1 for k = 0, 1, 2, 4, 8
PROPOSE_TOKENS = (1, 2, 4, 8)  # drafts per sequence measured
CONTEXT_TOKENS = 16  # tokens each scratch sequence holds before the timed calls
REPEATS = 3  # timed calls per shape; the median is kept
SCRATCH_SEQ_PREFIX = "__call_costs_"


@dataclass(frozen=True)
class CallCosts:
    """Seconds of one call of ``sequences[i]`` sequences with ``tokens[j]`` tokens each: ``seconds[i][j]``."""

    sequences: tuple[int, ...]  # increasing, >= 1
    tokens: tuple[int, ...]  # increasing, >= 1
    seconds: tuple[tuple[float, ...], ...]  # [len(sequences)][len(tokens)]

    def __post_init__(self):
        for name, axis in (("sequences", self.sequences), ("tokens", self.tokens)):
            if not axis or axis[0] < 1 or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"CallCosts.{name} must be increasing positive counts, got {axis}")
        shape = (len(self.sequences), len(self.tokens))
        if len(self.seconds) != shape[0] or any(len(row) != shape[1] for row in self.seconds):
            raise ValueError(f"CallCosts.seconds must be {shape[0]} x {shape[1]}, got {self.seconds}")

    def __call__(self, num_sequences: float, num_tokens: float) -> float:
        """Seconds of a call of that shape: bilinear between measured shapes, linear beyond them, never < 0."""
        i0, i1, wi = _bracket(self.sequences, num_sequences)
        j0, j1, wj = _bracket(self.tokens, num_tokens)

        def along_tokens(row: Sequence[float]) -> float:
            return row[j0] + wj * (row[j1] - row[j0])

        low, high = along_tokens(self.seconds[i0]), along_tokens(self.seconds[i1])
        return max(0.0, low + wi * (high - low))

    def describe(self) -> str:
        """One line per sequence count, in ms: for logs."""
        head = "tokens " + " ".join(f"{t:>6}" for t in self.tokens)
        rows = [f"{n:>3} seqs " + " ".join(f"{1e3 * s:6.2f}" for s in row)
                for n, row in zip(self.sequences, self.seconds)]  # fmt: skip
        return "\n".join([head, *rows])


class MeasuredOnce:
    """A stage's call costs, measured the first time they are asked for (logged, with the time it took)."""

    def __init__(self, stage: str, measure: Callable[[], CallCosts], log: Callable[[str], None]):
        self.stage = stage  # "verify" or "propose", for the log
        self._measure = measure
        self._log = log
        self._costs: CallCosts | None = None

    def get(self) -> CallCosts:
        if self._costs is None:
            started = time.monotonic()
            self._log(f"measuring {self.stage} call costs (once, on scratch sequences)")
            self._costs = self._measure()
            self._log(
                f"{self.stage} call costs measured in {time.monotonic() - started:.1f} s, ms per call:\n"
                f"{self._costs.describe()}"
            )
        return self._costs


def _bracket(axis: Sequence[int], x: float) -> tuple[int, int, float]:
    """Indices of the two grid points around ``x`` and its weight towards the second; beyond the ends, the last pair."""
    if len(axis) == 1:
        return 0, 0, 0.0
    hi = next((i for i, a in enumerate(axis) if a >= x), len(axis) - 1)
    hi = max(hi, 1)
    lo = hi - 1
    return lo, hi, (x - axis[lo]) / (axis[hi] - axis[lo])


def sequence_counts(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_num_seqs``, which is always measured."""
    counts = [1]
    while counts[-1] * 2 < max_num_seqs:
        counts.append(counts[-1] * 2)
    if max_num_seqs > 1:
        counts.append(max_num_seqs)
    return tuple(counts)


def measure_verify_costs(
    verifier, max_num_seqs: int, vocab_size: int, tokens: Sequence[int] = VERIFY_TOKENS
) -> CallCosts:
    """Time greedy verify calls of every (sequences, rows) shape on scratch sequences, then release them."""
    sequences = sequence_counts(max_num_seqs)
    seq_ids = [f"{SCRATCH_SEQ_PREFIX}{i}" for i in range(sequences[-1])]
    context = _scratch_tokens(CONTEXT_TOKENS, vocab_size)
    greedy = SamplingParams()
    try:
        verifier.verify([VerifyRequest(s, 0, context, 1, greedy) for s in seq_ids])  # prefill, also a warm-up

        def call(n: int, s: int) -> None:  # each call cuts the caches back to the context and scores s rows
            rows = _scratch_tokens(s, vocab_size)
            requests = [VerifyRequest(seq_id, CONTEXT_TOKENS, rows, s, greedy) for seq_id in seq_ids[:n]]
            results = verifier.verify(requests)
            [r.argmax.tolist() for r in results]  # waits for the device, as a response does

        return _grid(sequences, tuple(tokens), call)
    finally:
        for seq_id in seq_ids:
            verifier.release(seq_id)


def measure_propose_costs(
    proposer: Proposer, max_num_seqs: int, vocab_size: int | None, tokens: Sequence[int] = PROPOSE_TOKENS
) -> CallCosts:
    """Time greedy propose calls of every (sequences, drafts) shape on scratch sequences, then release them.

    Each sequence repeats the same context, so after the first call a call feeds the
    proposer one token and drafts from there, as a step after a rejection does.
    ``vocab_size`` None: the proposer reads no model (n-gram lookup), any ids will do.
    """
    sequences = sequence_counts(max_num_seqs)
    seq_ids = [f"{SCRATCH_SEQ_PREFIX}{i}" for i in range(sequences[-1])]
    context = _scratch_tokens(CONTEXT_TOKENS, vocab_size)
    greedy = SamplingParams()
    try:
        proposer.propose([ProposeRequest(s, context, 1, greedy, 0) for s in seq_ids])  # prefill, also a warm-up

        def call(n: int, k: int) -> None:
            proposals = proposer.propose([ProposeRequest(seq_id, context, k, greedy, 0) for seq_id in seq_ids[:n]])
            [p.token_ids.tolist() for p in proposals]  # waits for the device, as a response does

        return _grid(sequences, tuple(tokens), call)
    finally:
        for seq_id in seq_ids:
            proposer.release(seq_id)


def _grid(sequences: tuple[int, ...], tokens: tuple[int, ...], call: Callable[[int, int], None]) -> CallCosts:
    seconds = []
    for n in sequences:
        row = []
        for s in tokens:
            call(n, s)  # warm-up: first use of a shape may allocate
            times = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                call(n, s)
                times.append(time.perf_counter() - started)
            row.append(statistics.median(times))
        seconds.append(tuple(row))
    return CallCosts(sequences, tokens, tuple(seconds))


def _scratch_tokens(count: int, vocab_size: int | None) -> list[int]:
    return [(7 * i + 3) % (vocab_size or 1 << 15) for i in range(count)]
