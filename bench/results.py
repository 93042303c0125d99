"""Turn measured phases into rows: ratios against k = 0 and HF plain, the analytic bound, efficiency.

A row is a plain dict (JSON-ready), one per configuration and concurrency. Its
configurations (``kind``):

* ``k0`` -- the server, ``num_speculative_tokens = 0`` per request: plain decoding
  through the serving path, the baseline of that server;
* ``fixed`` -- the server, one proposer ``method``, ``k`` drafts per step per request;
* ``default`` -- the server as the repository ships it: requests send no
  ``num_speculative_tokens``, the server decides (``k`` is None);
* ``hf_plain``, ``hf_assisted``, ``hf_prompt_lookup`` -- in-process Hugging Face
  ``generate``, one request at a time (concurrency 1 only).

The keys this module reads: ``config``, ``kind``, ``concurrency``, ``k``, ``proposer``
(the method that drafts, None for plain decoding), ``baseline`` (the ``config`` of the
k = 0 row of the same server; ``hf plain`` for HF rows), ``tokens_per_s_aggregate``,
and for the bound either ``mean_accepted_length`` with ``num_drafts`` and
``decode_steps`` (server rows) or ``tokens_per_step`` alone (HF rows).
"""
from __future__ import annotations

import math
import statistics

from bench.bound import efficiency, speedup_bound
from specdec.proposers.model_free import MODEL_FREE_METHODS

StepTimes = dict[str, float]  # "target_1", "target_<n>", "draft_1" -> median ms
HF_PLAIN = "hf plain"
KINDS = ("k0", "fixed", "default", "hf_plain", "hf_assisted", "hf_prompt_lookup")


def k0_name(method: str) -> str:
    """The k = 0 row of the server that runs ``method`` (each method has its own server, so its own baseline)."""
    return f"k=0 ({method} server)"


def fixed_name(method: str, k: int) -> str:
    return f"{method} k={k}"


DEFAULT_NAME = "default"
DEFAULT_SERVER = "shipped"  # the server of the repository's own configuration, against its own k = 0


def step_time_keys(ks: list[int]) -> list[tuple[str, int]]:
    """``(name, tokens per forward)`` of every step time the bounds need."""
    return [("target_1", 1), *[(f"target_{k + 1}", k + 1) for k in ks if k + 1 > 1], ("draft_1", 1)]


def tokens_per_step(output_tokens: int, requests: int, decode_steps: int) -> float:
    """Tokens per target decode pass: each request's prefill pass emits one token and is left out."""
    return (output_tokens - requests) / decode_steps if decode_steps > 0 else math.nan


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or not base or math.isnan(base):
        return None
    return value / base


def _paired_median(row: dict, base: dict) -> float | None:
    """The median over rounds of this row's tokens/s over its baseline's in the same round.

    Rounds run every configuration in turn, so a round's two figures were measured
    minutes apart at most: their ratio is free of the drift between rounds, and the
    median of three or more such ratios is the speed figure to trust on a noisy machine.
    """
    mine, theirs = row.get("tokens_per_s_rounds"), base.get("tokens_per_s_rounds")
    if not mine or not theirs or len(mine) != len(theirs) or not all(theirs):
        return None
    return statistics.median(a / b for a, b in zip(mine, theirs))


def annotate(rows: list[dict], step_times: StepTimes) -> list[dict]:
    """Add ``x_k0``, ``x_hf_plain``, and at concurrency 1 ``speedup_bound`` and ``efficiency``.

    ``x_k0``: aggregate tokens/s over the baseline row's at the same concurrency.
    ``x_hf_plain``: aggregate tokens/s over HF plain's (one request at a time), at any
    concurrency: what serving earns over decoding one prompt after another in-process.
    The bound is that of one sequence decoding alone (``bench.bound``), so it is given at
    concurrency 1 only, and only for a fixed ``k``.
    """
    index = {(r["config"], r["concurrency"]): r for r in rows}
    hf_plain = next((r for r in rows if r["config"] == HF_PLAIN), None)
    for row in rows:
        tokens_per_s = row.get("tokens_per_s_aggregate")
        base = index.get((row.get("baseline"), row["concurrency"]))
        if (x := _ratio(tokens_per_s, base.get("tokens_per_s_aggregate") if base else None)) is not None:
            row["x_k0"] = x
        if base is not None and (paired := _paired_median(row, base)) is not None:
            row["x_k0_median"] = paired
        hf_rounds = {"tokens_per_s_rounds": row.get("hf_plain_tokens_per_s_rounds")}
        if (paired := _paired_median(row, hf_rounds)) is not None:
            row["x_hf_plain_median"] = paired  # against HF plain measured beside this server, round by round
        if hf_plain is not None and (x := _ratio(tokens_per_s, hf_plain.get("tokens_per_s_aggregate"))) is not None:
            row["x_hf_plain"] = x
        k = row.get("k")
        if row["concurrency"] == 1 and k is not None and k >= 1 and row.get("proposer") is not None:
            t_draft = _draft_step_ms(row, step_times)
            if t_draft is None:  # what a drafted token costs was not timed: no bound rather than another's
                row["speedup_bound"] = math.nan
                continue
            length, fraction = _length_and_drafting_fraction(row)
            if math.isnan(fraction) or (fraction > 0 and not 1.0 <= length <= k + 1):
                row["speedup_bound"] = math.nan  # no decode step was measured
                continue
            row["speedup_bound"] = speedup_bound(
                length, k, step_times["target_1"], step_times[f"target_{k + 1}"], t_draft, fraction
            )
            if "x_k0" in row:
                row["efficiency"] = efficiency(row["x_k0"], row["speedup_bound"])
    return rows


def _draft_step_ms(row: dict, step_times: StepTimes) -> float | None:
    """What one drafted token costs the row's proposer: nothing for a model-free one, the draft model's
    timed step (``draft_1``), a head's timed ``k``-draft proposal over ``k`` (``<method>_propose_<k>``,
    ``bench.bound.head_propose_ms``); None where the run did not time it, and for suffix decoding in
    front of a model, whose steps draft from one source or the other."""
    if "suffix_share" in row:
        return None
    if row["proposer"] in MODEL_FREE_METHODS:
        return 0.0
    if row["proposer"] == "draft_model":
        return step_times.get("draft_1")
    proposal = step_times.get(f"{row['proposer']}_propose_{row['k']}")
    return None if proposal is None else proposal / row["k"]


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
