"""How many tokens a step drafts, decided by what drafting has measurably earned at each batch size.

A table (:class:`~specdec.speculation_length.SpeculationLength`) is right for the machine,
pair and workload it was read off, and wrong elsewhere: a head that doubles one stream's
tokens/s on a GPU can lose to plain decoding at four streams on a CPU. So this policy
keeps the table's ``k`` as the most a step may draft, and at each batch size chooses
between that ``k`` and none by the tokens per second of step time each has made there
(tokens emitted over the step's wall time, smoothed over recent steps). Until both have
been tried ``MIN_TRIES`` times at a batch size they alternate; after that the better one
runs, and every ``RETRY_EVERY``-th step at that size runs the other, so a change in the
workload (acceptance falls, prompts get longer) is seen. A step without drafts is a plain
decoding step, so output never depends on the choice.

State: one :class:`_Arms` per batch size, owned by the one scheduler that asks and
reports (``k_for`` before a step, ``observe`` after it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.speculation_length import SpeculationLength

MIN_TRIES = 3  # steps each choice runs at a batch size before the better one is preferred
RETRY_EVERY = 16  # then one step in this many runs the other choice
SMOOTHING = 0.2  # weight of the newest step in a choice's running tokens per second


@dataclass
class _Arms:
    """At one batch size: the running tokens/s and the tries of drafting (True) and of not (False)."""

    tokens_per_s: dict[bool, float] = field(default_factory=dict)
    tries: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    steps: int = 0  # decisions made at this size

    def choose(self) -> bool:
        self.steps += 1
        if min(self.tries.values()) < MIN_TRIES:
            return self.tries[True] <= self.tries[False]  # alternate, drafting first
        better = self.tokens_per_s[True] > self.tokens_per_s[False]
        return not better if self.steps % RETRY_EVERY == 0 else better

    def record(self, drafted: bool, tokens_per_s: float) -> None:
        self.tries[drafted] += 1
        old = self.tokens_per_s.get(drafted)
        self.tokens_per_s[drafted] = tokens_per_s if old is None else old + SMOOTHING * (tokens_per_s - old)


class MeasuredSpeculationLength:
    """``table``'s k, or none where not drafting has made more tokens per second at that batch size."""

    def __init__(self, table: SpeculationLength):
        self.table = table
        self._arms: dict[int, _Arms] = {}
        self._pending: tuple[int, bool] | None = None  # the last k_for's batch size and choice, until observed

    def k_for(self, batch_size: int) -> int:
        k = self.table.k_for(batch_size)
        if k == 0:  # nothing to choose between
            self._pending = None
            return 0
        drafts = self._arms.setdefault(batch_size, _Arms()).choose()
        self._pending = (batch_size, drafts)
        return k if drafts else 0

    def observe(self, num_new_tokens: int, seconds: float) -> None:
        """The step that followed the last ``k_for``: the tokens it emitted over every sequence, its wall time.

        The scheduler reports no step that verified a prompt, whose time is the prompt's; such a
        step's choice is then left unrecorded."""
        if self._pending is None or seconds <= 0:
            return
        batch_size, drafted = self._pending
        self._pending = None
        self._arms[batch_size].record(drafted, num_new_tokens / seconds)

    def choices(self) -> dict[int, dict[str, float]]:
        """Per batch size, the running tokens/s of drafting and of not (those tried): for logs and tests."""
        return {n: {("draft" if d else "plain"): v for d, v in arms.tokens_per_s.items()}
                for n, arms in sorted(self._arms.items())}  # fmt: skip
