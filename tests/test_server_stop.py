"""How the orchestrator sees the server stopping (Triton's HTTP liveness, refused once it stops) and a model unloaded."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.server import free_port
from specdec_triton.server_stop import ServerStopWatch, http_liveness, http_model_readiness, wait_until_not_ready


def test_the_server_stops_once_it_refuses_the_question_it_answered():
    answers = iter([False, None, True, None, True, False, True])  # starting, no answer, live ..., refused
    watch = ServerStopWatch(lambda: next(answers))
    assert [watch.check() for _ in range(7)] == [False, False, False, False, False, True, True]  # a stop stays


def test_without_a_question_there_is_no_stop():
    watch = ServerStopWatch(None)
    assert not watch.watching and not watch.check()


class Live(http.server.BaseHTTPRequestHandler):
    ready_models: set[str] = set()

    def do_GET(self):
        allowed = self.headers.get("admin-key") == "k1" and (
            self.path == "/v2/health/live" or self.path in {f"/v2/models/{m}/ready" for m in self.ready_models})
        self.send_response(200 if allowed else 400 if self.path.startswith("/v2/models/") else 403)
        self.end_headers()

    def log_message(self, *args):
        pass


def a_server_process(*args: str) -> subprocess.Popen:
    """A process whose command line reads as tritonserver's, with ``args``; returned once it does (after exec)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    deadline = time.monotonic() + 10
    while args[-1].encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return process


def test_the_question_goes_to_the_servers_http_port_with_its_health_key():
    port = free_port()
    http_server = http.server.HTTPServer(("127.0.0.1", port), Live)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    process = a_server_process("--http-port", str(port), "--http-restricted-api=model-repository:x=y",
                               "--http-restricted-api=health,metadata:admin-key=k1")  # fmt: skip
    try:
        live = http_liveness(process.pid)
        assert live() is True
        http_server.shutdown()
        http_server.server_close()
        assert live() is False  # the HTTP service stopped: refused
    finally:
        process.kill()
        process.wait()


def test_a_reload_waits_until_the_unloaded_model_is_answered_not_ready():
    port = free_port()
    Live.ready_models = {"target_verifier"}
    http_server = http.server.HTTPServer(("127.0.0.1", port), Live)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    process = a_server_process("--http-port", str(port), "--http-restricted-api=health:admin-key=k1")
    try:
        ready = http_model_readiness(process.pid)
        assert ready("target_verifier") is True and ready("draft_proposer") is False
        assert not wait_until_not_ready(ready, "target_verifier", timeout_s=0.3)  # still ready: the wait gives up
        threading.Timer(0.2, Live.ready_models.clear).start()  # the unload takes effect
        start = time.monotonic()
        assert wait_until_not_ready(ready, "target_verifier", timeout_s=5)
        assert 0.2 <= time.monotonic() - start < 2
    finally:
        http_server.shutdown()
        http_server.server_close()
        process.kill()
        process.wait()


def test_a_server_without_http_has_no_question():
    process = a_server_process("--allow-http=false")
    try:
        assert http_liveness(process.pid) is None and http_model_readiness(process.pid) is None
    finally:
        process.kill()
        process.wait()
    assert http_liveness(2**22 + 1) is None  # no such process


def test_the_first_answer_is_told_once_and_a_watch_that_knows_of_one_sees_the_first_refusal():
    told, answers = [], iter([None, True, True, False])
    watch = ServerStopWatch(lambda: next(answers), on_answer=lambda: told.append(1))
    assert [watch.check() for _ in range(4)] == [False, False, False, True] and told == [1]
    assert ServerStopWatch(lambda: False, answered=True).check()
