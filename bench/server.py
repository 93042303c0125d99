"""Run ``scripts/serve.sh`` on free ports: the one server harness of the benchmarks and the end-to-end tests.

The server gets its own process group, so stopping it reaches the Python backend
stubs too: SIGINT first (Triton unloads its models), SIGKILL to the group if it has
not exited in time, and to any stub left behind. As a ``with`` block, stopping
happens on any exit from the block, Ctrl-C included. Readiness is Triton's HTTP
``/v2/health/ready`` (and the OpenAI server's ``/health`` when one is asked for), so
starting and stopping need no client library. Without ``openai`` the script is told
(``SPECDEC_OPENAI_PORT=0``) to start no OpenAI server, which would otherwise take port 9000.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVE_SCRIPT = REPO_ROOT / "scripts" / "serve.sh"


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may take it before the server)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports nothing listens on now: each held open until all are picked, since a
    port picked and closed may be the OS's next pick too (a server once got one port for HTTP and gRPC)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class TritonServer:
    """``serve.sh --model-repository=<repository>`` on three free ports, its output in ``log_path``."""

    def __init__(
        self,
        serve_script: Path,
        repository: Path,
        log_path: Path,
        env: dict[str, str] | None = None,  # added to this process's environment
        startup_timeout_s: float = 600.0,
        cwd: Path | None = None,  # the stubs import packages from the working directory before the venv's
        serve_args: tuple[str, ...] = (),  # serve.sh's own options, e.g. --speculative-config=...
        openai: bool = False,  # also serve the OpenAI API (serve.sh --openai-port) on a free port
    ):
        self.serve_script = Path(serve_script)
        self.repository = Path(repository)
        self.log_path = Path(log_path)
        self.env = {**os.environ, "SPECDEC_OPENAI_PORT": "0", **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.cwd = cwd
        self.serve_args = tuple(serve_args)
        ports = free_ports(4 if openai else 3)
        self.grpc_port, self.http_port, self.metrics_port = ports[:3]
        self.openai_port = ports[3] if openai else None
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The process ``serve.sh`` became (it execs ``tritonserver``); the model stubs are its children."""
        if self.process is None:
            raise RuntimeError("the server is not running")
        return self.process.pid

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def openai_url(self) -> str:
        """The OpenAI API's base URL, as ``openai.OpenAI(base_url=...)`` takes it."""
        if self.openai_port is None:
            raise RuntimeError("this server was started without the OpenAI API (openai=False)")
        return f"http://localhost:{self.openai_port}/v1"

    def command(self) -> list[str]:
        openai = [] if self.openai_port is None else [f"--openai-port={self.openai_port}"]
        return [
            str(self.serve_script),
            f"--model-repository={self.repository}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            *self.serve_args,
            *openai,
        ]

    def launch(self) -> None:
        """Start the process and return at once (``start`` also waits until it is ready)."""
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # own process group: the stubs are stopped with the server
            )

    def start(self) -> TritonServer:
        """Launch and wait until ready; stops the server and raises RuntimeError or TimeoutError if it is not."""
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        urls = [f"http://{self.http_url}/v2/health/ready"]
        if self.openai_port is not None:
            urls.append(f"http://localhost:{self.openai_port}/health")  # Triton ready through its channel
        try:
            for url in urls:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status != 200:
                        return False
            return True
        except OSError:  # not listening yet, or not ready (HTTP 400 is an HTTPError, an OSError)
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {self.process.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(1.0)
        raise TimeoutError(
            f"tritonserver not ready after {self.startup_timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def wait_exit(self, timeout_s: float) -> int:
        """Launch and wait for the server to exit by itself (a repository that must fail to load): its exit code.

        Raises TimeoutError, the server stopped, when it is still running after ``timeout_s``.
        """
        self.launch()
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"tritonserver still running after {timeout_s:.0f} s; log {self.log_path}") from None
        self.stop()  # stubs left behind, if any
        return code

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def statistics(self) -> dict:
        """Triton's per-model statistics (``get_inference_statistics``) as JSON."""
        import tritonclient.grpc as grpcclient  # here: starting and stopping a server need no client

        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            return client.get_inference_statistics(as_json=True)
        finally:
            client.close()

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT and wait; then SIGKILL to the whole group. A no-op when not running."""
        proc, self.process = self.process, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)
                proc.wait(timeout=timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stubs left behind, or a server that did not stop
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
