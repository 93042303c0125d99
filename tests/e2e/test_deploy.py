"""A repository written by scripts/new_repository.sh serves from anywhere, and model loads report their phases."""
from __future__ import annotations

import re
import subprocess

import pytest
from client.generate import generate_http
from triton_server import READY_TIMEOUT_S, REPO_ROOT, models_dir

from bench.server import SERVE_SCRIPT, TritonServer

pytestmark = pytest.mark.server

PROMPT = "def add(a, b):"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def copied_server(tmp_path_factory):
    models = models_dir()
    if not (models / "tiny-target").is_dir() or not (models / "tiny-draft").is_dir():
        pytest.skip(f"model pair not found under {models}")
    workdir = tmp_path_factory.mktemp("new_repository")
    repository = workdir / "elsewhere" / "repo"
    subprocess.run([str(REPO_ROOT / "scripts" / "new_repository.sh"), str(repository),
                    "--target", str(models / "tiny-target"), "--draft", str(models / "tiny-draft")],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    # a variable pointing nowhere: the copy must not need it
    server = TritonServer(SERVE_SCRIPT, repository, workdir / "tritonserver.log",
                          env={"SPECDEC_MODELS_DIR": str(workdir / "nowhere")}, startup_timeout_s=READY_TIMEOUT_S)  # fmt: skip
    try:
        server.start()
    except (RuntimeError, TimeoutError) as err:
        pytest.fail(str(err))
    yield server
    server.stop()


def test_a_copy_with_absolute_paths_serves_the_targets_greedy_output(copied_server, reference):
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    text = generate_http(copied_server.http_url, "ensemble", PROMPT, params).text
    assert reference.greedy_mismatch(PROMPT, text, MAX_TOKENS) is None


def test_model_loads_log_each_phase_with_its_seconds(copied_server):
    log = copied_server.log_path.read_text()
    for model in ("draft_proposer", "target_verifier"):
        for phase in ("loading weights of", "allocating the KV cache"):
            assert re.search(rf"\[specdec:{model}\] {phase} .*: done in \d+\.\d s", log), (model, phase)
