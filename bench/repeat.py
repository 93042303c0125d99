"""Workloads that repeat themselves, as agents and templated code do, for the proposers that can exploit it.

* ``repeat``: held-out prompts sent once (round 1), then the same prompts again
  (round 2): an agent re-asking, a retried tool call. Suffix decoding's global tree
  holds round 1's responses by round 2; n-gram lookup and a draft model see only the
  request itself.
* ``templated``: code whose prompt repeats one template with different values (test
  cases, records), so the continuation follows the pattern already in the prompt.

Each repetition uses prompts no server has seen (a fresh seed), so a learning proposer
starts every repetition cold, and repetitions can be interleaved across servers.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from bench.workload import Prompt

_NAMES = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "sigma"]


def templated_prompts(num_prompts: int, encode, seed: int) -> list[Prompt]:
    """Test methods or records that repeat one shape; each prompt stops where the next instance starts."""
    rng = random.Random(seed)
    prompts = []
    for index in range(num_prompts):
        names = rng.sample(_NAMES, 5)
        if index % 2 == 0:
            body = "".join(
                f"    def test_{name}(self):\n        result = compute({name!r}, {i})\n"
                f"        self.assertEqual(result.status, 'ok')\n        self.assertEqual(result.value, {i * 3})\n\n"
                for i, name in enumerate(names)
            )
            text = f"class TestCompute(unittest.TestCase):\n\n{body}    def test_"
        else:
            body = "".join(f"    {{'id': {i}, 'name': {name!r}, 'active': True, 'score': {i * 10}}},\n"
                           for i, name in enumerate(names))  # fmt: skip
            text = f"RECORDS = [\n{body}    {{'id': "
        prompts.append(Prompt(source=f"templated:{seed}:{index}", text=text, token_ids=list(encode(text))))
    return prompts


@dataclass(frozen=True)
class RepeatPhase:
    """One measured phase: a workload round of one repetition on one server."""

    workload: str  # repeat | templated
    round: int  # 1 or 2 for repeat; 1 for templated
    repetition: int
    config: str  # "k=0" or the method
    k: int
    row: dict  # bench.phase.phase_row's figures


def summary_rows(phases: list[RepeatPhase]) -> list[dict]:
    """Per (workload, round, config): medians over repetitions, and the median of per-repetition ratios to k=0."""
    groups: dict[tuple[str, int, str], list[RepeatPhase]] = {}
    for phase in phases:
        groups.setdefault((phase.workload, phase.round, phase.config), []).append(phase)
    baseline = {(p.workload, p.round, p.repetition): p.row["tokens_per_s_aggregate"]
                for p in phases if p.config == "k=0"}  # fmt: skip
    rows = []
    for (workload, round_, config), members in groups.items():
        ratios = [p.row["tokens_per_s_aggregate"] / baseline[(workload, round_, p.repetition)]
                  for p in members if baseline.get((workload, round_, p.repetition))]  # fmt: skip
        rows.append({
            "workload": workload, "round": round_, "config": config, "k": members[0].k, "repetitions": len(members),
            "tokens_per_s": _median(p.row["tokens_per_s_aggregate"] for p in members),
            "tokens_per_s_min": min(p.row["tokens_per_s_aggregate"] for p in members),
            "tokens_per_s_max": max(p.row["tokens_per_s_aggregate"] for p in members),
            "x_k0_median": _median(ratios),
            "tokens_per_step": _median(p.row.get("tokens_per_step", math.nan) for p in members),
            "acceptance_rate": _median(p.row.get("acceptance_rate", math.nan) for p in members),
            "itl_ms_p50": _median(p.row["itl_ms_p50"] for p in members),
            "outputs_equal_k0": all(p.row.get("outputs_equal_k0", True) for p in members),
            **{key: _median(p.row[key] for p in members) for key in SOURCE_KEYS if key in members[0].row},
        })  # fmt: skip
    return rows


# with suffix decoding in front of a model (bench.stats.source_figures): medians over repetitions too
SOURCE_KEYS = ("suffix_share", "accepted_per_step_suffix", "accepted_per_step_model")


def _median(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


COLUMNS = [
    ("workload", "workload", "{}"), ("round", "round", "{}"), ("config", "config", "{}"), ("k", "k", "{}"),
    ("tokens/s (median)", "tokens_per_s", "{:.1f}"), ("min", "tokens_per_s_min", "{:.1f}"),
    ("max", "tokens_per_s_max", "{:.1f}"), ("x k=0 (median)", "x_k0_median", "{:.2f}"),
    ("tokens/step", "tokens_per_step", "{:.2f}"), ("acceptance", "acceptance_rate", "{:.2f}"),
    ("ITL p50 ms", "itl_ms_p50", "{:.2f}"), ("= k=0 output", "outputs_equal_k0", "{}"),
    ("suffix share", "suffix_share", "{:.0%}"), ("accepted/step suffix", "accepted_per_step_suffix", "{:.2f}"),
    ("accepted/step model", "accepted_per_step_model", "{:.2f}"),
]  # fmt: skip
