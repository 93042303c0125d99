"""bench/report.py: the run's JSON document, its file name, and the markdown tables."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from bench.report import (
    COLUMNS,
    DETAIL_COLUMNS,
    format_cell,
    git_commit,
    machine_line,
    markdown_table,
    result_document,
    result_path,
)


def test_markdown_table_formats_rows_and_dashes_missing_values():
    rows = [
        {"config": "k=0 (draft_model server)", "concurrency": 1, "tokens_per_s_aggregate": 101.26, "x_k0": 1.0,
         "x_hf_plain": 0.9, "itl_ms_p50": 9.94, "tokens_per_step": 1.0},
        {"config": "draft_model k=2", "concurrency": 4, "x_k0": 1.734, "acceptance_rate": 0.8123,
         "tokens_per_step": math.nan, "per_position_acceptance": [0.9, 0.75], "efficiency": 0.8257},
    ]
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].count("|") == len(COLUMNS) + 1
    assert table[0] == ("| configuration | concurrency | tokens/s | x k = 0 | x k = 0, median of rounds | x HF plain "
                        "| x HF plain, median of rounds | ITL p50 ms | tokens per verify step | acceptance |")
    assert table[2] == "| k=0 (draft_model server) | 1 | 101.3 | 1.00x | - | 0.90x | - | 9.9 | 1.00 | - |"
    assert table[3] == "| draft_model k=2 | 4 | - | 1.73x | - | - | - | - | - | 0.81 |"
    detail = markdown_table(rows, DETAIL_COLUMNS).splitlines()
    cells = [c.strip() for c in detail[3].strip("|").split("|")]
    assert cells[DETAIL_COLUMNS.index(("per-position accept", "per_position_acceptance", None))] == "0.90 0.75"
    assert cells[[c[0] for c in DETAIL_COLUMNS].index("efficiency")] == "83%"
    assert format_cell({}, "per_position_acceptance", None) == "-"


def test_result_path_is_utc_date_time_and_commit(tmp_path):
    path = result_path(tmp_path, "abc1234", now=0.0)
    assert path == tmp_path / "19700101T000000Z-abc1234.json"


def test_result_document_records_command_machine_commit_versions_and_rows(tmp_path):
    rows = [{"config": "hf plain", "concurrency": 1, "tokens_per_s_aggregate": 1.0}]
    doc = result_document(rows, command="python scripts/benchmark.py --ks 2", args={"out_dir": tmp_path, "ks": [2]},
                          commit="abc1234", dirty=True, notes=["a note"])
    doc = json.loads(json.dumps(doc))  # JSON-ready as it is
    assert doc["schema_version"] == 1 and doc["commit"] == "abc1234" and doc["commit_dirty"] is True
    assert doc["args"] == {"out_dir": str(tmp_path), "ks": [2]} and doc["notes"] == ["a note"]
    assert {"cpu", "cores", "gpu", "platform"} <= set(doc["machine"])
    assert {"python", "torch", "transformers"} <= set(doc["versions"]) and doc["versions"]["torch"]
    assert doc["date"].endswith("Z") and doc["rows"] == rows
    line = machine_line(doc)
    assert "commit abc1234 (uncommitted changes)" in line and f"{doc['machine']['cores']} cores" in line


def test_git_commit_reads_the_checkout_and_survives_its_absence(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    commit, _ = git_commit(repo)
    expected = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
    assert commit == (expected or "unknown")
    assert git_commit(tmp_path) == ("unknown", False)
