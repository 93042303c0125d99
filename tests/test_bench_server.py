"""bench/server.py with a stand-in for scripts/serve.sh: start, readiness, stop of the whole group, exit codes."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bench.server import TritonServer, free_port

# A stand-in for serve.sh: answers /v2/health/ready on --http-port and keeps a child (a "stub")
# in its process group; the child's pid goes to the file named by FAKE_STUB_PID.
FAKE_SERVER = f"""#!{sys.executable}
import http.server, os, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # started from a background job, SIGINT comes ignored
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
if os.environ.get("FAKE_EXIT"):
    print("failing to load", flush=True)
    sys.exit(int(os.environ["FAKE_EXIT"]))
stub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(os.environ["FAKE_STUB_PID"], "w").write(str(stub.pid))

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(args["http-port"])), Ready).serve_forever()
"""


@pytest.fixture
def fake_serve(tmp_path: Path) -> Path:
    script = tmp_path / "serve.sh"
    script.write_text(FAKE_SERVER)
    script.chmod(0o755)
    return script


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_free_port_is_bindable():
    port = free_port()
    assert 1024 <= port < 65536


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_server_starts_is_ready_and_stops_with_its_stubs(fake_serve, tmp_path):
    pid_file = tmp_path / "stub.pid"
    server = TritonServer(fake_serve, tmp_path / "repo", tmp_path / "server.log",
                          env={"FAKE_STUB_PID": str(pid_file)}, startup_timeout_s=60)  # fmt: skip
    assert "--model-repository=" + str(tmp_path / "repo") in server.command()
    assert len({server.grpc_port, server.http_port, server.metrics_port}) == 3
    with server:
        assert server.is_ready()
        stub = int(pid_file.read_text())
        assert _alive(stub)
    assert server.process is None and not server.is_ready()
    deadline = time.monotonic() + 10
    while _alive(stub) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(stub), "the stub outlived the server"
    server.stop()  # stopping twice is a no-op


def test_server_that_exits_while_starting_raises_with_its_log(fake_serve, tmp_path):
    server = TritonServer(fake_serve, tmp_path, tmp_path / "server.log", env={"FAKE_EXIT": "3"}, startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*failing to load"):
        server.start()
    assert server.process is None


def test_wait_exit_returns_the_exit_code(fake_serve, tmp_path):
    server = TritonServer(fake_serve, tmp_path, tmp_path / "server.log", env={"FAKE_EXIT": "1"})
    assert server.wait_exit(timeout_s=60) == 1
    assert "failing to load" in server.log_tail()
