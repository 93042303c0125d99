"""Timed phases for the long, silent parts of a model load.

A checkpoint load, a KV-cache allocation or a CUDA-graph capture can take from a
second to minutes, and the server prints nothing while it runs: a line when each
phase starts and one with its elapsed seconds when it ends tell a waiting user what
the server is doing and which phase to look at when a load is slow.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Log = Callable[[str], None]  # e.g. a model's ``logger.info``


@contextmanager
def timed_phase(log: Log | None, what: str) -> Iterator[None]:
    """Log ``what ...`` now and ``what: done in N.N s`` when the block ends; nothing when ``log`` is None.

    A phase that raises logs no end line: the load fails with the error instead.
    """
    if log is None:
        yield
        return
    log(f"{what} ...")
    start = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - start:.1f} s")
