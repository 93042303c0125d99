#!/usr/bin/env python3
"""Start the server, stream one completion with and without speculation, print the comparison."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from client.generate import generate_grpc  # noqa: E402

from bench.server import free_ports  # noqa: E402

DEFAULT_PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'


def wait_ready(http_port: int, server: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            sys.exit(f"[demo] tritonserver exited with {server.returncode}; its log:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    sys.exit(f"[demo] server not ready after {timeout:.0f} s; its log:\n{log_path.read_text()[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, help="k for the speculative run (default: config's)")
    parser.add_argument("--startup-timeout", type=float, default=300)
    args = parser.parse_args()

    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = REPO_ROOT / ".cache" / "demo-server.log"
    log_path.parent.mkdir(exist_ok=True)
    print(f"[demo] starting tritonserver (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(REPO_ROOT / "scripts" / "serve.sh"), f"--http-port={http_port}", f"--grpc-port={grpc_port}",
             f"--metrics-port={metrics_port}", "--openai-port=0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_ready(http_port, server, log_path, args.startup_timeout)
        url = f"127.0.0.1:{grpc_port}"
        base = {"max_tokens": args.max_tokens, "stream": True}
        generate_grpc(url, "ensemble", args.prompt, {**base, "max_tokens": 8})  # warm-up
        print(f"[demo] prompt:\n{args.prompt}", flush=True)
        print("[demo] streaming with speculation:\n", flush=True)
        spec = generate_grpc(url, "ensemble", args.prompt,
                             {**base, "num_speculative_tokens": args.num_speculative_tokens},
                             lambda text: print(text, end="", flush=True))
        plain = generate_grpc(url, "ensemble", args.prompt, {**base, "num_speculative_tokens": 0})
        print("\n")
        spec_tps = spec.num_output_tokens / spec.seconds
        plain_tps = plain.num_output_tokens / plain.seconds
        print(f"[demo] speculative: {spec.num_output_tokens} tokens in {spec.seconds:.2f} s = {spec_tps:.1f} tok/s, "
              f"acceptance {spec.acceptance_rate:.3f} "
              f"({spec.total_accepted_draft_tokens}/{spec.total_draft_tokens} draft tokens)")
        print(f"[demo] k = 0:       {plain.num_output_tokens} tokens in {plain.seconds:.2f} s = {plain_tps:.1f} tok/s")
        print(f"[demo] speedup {spec_tps / plain_tps:.2f}x; same text as k = 0: {spec.text == plain.text}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        print("[demo] server stopped", flush=True)


if __name__ == "__main__":
    main()
