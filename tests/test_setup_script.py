"""scripts/setup.sh: which torch build it installs, read from its --dry-run, and its up-to-date stamp."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SETUP = REPO_ROOT / "scripts" / "setup.sh"
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0"


def setup(tmp_path: Path, nvidia_smi: str | None, index_answers: bool = True, **env: str) -> subprocess.CompletedProcess:
    """``setup.sh --dry-run`` for a fresh venv, with a stand-in ``nvidia-smi`` (None: none answers).

    ``index_answers``: whether PyTorch's CPU index answers; a dry run runs the interpreter
    only for that question, so a stand-in interpreter (``PYTHON``) gives the answer.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    # a machine without a GPU may still have nvidia-smi, which then fails: the stand-in does the same
    fake.write_text("#!/bin/sh\n" + (f"echo '{nvidia_smi}'\n" if nvidia_smi else "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"))
    fake.chmod(0o755)
    python = bin_dir / "python-probe"
    python.write_text(f"#!/bin/sh\nexit {0 if index_answers else 1}\n")
    python.chmod(0o755)
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SPECDEC_VENV": str(tmp_path / "venv"),
               "PYTHON": str(python), **env}  # fmt: skip
    for key in ("SPECDEC_TORCH", "SPECDEC_TORCH_INDEX"):
        if key not in env:
            environ.pop(key, None)
    return subprocess.run([str(SETUP), "--dry-run"], env=environ, capture_output=True, text=True, timeout=60)


GPU = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"


@pytest.mark.parametrize("nvidia_smi, env, build, expected", [
    (None, {}, "cpu", f"would run: {{venv}}/bin/python -m pip install --disable-pip-version-check -q {CPU_INDEX}"),
    (GPU, {}, "cuda", "would run: {venv}/bin/python -m pip install --disable-pip-version-check -q torch==2.13.0"),
    (GPU, {"SPECDEC_TORCH": "cpu"}, "cpu", CPU_INDEX),
    (None, {"SPECDEC_TORCH": "cuda"}, "cuda", "-q torch==2.13.0"),
    (None, {"SPECDEC_TORCH_INDEX": "https://example.org/whl"}, "cpu", "-q --index-url https://example.org/whl torch=="),
])  # fmt: skip
def test_torch_build_follows_the_machine_or_the_override(tmp_path, nvidia_smi, env, build, expected):
    result = setup(tmp_path, nvidia_smi, **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    torch_lines = [line for line in lines if "would run:" in line and "torch==" in line]
    assert len(torch_lines) == 1 and expected.format(venv=tmp_path / "venv") in torch_lines[0]
    assert ("download.pytorch.org/whl/cpu" in torch_lines[0]) == (CPU_INDEX in expected)  # CUDA: PyPI's build
    assert [line for line in lines if line.startswith("[setup] (")] == [
        f"[setup] ({i}/5) {what}" for i, what in enumerate([
            f"virtualenv {tmp_path / 'venv'}",
            f"torch 2.13.0 ({build} build)",
            "the project, tritonclient, nvidia-pytriton (tritonserver), the OpenAI server (fastapi, uvicorn), test and benchmark tools",
            "check",
            "the compile cache of model_repository/ (scripts/warm_cache.py; SPECDEC_WARM_CACHE=0 skips it)"],
            start=1)]  # fmt: skip
    assert f"[setup] would run: {tmp_path / 'venv'}/bin/python scripts/warm_cache.py" in lines
    assert lines[-1] == "[setup] dry run: nothing was installed"
    assert not (tmp_path / "venv").exists()


def test_without_the_cpu_index_a_local_wheel_is_taken_and_its_dependencies_from_pypi(tmp_path):
    result = setup(tmp_path, None, index_answers=False)
    assert result.returncode == 0, result.stderr
    torch_lines = [line for line in result.stdout.splitlines() if "would run:" in line and "torch==" in line]
    assert len(torch_lines) == 2
    assert torch_lines[0].endswith("-q --no-index --no-deps torch==2.13.0")  # pip's own sources: find-links
    assert torch_lines[1].endswith("--disable-pip-version-check -q torch==2.13.0")  # torch is there: only its dependencies
    assert "does not answer" in result.stdout


def test_a_bad_override_is_refused_naming_the_allowed_values(tmp_path):
    result = setup(tmp_path, None, SPECDEC_TORCH="gpu")
    assert result.returncode == 2
    assert "SPECDEC_TORCH must be one of auto, cpu, cuda; got 'gpu'" in result.stderr


def test_an_up_to_date_venv_is_left_alone(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    digest = hashlib.sha256((REPO_ROOT / "pyproject.toml").read_bytes() + SETUP.read_bytes()).hexdigest()
    (venv / ".specdec-setup").write_text(digest + "\n")
    result = setup(tmp_path, None, SPECDEC_WARM_CACHE="0")
    assert (result.returncode, result.stdout) == (0, f"[setup] {venv} is up to date\n"
                                                     "[setup] not warming the compile cache (SPECDEC_WARM_CACHE=0)\n")
    (venv / ".specdec-setup").write_text("stale\n")
    assert "would run:" in setup(tmp_path, None).stdout
