"""Soak: many requests at high concurrency with cancellations and killed clients; nothing lost, nothing wrong.

    .venv/bin/python scripts/soak.py                                  # 1,000 requests, 32 at once (minutes)
    .venv/bin/python scripts/soak.py --requests 100 --concurrency 8 --client-kills 2
    .venv/bin/python scripts/soak.py --requests 300 --concurrency 16 --guided-fraction 0.5   # free and JSON mixed
    .venv/bin/python scripts/soak.py --url localhost:8001 --pid <tritonserver pid>   # a server already running
    .venv/bin/python scripts/soak.py --repository /srv/repo        # a copy from scripts/new_repository.sh

Without ``--url`` it starts ``scripts/serve.sh`` on ``--repository`` (the committed one). Each
request is greedy and streamed; a share of them (``--cancel-fraction``) is cancelled
by its client after the first response, and ``--client-kills`` client processes are
SIGKILLed mid-stream (the server sees the connection drop). At the end it checks:

* errors: requests that failed other than by their own cancellation -- must be 0;
* mismatches: completed outputs that differ from the target's own greedy output
  (Hugging Face ``generate`` in this process, up to near-ties) -- must be 0; a share of
  the requests (``--guided-fraction``) is constrained by a JSON schema instead, and its
  output must be valid JSON of that schema and equal the same request's output at k = 0
  (greedy under a grammar is the constrained target's own argmax, whatever was drafted);
* leaked: sequences still held by any stateful model once the load is over -- must be 0;
* RSS: the server's processes' resident memory after a warm-up and at the end,
  which must stay flat (within ``--rss-tolerance``).

It exits non-zero when any check fails. Not part of the test suite: it runs minutes.
"""
from __future__ import annotations

import argparse
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "e2e")]  # the client package and the test reference

import tritonclient.grpc as grpcclient  # noqa: E402
from client.generate import GenerateError, generate_grpc, grpc_inputs  # noqa: E402

from bench.server import SERVE_SCRIPT, TritonServer  # noqa: E402
from bench.stats import parse_prometheus  # noqa: E402

PROMPTS = [
    "Once upon a time", "def add(a, b):\n    return", "The quick brown fox", "import os\nimport sys\n",
    "Hello, world!", "1, 2, 3, 4,", "class Node:\n    def __init__(self", "Grüße aus München",
    "for i in range(10):", "The weather today is", "SELECT * FROM", "if __name__ == '__main__':",
]  # fmt: skip
STATEFUL = ("speculative_decoding", "target_verifier", "draft_proposer")
# a small schema the tiny target completes within a few dozen tokens: an object of bounded keys and values
GUIDE = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
         "required": ["id", "ok", "tag"], "additionalProperties": False}  # fmt: skip


@dataclass
class Tally:
    completed: int = 0
    guided: int = 0  # of the completed, those constrained by a JSON schema
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def cancelled_request(url: str, prompt: str, max_tokens: int) -> None:
    """Sent to speculative_decoding (an ensemble does not forward cancellation); cancelled after the first response."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        inputs = grpc_inputs(prompt, {"stream": True, "max_tokens": max_tokens})
        client.async_stream_infer("speculative_decoding", inputs)
        _, error = responses.get(timeout=300)
        if error is not None:
            raise GenerateError(str(error))
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()


def killed_client(url: str, prompt: str) -> None:
    """A client process killed mid-stream: its connection drops without a cancellation."""
    command = [sys.executable, "-m", "client.generate", prompt, "--url", url, "--model", "speculative_decoding",
               "--max-tokens", "400", "--min-tokens", "400"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process.stdout.read(1)  # the first streamed byte: the request is running
    process.send_signal(signal.SIGKILL)
    process.wait()


def guided_problem(url: str, prompt: str, params: dict) -> str | None:
    """What is wrong with a JSON-schema-constrained request's output, or None: valid, and k = 0's own."""
    import json

    guided = {**params, "max_tokens": 64, "guided_decoding_guide_type": "json_schema",
              "guided_decoding_guide": json.dumps(GUIDE)}  # fmt: skip
    text = generate_grpc(url, "ensemble", prompt, guided).text
    plain = generate_grpc(url, "ensemble", prompt, {**guided, "num_speculative_tokens": 0}).text
    if text != plain:
        return f"{prompt!r}: {text!r} under speculation, {plain!r} at k = 0"
    try:
        value = json.loads(text)
    except ValueError:
        return f"{prompt!r}: not JSON: {text!r}"
    if set(value) != set(GUIDE["required"]) or not (isinstance(value["id"], int) and 0 <= value["id"] <= 999
                                                    and isinstance(value["ok"], bool) and value["tag"] in "abc"):
        return f"{prompt!r}: not of the schema: {text!r}"
    return None


def run_load(args, url: str, reference) -> Tally:
    tally, rng = Tally(), random.Random(args.seed)
    kinds = ["cancel" if rng.random() < args.cancel_fraction else
             "guided" if rng.random() < args.guided_fraction else "normal" for _ in range(args.requests)]
    for i in rng.sample(range(args.requests), min(args.client_kills, args.requests)):
        kinds[i] = "kill"
    jobs: queue.Queue = queue.Queue()
    for i, kind in enumerate(kinds):
        jobs.put((i, kind, PROMPTS[i % len(PROMPTS)]))
    params = {"stream": True, "max_tokens": args.max_tokens, "exclude_input_in_output": True}

    def worker() -> None:
        while True:
            try:
                i, kind, prompt = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "normal":
                    text = generate_grpc(url, "ensemble", prompt, params).text
                    mismatch = reference.greedy_mismatch(prompt, text, args.max_tokens)
                    with tally.lock:
                        tally.completed += 1
                        if mismatch:
                            tally.mismatches.append(mismatch)
                elif kind == "guided":
                    problem = guided_problem(url, prompt, params)
                    with tally.lock:
                        tally.completed += 1
                        tally.guided += 1
                        if problem:
                            tally.mismatches.append(f"request {i} (guided): {problem}")
                elif kind == "cancel":
                    cancelled_request(url, prompt, args.max_tokens)
                    with tally.lock:
                        tally.cancelled += 1
                else:
                    killed_client(url, prompt)
            except Exception as err:  # noqa: BLE001 (every failure is counted and shown)
                with tally.lock:
                    tally.errors.append(f"request {i} ({kind}): {err}")

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally


def read_metrics(metrics_url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return parse_prometheus(response.read().decode())


def held_sequences(metrics_url: str) -> dict[str, float]:
    samples = read_metrics(metrics_url)
    return {m: samples.get(("spec_decode_num_active_sequences", (("model", m),)), 0.0) for m in STATEFUL}


def drafted_and_accepted(metrics_url: str) -> tuple[int, int]:
    """The server's draft and accepted token counters: a soak with speculation on must have drafted."""
    samples = read_metrics(metrics_url)
    label = (("model", "speculative_decoding"),)
    return (int(samples.get(("spec_decode_num_draft_tokens", label), 0)),
            int(samples.get(("spec_decode_num_accepted_tokens", label), 0)))  # fmt: skip


def server_rss_mib(server_pid: int) -> float:
    """Resident memory of tritonserver and its stubs, MiB."""
    pids = [server_pid] + [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(server_pid)],
                                                          capture_output=True, text=True).stdout.split()]  # fmt: skip
    total_kib = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total_kib / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--client-kills", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--guided-fraction", type=float, default=0.0,
                        help="share of the requests constrained by a JSON schema (checked valid and equal to k = 0's)")
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="largest allowed RSS growth, a fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="gRPC address of a running server (default: start one)")
    parser.add_argument("--metrics-url", help="with --url: its /metrics (default: port 8002 of --url's host)")
    parser.add_argument("--pid", type=int, help="with --url: the tritonserver process, for RSS")
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository",
                        help="without --url: the model repository the server serves (its target must be --models' "
                             "tiny-target, the reference)")
    args = parser.parse_args(argv)

    from triton_server import Reference  # noqa: E402 (imports torch: after the arguments are checked)

    from specdec.models import load_causal_lm
    from specdec_triton.text import TextCodec

    target = args.models / "tiny-target"
    model = load_causal_lm(target, dtype="float32")
    reference = Reference(model, TextCodec(str(target)), int(model.config.max_position_embeddings))
    server = None
    if args.url is None:
        log = Path(tempfile.gettempdir()) / "specdec-soak-tritonserver.log"
        print(f"starting a server; its log: {log}")
        server = TritonServer(SERVE_SCRIPT, args.repository, log, cwd=ROOT).start()
        url, metrics_url, pid = server.grpc_url, f"http://localhost:{server.metrics_port}/metrics", server.pid
    else:
        url, pid = args.url, args.pid
        metrics_url = args.metrics_url or f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    try:
        for prompt in PROMPTS:  # warm-up: every model has run, allocations have settled
            generate_grpc(url, "ensemble", prompt, {"max_tokens": args.max_tokens})
        rss_before = server_rss_mib(pid) if pid else None
        started = time.monotonic()
        tally = run_load(args, url, reference)
        seconds = time.monotonic() - started
        deadline = time.monotonic() + 60  # a killed client's request may run to its end
        while any(held_sequences(metrics_url).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        held = held_sequences(metrics_url)
        drafted, accepted = drafted_and_accepted(metrics_url)
        rss_after = server_rss_mib(pid) if pid else None
    finally:
        if server is not None:
            server.stop()
    growth = (rss_after / rss_before - 1) if rss_before else None
    print(f"{args.requests} requests at concurrency {args.concurrency} in {seconds:.1f} s: "
          f"{tally.completed} completed ({tally.guided} guided), {tally.cancelled} cancelled, "
          f"{args.client_kills} clients killed")
    print(f"errors {len(tally.errors)}, mismatches {len(tally.mismatches)}, leaked {int(sum(held.values()))} {held}")
    print(f"drafted {drafted} tokens, {accepted} accepted (the server's counters since it started)")
    if growth is not None:
        print(f"RSS {rss_before:.0f} MiB after warm-up, {rss_after:.0f} MiB at the end ({100 * growth:+.1f} %)")
    for line in (tally.errors + tally.mismatches)[:20]:
        print("  " + line)
    ok = not tally.errors and not tally.mismatches and not any(held.values())
    ok = ok and (growth is None or growth <= args.rss_tolerance)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
