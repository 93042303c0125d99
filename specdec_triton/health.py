"""Whether the composing models' stubs are alive, seen from the orchestrator's process.

Triton 2.51's Python backend neither restarts a stub that died nor lets a model report
itself unready: ``/v2/health/ready`` answers 200 while every request to the dead model
fails, and requests already sent to it wait 10-25 s for an error. So each composing
model records its stub's process id at load (:func:`register_stub`, a file beside the
server's secret, see :mod:`specdec_triton.internal`), and the orchestrator checks those
processes every ``interval_s`` (:class:`StubWatch`): a check reads one small file and
one ``/proc`` entry per model, no request to the model, so it answers at once even when
the model's instance is blocked on a dead stub. A stub that is gone or a zombie (the
server reaps its children only when it unloads them) is dead.

The error class is the second signal: a BLS error saying a stub "is not healthy"
(:func:`dead_stub_in`) triggers the same handling without waiting for the next check.
What the orchestrator does about a dead stub is :mod:`specdec_triton.recovery`'s.
"""
from __future__ import annotations

import json
import os
import time
import re
from collections.abc import Iterable
from pathlib import Path

from specdec_triton.internal import secret_path

# Triton names a stub '<model>_<group>_<instance>' in its error messages
_DEAD_STUB = re.compile(r"Stub process '(?P<model>.+?)_\d+_\d+' is not healthy")
# how a step call on a model's socket fails when the model's process goes (specdec_triton.socket_calls)
_SOCKET_CLOSED = re.compile(r"(?P<model>[\w.-]+) stopped: the connection to its process closed")


def pid_path(model: str, server_pid: int | None = None) -> Path:
    """Where ``model``'s stub records its process id, beside the server's secret."""
    secret = secret_path(server_pid)
    return secret.with_name(f"{secret.stem}.{model}.pid")


def config_path(model: str, server_pid: int | None = None) -> Path:
    """Where ``model`` keeps the configuration it was loaded with, for a reload."""
    return pid_path(model, server_pid).with_suffix(".json")


def register_stub(model: str, model_config: str | None = None, server_pid: int | None = None) -> None:
    """Called by a composing model at load; a reloaded model replaces the id of the stub before it.

    ``model_config``: the model's configuration as Triton gave it (``args["model_config"]``,
    JSON). A reload of an unchanged model from the Python backend is a no-op in Triton
    2.51; one that passes the configuration loads the model again.
    """
    if model_config is not None:
        _write(config_path(model, server_pid), model_config)
    _write(pid_path(model, server_pid), str(os.getpid()))


def loaded_config(model: str, server_pid: int | None = None) -> str:
    """The configuration ``model`` registered; empty when it registered none."""
    try:
        return config_path(model, server_pid).read_text()
    except OSError:
        return ""


RELOAD_PARAMETER = "specdec_reload"  # changed on every reload; Parameters.from_args drops it


def reload_config(model: str, server_pid: int | None = None) -> str:
    """The registered configuration with ``RELOAD_PARAMETER`` set to a fresh value.

    Triton 2.51 answers a load whose configuration equals the loaded one as done at
    once, without starting a new stub, and whether the registered JSON equals it
    depends on how Triton completed it; a parameter that differs every time makes
    each reload a real one.
    """
    text = loaded_config(model, server_pid)
    if not text:
        return ""
    config = json.loads(text)
    config.setdefault("parameters", {})[RELOAD_PARAMETER] = {"string_value": str(time.time_ns())}
    return json.dumps(config)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def is_alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has exited; its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat[stat.rfind(")") + 2:].split(" ", 1)[0]  # the command name may hold spaces and ')'
    return state not in ("Z", "X", "x")


def dead_stub_in(message: str) -> str | None:
    """The model whose stub an error message reports dead (Triton's, or a socket call's), if any."""
    match = _DEAD_STUB.search(message) or _SOCKET_CLOSED.search(message)
    return match.group("model") if match else None


class StubWatch:
    """Which of ``models`` have a dead stub; a model that never registered is not watched."""

    def __init__(self, models: Iterable[str], server_pid: int | None = None):
        self.models = tuple(models)
        self.server_pid = server_pid

    def dead(self) -> list[str]:
        dead = []
        for model in self.models:
            try:
                pid = int(pid_path(model, self.server_pid).read_text().strip())
            except (OSError, ValueError):
                continue  # not registered (yet): a model still loading, or one of another kind
            if not is_alive(pid):
                dead.append(model)
        return dead
