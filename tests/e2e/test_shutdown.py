"""Through a real server: SIGTERM with streams in flight answers each and ends every process of the server.

Eight long greedy streams decode, four through ``ensemble`` (what clients use) and four
through ``speculative_decoding``; once each has sent text, SIGTERM goes to ``tritonserver``.
Each stream must get a final answer from the model (its text, or UNAVAILABLE "the
server is shutting down"), Triton must unload every model by itself, well within its
exit timeout rather than by its forced exit ("Exit timeout expired"), and no process
of the server may remain 20 s after the signal, nor any file it kept: its secret, its
models' process ids and configurations, their socket directories.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from client.generate import generate_grpc
from test_concurrency import PROMPTS
from test_faults import streams_interrupted, wait_exit
from triton_server import REPO_ROOT, server_on_free_ports

pytestmark = [pytest.mark.server, pytest.mark.slow]

NUM_STREAMS = 8  # half to each model
MODELS = ("ensemble", "speculative_decoding")
GONE_WITHIN_S = 20.0
ANSWERED = ("finished", "shutting down")  # a stream's own end, or the model's final error


def session_processes(session: int) -> list[int]:
    """Every process in ``session`` (the server's: it was started as a session leader), zombies aside."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def files_of(server_pid: int, stub_pids: list[int]) -> list[str]:
    """What the server keeps in the temporary directory: ``specdec-<its pid>-*`` files, its stubs' socket directories."""
    names = os.listdir(tempfile.gettempdir())
    return [name for name in names if name.startswith(f"specdec-{server_pid}-")
            or any(name.startswith("specdec-") and f"-{pid}-" in name for pid in stub_pids)]  # fmt: skip


def streams_stopped(server, models: tuple[str, ...]) -> tuple[list[tuple[float | None, str]], float, list[int]]:
    """Streams to ``models`` in turn; SIGTERM once each has sent text.

    Returns each stream's (seconds from the signal to its end, how it ended), the seconds
    until ``tritonserver`` exited, and the server's processes still alive ``GONE_WITHIN_S``
    after the signal.
    """
    session = server.process.pid
    signalled: list[float] = []
    exited: list[float] = []

    def stop() -> None:
        signalled.append(time.monotonic())
        os.kill(server.process.pid, signal.SIGTERM)
        wait_exit(server, 60)
        exited.append(time.monotonic() - signalled[0])

    ends = streams_interrupted(server, stop, models, NUM_STREAMS, GONE_WITHIN_S)
    while (left := session_processes(session)) and time.monotonic() - signalled[0] < GONE_WITHIN_S:
        time.sleep(0.2)
    return ends, exited[0], left


@pytest.fixture
def stopped_server(tmp_path):
    server = server_on_free_ports(tmp_path, REPO_ROOT / "model_repository")
    server.start()
    yield server
    server.stop()


def test_sigterm_answers_every_stream_and_leaves_no_process(stopped_server):
    server = stopped_server
    for model in MODELS:
        generate_grpc(server.grpc_url, model, PROMPTS[0], {"max_tokens": 8})  # warm up every model
    stubs = [pid for pid in session_processes(server.pid) if pid != server.pid]
    assert files_of(server.pid, stubs), "the server keeps no file where this test looks"
    ends, exited, left = streams_stopped(server, MODELS)
    code, log = server.process.returncode, server.log_path.read_text(errors="replace")
    print(f"tritonserver exited {exited:.1f} s after SIGTERM (code {code}); stream ends: "
          f"{[(MODELS[i % 2], round(s, 1) if s is not None else None, e[:70]) for i, (s, e) in enumerate(ends)]}")
    for i, (seconds, how) in enumerate(ends):
        assert seconds is not None and any(answer in how for answer in ANSWERED), (MODELS[i % 2], ends)
    assert "Exit timeout expired" not in log, server.log_tail()
    assert code == 0, server.log_tail()
    assert not left, f"processes of the server alive {GONE_WITHIN_S:g} s after SIGTERM: {left}"
    assert not files_of(server.pid, stubs), "files left by a server that stopped cleanly"

