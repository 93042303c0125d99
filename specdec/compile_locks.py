"""Inductor's lock files: who holds one, and a compile that waits on one, bounded and explained.

``torch.compile``'s CPU backend (inductor) serializes work on lock files under its cache
directory, ``<TORCHINDUCTOR_CACHE_DIR>/locks/<key>.lock``: the probe of the CPU's vector
instructions (``torch._inductor.cpu_vec_isa``) and the C++ build of each kernel
(``codecache.CppCodeCache``) each take one. They are ``filelock`` locks, an ``flock`` polled
every few milliseconds for at most torch's ``LOCK_TIMEOUT`` (``TORCHINDUCTOR_FILE_LOCK_TIMEOUT``,
600 s) per lock. An ``flock`` dies with the last process holding it, so a holder that died
frees the lock at once and the next poll takes it over; the file left behind blocks nobody.
A live holder holds it as long as it lives: an orphaned model process, stuck mid-compile,
made every later load wait ten minutes a lock without a line.

Here: ``describe_lock`` names a lock's holder (pid, command line, whether its parent is gone),
found in ``/proc/locks`` by the file's inode; ``lock_waited_on`` reads the lock a thread is
polling for from its stack (a poll leaves no waiter in ``/proc/locks``); ``WaitReport`` is the
policy of what to say and when; ``compile_phase`` puts them around a compile: each lock wait
bounded to ``lock_timeout_s`` (``compile_lock_timeout_s``), a line every ``REPORT_EVERY_S``
saying what it waits for, and a timeout turned into an error that names the lock and its holder.
"""
from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from specdec.progress import Log

DEFAULT_LOCK_TIMEOUT_S = 120.0  # one kernel's C++ build takes seconds; a wait this long is a stuck holder
REPORT_EVERY_S = 30.0  # a line this often while a compile runs or waits
FIRST_WAIT_REPORT_S = 3.0  # a lock wait is told once it lasts this long (a peer's kernel build takes about that)
LOOK_EVERY_S = 1.0  # how often the watcher reads the compiling thread's stack
COMMAND_CHARS = 160  # of a holder's command line, in a message
_TIMEOUT_TEXT = re.compile(r"The file lock '(?P<path>[^']+)' could not be acquired")
_lock_timeout_s = DEFAULT_LOCK_TIMEOUT_S  # this process's, set once at load (set_lock_timeout)


class CompileLockTimeout(RuntimeError):
    """A compile waited longer than ``compile_lock_timeout_s`` for a lock another process holds."""


@dataclass(frozen=True)
class LockHolder:
    pid: int  # as this PID namespace sees it; 0: a process outside it
    command: str  # its command line; "" where it cannot be read (gone, or another namespace)
    parent: int | None  # its parent's pid; None where it cannot be read


def set_lock_timeout(seconds: float) -> None:
    """This process's bound on each lock wait of a compile (a model's ``compile_lock_timeout_s``)."""
    if not seconds > 0:
        raise ValueError(f"compile_lock_timeout_s must be > 0, got {seconds!r}")
    global _lock_timeout_s
    _lock_timeout_s = float(seconds)


def lock_timeout_s() -> float:
    return _lock_timeout_s


def apply_lock_timeout() -> int:
    """Make torch wait at most ``lock_timeout_s()`` (whole seconds, as torch reads it) for each lock; that bound.

    In this process through the module constant inductor reads at each wait, and in the compile
    workers it starts from now on through their environment (they read it at import).
    """
    seconds = math.ceil(_lock_timeout_s)
    os.environ["TORCHINDUCTOR_FILE_LOCK_TIMEOUT"] = str(seconds)
    from torch._inductor import codecache, config

    config.file_lock_timeout = seconds
    codecache.LOCK_TIMEOUT = seconds  # what codecache, cpu_vec_isa and cpp_builder pass to each FileLock
    return seconds


def parse_proc_locks(text: str) -> dict[tuple[int, int, int], int]:
    """``{(major, minor, inode): pid}`` of the locks held in ``/proc/locks``'s ``text``; waiters (``->``) left out.

    A line: ``1: FLOCK  ADVISORY  WRITE 656 fe:00:2229095 0 EOF``, device numbers in hex.
    """
    held = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            held[(int(major, 16), int(minor, 16), int(inode))] = int(fields[4])
        except ValueError:
            continue
    return held


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def holder_of(lock_path: str, proc_locks: str | None = None) -> LockHolder | None:
    """The process holding the lock on ``lock_path`` (``proc_locks``: ``/proc/locks``'s text), or None if none.

    Matched by device and inode; by inode alone where the device differs (an overlay
    filesystem reports its own device to ``stat`` and the lower one's to ``/proc/locks``).
    """
    try:
        st = os.stat(lock_path)
    except OSError:
        return None
    held = parse_proc_locks((_read("/proc/locks") or "") if proc_locks is None else proc_locks)
    pid = held.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    if pid is None:
        same_inode = [p for (_, _, inode), p in held.items() if inode == st.st_ino]
        pid = same_inode[0] if len(same_inode) == 1 else None
    if pid is None:
        return None
    command = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip() if pid else ""
    stat = _read(f"/proc/{pid}/stat") if pid else None
    parent = int(stat.rsplit(")", 1)[1].split()[1]) if stat else None  # after "pid (comm) state ppid"
    return LockHolder(pid, command, parent)


def describe_lock(lock_path: str, proc_locks: str | None = None) -> str:
    """``lock_path`` and who holds it, in words a user can act on."""
    holder = holder_of(lock_path, proc_locks)
    where = f"inductor's lock {lock_path}"
    if holder is None:
        return f"{where}, held by no process now (its holder exited: a new load takes it)"
    if holder.pid == 0:
        return f"{where}, held by a process outside this PID namespace (another container sharing the cache?)"
    if holder.pid == os.getpid():
        return f"{where}, held by this process (pid {holder.pid}) itself"
    command = holder.command if len(holder.command) <= COMMAND_CHARS else holder.command[:COMMAND_CHARS] + "..."
    orphan = ", an orphan (its parent exited)" if holder.parent == 1 else ""
    return f"{where}, held by pid {holder.pid} ({command or 'command line unreadable'}){orphan}"


def lock_waited_on(thread_id: int) -> str | None:
    """The lock file the thread ``thread_id`` is polling for now, read from its stack; None if it waits on none.

    ``filelock`` polls with a non-blocking ``flock`` and a sleep, so the kernel lists no waiter:
    a frame of ``filelock``'s (or torch's wrapper of it) whose ``self`` names a ``lock_file`` is
    the acquire in progress. Once acquired, those frames have returned.
    """
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("filelock") or module == "torch.utils._filelock":
            lock_file = getattr(frame.f_locals.get("self"), "lock_file", None)
            if isinstance(lock_file, str):
                return lock_file
        frame = frame.f_back
    return None


def lock_timed_out(error: BaseException) -> str | None:
    """The lock file of a ``filelock.Timeout`` in ``error`` or its causes (inductor wraps it, and a
    compile worker's comes back as text), or None when the error is another."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = _TIMEOUT_TEXT.search(str(error))
        if found:
            return found["path"]
        error = error.__cause__ or error.__context__
    return None


class WaitReport:
    """What a compile's watcher says, and when: the policy, apart from clocks and stacks.

    ``look(now, lock, step)`` is called every ``LOOK_EVERY_S`` with the lock the compiling thread
    waits on (None: on none) and the step it is at, and returns the line due then, if any: a wait
    is told once it has lasted ``FIRST_WAIT_REPORT_S``, then every ``every_s``, with how long it
    has waited and the bound; a compile that waits on nothing says every ``every_s`` that it runs.
    """

    def __init__(self, what: str, started: float, timeout_s: float, every_s: float = REPORT_EVERY_S,
                 describe: Callable[[str], str] = describe_lock):  # fmt: skip
        self.what, self.started, self.timeout_s, self.every_s = what, started, timeout_s, every_s
        self.describe = describe
        self._lock: str | None = None
        self._lock_since = started
        self._last_line = started

    def look(self, now: float, lock: str | None, step: str | None = None) -> str | None:
        if lock != self._lock:
            self._lock, self._lock_since = lock, now
        at = f" ({step})" if step else ""
        if lock is not None:
            waited = now - self._lock_since
            told = self._last_line > self._lock_since
            if waited >= FIRST_WAIT_REPORT_S and (not told or now - self._last_line >= self.every_s):
                self._last_line = now
                return (f"{self.what}{at}: waiting {waited:.0f} s for {self.describe(lock)}; the compile gives up "
                        f"after {self.timeout_s:g} s of waiting (compile_lock_timeout_s)")  # fmt: skip
            return None
        if now - self._last_line >= self.every_s:
            self._last_line = now
            return f"{self.what}{at}: still compiling, {now - self.started:.0f} s so far"
        return None


class CompileProgress:
    """The steps of a compile phase (the pass shapes a warm-up runs), each logged with its seconds as it ends."""

    def __init__(self, log: Log | None, what: str):
        self.log, self.what = log, what
        self.current: str | None = None  # the step running now; read by the watcher's thread
        self._since = 0.0

    def step(self, name: str) -> None:
        """``name`` starts now (the one before it, if any, has ended)."""
        now = time.monotonic()
        self.end(now)
        self.current, self._since = name, now

    def end(self, now: float) -> None:
        if self.current is not None and self.log is not None:
            self.log(f"{self.what}: {self.current}: {now - self._since:.1f} s")
        self.current = None


def _watch(report: WaitReport, progress: CompileProgress, thread_id: int, log: Log, stop: threading.Event) -> None:
    while not stop.wait(LOOK_EVERY_S):
        line = report.look(time.monotonic(), lock_waited_on(thread_id), progress.current)
        if line is not None:
            log(line)


@contextmanager
def compile_phase(log: Log | None, what: str, every_s: float = REPORT_EVERY_S,
                  note: str = "torch.compile; cached on disk for the next load") -> Iterator[CompileProgress]:
    """Run a block that compiles: ``what (note) ...`` now, its steps as they end (``CompileProgress.step``), a
    line every ``every_s`` while it runs (what it waits for, if a lock), ``what: done in N.N s`` at its
    end; each lock wait bounded to ``lock_timeout_s()``.

    A wait that runs out raises :class:`CompileLockTimeout` naming the lock and its holder.
    Without ``log`` only the bound and the error apply.
    """
    timeout = apply_lock_timeout()
    start = time.monotonic()
    progress = CompileProgress(log, what)
    stop = threading.Event()
    watcher = None
    if log is not None:
        log(f"{what} ({note}) ..." if note else f"{what} ...")
        report = WaitReport(what, start, timeout, every_s)
        watcher = threading.Thread(target=_watch, args=(report, progress, threading.get_ident(), log, stop),
                                   name="compile-watch", daemon=True)  # fmt: skip
        watcher.start()
    try:
        yield progress
    except Exception as error:
        lock = lock_timed_out(error)
        if lock is None:
            raise
        raise CompileLockTimeout(
            f"{what}: gave up after waiting {timeout} s (compile_lock_timeout_s) for {describe_lock(lock)}. "
            "Stop that process (an flock lasts as long as its holder), or give this server an inductor cache of "
            "its own (TORCHINDUCTOR_CACHE_DIR), and load again"
        ) from error
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    progress.end(time.monotonic())
    if log is not None:
        log(f"{what}: done in {time.monotonic() - start:.1f} s")
