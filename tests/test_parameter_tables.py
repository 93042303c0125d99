"""specdec_triton/parameters.py against the configs that read it and the docs written from it
(scripts/parameter_tables.py)."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from specdec_triton import configs
from specdec_triton.parameters import MODELS, Parameter
from specdec_triton.plumbing import ParameterError, Parameters

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("parameter_tables", REPO_ROOT / "scripts" / "parameter_tables.py")
parameter_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parameter_tables)

CONFIGS = {
    "tokenizer": configs.TokenizerConfig,
    "detokenizer": configs.TokenizerConfig,
    "draft_proposer": configs.DraftProposerConfig,
    "target_verifier": configs.TargetVerifierConfig,
    "rejection_sampler": configs.RejectionSamplerConfig,
    "speculative_decoding": configs.OrchestratorConfig,
}


def test_the_docs_tables_are_the_declarations():
    """Fails when a page's table and specdec_triton/parameters.py differ: run scripts/parameter_tables.py."""
    assert parameter_tables.update(REPO_ROOT, write=False) == []


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_config_reads_every_key_it_declares(model, monkeypatch):
    """A config.pbtxt listing every declared key, each empty, loads: no declaration is left unread."""
    monkeypatch.delenv("SPECDEC_MODELS_DIR", raising=False)  # the checkout's models/, beside the repository
    params = Parameters({p.name: "" for p in MODELS[model]}, base_dir=str(REPO_ROOT / "model_repository"),
                        component=model)  # fmt: skip
    CONFIGS[model].from_parameters(params)
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['undeclared'\]"):
        CONFIGS[model].from_parameters(Parameters({"undeclared": "1"}, str(REPO_ROOT / "model_repository"), model))


def test_a_drifted_table_is_named_and_rewritten(tmp_path):
    shutil.copytree(REPO_ROOT / "model_repository", tmp_path / "model_repository",
                    ignore=shutil.ignore_patterns("1"))  # fmt: skip
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# r\n")
    blocks = "".join(f"<!-- parameters:{model} -->\n<!-- /parameters -->\n" for model in
                     ("tokenizer", "draft_proposer", "target_verifier", "rejection_sampler", "speculative_decoding"))
    page = tmp_path / "docs" / "configuration.md"
    page.write_text(blocks + "<!-- parameters:nobody -->\n<!-- /parameters -->\n")
    problems = parameter_tables.update(tmp_path, write=False)
    assert "docs/configuration.md: the draft_proposer table differs from specdec_triton/parameters.py " \
           "(python scripts/parameter_tables.py rewrites it)" in problems  # fmt: skip
    assert any("<!-- parameters:nobody --> names no model" in p for p in problems)
    parameter_tables.update(tmp_path, write=True)
    assert [p for p in parameter_tables.update(tmp_path, write=False) if "differs" in p] == []
    assert "| `max_num_seqs` | `8` | integer >= 1 |" in page.read_text()
    page.write_text("no tables\n")
    assert "no page has a table of tokenizer's parameters (<!-- parameters:tokenizer -->)" in \
        parameter_tables.update(tmp_path, write=False)  # fmt: skip


def test_a_table_shows_the_shipped_value_where_it_differs_and_undeclared_keys_are_named(tmp_path):
    shutil.copytree(REPO_ROOT / "model_repository", tmp_path / "model_repository",
                    ignore=shutil.ignore_patterns("1"))  # fmt: skip
    table = parameter_tables.table("speculative_decoding", tmp_path / "model_repository")
    assert "| `num_speculative_tokens` | `4` (shipped: `8`) | integer >= 0 |" in table
    assert "| `health_check_interval_s` | `0.5` | number in [0.05, 60] |" in table
    config = tmp_path / "model_repository" / "rejection_sampler" / "config.pbtxt"
    typo = 'parameters [\n  { key: "typo" value: { string_value: "" } },'
    config.write_text(config.read_text().replace("parameters [", typo))
    assert parameter_tables._undeclared(tmp_path / "model_repository") == [
        "model_repository/rejection_sampler/config.pbtxt: parameter 'typo' is not declared for rejection_sampler in "
        "specdec_triton/parameters.py"]  # fmt: skip


def test_a_parameter_names_a_known_kind():
    with pytest.raises(ValueError, match=r"parameter 'x': kind must be one of"):
        Parameter("x", "list", None, "")
