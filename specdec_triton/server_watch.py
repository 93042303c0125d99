"""A model's process ends with the server that started it, whatever stopped the server.

Triton's Python backend runs each model in a stub process, a child of ``tritonserver``.
When the server is killed (SIGKILL, a crash, a forced exit), nothing tells the stubs: one
busy in a long load, a cold ``torch.compile`` waiting on its compiler processes, lives on,
reparented, holding the compile cache's lock, and the next server's load of the same
model waits on that lock with no end. So each model starts, first thing when its
``model.py`` is imported (before torch: a reload's new process killed with the server while
it imported lived on for 15 s and more), a daemon thread that checks every ``interval_s`` that its parent is still
the server that started it; once it is not, it kills its own descendants (the compilers)
and exits at once. The kernel then frees every lock the process held.

That thread needs the interpreter's lock, which a stub whose server vanished mid-request may
never give back (the stub's own C++ health thread tears the model down from outside Python
while the main thread waits on it). So each model also starts a second watch outside its
interpreter: a ``/bin/sh`` loop, a child of the model's process, that sees the same change of
parent and, ``grace_s`` later, SIGKILLs the model's process and everything below it. It ends
on its own once the model's process ends (its own parent changes), so an unloaded model leaves
nothing behind and a reused process id is never mistaken for the model.

A parent-death signal (``prctl(PR_SET_PDEATHSIG)``) would be immediate, but it fires when
the *thread* that spawned the stub exits, which in a live server can be a loader thread.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STUB = "triton_python_backend_stub"  # the executable of a Python-backend model's process
INTERVAL_S = 1.0  # how soon a model's process follows its server: a second, against minutes of a lost compile
GRACE_S = 3.0  # how long the outside watch leaves the model's own watch to end it, with what it started

# $1 server pid, $2 model pid, $3 interval, $4 grace. Field 4 of /proc/PID/stat is the parent (the
# names read here, "sh" and "triton_python_b", have no spaces). Ends when its own parent is no
# longer the model (the model ended); kills the model's tree once the model's parent is no longer
# the server. Descendants are gathered in passes over /proc until no new one appears. It ignores
# SIGINT, SIGTERM and SIGHUP (its sleeps too: ignored stays ignored across exec): Ctrl-C reaches the
# server's whole process group, this watch included, and a model stuck in a long C call outlived it.
OUTSIDE_WATCH = r"""
trap '' INT TERM HUP
server=$1 model=$2 interval=$3 grace=$4
parent_of() { { read -r _ _ _ parent _ < "/proc/$1/stat"; } 2>/dev/null && echo "$parent"; }
while [ "$(parent_of $$)" = "$model" ]; do
  if [ "$(parent_of "$model")" != "$server" ]; then
    sleep "$grace"
    [ "$(parent_of $$)" = "$model" ] || exit 0
    tree=" $model " grown=1
    while [ $grown = 1 ]; do
      grown=0
      for stat in /proc/[0-9]*/stat; do
        { read -r pid _ _ parent _ < "$stat"; } 2>/dev/null || continue
        case "$tree" in *" $parent "*) case "$tree" in *" $pid "*) ;; *) tree="$tree$pid " grown=1 ;; esac ;; esac
      done
    done
    for pid in $tree; do [ "$pid" = $$ ] || kill -9 "$pid" 2>/dev/null; done
    exit 0
  fi
  sleep "$interval"
done
"""


def exit_with_server(interval_s: float = INTERVAL_S, only_in_stub: bool = True,
                     grace_s: float = GRACE_S) -> threading.Thread | None:  # fmt: skip
    """Start both watches; None where this process is no Triton stub (a test loading a model in-process)."""
    if only_in_stub and _executable() != STUB:
        return None
    server = os.getppid()
    subprocess.Popen(["/bin/sh", "-c", OUTSIDE_WATCH, "specdec-server-watch", str(server), str(os.getpid()),
                      str(interval_s), str(grace_s)], stdin=subprocess.DEVNULL, close_fds=True)  # fmt: skip

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
