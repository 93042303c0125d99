"""``python -m specdec_openai`` as a process: ``--exit-with``, and the API key as serve.sh hands it over.

No Triton runs here: the OpenAI server points at a port nobody listens on, so its
``/health`` is a 503, which is how these tests know it is up. serve.sh runs with a fake
``tritonserver`` first on PATH, which records its environment and sleeps.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.server import free_port, free_ports

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-main-test-7Qp3"


def status(url: str, key: str | None = None) -> int | None:
    """The HTTP status of a GET, or None if nothing answers."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def wait_answering(process: subprocess.Popen, url: str, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := status(url)) is None:
        assert process.poll() is None, f"the server exited with code {process.returncode}"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)
    return code


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_server_exits_with_the_process_it_watches():
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "specdec_openai", "--triton-url", "127.0.0.1:1", "--host", "127.0.0.1",
         "--port", str(port), "--exit-with", str(watched.pid)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    try:
        assert wait_answering(server, f"http://127.0.0.1:{port}/health") == 503  # Triton is not there
        watched.kill()
        watched.wait()
        assert server.wait(timeout=15) == 0
    finally:
        stop(watched, server)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def test_serve_sh_hands_the_key_to_the_openai_server_through_its_environment_only(tmp_path):
    fake = tmp_path / "bin" / "tritonserver"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nenv > "{tmp_path}/triton.env"\nexec sleep 120\n')
    fake.chmod(0o755)
    (port, grpc_port), log = free_ports(2), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_OPENAI_API_KEY", "VLLM_API_KEY")}
    env.update(PATH=f"{fake.parent}:{env['PATH']}", VENV=str(Path(sys.executable).parents[1]))
    command = [str(REPO_ROOT / "scripts" / "serve.sh"), f"--openai-port={port}", f"--grpc-port={grpc_port}",
               "--openai-api-key", KEY]  # fmt: skip
    with open(log, "w") as out:
        serve = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    face = None
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_answering(serve, f"{base}/health") == 503  # open, and Triton is not there
        assert status(f"{base}/v1/models") == 401 and status(f"{base}/v1/models", "wrong") == 401
        assert status(f"{base}/v1/models", KEY) == 503  # let in; Triton is not there
        (face,) = _children(serve.pid)  # serve.sh became the fake tritonserver; the OpenAI server is its child
        assert KEY not in Path(f"/proc/{face}/cmdline").read_text()
        assert f"SPECDEC_OPENAI_API_KEY={KEY}" in Path(f"/proc/{face}/environ").read_text().split("\0")
        assert KEY not in (tmp_path / "triton.env").read_text()
        serve.kill()
        serve.wait()
    finally:
        stop(serve)
        if face is not None and Path(f"/proc/{face}").exists():  # --exit-with ends it within a second or so
            time.sleep(3)
            with contextlib.suppress(ProcessLookupError):
                os.kill(face, signal.SIGKILL)
    text = log.read_text()
    assert "API key required (from SPECDEC_OPENAI_API_KEY)" in text and KEY not in text


def test_serve_sh_refuses_an_empty_key_before_starting_anything():
    env = {**os.environ, "VENV": str(Path(sys.executable).parents[1])}
    result = subprocess.run([str(REPO_ROOT / "scripts" / "serve.sh"), "--openai-api-key="], capture_output=True,
                            text=True, timeout=60, env=env)  # fmt: skip
    assert result.returncode == 1 and "--openai-api-key needs a key (it is empty)" in result.stderr
