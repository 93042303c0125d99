"""A model's load ends when the server stops (``specdec_triton.load_interrupt``): Triton waits for loads."""
from __future__ import annotations

import threading
import time

import pytest

from specdec_triton.load_interrupt import LoadInterrupted, LoadWatch


class Server:
    """Live until ``stop``; then every question is refused, as Triton's stopped HTTP service does."""

    def __init__(self):
        self.stopped = threading.Event()

    def __call__(self):
        return not self.stopped.is_set()


def busy_load(seconds: float) -> int:
    """A load in Python: the exception lands between its instructions."""
    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        n += 1
    return n


def test_a_load_the_server_stops_during_ends_at_once():
    server, logged = Server(), []
    threading.Timer(0.3, server.stopped.set).start()
    started = time.monotonic()
    with pytest.raises(LoadInterrupted, match="the server is stopping: this model's load ends"):
        with LoadWatch(live=server, poll_s=0.05, log=logged.append):
            busy_load(30)
    assert time.monotonic() - started < 5
    assert logged == ["the server is stopping (its HTTP endpoint refuses liveness): this load ends"]


def test_an_except_exception_in_the_load_does_not_keep_it_going():
    server = Server()
    threading.Timer(0.2, server.stopped.set).start()
    with pytest.raises(LoadInterrupted):
        with LoadWatch(live=server, poll_s=0.05):
            try:
                busy_load(30)
            except Exception:  # a compiler's fallback: LoadInterrupted is none of its business
                pass
            busy_load(30)


def test_a_load_that_ends_first_is_never_interrupted_after_it():
    server = Server()
    with LoadWatch(live=server, poll_s=0.05):
        busy_load(0.2)
    server.stopped.set()
    busy_load(0.5)  # what runs after the load: no exception may land here


def test_a_server_that_never_answered_is_a_start_and_is_not_watched():
    """At a first start Triton's HTTP service is not up yet: refusals say nothing, the load goes on."""
    with LoadWatch(live=lambda: False, answered=False, poll_s=0.05):
        assert busy_load(0.5) > 0


def test_a_reload_that_starts_after_the_stop_learns_of_the_server_s_answer_from_its_marker():
    """The HTTP service is gone before the reload's process asks: the marker says the server had answered."""
    with pytest.raises(LoadInterrupted):
        with LoadWatch(live=lambda: False, answered=True, poll_s=0.05):
            busy_load(30)


def test_the_watch_begins_at_import_and_interrupts_whatever_the_loading_thread_runs_then():
    """Started before torch's import: a stop during the import ends it too (the stub reports a failed load)."""
    server = Server()
    watch = LoadWatch(live=server, answered=True, poll_s=0.05)  # at the import of a reload's model
    server.stopped.set()
    with pytest.raises(LoadInterrupted):
        try:
            busy_load(30)  # the import of torch, say: initialize never runs
        finally:
            watch.__exit__(None, None, None)  # the stub's end, here: nothing lands after it
    busy_load(0.3)


def test_outside_tritonserver_nothing_is_watched():
    """A test that imports a ``model.py`` is no model's load: no question goes to a port 8000 it does not own."""
    assert not LoadWatch(answered=True).watching
