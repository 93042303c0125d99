"""Through a real server: a composing model's process killed under load fails its requests at once and is reloaded.

Each stateful stub is SIGKILLed while eight streams decode through it. Every stream
must end with an UNAVAILABLE error within seconds (not the 10-25 s Triton takes to
notice on its own); the orchestrator then reloads the model (``scripts/serve.sh``
runs Triton with explicit model control) and serves again, with output equal to the
target's and no sequence held anywhere. Then SIGTERM with streams in flight, half through
``ensemble`` (what clients use) and half through ``speculative_decoding``: each stream gets a
final answer (its text, or UNAVAILABLE "the server is shutting down"), Triton unloads every model
by itself within its exit timeout rather than by its forced exit ("Exit timeout expired"), and no
process of the server remains 30 s after the signal, nor any file it kept (its secret, its
models' process ids and configurations, their socket directories). The head beside the target
killed with it, and SIGKILL of tritonserver, are tested on the head's server (``test_heads.py``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from client.generate import GenerateError, generate_grpc, generate_http
from test_concurrency import PROMPTS, wait_until_idle
from triton_server import REPO_ROOT, models_dir, repository_copy, server_on_free_ports

pytestmark = [pytest.mark.server, pytest.mark.slow]

NUM_STREAMS = 8
LONG = {"stream": True, "max_tokens": 1500, "min_tokens": 1500, "exclude_input_in_output": True}  # never ends early
ERROR_WITHIN_S = 5.0
RECOVERY_TIMEOUT_S = 180.0
STOP_WITHIN_S = 15.0
EXIT_TIMEOUT_S = 20.0  # scripts/serve.sh's --exit-timeout-secs
GONE_WITHIN_S = 30.0
ANSWERED = ("finished", "shutting down")  # a stream's own end, or the model's final error
PUBLIC_MODELS = ("ensemble", "speculative_decoding")


def stub_pid(server, model: str) -> int:
    """The process of ``model``'s Python stub: a child of tritonserver running its model.py."""
    lines = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.pid)],
                           capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    pids = [int(line.split()[0]) for line in lines if f"/{model}/1/model.py" in line and "<defunct>" not in line]
    assert len(pids) == 1, f"expected one live stub of {model}, found {lines}"
    return pids[0]


def streams_killed_midway(server, model: str) -> list[tuple[float | None, str]]:
    """Eight long streams; once each has sent text, kill ``model``'s stub: see :func:`streams_interrupted`."""
    return streams_interrupted(server, lambda: os.kill(stub_pid(server, model), signal.SIGKILL))


def streams_interrupted(server, interrupt, model: str | tuple[str, ...] = "speculative_decoding",
                        num_streams: int = NUM_STREAMS, join_s: float = 120.0) -> list[tuple[float | None, str]]:  # fmt: skip
    """Long streams to ``model`` (to each of several in turn); once each has sent text, ``interrupt()``:
    (seconds from it to each end, error).

    Each stream is waited for ``join_s`` at most after the interrupt returns; one still open then ends as (None, "").
    """
    started = threading.Barrier(num_streams + 1, timeout=300)
    killed_at: list[float] = []
    ends: list[tuple[float | None, str]] = [(None, "")] * num_streams

    def run(i: int) -> None:
        first = [True]

        def on_chunk(_text: str) -> None:
            if first[0]:
                first[0] = False
                started.wait()

        try:
            target = model if isinstance(model, str) else model[i % len(model)]
            generate_grpc(server.grpc_url, target, PROMPTS[i], LONG, on_chunk)
            ends[i] = (time.monotonic() - killed_at[0], "finished")
        except GenerateError as err:
            ends[i] = (time.monotonic() - killed_at[0], str(err))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    started.wait()
    killed_at.append(time.monotonic())
    interrupt()
    deadline = killed_at[0] + join_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return ends


# the orchestrator's answer while the model reloads; Triton's own while it reloads the ensemble composing it
RECOVERING = ("stopped", "recovering", "has no available versions")


def serves_again(server, reference, deadline_s: float) -> tuple[float, bool]:
    """Seconds until a request succeeds again (its text must be the target's), and whether readiness was ever
    false meanwhile (asked every 0.1 s beside the requests)."""
    start, unready, done = time.monotonic(), [], threading.Event()

    def watch_readiness() -> None:
        while not done.is_set() and not unready:
            if not server.is_ready():
                unready.append(time.monotonic() - start)
            done.wait(0.1)

    watcher = threading.Thread(target=watch_readiness, daemon=True)
    watcher.start()
    params = {"max_tokens": 24, "exclude_input_in_output": True}
    try:
        while time.monotonic() - start < deadline_s:
            try:
                text = generate_grpc(server.grpc_url, "ensemble", PROMPTS[0], params).text
            except GenerateError as err:
                assert any(reason in str(err) for reason in RECOVERING), str(err)
                time.sleep(0.5)
                continue
            mismatch = reference.greedy_mismatch(PROMPTS[0], text, 24)
            assert not mismatch, mismatch
            return time.monotonic() - start, bool(unready)
    finally:
        done.set()
        watcher.join()
    pytest.fail(f"no request succeeded within {deadline_s} s of the fault; log:\n{server.log_tail()}")


def lifecycle_lines(server, model: str) -> str:
    """The server log's lines on ``model``'s loads and unloads, and the orchestrator's on its recovery."""
    lines = server.log_path.read_text(errors="replace").splitlines()
    return "\n".join(line[:200] for line in lines if "model_lifecycle" in line and model in line
                     or "[specdec:speculative_decoding]" in line)  # fmt: skip


@pytest.fixture
def fault_server(tmp_path):
    server = server_on_free_ports(tmp_path, REPO_ROOT / "model_repository")
    server.start()
    yield server
    server.stop()


def test_a_killed_stub_fails_its_requests_at_once_is_reloaded_and_sigterm_then_drains(fault_server, reference):
    """One server's life: each stateful stub killed under load, then SIGTERM with streams in flight.

    Each kill fails every stream within seconds; Triton's strict readiness is false while the
    dead target_verifier loads again and true once it serves, with the target's output. SIGTERM with
    streams in flight through both public models then answers each (drained or a final error), and
    the server exits by itself in 15 s, leaving no process and no file.
    """
    server = fault_server
    generate_grpc(server.grpc_url, "ensemble", PROMPTS[0], {"max_tokens": 8})  # warm up every model
    for model in ("target_verifier", "draft_proposer"):
        ends = streams_killed_midway(server, model)
        for seconds, error in ends:
            assert seconds is not None and seconds < ERROR_WITHIN_S, (model, ends)
            assert f"{model} stopped" in error, (model, error)
        seconds, unready = serves_again(server, reference, RECOVERY_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while not server.is_ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"{model}: every stream failed within {max(s for s, _ in ends):.1f} s of the kill; "
              f"serving again after {seconds:.1f} s; readiness false meanwhile: {unready}")
        assert server.is_ready(), model
        # its reload takes seconds; draft_proposer's may beat a poll
        assert unready or model != "target_verifier", lifecycle_lines(server, model)
        wait_until_idle(server, timeout_s=10)
    stubs = [pid for pid in session_processes(server.pid) if pid != server.pid]
    assert files_of(server.pid, stubs), "the server keeps no file where this test looks"
    ends, exited, left = streams_stopped(server, PUBLIC_MODELS)
    code, log = server.process.returncode, server.log_path.read_text(errors="replace")
    print(f"tritonserver exited {exited:.1f} s after SIGTERM (code {code}); stream ends: "
          f"{[(PUBLIC_MODELS[i % 2], None if s is None else round(s, 1), e[:70]) for i, (s, e) in enumerate(ends)]}")
    for i, (seconds, how) in enumerate(ends):
        assert seconds is not None and any(answer in how for answer in ANSWERED), (PUBLIC_MODELS[i % 2], ends)
    assert "Exit timeout expired" not in log, server.log_tail()
    assert code == 0 and exited < GONE_WITHIN_S, server.log_tail()
    assert not left, f"processes of the server alive {GONE_WITHIN_S:g} s after SIGTERM: {left}"
    assert not files_of(server.pid, stubs), "files left by a server that stopped cleanly"


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


def wait_exit(server, timeout_s: float) -> None:
    """Wait for tritonserver to exit; fails with its log and its processes' states if it has not after ``timeout_s``."""
    try:
        server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        processes = subprocess.run(["ps", "-ww", "-s", str(server.process.pid), "-o", "pid=,stat=,wchan=,args="],
                                   capture_output=True, text=True).stdout  # fmt: skip
        pytest.fail(f"tritonserver had not exited {timeout_s:g} s after SIGTERM; its processes:\n{processes}\n"
                    f"log:\n{server.log_tail()}")


MAX_REQUEST_SECONDS = 3.0


@pytest.fixture
def stopping_server(tmp_path):
    """A server whose orchestrator stops it when a model dies, and cancels requests after 3 s."""
    parameters = {"on_stub_failure": "stop", "max_request_seconds": str(MAX_REQUEST_SECONDS)}
    repository = repository_copy(tmp_path, models_dir(), "draft_model", parameters=parameters)
    server = server_on_free_ports(tmp_path, repository)
    server.start()
    yield server
    server.stop()


def test_an_abandoned_http_request_is_cut_at_max_request_seconds_and_a_dead_model_stops_the_server(stopping_server):
    server = stopping_server
    generate_grpc(server.grpc_url, "ensemble", PROMPTS[0], {"max_tokens": 8})
    start = time.monotonic()
    # HTTP /generate: one response, never streamed. k = 0: a loop the draft predicts whole could otherwise
    # emit the 1900 tokens in under the limit, at up to k + 1 tokens a step
    with pytest.raises(GenerateError, match=r"max_request_seconds=3"):
        generate_http(server.http_url, "ensemble", PROMPTS[1],
                      {"max_tokens": 1900, "min_tokens": 1900, "num_speculative_tokens": 0})  # fmt: skip
    assert MAX_REQUEST_SECONDS <= time.monotonic() - start < MAX_REQUEST_SECONDS + 5
    wait_until_idle(server)
    killed_at = time.monotonic()
    os.kill(stub_pid(server, "target_verifier"), signal.SIGKILL)
    while server.is_ready() and time.monotonic() - killed_at < 5:
        time.sleep(0.1)
    unready_after = time.monotonic() - killed_at
    wait_exit(server, 60)
    print(f"on_stub_failure stop: not ready {unready_after:.1f} s after the kill, "
          f"exited after {time.monotonic() - killed_at:.1f} s")
    # Triton waits out its exit timeout for the dead instance, which never finishes unloading
    assert unready_after < 5 and time.monotonic() - killed_at < EXIT_TIMEOUT_S + 15


def alive(pid: int) -> bool:
    """A zombie has ended: it holds nothing, only its exit status waits for whichever process adopted it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
