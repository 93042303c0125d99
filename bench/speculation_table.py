"""A ``num_speculative_tokens_per_batch_size`` table read off a served benchmark run.

Where drafting stops paying is the method's, the pair's and the hardware's, so the table
a repository ships is only right where it was measured. ``scripts/benchmark.py`` measures
the trade-off end to end: on one server, k = 0 and fixed k's at each concurrency, round
by round. This module turns those rows into the table:

* at each measured concurrency the ``k`` whose tokens/s over k = 0, paired round by round
  (the median of the per-round ratios), is highest, if that ratio reaches ``1 + margin``;
  otherwise no drafts. A closed loop of ``c`` streams keeps about ``c`` sequences in a step,
  so a concurrency stands for that batch size;
* between two measured concurrencies, the smaller of their two ``k``: a batch size that
  was not measured drafts no more than both its neighbours do, because the promise is never
  to be slower than no speculation, not to be as fast as the best guess;
* past the largest measured concurrency, its ``k`` (reported, since it is extrapolated).

The shipped table (``1:8,5:0``, suffix decoding on the shipped models) is what this rule
gives for the run it was read from (k = 8 faster at 1, 2 and 4 streams, slower at 8).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from specdec.speculation_length import parse_per_batch_size

DEFAULT_MARGIN = 0.05  # a k must beat k = 0 by this much: one timing on a noisy machine differs by more


@dataclass(frozen=True)
class Choice:
    """The ``k`` chosen at one concurrency, and the evidence: each measured k's paired ratios to k = 0."""

    concurrency: int
    k: int
    ratios: dict[int, list[float]]  # k -> tokens/s over k = 0's, one per round

    def median(self, k: int) -> float:
        return statistics.median(self.ratios[k])


def servers_in(rows: list[dict]) -> list[str]:
    """The servers of a run that have fixed-k rows, in the run's order."""
    return list(dict.fromkeys(r["server"] for r in rows if r.get("kind") == "fixed" and r.get("server")))


def paired_ratios(rows: list[dict], server: str) -> dict[int, dict[int, list[float]]]:
    """``{concurrency: {k: [tokens/s over k = 0's, per round]}}`` for ``server``'s fixed-k rows."""
    base = {r["concurrency"]: r for r in rows if r.get("kind") == "k0" and r.get("server") == server}
    table: dict[int, dict[int, list[float]]] = {}
    for row in rows:
        if row.get("kind") != "fixed" or row.get("server") != server:
            continue
        k0 = base.get(row["concurrency"])
        mine, theirs = row.get("tokens_per_s_rounds") or [], (k0 or {}).get("tokens_per_s_rounds") or []
        if not mine or len(mine) != len(theirs) or not all(theirs):
            raise ValueError(f"{row['config']!r} at concurrency {row['concurrency']}: no k = 0 rounds of server "
                             f"{server!r} to pair its {len(mine)} rounds with")  # fmt: skip
        table.setdefault(row["concurrency"], {})[row["k"]] = [a / b for a, b in zip(mine, theirs)]
    if not table:
        raise ValueError(f"server {server!r} has no fixed-k rows; the run's servers: {servers_in(rows)}")
    return table


def choose(ratios: dict[int, dict[int, list[float]]], margin: float = DEFAULT_MARGIN) -> list[Choice]:
    """Per concurrency, the k with the highest median paired ratio if it reaches ``1 + margin``, else 0."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    choices = []
    for concurrency in sorted(ratios):
        by_k = ratios[concurrency]
        best = max(by_k, key=lambda k: (statistics.median(by_k[k]), -k))
        k = best if statistics.median(by_k[best]) >= 1 + margin else 0
        choices.append(Choice(concurrency, k, by_k))
    return choices


def table_entries(choices: list[Choice]) -> tuple[tuple[int, int], ...]:
    """``(from batch size, k)`` entries: each measured concurrency's k, the smaller neighbour's between them."""
    if not choices or choices[0].concurrency != 1:
        found = [c.concurrency for c in choices]
        raise ValueError(f"a table starts at batch size 1: the run must measure concurrency 1 (it has {found})")
    entries: list[tuple[int, int]] = []
    for here, after in zip(choices, choices[1:] + [None]):
        entries.append((here.concurrency, here.k))
        if after is not None and after.concurrency > here.concurrency + 1:
            entries.append((here.concurrency + 1, min(here.k, after.k)))
    kept = [e for i, e in enumerate(entries) if i == 0 or e[1] != entries[i - 1][1]]
    return tuple(kept)


def format_table(entries: tuple[tuple[int, int], ...]) -> str:
    text = ",".join(f"{size}:{k}" for size, k in entries)
    assert parse_per_batch_size(text) == entries  # the form the orchestrator reads
    return text


def read_table(rows: list[dict], server: str, margin: float = DEFAULT_MARGIN) -> tuple[list[Choice], str]:
    """``server``'s choices per concurrency and the table they make, from a run's rows."""
    choices = choose(paired_ratios(rows, server), margin)
    return choices, format_table(table_entries(choices))
