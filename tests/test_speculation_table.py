"""The batch-size table read off a served benchmark run (bench/speculation_table.py, scripts/speculation_table.py)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from bench.repository import get_parameters, set_parameters
from bench.speculation_table import choose, paired_ratios, read_table

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import speculation_table  # noqa: E402

SHIPPED_RUN = REPO_ROOT / "benchmarks" / "results" / "20261126T081900Z-c0a00d1.json"  # the shipped table's run


def rows_for(server: str, measured: dict[int, dict[int, list[float]]]) -> list[dict]:
    """Benchmark rows of one server: k = 0 at 100 tokens/s every round, each k at ratio x 100."""
    rows = []
    for concurrency, by_k in measured.items():
        rounds = len(next(iter(by_k.values())))
        rows.append({"config": f"k=0 ({server} server)", "kind": "k0", "server": server, "k": 0,
                     "concurrency": concurrency, "tokens_per_s_rounds": [100.0] * rounds})  # fmt: skip
        for k, ratios in by_k.items():
            rows.append({"config": f"{server} k={k}", "kind": "fixed", "server": server, "k": k,
                         "concurrency": concurrency, "tokens_per_s_rounds": [100.0 * r for r in ratios]})  # fmt: skip
    return rows


def table(measured, margin=0.05) -> str:
    return read_table(rows_for("s", measured), "s", margin)[1]


def test_the_rule_gives_the_shipped_table_from_the_run_it_was_read_from():
    rows = json.loads(SHIPPED_RUN.read_text())["rows"]
    assert read_table(rows, "suffix")[1] == "1:8,5:0"
    shipped = get_parameters((REPO_ROOT / "model_repository" / "speculative_decoding" / "config.pbtxt").read_text())
    assert shipped["num_speculative_tokens_per_batch_size"] == "1:8,5:0"


def test_the_best_median_k_is_taken_only_past_the_margin():
    measured = {1: {2: [1.30, 1.20, 1.25], 4: [1.40, 1.10, 1.35]}, 2: {2: [1.04, 1.06, 1.03], 4: [0.9, 1.2, 0.95]}}
    assert table(measured) == "1:4,2:0"  # at 2 streams the best median, 1.04x, is within the margin
    assert table(measured, margin=0.0) == "1:4,2:2"
    with pytest.raises(ValueError, match="margin"):
        choose(paired_ratios(rows_for("s", measured), "s"), -0.1)


def test_an_unmeasured_batch_size_drafts_no_more_than_either_neighbour():
    measured = {1: {4: [1.5] * 3}, 4: {4: [1.2] * 3, 2: [1.3] * 3}, 16: {2: [1.1] * 3}}
    # 1: 4; 2-3: min(4, 2); 4: 2; 5-15: min(2, 2); 16 on: 2
    assert table(measured) == "1:4,2:2"
    measured[16] = {2: [0.9] * 3}
    assert table(measured) == "1:4,2:2,5:0"
    assert table({1: {3: [1.2] * 3}, 2: {3: [1.2] * 3}}) == "1:3"


def test_a_run_that_cannot_make_a_table_is_refused_by_name():
    with pytest.raises(ValueError, match=r"concurrency 1 \(it has \[2, 4\]\)"):
        table({2: {4: [1.2] * 3}, 4: {4: [1.2] * 3}})
    rows = rows_for("s", {1: {4: [1.2] * 3}})
    with pytest.raises(ValueError, match=r"server 'other' has no fixed-k rows; the run's servers: \['s'\]"):
        paired_ratios(rows, "other")
    rows[0]["tokens_per_s_rounds"] = [100.0]
    with pytest.raises(ValueError, match="no k = 0 rounds of server 's' to pair its 3 rounds"):
        paired_ratios(rows, "s")


def write_run(tmp_path: Path, server: str, measured) -> Path:
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": rows_for(server, measured)}))
    return run


def copy_of_shipped_repository(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_MODELS_DIR", str(REPO_ROOT / "models"))
    repository = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("__pycache__"))
    return repository


def test_write_sets_the_table_in_a_repository_that_serves_the_measured_configuration(tmp_path, capsys, monkeypatch):
    repository = copy_of_shipped_repository(tmp_path, monkeypatch)
    run = write_run(tmp_path, "eagle3+beside", {1: {4: [1.6] * 3}, 4: {4: [1.1] * 3}, 8: {4: [0.9] * 3}})
    args = [str(run), "--server", "eagle3+beside", "--write", str(repository)]

    assert speculation_table.main(args) == 1  # the copy serves suffix decoding, composing
    err = capsys.readouterr().err
    assert "draft_proposer.method is 'suffix', the run's 'eagle3+beside' had 'eagle3'" in err
    assert "draft_proposer.run_with_target is 'false'" in err

    proposer = repository / "draft_proposer" / "config.pbtxt"
    head = str(REPO_ROOT / "models" / "tiny-eagle3")
    proposer.write_text(set_parameters(proposer.read_text(), {"method": "eagle3", "draft_model": head,
                                                              "run_with_target": "true"}))  # fmt: skip
    assert speculation_table.main(args) == 0
    assert "| 4 | 1.10x (1.10-1.10) | 4 |" in capsys.readouterr().out
    orchestrator = get_parameters((repository / "speculative_decoding" / "config.pbtxt").read_text())
    assert orchestrator["num_speculative_tokens_per_batch_size"] == "1:4,5:0"


def test_the_command_names_what_it_cannot_read(tmp_path, capsys):
    assert speculation_table.main([str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    run = write_run(tmp_path, "s", {1: {4: [1.2]}})
    assert speculation_table.main([str(run), "--write", str(tmp_path)]) == 1
    assert "--write needs --server" in capsys.readouterr().err
    assert speculation_table.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "1 paired round(s)" in out and "still pays at the largest measured concurrency, 1" in out


def test_write_raises_num_speculative_tokens_to_the_table_and_keeps_a_repository_the_models_refuse(
    tmp_path, capsys, monkeypatch
):
    repository = copy_of_shipped_repository(tmp_path, monkeypatch)
    run = write_run(tmp_path, "suffix", {1: {16: [1.9] * 3}, 2: {16: [1.2] * 3}})
    args = [str(run), "--server", "suffix", "--write", str(repository)]
    assert speculation_table.main(args) == 0
    orchestrator = repository / "speculative_decoding" / "config.pbtxt"
    values = get_parameters(orchestrator.read_text())
    assert (values["num_speculative_tokens_per_batch_size"], values["num_speculative_tokens"]) == ("1:16", "16")
    assert "set num_speculative_tokens '16'" in capsys.readouterr().out

    broken = set_parameters(orchestrator.read_text(), {"stage_calls": "carrier-pigeon"})
    orchestrator.write_text(broken)
    run = write_run(tmp_path, "suffix", {1: {4: [1.5] * 3}, 2: {4: [0.9] * 3}})
    assert speculation_table.main([str(run), "--server", "suffix", "--write", str(repository)]) == 1
    assert "stage_calls" in capsys.readouterr().err
    assert orchestrator.read_text() == broken  # the table was not left half-applied
