"""Rows of ``scripts/benchmark_engine.py``: medians over rounds, ratios, the output check and the table.

Every ratio is paired by round: round r of a configuration ran beside round r of what it
is divided by, so the pair shares the machine's speed then, and the median of the
per-round ratios is reported (``*_rounds`` keeps them). A ``+json`` row
(``bench.engine_configs``) is divided by ``k0+json`` (``x_k0``) and by the same
configuration unconstrained (``x_unguided``), when that ran.
"""
from __future__ import annotations

import math
import statistics

from bench.bound import speedup_bound
from bench.engine_configs import FOLLOW, K0, guided, reference, unguided

HF_PLAIN = "hf plain"


def lossless_failures(outputs: dict, plain_reference: str = K0) -> list[str]:
    """Greedy decoding: each configuration's tokens against its reference's (k0, or ``k0+json`` under the guide),
    prompt by prompt (empty: all equal). ``outputs``: ``{(method, k, concurrency): [tokens of each prompt]}``."""
    failures = []
    for (method, k, c), got in outputs.items():
        name = reference(method) if guided(method) else plain_reference
        want = outputs[(name, 0, c)]
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if bad or len(got) != len(want):
            failures.append(f"{method} k={k} at concurrency {c}: output differs from {name}'s on prompts {bad}")
    return failures


def summarize(results: dict, times: dict[str, dict[str, float]]) -> list[dict]:
    """One row per (graphs, method, k, concurrency): medians over its rounds, and at one stream the bound."""
    rows = []
    for (tag, method, k, c), rounds in results.items():
        row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if _numeric(rounds[0][key])}
        row["per_position_acceptance"] = rounds[-1]["per_position_acceptance"]
        row["tokens_per_s_rounds"] = [r["tokens_per_s_aggregate"] for r in rounds]
        row.update(config=f"{method} k={k}" if k else method, method=method, k=k, concurrency=c, graphs=tag)
        step = times.get(tag, {})
        fixed_k = k and not unguided(method).endswith(FOLLOW)  # the bound is for one k every step
        if fixed_k and c == 1 and f"target_{k + 1}" in step and not math.isnan(row["mean_accepted_length"]):
            draft_ms = row["propose_ms_per_drafting_step"] / k  # measured in the run: a head's step, the draft's, or 0
            row["bound"] = speedup_bound(row["mean_accepted_length"], k, step["target_1"], step[f"target_{k + 1}"],
                                         draft_ms)  # fmt: skip
        rows.append(row)
    return rows


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def add_ratios(rows: list[dict]) -> None:
    """``x_k0``: each row against k0 under the same guide, graphs setting and concurrency; ``x_unguided``: a
    ``+json`` row against the same configuration without the guide; ``x_hf_plain``: against HF plain."""
    by_config = {(r["graphs"], r["concurrency"], r["method"], r["k"]): r for r in rows if r["method"] is not None}
    hf = next((r["tokens_per_s_aggregate"] for r in rows if r["config"] == HF_PLAIN), None)
    for row in rows:
        where = (row.get("graphs"), row["concurrency"])
        row["x_k0"] = _paired(row, by_config.get((*where, reference(row["method"] or K0), 0)), "x_k0")
        if row["method"] is not None and guided(row["method"]):
            row["x_unguided"] = _paired(row, by_config.get((*where, unguided(row["method"]), row["k"])), "x_unguided")
        row["x_hf_plain"] = row["tokens_per_s_aggregate"] / hf if hf else None
        if "bound" in row and row["x_k0"]:
            row["efficiency"] = row["x_k0"] / row["bound"]


def _paired(row: dict, base: dict | None, name: str) -> float | None:
    """The median of ``row``'s per-round tokens/s over ``base``'s (kept as ``name + "_rounds"``); None without a base."""
    if base is None:
        return None
    row[f"{name}_rounds"] = [a / b for a, b in zip(row["tokens_per_s_rounds"], base["tokens_per_s_rounds"])]
    return statistics.median(row[f"{name}_rounds"]) if row[f"{name}_rounds"] else None


def table(rows: list[dict]) -> str:
    head = ("| config | graphs | c | tok/s | x k0 | x unguided | x HF plain | ITL p50 ms | tokens/step | "
            "accept per position | suffix share | bound | eff. |")  # fmt: skip
    lines = [head, "|" + "---|" * 13]
    fmt = lambda v, p=2: "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{p}f}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['config']} | {r.get('graphs') or ''} | {r['concurrency']} | {fmt(r['tokens_per_s_aggregate'], 1)} | "
            f"{fmt(r.get('x_k0'))} | {fmt(r.get('x_unguided'))} | {fmt(r.get('x_hf_plain'))} | {fmt(r['itl_ms_p50'])} | "
            f"{fmt(r.get('mean_accepted_length'))} | {' '.join(f'{x:.2f}' for x in r.get('per_position_acceptance') or [])} | "
            f"{fmt(r.get('suffix_share'))} | {fmt(r.get('bound'))} | {fmt(r.get('efficiency'))} |"
        )
    return "\n".join(lines)
