"""specdec/progress.py and the load phases ``build_lm`` reports."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.build import build_lm
from specdec.progress import timed_phase


def test_timed_phase_logs_start_and_elapsed_seconds():
    lines: list[str] = []
    with timed_phase(lines.append, "loading x"):
        lines.append("inside")
    assert lines[:2] == ["loading x ...", "inside"]
    assert re.fullmatch(r"loading x: done in \d+\.\d s", lines[2])


def test_timed_phase_without_a_log_is_silent_and_a_failure_logs_no_end():
    with timed_phase(None, "quiet"):
        pass
    lines: list[str] = []
    with pytest.raises(RuntimeError), timed_phase(lines.append, "failing"):
        raise RuntimeError("boom")
    assert lines == ["failing ..."]


TINY_DRAFT = Path(__file__).resolve().parent.parent / "models" / "tiny-draft"


@pytest.mark.parametrize(
    "engine, phases",
    [
        ("fast", [f"loading weights of {TINY_DRAFT} to cpu", "allocating the KV cache (2 sequences x 32 tokens)"]),
        ("hf", [f"loading {TINY_DRAFT} to cpu"]),
    ],
)
def test_build_lm_reports_each_load_phase(engine, phases):
    lines: list[str] = []
    build_lm(str(TINY_DRAFT), engine, "float32", "cpu", max_num_seqs=2, max_model_len=32, log=lines.append)
    assert len(lines) == 2 * len(phases)
    for phase, start, end in zip(phases, lines[::2], lines[1::2]):
        assert start == f"{phase} ..."
        assert re.fullmatch(re.escape(phase) + r": done in \d+\.\d s", end)
