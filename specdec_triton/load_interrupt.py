"""A model's load ends when the server stops: Triton 2.51 does not stop while a model loads.

On SIGINT or SIGTERM Triton stops its HTTP service at once, then waits for every model
still loading (its log: "a related model ... is currently loading or unloading") before it
unloads the others and exits. The reload of a killed target_verifier takes tens of seconds
(torch's import, the weights, the compiled code from the cache), and a stop then waited for
it, or for the exit timeout. Killing the loading process does not help: Triton notices a
process that died in its load only at the Python backend's stub timeout (30 s).

So while a model loads, from its ``model.py``'s import (before torch's, which takes seconds)
to the end of its ``initialize``, a thread of its process asks the server's liveness as the
orchestrator does (:class:`specdec_triton.server_stop.ServerStopWatch`) and, once the server
is seen stopping, raises :class:`LoadInterrupted` in the thread that loads: the load fails
at its next Python instruction, and Triton goes on with the stop. It is a
``BaseException``, so that no ``except Exception`` of the code it crosses (a compiler's
fallback to eager) keeps the load going, and it is raised again at each question while the
load lasts. A reload's process may start after the stop, when the HTTP service is already
gone: it learns that the server answered live before from a file the orchestrator writes
at its first answer (``answered_live_marker``), so its first refusal is the stop. A first
start is not interrupted this way: no answer came before it, and Triton's HTTP service
starts after the models load (a stop then ends the start at once anyway).
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

from specdec_triton.server_stop import Liveness, ServerStopWatch, answered_live_marker, http_liveness

POLL_S = 0.5  # between liveness questions while a model loads


class LoadInterrupted(BaseException):
    """The server is stopping: the load in progress is given up."""

    def __init__(self, *args):
        super().__init__(*(args or ("the server is stopping: this model's load ends",)))


class LoadWatch:
    """From a model's import (before torch's) to the end of its ``initialize``: the load ends if the server stops.

    ``live``: the liveness question (default: this process's parent's HTTP endpoint, where the
    parent is ``tritonserver``; none where it is not, as for a test that imports a ``model.py``,
    or where the server serves no HTTP, and then nothing is watched). ``answered``: whether the
    server answered live before this load (default: its marker, which the orchestrator
    writes at its first answer): a load in a server that answered is a reload, and the first
    refusal is a stop; in one that has not, only a refusal after an answer is.
    """

    def __init__(self, live: Liveness | None = None, answered: bool | None = None, poll_s: float = POLL_S,
                 log: Callable[[str], None] = print):  # fmt: skip
        answered = answered_live_marker().exists() if answered is None else answered
        if live is None:
            live = http_liveness() if _parent_is_tritonserver() else None
        self._watch = ServerStopWatch(live, answered=answered)
        self._loader = threading.get_ident()  # the thread that loads: the importing one, until a ``with``
        self._done, self._lock = threading.Event(), threading.Lock()
        self._poll_s, self.log = poll_s, log
        if self._watch.watching:
            threading.Thread(target=self._interrupt_on_stop, name="load-interrupt", daemon=True).start()

    @property
    def watching(self) -> bool:
        return self._watch.watching

    def __enter__(self) -> LoadWatch:
        self._loader = threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done.set()

    def _interrupt_on_stop(self) -> None:
        told = False
        while not self._done.wait(self._poll_s):
            if not self._watch.check():
                continue
            with self._lock:  # never once the load has ended: the exception would land in what runs after it
                if self._done.is_set():
                    return
                raise_in = ctypes.c_ulong(self._loader)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(raise_in, ctypes.py_object(LoadInterrupted))
            if not told:
                self.log("the server is stopping (its HTTP endpoint refuses liveness): this load ends")
                told = True


def _parent_is_tritonserver() -> bool:
    try:
        program = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return os.path.basename(program) == b"tritonserver"
