"""scripts/profile_steps.py: each propose and verify of a configuration timed apart, on the shipped pair."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from profile_steps import CallTimes  # noqa: E402


class Calls:
    def verify(self, requests):
        return [len(r) for r in requests]


class Request:
    def __init__(self, n: int):
        self.token_ids = [0] * n

    def __len__(self) -> int:
        return len(self.token_ids)


def test_calls_are_timed_by_name_kind_and_rows_and_still_answer():
    calls, times = Calls(), CallTimes(torch.device("cpu"), wide=4)
    times.wrap(calls, "verify")
    assert calls.verify([Request(2), Request(9)]) == [2, 9]  # a row wider than 4: a prefill
    calls.verify([Request(3)])
    calls.verify([Request(1)])
    assert {key: len(ms) for key, ms in times.ms.items()} == {("verify", "prefill", 2): 1, ("verify", "step", 1): 2}


def test_the_script_reports_the_shipped_heads_calls():
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "profile_steps.py"), "--target", str(REPO_ROOT / "models" / "tiny-target"),
         "--eagle3", str(REPO_ROOT / "models" / "tiny-eagle3"), "--method", "eagle3", "--k", "3", "--concurrency", "2",
         "--num-prompts", "3", "--prompt-tokens", "24", "--max-tokens", "6", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eagle3 k=3 c=2 on cpu: 18 tokens" in done.stdout
    rows = [line.split("|")[1:4] for line in done.stdout.splitlines() if line.startswith("| propose") or line.startswith("| verify")]
    assert {(call.strip(), kind.strip()) for call, kind, _ in rows} >= {("verify", "prefill"), ("verify", "step"), ("propose", "step")}
