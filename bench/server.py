"""Run ``scripts/serve.sh`` on free ports for the length of a ``with`` block.

The server gets its own process group, so stopping it reaches the Python backend
stubs too: SIGINT first (Triton unloads its models), SIGKILL to the group if it has
not exited in time. Stopping happens on any exit from the block, Ctrl-C included.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TritonServer:
    def __init__(
        self,
        serve_script: Path,
        repository: Path,
        log_path: Path,
        env: dict[str, str] | None = None,  # added to this process's environment
        startup_timeout_s: float = 600.0,
    ):
        self.serve_script = Path(serve_script)
        self.repository = Path(repository)
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int:
        """The process ``serve.sh`` became (it execs ``tritonserver``); the model stubs are its children."""
        if self._proc is None:
            raise RuntimeError("the server is not running")
        return self._proc.pid

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def statistics(self) -> dict:
        """Triton's per-model statistics (``get_inference_statistics``) as JSON."""
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            return client.get_inference_statistics(as_json=True)
        finally:
            client.close()

    def __enter__(self) -> "TritonServer":
        self._log = open(self.log_path, "w")
        self._proc = subprocess.Popen(
            [
                str(self.serve_script),
                f"--model-repository={self.repository}",
                f"--grpc-port={self.grpc_port}",
                f"--http-port={self.http_port}",
                f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # own process group: the stubs are stopped with the server
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"tritonserver exited with code {self._proc.returncode} while starting; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.is_server_ready():
                        return
                except Exception:  # not listening yet
                    pass
                time.sleep(1.0)
        finally:
            client.close()
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout_s:.0f} s; log {self.log_path}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGINT)
                    proc.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stubs left behind, or a server that did not stop
            except ProcessLookupError:
                pass
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
