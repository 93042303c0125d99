"""bench/repeat.py: a repeating-workload run's summary rows."""
from __future__ import annotations

import math

import pytest

from bench.repeat import COLUMNS, RepeatPhase, summary_rows
from bench.report import markdown_table


def _phase(config: str, repetition: int, tokens_per_s: float, **figures) -> RepeatPhase:
    row = {"tokens_per_s_aggregate": tokens_per_s, "itl_ms_p50": 2.0, "tokens_per_step": 1.0, **figures}
    return RepeatPhase("repeat", 1, repetition, config, 0 if config == "k=0" else 8, row)


def test_each_configuration_is_the_median_of_its_repetitions_against_the_same_repetition_s_k0():
    phases = [_phase("k=0", 0, 100.0), _phase("k=0", 1, 200.0), _phase("k=0", 2, 100.0),
              _phase("suffix", 0, 300.0), _phase("suffix", 1, 300.0), _phase("suffix", 2, 250.0)]  # fmt: skip
    rows = {r["config"]: r for r in summary_rows(phases)}
    suffix = rows["suffix"]
    assert suffix["tokens_per_s"] == 300.0 and (suffix["tokens_per_s_min"], suffix["tokens_per_s_max"]) == (250.0, 300.0)
    assert suffix["x_k0_median"] == pytest.approx(2.5)  # of 3.0, 1.5, 2.5: each repetition against its own k = 0
    assert rows["k=0"]["x_k0_median"] == 1.0
    assert "suffix_share" not in suffix


def test_suffix_decoding_in_front_of_a_model_carries_each_source_s_figures():
    figures = [dict(suffix_share=s, accepted_per_step_suffix=a, accepted_per_step_model=m)
               for s, a, m in ((0.4, 4.5, 2.4), (0.35, 2.6, 1.5), (0.5, 2.6, math.nan))]  # fmt: skip
    phases = [_phase("k=0", i, 100.0) for i in range(3)]
    phases += [_phase("eagle3+suffix", i, 150.0, **f) for i, f in enumerate(figures)]
    [row] = [r for r in summary_rows(phases) if r["config"] == "eagle3+suffix"]
    assert (row["suffix_share"], row["accepted_per_step_suffix"]) == (0.4, 2.6)
    assert row["accepted_per_step_model"] == pytest.approx(1.95)  # a repetition where the model drafted nothing: left out
    table = markdown_table(summary_rows(phases), COLUMNS)
    assert "| 40% | 2.60 | 1.95 |" in table and table.count("| - | - | - |") == 1  # k = 0: no sources
