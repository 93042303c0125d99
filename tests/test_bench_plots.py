"""bench/plots.py: the series a run's plots show, and the PNGs written from them."""
from __future__ import annotations

import math

import pytest

from bench.plots import ACCEPTANCE_PNG, acceptance_series, concurrency_series, reference_levels, write_plots


def _row(config: str, kind: str, concurrency: int, tokens_per_s: float, itl: float, rates=None) -> dict:
    return {"config": config, "kind": kind, "concurrency": concurrency, "tokens_per_s_aggregate": tokens_per_s,
            "itl_ms_p50": itl, "per_position_acceptance": rates or []}


RESULT = {
    "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None},
    "commit": "abc1234",
    "date": "2026-01-01T00:00:00Z",
    "rows": [
        _row("hf plain", "hf_plain", 1, 80.0, 12.0),
        _row("hf assisted k=2", "hf_assisted", 1, 95.0, math.nan),
        # rows come in the order they ran: concurrency is sorted by the series
        _row("k=0 (draft_model server)", "k0", 4, 300.0, 13.0),
        _row("k=0 (draft_model server)", "k0", 1, 100.0, 10.0),
        _row("draft_model k=2", "fixed", 1, 130.0, 7.0, [0.8, 0.5]),
        _row("draft_model k=2", "fixed", 4, 280.0, math.nan, [0.7, 0.4]),
        _row("default", "default", 1, 135.0, 6.5, [0.8, 0.5, 0.3, 0.1]),
        _row("ngram k=2", "fixed", 1, 110.0, 8.0, []),  # nothing drafted: no acceptance line
    ],
}


def test_concurrency_series_has_one_line_per_served_configuration():
    assert concurrency_series(RESULT, "tokens_per_s_aggregate") == {
        "k=0 (draft_model server)": [(1, 100.0), (4, 300.0)],
        "draft_model k=2": [(1, 130.0), (4, 280.0)],
        "default": [(1, 135.0)],
        "ngram k=2": [(1, 110.0)],
    }
    itl = concurrency_series(RESULT, "itl_ms_p50")
    assert itl["draft_model k=2"] == [(1, 7.0)]  # a NaN is left out, not drawn as 0
    assert "hf plain" not in itl


def test_reference_levels_are_the_hf_rows_at_concurrency_one():
    assert reference_levels(RESULT, "tokens_per_s_aggregate") == {"hf plain": 80.0, "hf assisted k=2": 95.0}
    assert reference_levels(RESULT, "itl_ms_p50") == {"hf plain": 12.0}


def test_acceptance_series_per_method_and_k_at_the_lowest_concurrency():
    assert acceptance_series(RESULT) == {"draft_model k=2": [0.8, 0.5], "default": [0.8, 0.5, 0.3, 0.1]}


def test_write_plots_writes_three_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_plots(RESULT, tmp_path / "img")
    assert sorted(p.name for p in paths) == sorted(["throughput.png", "itl_p50.png", ACCEPTANCE_PNG])
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
