"""The per-boot secret that keeps the stateful models to the orchestrator (specdec_triton.internal)."""
from __future__ import annotations

import os
from pathlib import Path
import stat

import numpy as np
import pytest

from specdec_triton import wire
from specdec_triton.internal import (
    boot_secret, is_authorized, process_identity, remove_dead_socket_directories, remove_server_files, secret_path,
)  # fmt: skip
from specdec_triton.plumbing import RequestError


def test_the_first_model_creates_the_secret_and_the_others_read_it(tmp_path):
    path = tmp_path / "specdec-123.secret"
    first = boot_secret(path)
    assert len(first) == 64 and boot_secret(path) == first
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # its owner only
    assert boot_secret(tmp_path / "specdec-124.secret") != first  # another server, another secret


def test_the_path_is_per_server_boot_and_can_be_moved(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_SECRET_DIR", str(tmp_path))
    start = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    assert secret_path() == tmp_path / f"specdec-{os.getppid()}-{start}.secret"  # a stub's parent: tritonserver
    assert process_identity(os.getpid()) != process_identity(os.getppid())
    gone = 2**22 + 1  # above any pid_max: no such process
    assert secret_path(gone) == tmp_path / f"specdec-{gone}.secret"


def test_files_of_servers_that_stopped_are_removed_when_a_server_boots(tmp_path):
    """A reused process id must not inherit a dead server's secret or its models' process ids."""
    mine = process_identity(os.getpid())
    dead = f"{os.getpid()}-1"  # this id, another start: a server that ran before under it
    keep = [tmp_path / f"specdec-{mine}.tokenizer.pid", tmp_path / "specdec-tokenizer-12-abc", tmp_path / "other.txt"]
    keep.append(tmp_path / f"specdec-{os.getpid()}.tokenizer.pid")  # a bare id some process holds: cannot tell
    drop = [tmp_path / f"specdec-{dead}.secret", tmp_path / f"specdec-{dead}.tokenizer.pid",
            tmp_path / f"specdec-{2**22 + 1}-5.target_verifier.json",
            tmp_path / f"specdec-{2**22 + 1}.secret"]  # a bare id no process holds  # fmt: skip
    for path in keep + drop:
        path.write_text("1")
    boot_secret(tmp_path / f"specdec-{mine}.secret")
    assert all(p.exists() for p in keep) and not any(p.exists() for p in drop)


def test_socket_directories_of_processes_that_are_gone_are_removed(tmp_path):
    gone = 2**22 + 1
    keep = [tmp_path / f"specdec-target_verifier-{os.getpid()}-abcd_123", tmp_path / f"specdec-x-{gone}"]
    drop = [tmp_path / f"specdec-target_verifier-{gone}-abcd_123", tmp_path / f"specdec-draft_proposer-{gone}-zz9_0000"]
    for path in keep + drop:
        path.mkdir()
        (path / "calls.sock").write_text("")
    remove_dead_socket_directories("target_verifier", tmp_path)  # one model's, as a model at load
    assert all(p.exists() for p in keep + drop[1:]) and not drop[0].exists()
    remove_dead_socket_directories(directory=tmp_path)  # every model's, as a booting server
    assert all(p.exists() for p in keep) and not any(p.exists() for p in drop)


def test_a_server_that_stops_removes_its_own_files_and_no_others(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_SECRET_DIR", str(tmp_path))
    mine = secret_path(os.getpid())
    boot_secret(mine)
    files = [mine.with_name(f"{mine.stem}.{model}.pid") for model in ("tokenizer", "target_verifier")]
    files.append(files[0].with_suffix(".json"))
    other = tmp_path / f"specdec-{os.getppid()}-{process_identity(os.getppid()).split('-')[-1]}.secret"  # a live one
    for path in files + [other]:
        path.write_text("1")
    remove_server_files(os.getpid())
    assert not mine.exists() and not any(p.exists() for p in files) and other.exists()


def test_an_empty_secret_file_is_an_error_not_an_open_door(tmp_path, monkeypatch):
    monkeypatch.setattr("specdec_triton.internal._READ_TIMEOUT_S", 0.05)
    path = tmp_path / "specdec-1.secret"
    path.write_text("")
    with pytest.raises(RuntimeError, match="is empty"):
        boot_secret(path)


def test_requests_without_the_secret_are_refused_naming_the_model():
    secret = "ab" * 32
    assert is_authorized(secret, secret) and not is_authorized(None, secret) and not is_authorized("x", secret)
    inputs = wire.verify_inputs([]) | {"seq_id": np.array([b"s"], dtype=np.object_)}
    with pytest.raises(RequestError, match="target_verifier is internal to speculative_decoding.*'caller_secret'"):
        wire.check_caller(inputs, secret, "target_verifier")
    with pytest.raises(RequestError, match="is internal"):
        wire.check_caller({**inputs, **wire.secret_input("cd" * 32)}, secret, "target_verifier")
    wire.check_caller({**inputs, **wire.secret_input(secret)}, secret, "target_verifier")
