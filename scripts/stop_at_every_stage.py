"""Stop the server at every stage of its life, each way it can be stopped; it must leave nothing and start again.

    .venv/bin/python scripts/stop_at_every_stage.py                   # every stage x every stop (about 15 min)
    .venv/bin/python scripts/stop_at_every_stage.py --stages compiling --stops sigint

Stages, each reached from a fresh start of ``scripts/serve.sh`` on the committed repository
(with its OpenAI server):

* ``loading``: target_verifier has begun loading its weights;
* ``compiling``: target_verifier compiles its forward on a cold cache (``TORCHINDUCTOR_CACHE_DIR``
  an empty directory, shared by every ``compiling`` case and the last start, so each start meets
  what the stopped compiles left: their lock files, their half-written entries);
* ``serving``: 8 long greedy streams in flight, half through ``ensemble``, half through
  ``speculative_decoding``;
* ``recovering``: target_verifier's process killed, the orchestrator reloading it.

Stops: ``sigint`` to the server's process group (what Ctrl-C sends), ``sigterm`` and ``sigkill`` to
``serve.sh``'s process (it execs ``tritonserver``: the same process). After each stop no process
of the server's session (stubs, their compiler children, the OpenAI server) may remain 15 s later.
Each start must reach its stage (a start that hangs on what a stopped one left fails its case),
and a last start on the cold cache the compiles were stopped in must become ready.

Not part of the test suite (minutes of server starts); writes a JSON of every case to ``--out``.
Exits non-zero when any case fails.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "e2e")]  # the client package and the fault tests' helpers

from test_faults import PUBLIC_MODELS, session_processes, streams_interrupted, stub_pid  # noqa: E402

from bench.server import SERVE_SCRIPT, TritonServer  # noqa: E402

STAGES = ("loading", "compiling", "serving", "recovering")
STOPS = ("sigint", "sigterm", "sigkill")
GONE_WITHIN_S = 15.0
STAGE_TIMEOUT_S = 600.0  # a cold compile on a loaded 2-core machine
# the log line that marks a stage once the server is up to it
STAGE_LINES = {
    "loading": "[specdec:target_verifier] loading weights of",
    "compiling": "[specdec:target_verifier] compiling the forward of",
    "recovering": "composing model(s) target_verifier stopped",
}


def wait_for_line(server: TritonServer, line: str, timeout_s: float) -> float:
    """Seconds until ``line`` is in the server's log; raises if the server exits or the time runs out first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if line in server.log_path.read_text(errors="replace"):
            return time.monotonic() - start
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited ({server.process.returncode}) before {line!r}")
        time.sleep(0.1)
    raise TimeoutError(f"no {line!r} within {timeout_s:g} s")


def reach(server: TritonServer, stage: str) -> float:
    """Start ``server`` and bring it to ``stage`` (``serving``: ready; :func:`run_case` sends the streams);
    the seconds that took."""
    start = time.monotonic()
    if stage in ("loading", "compiling"):
        server.launch()
        wait_for_line(server, STAGE_LINES[stage], STAGE_TIMEOUT_S)
        if stage == "compiling":
            time.sleep(3.0)  # the compiler's worker processes are up
        return time.monotonic() - start
    server.start()
    if stage == "recovering":
        os.kill(stub_pid(server, "target_verifier"), signal.SIGKILL)
        wait_for_line(server, STAGE_LINES[stage], 60)
        time.sleep(2.0)  # the reload under way
    return time.monotonic() - start


def stop(server: TritonServer, how: str) -> list[str]:
    """Stop the server ``how``; the command lines of its session's processes still alive ``GONE_WITHIN_S`` later."""
    session = server.process.pid
    if how == "sigint":
        os.killpg(session, signal.SIGINT)
    else:
        os.kill(session, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    server.process.poll()
    commands = []
    for pid in left:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        commands.append(f"{pid}: {command[:160]}")
    try:
        os.killpg(session, signal.SIGKILL)  # what was left, so the next case starts clean
    except (ProcessLookupError, PermissionError):
        pass
    server.process = None
    return commands


def run_case(stage: str, how: str, workdir: Path, env: dict[str, str]) -> dict:
    server = TritonServer(SERVE_SCRIPT, ROOT / "model_repository", workdir / f"{stage}-{how}.log", env=env,
                          startup_timeout_s=STAGE_TIMEOUT_S, openai=True)  # fmt: skip
    case = {"stage": stage, "stop": how, "log": str(server.log_path)}
    try:
        case["seconds_to_stage"] = round(reach(server, stage), 1)
    except (RuntimeError, TimeoutError) as err:
        case["error"] = f"did not reach {stage}: {err}"
    if server.process is not None:
        started, left = time.monotonic(), []
        if stage == "serving":  # the stop once each stream has sent text
            streams_interrupted(server, lambda: left.extend(stop(server, how)), PUBLIC_MODELS, 8, GONE_WITHIN_S)
        else:
            left = stop(server, how)
        case.update(left=left, seconds_to_gone=round(time.monotonic() - started, 1))
    case["ok"] = "error" not in case and not case.get("left")
    return case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--stops", nargs="+", choices=STOPS, default=list(STOPS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="stop-at-every-stage-"))
    cold_cache = workdir / "cold-inductor-cache"  # the compiling cases' and the last start's
    cases = []
    for stage in args.stages:
        for how in args.stops:
            env = {"TORCHINDUCTOR_CACHE_DIR": str(cold_cache)} if stage == "compiling" else {}
            case = run_case(stage, how, workdir, env)
            cases.append(case)
            print(json.dumps(case), flush=True)
    if "compiling" in args.stages:
        server = TritonServer(SERVE_SCRIPT, ROOT / "model_repository", workdir / "last-start.log",
                              env={"TORCHINDUCTOR_CACHE_DIR": str(cold_cache)}, startup_timeout_s=STAGE_TIMEOUT_S)  # fmt: skip
        started, last = time.monotonic(), {"stage": "ready after the stopped compiles", "log": str(server.log_path)}
        try:
            server.start()
            last["seconds_to_stage"] = round(time.monotonic() - started, 1)
            server.stop()
        except (RuntimeError, TimeoutError) as err:
            last["error"] = str(err)
        last["ok"] = "error" not in last
        cases.append(last)
        print(json.dumps(last), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"stops-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps({"cases": cases, "gone_within_s": GONE_WITHIN_S}, indent=1) + "\n")
    failed = [c for c in cases if not c["ok"]]
    print(f"{len(cases) - len(failed)} of {len(cases)} cases passed; {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
