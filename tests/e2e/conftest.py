"""End-to-end fixtures: a real tritonserver started by scripts/serve.sh, and the target as a reference.

The default server serves the committed ``model_repository`` as is (suffix decoding,
checkpoints in ``${SPECDEC_MODELS_DIR}``, which serve.sh sets). The n-gram server serves a copy made in
a temporary directory with ``method: ngram``, the table server one with the shipped draft model
whose step k follows a ``num_speculative_tokens_per_batch_size`` table. ``SPECDEC_E2E_MODELS`` may name another
directory holding ``tiny-target`` and ``tiny-draft``; every server then uses a copy
pointing there. Without the model pair the tests skip.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from triton_server import REPO_ROOT, Reference, server_on_free_ports, models_dir, repository_copy

from specdec.models import load_causal_lm
from specdec_triton.text import TextCodec

SHIPPED_METHOD = "suffix"  # the committed draft_proposer's method
# suffix decoding set by vLLM's JSON alone on serve.sh's command line, its speculation tree verified as a tree
SUFFIX_TREE_JSON = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_use_tree_spec": True}
sys.path.insert(0, str(REPO_ROOT))  # the command-line client is a top-level package, not installed


def _start_server(tmp_path_factory, method: str, parameters: dict[str, str] | None = None, openai: bool = False):
    models = models_dir()
    if not (models / "tiny-target").is_dir() or not (models / "tiny-draft").is_dir():
        pytest.skip(f"model pair not found under {models}")
    workdir = tmp_path_factory.mktemp(f"server_{method}")
    committed = method == SHIPPED_METHOD and models == REPO_ROOT / "models" and not parameters
    repository = (
        REPO_ROOT / "model_repository" if committed else repository_copy(workdir, models, method, parameters=parameters)
    )
    server = server_on_free_ports(workdir, repository, openai)
    server.start()
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The committed repository: suffix decoding, k = 8; with the OpenAI API (``server.openai_url``)."""
    server = _start_server(tmp_path_factory, SHIPPED_METHOD, openai=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ngram_server(tmp_path_factory):
    server = _start_server(tmp_path_factory, "ngram")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def table_server(tmp_path_factory):
    """The shipped draft model, eager: k = 4 for one sequence, 2 for two, none from three sequences on.

    Eager as every copy is (``repository_copy``): the compiled draft is served by ``test_deploy.py``'s
    copy of the shipped configuration, and compiling it here cost this server's start 40-50 s.

    Every step drafts the table's k (no k that follows acceptance, which reads the clock), so
    that a seed gives the same text each time: a model's drafts shape the draws.
    """
    server = _start_server(tmp_path_factory, "draft_model", {
        "num_speculative_tokens": "4", "num_speculative_tokens_per_batch_size": "1:4,2:2,3:0",
        "speculation_follows_acceptance": "false"})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def suffix_json_server(tmp_path_factory):
    """``SUFFIX_TREE_JSON`` over a copy whose method and k are left empty for the JSON to set: the server of
    ``test_suffix.py`` (lossless, learns from past responses) and of ``test_trees.py``'s suffix tree."""
    models = models_dir()
    if not (models / "tiny-target").is_dir():
        pytest.skip(f"model pair not found under {models}")
    workdir = tmp_path_factory.mktemp("server_suffix_json")
    server = server_on_free_ports(workdir, repository_copy(workdir, models, ""),
                                  serve_args=(f"--speculative-config={json.dumps(SUFFIX_TREE_JSON)}",))  # fmt: skip
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference() -> Reference:
    target = models_dir() / "tiny-target"
    if not target.is_dir():
        pytest.skip(f"model pair not found under {models_dir()}")
    torch.set_num_threads(1)
    model = load_causal_lm(target, dtype="float32")
    return Reference(model, TextCodec(str(target)), int(model.config.max_position_embeddings))
