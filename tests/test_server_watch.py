"""A model's process, and what it started, end when the server that started it is killed (specdec_triton.server_watch)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_triton.server_watch import exit_with_server

REPO_ROOT = Path(__file__).resolve().parents[1]
# the "server": starts a "model" that watches it and runs a long "compiler" child, prints both pids, then waits
# ``{work}`` is what the "model" does once it has printed: wait, hold the interpreter's lock, or end.
SERVER = """
import subprocess, sys, time
model = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
from specdec_triton.server_watch import exit_with_server
exit_with_server(interval_s=0.05, only_in_stub=False, grace_s=0.2)
compiler = subprocess.Popen(["sleep", "300"])
print(compiler.pid, flush=True)
{work}
'''], stdout=subprocess.PIPE, text=True)
print(model.pid, model.stdout.readline().strip(), flush=True)
time.sleep(300)
"""
WAITS = "time.sleep(300)"
HOLDS_THE_LOCK = "sum(range(10**15))"  # one C call: no other thread of the model runs Python meanwhile


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent has not read its status yet


def start_server(work: str, new_session: bool = False) -> tuple[subprocess.Popen, int, int]:
    """The "server", its "model"'s pid and the "compiler"'s pid; ``new_session``: a process group of their own."""
    server = subprocess.Popen([sys.executable, "-c", SERVER.replace("{work}", work)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                              start_new_session=new_session,
                              # Ctrl-C's default action, which a test runner's worker may have set to ignored
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    model, compiler = (int(pid) for pid in server.stdout.readline().split())
    assert alive(model) and alive(compiler)
    return server, model, compiler


def children(pid: int) -> list[int]:
    stats = (path.read_text() for path in Path("/proc").glob("[0-9]*/stat") if path.exists())
    return [int(stat.split()[0]) for stat in stats if int(stat.rsplit(")", 1)[1].split()[1]) == pid]


def gone_within(seconds: float, *pids: int) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


@pytest.mark.parametrize("work", [WAITS, HOLDS_THE_LOCK], ids=["waiting", "holding-the-interpreter-lock"])
def test_a_killed_server_takes_its_models_and_their_children_with_it(work):
    server, model, compiler = start_server(work)
    watches = [pid for pid in children(model) if pid != compiler]
    assert len(watches) == 1  # the outside watch, a shell
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    assert gone_within(5, model, compiler, *watches)


def test_ctrl_c_to_the_servers_group_ends_a_model_holding_the_interpreter_lock():
    """SIGINT reaches every process of the group: the server ends, the model cannot run Python, and the
    outside watch, which ignores it, ends the model."""
    server, model, compiler = start_server(HOLDS_THE_LOCK, new_session=True)
    watches = [pid for pid in children(model) if pid != compiler]
    os.killpg(server.pid, signal.SIGINT)
    time.sleep(0.2)  # the group has had the signal
    server.kill()  # however the server took it, it is gone now
    server.wait()
    assert gone_within(5, model, *watches)


def test_the_outside_watch_ends_with_a_model_that_ends():
    server, model, compiler = start_server(WAITS)
    (watch,) = [pid for pid in children(model) if pid != compiler]
    os.kill(model, signal.SIGKILL)  # the model ends; its server lives on
    assert gone_within(5, watch)
    assert alive(compiler)  # reparented and left alone: only a model whose server is gone is cleaned up
    os.kill(compiler, signal.SIGKILL)
    server.kill()
    server.wait()


def test_nothing_is_watched_outside_a_triton_stub():
    assert exit_with_server() is None  # pytest is no stub: loading a model here must not tie it to pytest's parent
