"""How many tokens a step drafts: vLLM's rules as data, and the expected-throughput choice behind them.

Drafting pays when the tokens a verify step yields grow faster than the step's cost.
With a per-draft acceptance rate ``alpha`` (drafts accepted independently, Leviathan et
al. 2023, eq. 1) a step that drafts ``k`` tokens emits on average

    E[tokens](k) = (1 - alpha^(k+1)) / (1 - alpha)

and costs one verify call over ``k + 1`` rows per sequence plus ``k`` draft passes. On
a memory-bound target (one stream on a GPU, a small model on a CPU) the verify call
barely grows with ``k``, so drafting pays; as the batch grows the target becomes
compute-bound, ``k + 1`` rows cost ``k + 1`` times one, and plain decoding wins. So the
choice depends on the batch size, and that is the one input the serving rule reads:

* ``num_speculative_tokens`` -- k when nothing else applies;
* ``per_batch_size`` -- vLLM's ``num_speculative_tokens_per_batch_size`` idea: a table
  ``batch size -> k``, each entry applying from its batch size up to the next entry;
* ``disable_by_batch_size`` -- vLLM's ``speculative_disable_by_batch_size``: no drafts
  while more sequences than this run.

:func:`choose_k` is the model behind such a table: given what a step's calls cost at a
batch size (:class:`StepCosts`: lines fitted to measured call times) and the acceptance
rate, the ``k`` that earns the most tokens per second. The shipped table was read off
``scripts/benchmark.py``'s fixed-k rows directly, which measure the same trade-off
end to end.
"""
from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """Mean tokens one step emits with ``k`` drafts: accepted drafts plus the recovered or bonus token."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if acceptance_rate == 1.0:
        return float(k + 1)
    return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)


@dataclass(frozen=True)
class StepCosts:
    """What one step's calls cost at one batch size, as lines in the tokens they carry.

    ``verify`` is one target forward over ``batch * (k + 1)`` rows; ``propose`` is one
    draft pass per drafted token over ``batch`` rows (the first also feeds the tokens
    accepted last step, which is about one more row each).
    """

    verify_fixed_s: float  # a verify call's cost that does not grow with rows (launch, round trip, weights)
    verify_per_row_s: float  # each row of the target forward
    propose_fixed_s: float = 0.0  # a draft pass's cost that does not grow with rows
    propose_per_row_s: float = 0.0  # each row of a draft pass

    def step_seconds(self, batch_size: int, k: int) -> float:
        verify = self.verify_fixed_s + self.verify_per_row_s * batch_size * (k + 1)
        propose = k * (self.propose_fixed_s + self.propose_per_row_s * batch_size) if k else 0.0
        return verify + propose


def choose_k(batch_size: int, acceptance_rate: float, costs: StepCosts, max_k: int) -> int:
    """The ``k`` in ``0 .. max_k`` with the most tokens per second; the smaller ``k`` on a tie."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_k < 0:
        raise ValueError(f"max_k must be >= 0, got {max_k}")

    def tokens_per_second(k: int) -> float:
        return batch_size * expected_tokens(acceptance_rate, k) / costs.step_seconds(batch_size, k)

    best = 0
    for k in range(1, max_k + 1):
        if tokens_per_second(k) > tokens_per_second(best) * (1 + 1e-9):
            best = k
    return best


def parse_per_batch_size(text: str) -> tuple[tuple[int, int], ...]:
    """``"1:4,3:2,5:0"`` -> ((1, 4), (3, 2), (5, 0)): k = 4 at 1-2 sequences, 2 at 3-4, 0 from 5 on.

    Raises ValueError naming the bad entry; an empty text is no table.
    """
    table: list[tuple[int, int]] = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        size, sep, k = entry.partition(":")
        try:
            pair = (int(size), int(k)) if sep else None
        except ValueError:
            pair = None
        if pair is None or pair[0] < 1 or pair[1] < 0:
            raise ValueError(f"entry {entry!r} is not 'batch_size:k' with batch_size >= 1 and k >= 0")
        if table and pair[0] <= table[-1][0]:
            raise ValueError(f"entry {entry!r}: batch sizes must increase (after {table[-1][0]})")
        table.append(pair)
    if table and table[0][0] != 1:
        raise ValueError(f"the first entry must be for batch size 1, got {table[0][0]}")
    return tuple(table)


@dataclass(frozen=True)
class SpeculationLength:
    """The most drafts a step allows, from the number of sequences in it, and whether a sequence may draft fewer."""

    num_speculative_tokens: int  # k when no table entry or limit applies
    per_batch_size: tuple[tuple[int, int], ...] = ()  # (from batch size, k), increasing
    disable_by_batch_size: int = 0  # no drafts while more sequences than this run; 0: never
    # each sequence's k under that cap from its own acceptance and the measured costs
    # (specdec.follow_acceptance); False: every sequence drafts the cap, as the table says
    follows_acceptance: bool = False

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        too_big = [k for _, k in self.per_batch_size if k > self.num_speculative_tokens]
        if too_big:
            raise ValueError(
                f"num_speculative_tokens_per_batch_size asks for k = {max(too_big)}, more than "
                f"num_speculative_tokens = {self.num_speculative_tokens}"
            )

    def k_for(self, batch_size: int) -> int:
        if self.disable_by_batch_size and batch_size > self.disable_by_batch_size:
            return 0
        k = self.num_speculative_tokens
        for size, entry_k in self.per_batch_size:
            if batch_size >= size:
                k = entry_k
        return k
