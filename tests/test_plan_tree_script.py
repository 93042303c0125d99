"""``scripts/plan_tree.py`` end to end on the shipped EAGLE-3 head, as small as it runs: a plan comes out."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specdec.tree import parse_token_tree

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_planner_writes_a_plan_and_its_fastest_tree(tmp_path: Path) -> None:
    best = tmp_path / "best.txt"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "plan_tree.py"), "--num-prompts", "1", "--max-tokens", "8",
               "--rounds", "1", "--max-depth", "3", "--max-rank", "3", "--max-nodes", "4", "--out-dir", str(tmp_path),
               "--best-out", str(best)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = tmp_path.glob("plan-tree-*.json")
    plan = json.loads(result.read_text())
    assert plan["measurement_tree_nodes"] == 3 + 9 + (27 - 8)  # ranks 0-2 to depth 3, not three times off the top
    assert [row["num_nodes"] for row in plan["plans"]] == [1, 2, 3, 4]
    assert plan["timed"][0]["tree"] is None and all(row["step_s"] > 0 for row in plan["timed"])
    nodes, tree = best.read_text().splitlines()
    assert parse_token_tree(tree).num_nodes == int(nodes) <= 4
