"""Who may call the stateful models: the orchestrator of the same server, proven by a per-boot secret.

``draft_proposer`` and ``target_verifier`` hold every live sequence's state, and Triton
2.51 serves every model of a repository to any client that reaches its ports: one
direct call naming fresh seq_ids could take every KV slot, and one naming a live
sequence could overwrite or free it. So these two models answer a propose, verify or
release request only when it carries ``caller_secret``, a random token that only the
processes of this server can read:

* the first model of a server to load creates ``specdec-<tritonserver pid>-<its start
  time>.secret`` in
  ``SPECDEC_SECRET_DIR`` (default: the system temporary directory), readable by its
  owner only, holding 32 random bytes in hex; the others, the orchestrator among them,
  read it (every Python stub is a child of the ``tritonserver`` process, so all find
  the same file, and a restarted server makes a new one);
* the orchestrator sends it with every BLS call; a request without it, or with another
  value, is refused with an error that names the model as internal.

Nothing is left per boot: the model that creates the secret removes what servers that
no longer run left (:func:`remove_dead_servers_files`: their secrets, their models'
``.pid`` and ``.json`` files, their models' socket directories), and the orchestrator
removes this server's own files when the server stops cleanly (:func:`remove_server_files`).
A live server's files are never touched: each name carries its process's identity.

A describe request needs no secret: it only reports the model's limits. The stateless
models (tokenizer, detokenizer, rejection_sampler) stay callable on their own. This is
a guard against clients of the public ports, not against code running as the server's
user, which can read the file, as it can read the model weights.
"""
from __future__ import annotations

import hmac
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

SECRET_INPUT = "caller_secret"
_READ_TIMEOUT_S = 10.0  # another stub creates the file and writes it at the same moment


def secret_path(server_pid: int | None = None) -> Path:
    """Where the server with ``server_pid`` (default: this stub's parent) keeps its secret.

    Named by the process id and the process's start time: ids are reused, and a file a
    dead server left under the same id (its secret, its models' process ids, read by the
    supervisor) must not pass for this server's.
    """
    directory = Path(os.environ.get("SPECDEC_SECRET_DIR") or tempfile.gettempdir())
    return directory / f"specdec-{process_identity(server_pid if server_pid is not None else os.getppid())}.secret"


def process_identity(pid: int) -> str:
    """``<pid>-<start time in clock ticks after boot>`` (Linux's /proc); the bare id where that is unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return str(pid)
    return f"{pid}-{stat[stat.rfind(')') + 2:].split()[19]}"  # field 22, starttime; the name may hold ')'


def remove_dead_servers_files(directory: Path, keep: Path | None = None) -> None:
    """Delete the files of servers that no longer run: a crash leaves them, and a stop does until the next boot.

    ``specdec-<pid>-<start>.*`` of a process that is gone or another boot's; ``specdec-<pid>.*``
    (named by the bare id, as before start times) of an id no process holds, where ``/proc``
    can tell.
    """
    proc = Path("/proc/self/stat").exists()
    for path in directory.glob("specdec-*.*"):
        identity = path.name[len("specdec-"):].split(".", 1)[0]
        pid, _, start = identity.partition("-")
        if not pid.isdigit() or (start and not start.isdigit()):
            continue  # another file of the project's (a model's socket directory) or not ours
        dead = process_identity(int(pid)) != identity if start else proc and not Path(f"/proc/{pid}").exists()
        if dead and path.is_file() and path != keep:
            path.unlink(missing_ok=True)
    remove_dead_socket_directories()


# a model's socket directory (specdec_triton.socket_calls): specdec-<model>-<its process id>-<mkdtemp's random characters>
_SOCKET_DIRECTORY = re.compile(r"specdec-(?P<model>.+)-(?P<pid>\d+)-[A-Za-z0-9_]+")


def remove_dead_socket_directories(model: str | None = None, directory: Path | None = None) -> None:
    """Delete the socket directories of model processes that are gone (``model``'s only, if given).

    A stub that stopped cleanly removed its own; a killed one, or one of a killed server,
    could not.
    """
    directory = directory or Path(tempfile.gettempdir())
    for entry in os.scandir(directory):
        match = _SOCKET_DIRECTORY.fullmatch(entry.name)
        if not match or (model is not None and match.group("model") != model):
            continue
        if entry.is_dir(follow_symlinks=False) and not _exists(int(match.group("pid"))):
            shutil.rmtree(entry.path, ignore_errors=True)


def remove_server_files(server_pid: int | None = None) -> None:
    """Delete this server's secret and its models' files: called once the server is stopping, by the orchestrator.

    Never before: a model reloaded after a fault reads the secret and writes its process id again.
    """
    secret = secret_path(server_pid)
    for path in secret.parent.glob(f"{secret.stem}.*"):
        if path.is_file():
            path.unlink(missing_ok=True)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


def boot_secret(path: Path | None = None) -> str:
    """This server's secret: created by the first caller (atomically, mode 0600), read by the rest."""
    path = path or secret_path()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    remove_dead_servers_files(path.parent, keep=path)  # once per boot, by the model that made the secret
    return _read(path)


def _read(path: Path) -> str:
    deadline = time.monotonic() + _READ_TIMEOUT_S
    while True:
        value = path.read_text().strip()
        if value or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # created, not written yet
    if not value:
        raise RuntimeError(f"the server's secret file {path} is empty; remove it and restart the server")
    return value


def is_authorized(given: str | None, secret: str) -> bool:
    """Constant-time comparison, so timing does not reveal how much of a guess was right."""
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())
