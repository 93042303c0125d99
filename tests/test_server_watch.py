"""A model's process, and what it started, end when the server that started it is killed (specdec_triton.server_watch)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdec_triton.server_watch import exit_with_server

REPO_ROOT = Path(__file__).resolve().parents[1]
# the "server": starts a "model" that watches it and runs a long "compiler" child, prints both pids, then waits
SERVER = """
import subprocess, sys, time
model = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
from specdec_triton.server_watch import exit_with_server
exit_with_server(interval_s=0.05, only_in_stub=False)
compiler = subprocess.Popen(["sleep", "300"])
print(compiler.pid, flush=True)
time.sleep(300)
'''], stdout=subprocess.PIPE, text=True)
print(model.pid, model.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent has not read its status yet


def test_a_killed_server_takes_its_models_and_their_children_with_it():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})  # fmt: skip
    model, compiler = (int(pid) for pid in server.stdout.readline().split())
    assert alive(model) and alive(compiler)
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    deadline = time.monotonic() + 5
    while (alive(model) or alive(compiler)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(model) and not alive(compiler)


def test_nothing_is_watched_outside_a_triton_stub():
    assert exit_with_server() is None  # pytest is no stub: loading a model here must not tie it to pytest's parent
