"""Turn measured phases into table rows: speedups against the right baseline, bounds, efficiency.

A row is a plain dict (JSON-ready). The keys this module reads:

* ``config``, ``concurrency``, ``k`` (0 for baselines), ``proposer`` (``"draft_model"``,
  ``"ngram"`` or None for baselines);
* ``baseline``: the ``config`` of the row it is compared to at the same concurrency
  (k = 0 on the same server; plain ``generate`` for the Hugging Face rows);
* ``tokens_per_s_per_stream``;
* for the bound, either ``mean_accepted_length`` with ``num_drafts`` and ``decode_steps``
  (server rows: steps that drafted and all decode steps), or ``tokens_per_step`` alone
  (tokens per target pass, every pass taken as drafting: Hugging Face rows).
"""
from __future__ import annotations

import math

from bench.bound import efficiency, speedup_bound

StepTimes = dict[str, float]  # "target_1", "target_<n>", "draft_1" -> median ms


def step_time_keys(ks: list[int]) -> list[tuple[str, int]]:
    """``(name, tokens per forward)`` of every step time the bounds need."""
    return [("target_1", 1), *[(f"target_{k + 1}", k + 1) for k in ks if k + 1 > 1], ("draft_1", 1)]


def tokens_per_step(output_tokens: int, requests: int, decode_steps: int) -> float:
    """Tokens per target decode pass: each request's prefill pass emits one token and is left out."""
    return (output_tokens - requests) / decode_steps if decode_steps > 0 else math.nan


def annotate(rows: list[dict], step_times: StepTimes) -> list[dict]:
    """Add ``speedup`` (per-stream tokens/s over the baseline row), ``speedup_bound`` and ``efficiency``.

    Rows of the adaptive length policy get a speedup, no bound: they do not draft a fixed ``k``.
    """
    index = {(r["config"], r["concurrency"]): r for r in rows}
    for row in rows:
        base = index.get((row.get("baseline"), row["concurrency"]))
        if base is not None and base.get("tokens_per_s_per_stream"):
            row["speedup"] = row["tokens_per_s_per_stream"] / base["tokens_per_s_per_stream"]
        k = row.get("k", 0)
        # the bound is for k drafts a step; an adaptive length drafts 0 .. k, chosen step by step
        if k >= 1 and row.get("proposer") is not None and row.get("length_policy", "fixed") == "fixed":
            t_draft = 0.0 if row["proposer"] == "ngram" else step_times["draft_1"]
            length, fraction = _length_and_drafting_fraction(row)
            if math.isnan(fraction) or (fraction > 0 and not 1.0 <= length <= k + 1):
                row["speedup_bound"] = math.nan  # no decode step was measured
                continue
            row["speedup_bound"] = speedup_bound(
                length, k, step_times["target_1"], step_times[f"target_{k + 1}"], t_draft, fraction
            )
            if "speedup" in row:
                row["efficiency"] = efficiency(row["speedup"], row["speedup_bound"])
    return rows


def _length_and_drafting_fraction(row: dict) -> tuple[float, float]:
    steps, drafts = row.get("decode_steps"), row.get("num_drafts")
    if steps is not None and drafts is not None:
        if steps <= 0:
            return math.nan, math.nan
        return row.get("mean_accepted_length", math.nan), min(1.0, drafts / steps)
    return row.get("tokens_per_step", math.nan), 1.0


def match_reference(rows: list[dict], outputs: dict[tuple[str, int], list[str]], reference: str) -> None:
    """Set ``identical_outputs`` to the share of a row's outputs equal to ``reference``'s, prompt by prompt.

    ``outputs`` maps ``(config, concurrency)`` to the texts in prompt order (one run
    of the prompts after another, when a configuration ran several rounds); the
    reference is read at any concurrency (greedy outputs do not depend on it). With
    greedy decoding a lossless method matches plain decoding exactly.
    """
    ref = next((texts for (config, _), texts in outputs.items() if config == reference), None)
    if ref is None:
        return
    for row in rows:
        texts = outputs.get((row["config"], row["concurrency"]))
        if texts is not None:
            row["identical_outputs"] = sum(a == ref[i % len(ref)] for i, a in enumerate(texts)) / len(texts)
