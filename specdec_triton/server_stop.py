"""Whether the server was told to stop, seen from the orchestrator's process.

A decoupled Python model hears of a stop from Triton only in ``finalize``, and Triton
2.51 unloads models, so calls ``finalize``, only once no model counts an inference in
flight (``InferenceServer::Stop``: ``StopAllModels``, wait for ``InflightStatus`` to be
empty, then ``UnloadAllModels``). A Python model's request stops counting once its
``execute`` has it, so streams sent to ``speculative_decoding`` let the unload go on, and
the stateful models' unloading ends them. An ``ensemble`` counts each of its requests
until the model it calls sends the final response: streams sent through ``ensemble``
held the unload back, the orchestrator never heard of the stop and kept decoding, and
Triton waited out ``--exit-timeout-secs`` and exited by force, crashing in its teardown.

So the orchestrator watches for the stop itself (:class:`ServerStopWatch`) and, once it
sees it, ends every request in flight (:mod:`specdec_triton.recovery`). What it watches
is Triton's own HTTP liveness endpoint, ``/v2/health/live``: Triton 2.51 stops its HTTP
service first thing on SIGTERM or SIGINT, so the endpoint that answered turns away the
next question at once. Not used: ``pb_utils.is_model_ready``, which Triton refuses once
stopping ("Server not ready") but also while starting, and a refused model-control
message in the 2.51 Python backend frees its error text in shared memory while the stub
reads it: asked every half second during a start, the server crashed on its first
request (a ``boost::interprocess::lock_exception`` in ``TRITONBACKEND_ModelInstanceExecute``).
"""
from __future__ import annotations

import http.client
import os
import time
from collections.abc import Callable
from pathlib import Path

from specdec_triton.internal import secret_path

SERVER_NOT_READY = "Server not ready"  # Triton's answer to a BLS call once stopping
LIVE_PATH = "/v2/health/live"
ASK_TIMEOUT_S = 1.0  # a busy server answers within this; no answer is no evidence either way

# () -> True: the server answered live; False: it refused (not live, or not listening); None: no answer
Liveness = Callable[[], "bool | None"]


class ServerStopWatch:
    """The server is stopping once the liveness question it answered is refused.

    Refusals before the first answer (the server still starting, its endpoints not up)
    say nothing, unless the server answered before this watch began (``answered``: a
    model's process started by a running server, a reload). ``on_answer``: called once, at
    the first answer.
    """

    def __init__(self, live: Liveness | None, answered: bool = False, on_answer: Callable[[], None] | None = None):
        self._live = live  # None: nothing to ask (no HTTP endpoint); the watch never sees a stop
        self._answered = answered
        self._on_answer = on_answer
        self.stopping = False

    @property
    def watching(self) -> bool:
        return self._live is not None

    def check(self) -> bool:
        if self.stopping or self._live is None:
            return self.stopping
        answer = self._live()
        if answer and not self._answered:
            self._answered = True
            if self._on_answer is not None:
                self._on_answer()
        elif answer is False and self._answered:
            self.stopping = True
        return self.stopping


def answered_live_marker(server_pid: int | None = None) -> Path:
    """The file saying that the server (default: this stub's parent) has answered live: its first models
    loaded, its HTTP service up. Written by the orchestrator; one of the server's files (``specdec_triton.internal``)."""
    return secret_path(server_pid).with_suffix(".live")


def http_liveness(server_pid: int | None = None) -> Liveness | None:
    """Whether ``tritonserver`` (default: this stub's parent) answers live over its HTTP endpoint.

    None when the server serves no HTTP.
    """
    ask = http_health(server_pid)
    return None if ask is None else lambda: ask(LIVE_PATH)


def http_model_readiness(server_pid: int | None = None) -> Callable[[str], "bool | None"] | None:
    """``ready(model)``: whether the server answers that model ready (``/v2/models/<model>/ready``).

    True: 200; False: refused or not ready; None: no answer. None when the server serves no HTTP.
    """
    ask = http_health(server_pid)
    return None if ask is None else lambda model: ask(f"/v2/models/{model}/ready")


def http_health(server_pid: int | None = None) -> Callable[[str], "bool | None"] | None:
    """``ask(path)``: a GET of a health path on ``tritonserver``'s HTTP endpoint; whether it answered 200.

    Where to ask is read from the server's command line: ``--http-port`` (8000),
    ``--http-address``, ``--allow-http``, and the key of ``--http-restricted-api`` when it
    restricts health. None when the server serves no HTTP.
    """
    pid = server_pid if server_pid is not None else os.getppid()
    try:
        options = _options(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[1:])
    except OSError:
        return None
    if options.get("allow-http", ["true"])[-1].lower() in ("false", "0", "no", "off"):
        return None
    address = options.get("http-address", ["0.0.0.0"])[-1]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(address, address)
    port = int(options.get("http-port", ["8000"])[-1])
    headers = {}
    for restricted in options.get("http-restricted-api", []):
        headers.update(_restricted_health_header(restricted))

    def ask(path: str) -> bool | None:
        connection = http.client.HTTPConnection(host, port, timeout=ASK_TIMEOUT_S)  # no proxy: our own server
        try:
            connection.request("GET", path, headers=headers)
            return connection.getresponse().status == 200
        except ConnectionRefusedError:
            return False  # the HTTP service stopped: the server is exiting
        except OSError:
            return None  # a timeout or a reset: a loaded server, or a stop; the next question tells
        finally:
            connection.close()

    return ask


def wait_until_not_ready(ready: Callable[[str], "bool | None"], model: str, timeout_s: float,
                         poll_s: float = 0.05) -> bool:  # fmt: skip
    """Ask until ``model`` is answered not ready; False if it still was (or no answer came) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready(model) is False:
            return True
        time.sleep(poll_s)
    return False


def _options(args: list[str]) -> dict[str, list[str]]:
    """``--name=value`` and ``--name value`` as {name: [each value given]}."""
    options: dict[str, list[str]] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "true"
        options.setdefault(name, []).append(value)
    return options


def _restricted_health_header(value: str) -> dict[str, str]:
    """``<categories>:<key>=<value>``: the header a health request needs, when "health" is among the categories."""
    categories, _, header = value.partition(":")
    key, _, expected = header.partition("=")
    return {key: expected} if "health" in categories.split(",") and key else {}
