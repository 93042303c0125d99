"""``python -m specdec_openai --exit-with PID`` stops once that process is gone (how serve.sh ties it to Triton)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.server import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_server_exits_with_the_process_it_watches():
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "specdec_openai", "--triton-url", "127.0.0.1:1", "--host", "127.0.0.1",
         "--port", str(port), "--exit-with", str(watched.pid)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # up and answering: /v1/models needs no Triton
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        watched.kill()
        watched.wait()
        assert server.wait(timeout=15) == 0
    finally:
        for process in (watched, server):
            if process.poll() is None:
                process.kill()
                process.wait()
