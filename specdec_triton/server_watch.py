"""A model's process ends with the server that started it, whatever stopped the server.

Triton's Python backend runs each model in a stub process, a child of ``tritonserver``.
When the server is killed (SIGKILL, a crash, a forced exit), nothing tells the stubs: one
busy in a long load, a cold ``torch.compile`` waiting on its compiler processes, lives on,
reparented, holding the compile cache's lock, and the next server's load of the same
model waits on that lock with no end. So each model starts, first thing in
``initialize``, a daemon thread that checks every ``interval_s`` that its parent is still
the server that started it; once it is not, it kills its own descendants (the compilers)
and exits at once. The kernel then frees every lock the process held.

A parent-death signal (``prctl(PR_SET_PDEATHSIG)``) would be immediate, but it fires when
the *thread* that spawned the stub exits, which in a live server can be a loader thread.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

STUB = "triton_python_backend_stub"  # the executable of a Python-backend model's process
INTERVAL_S = 1.0  # how soon a model's process follows its server: a second, against minutes of a lost compile


def exit_with_server(interval_s: float = INTERVAL_S, only_in_stub: bool = True) -> threading.Thread | None:
    """Start the watch; None where this process is no Triton stub (a test loading a model in-process)."""
    if only_in_stub and _executable() != STUB:
        return None
    server = os.getppid()

    def watch() -> None:
        while os.getppid() == server:
            time.sleep(interval_s)
        print(f"[specdec] the server (pid {server}) is gone: process {os.getpid()} ends", file=sys.stderr, flush=True)
        kill_descendants(os.getpid())
        os._exit(1)

    thread = threading.Thread(target=watch, name="specdec-server-watch", daemon=True)
    thread.start()
    return thread


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid``, children first read, so that none is reparented unseen."""
    parents = _parents()
    stack = [child for child, parent in parents.items() if parent == pid]
    while stack:
        child = stack.pop()
        stack += [grandchild for grandchild, parent in parents.items() if parent == child]
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process /proc shows."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # it ended while we read
        parents[int(stat.parent.name)] = int(text[text.rfind(")") + 2:].split()[1])  # field 4, after the name
    return parents


def _executable() -> str:
    try:
        return Path("/proc/self/exe").resolve().name
    except OSError:
        return Path(sys.executable).name
