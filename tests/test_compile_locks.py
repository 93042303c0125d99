"""specdec/compile_locks.py: a compile's wait on an inductor lock that another, real process holds.

The holder is a subprocess holding an ``flock`` on the file, as an orphaned model process held
one of inductor's; the waiter is ``filelock`` with the timeout torch reads, as inductor waits.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from filelock import FileLock, Timeout

from specdec import compile_locks
from specdec.compile_locks import (
    CompileLockTimeout, WaitReport, compile_phase, describe_lock, holder_of, lock_timed_out, lock_waited_on,
    parse_proc_locks, set_lock_timeout,
)  # fmt: skip

HOLD = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def held(tmp_path):
    """A lock file under a ``locks/`` directory, held by a live process: (path, that process)."""
    path = tmp_path / "locks" / "c5momhmpcehpoqq.lock"
    path.parent.mkdir()
    script = tmp_path / "hold_lock.py"
    script.write_text(HOLD)
    holder = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield str(path), holder
    holder.kill()
    holder.wait()


@pytest.fixture
def torch_bound(monkeypatch):
    """Restore the process's lock bound, torch's and the environment's after the test."""
    from torch._inductor import codecache, config

    monkeypatch.setenv("TORCHINDUCTOR_FILE_LOCK_TIMEOUT", os.environ.get("TORCHINDUCTOR_FILE_LOCK_TIMEOUT", "600"))
    monkeypatch.setattr(compile_locks, "_lock_timeout_s", compile_locks.DEFAULT_LOCK_TIMEOUT_S)
    before = codecache.LOCK_TIMEOUT, config.file_lock_timeout
    yield codecache
    codecache.LOCK_TIMEOUT, config.file_lock_timeout = before


def _wait_as_inductor_does(path: str) -> None:
    """What codecache and cpu_vec_isa do: a FileLock with the timeout the module holds at the call."""
    from torch._inductor import codecache

    assert codecache.LOCK_TIMEOUT <= 30, "the bound was not applied: this wait would take torch's default"
    with FileLock(path, timeout=codecache.LOCK_TIMEOUT):
        pass


def test_the_holder_of_a_lock_is_named_by_pid_and_command_line(held):
    path, holder = held
    found = holder_of(path)
    assert found is not None and found.pid == holder.pid
    assert "hold_lock.py" in found.command and found.parent == os.getpid()
    text = describe_lock(path)
    assert path in text and f"pid {holder.pid}" in text and "hold_lock.py" in text and "orphan" not in text


def test_a_lock_of_a_dead_holder_is_free_and_taken_over(held):
    path, holder = held
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert holder_of(path) is None
    assert "held by no process now" in describe_lock(path)
    start = time.monotonic()
    with FileLock(path, timeout=5):  # the file is still there: an flock, not the file, is the lock
        assert os.path.exists(path)
    assert time.monotonic() - start < 1


def test_a_wait_on_a_holder_that_dies_meanwhile_takes_the_lock(held, torch_bound):
    path, holder = held
    set_lock_timeout(30)
    threading.Timer(0.5, holder.kill).start()
    start = time.monotonic()
    with compile_phase(None, "compiling x"):
        _wait_as_inductor_does(path)
    assert time.monotonic() - start < 10


def test_a_wait_on_a_live_holder_fails_in_the_bound_naming_lock_and_holder(held, torch_bound):
    path, holder = held
    set_lock_timeout(1)
    start = time.monotonic()
    with pytest.raises(CompileLockTimeout) as failure, compile_phase(None, "compiling the forward of m"):
        _wait_as_inductor_does(path)
    assert time.monotonic() - start < 5
    text = str(failure.value)
    assert text.startswith("compiling the forward of m: gave up after waiting 1 s (compile_lock_timeout_s)")
    assert path in text and f"pid {holder.pid}" in text and "hold_lock.py" in text
    assert torch_bound.LOCK_TIMEOUT == 1 and os.environ["TORCHINDUCTOR_FILE_LOCK_TIMEOUT"] == "1"  # workers too


def test_while_waiting_a_line_names_the_lock_and_its_holder_and_repeats(held, torch_bound, monkeypatch):
    path, holder = held
    monkeypatch.setattr(compile_locks, "LOOK_EVERY_S", 0.1)
    monkeypatch.setattr(compile_locks, "FIRST_WAIT_REPORT_S", 0.3)
    set_lock_timeout(2)
    lines: list[str] = []
    with pytest.raises(CompileLockTimeout), compile_phase(lines.append, "compiling y", every_s=0.5) as progress:
        progress.step("2 sequence(s) x 5 token(s)")
        _wait_as_inductor_does(path)
    waits = [line for line in lines if "waiting" in line]
    assert lines[0] == "compiling y (torch.compile; cached on disk for the next load) ..." and len(waits) >= 2, lines
    assert waits[0].startswith("compiling y (2 sequence(s) x 5 token(s)): waiting ")
    assert all(path in line and f"pid {holder.pid}" in line and "after 2 s of waiting" in line for line in waits)


def test_a_phase_that_waits_on_nothing_logs_its_steps_and_elapsed_time(torch_bound, monkeypatch):
    monkeypatch.setattr(compile_locks, "LOOK_EVERY_S", 0.05)
    lines: list[str] = []
    with compile_phase(lines.append, "compiling z", every_s=0.2, note="") as progress:
        progress.step("a prefill of 16 tokens")
        time.sleep(0.5)
        progress.step("1 sequence(s) x 1 token(s)")
    assert lines[0] == "compiling z ..."
    assert any(re.fullmatch(r"compiling z \(a prefill of 16 tokens\): still compiling, \d+ s so far", x) for x in lines)
    assert re.fullmatch(r"compiling z: a prefill of 16 tokens: 0\.\d s", lines[-3]), lines
    assert re.fullmatch(r"compiling z: 1 sequence\(s\) x 1 token\(s\): 0\.\d s", lines[-2])
    assert re.fullmatch(r"compiling z: done in 0\.\d s", lines[-1])


def test_other_failures_pass_through(torch_bound):
    with pytest.raises(ValueError, match="not a lock"), compile_phase(None, "compiling"):
        raise ValueError("not a lock")


def test_the_lock_a_thread_polls_for_is_read_from_its_stack(held):
    path, holder = held
    seen: list[str | None] = []
    waiter = threading.Thread(target=lambda: pytest.raises(Timeout, FileLock(path, timeout=1.5).acquire))
    waiter.start()
    time.sleep(0.5)
    seen.append(lock_waited_on(waiter.ident))
    waiter.join()
    assert seen == [path]
    assert lock_waited_on(threading.get_ident()) is None


def test_a_timeout_is_found_through_wrappers_and_in_a_compile_workers_text():
    try:
        try:
            raise Timeout("/c/locks/a.lock")
        except Timeout as timeout:
            raise RuntimeError("InductorError: backend failed") from timeout
    except RuntimeError as wrapped:
        assert lock_timed_out(wrapped) == "/c/locks/a.lock"
    worker = RuntimeError("SubprocException: ...\nfilelock.Timeout: The file lock '/c/locks/b.lock' could not be "
                          "acquired.")
    assert lock_timed_out(worker) == "/c/locks/b.lock"
    assert lock_timed_out(ValueError("something else")) is None


def test_proc_locks_lines_give_held_locks_by_device_and_inode():
    text = ("1: FLOCK  ADVISORY  WRITE 656 fe:00:2229095 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 700 fe:00:2229095 0 EOF\n"  # a blocked waiter, not a holder
            "2: POSIX  ADVISORY  READ 12 08:1a:77 0 EOF\n")  # fmt: skip
    assert parse_proc_locks(text) == {(0xFE, 0, 2229095): 656, (0x08, 0x1A, 77): 12}


def test_the_report_policy_tells_a_wait_after_a_while_then_every_interval():
    report = WaitReport("compiling", started=0.0, timeout_s=120, every_s=15, describe=lambda p: f"lock {p}")
    said = {t: report.look(t, "/l.lock" if 10 <= t < 60 else None, "step") for t in range(0, 80)}
    lines = {t: line for t, line in said.items() if line}
    assert list(lines) == [13, 28, 43, 58, 73]  # a wait told after 3 s, then every 15 s; running: 15 s after
    assert lines[13] == ("compiling (step): waiting 3 s for lock /l.lock; the compile gives up after 120 s of "
                         "waiting (compile_lock_timeout_s)")  # fmt: skip
    assert lines[58] == ("compiling (step): waiting 48 s for lock /l.lock; the compile gives up after 120 s of "
                         "waiting (compile_lock_timeout_s)")  # fmt: skip
    assert lines[73] == "compiling (step): still compiling, 73 s so far"


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="compile_lock_timeout_s must be > 0"):
        set_lock_timeout(0)
