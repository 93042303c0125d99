"""vLLM's speculative_config: parsed into per-model keys, refused by name, and never silently in conflict."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specdec_triton import speculative_config as sc
from specdec_triton.speculative_config import SpeculativeConfigError


def repository(tmp_path, parameter: str = ""):
    """A repository whose orchestrator config.pbtxt sets ``speculative_config`` to ``parameter``."""
    model = tmp_path / sc.ORCHESTRATOR
    model.mkdir(parents=True)
    escaped = parameter.replace("\\", "\\\\").replace('"', '\\"')
    model.joinpath("config.pbtxt").write_text(
        f'name: "{sc.ORCHESTRATOR}"\nbackend: "python"\n'
        f'parameters [ {{ key: "speculative_config" value: {{ string_value: "{escaped}" }} }} ]\n'
    )
    return tmp_path


def test_keys_map_onto_the_models_that_read_them():
    settings = sc.parse('{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 16,'
                        ' "suffix_decoding_min_token_prob": 0.2, "disable_by_batch_size": 6,'
                        ' "draft_tensor_parallel_size": 1}')  # fmt: skip
    assert settings["draft_proposer"] == {"method": "suffix", "suffix_decoding_max_tree_depth": "16",
                                          "suffix_decoding_min_token_prob": "0.2"}  # fmt: skip
    # vLLM has no per-batch-size table: k is fixed
    assert settings["speculative_decoding"] == {"num_speculative_tokens": "8", "speculative_disable_by_batch_size": "6",
                                                "num_speculative_tokens_per_batch_size": ""}  # fmt: skip


def test_arctic_inferences_key_puts_suffix_decoding_in_front_of_the_model():
    settings = sc.parse('{"method": "eagle3", "model": "/ckpt/head", "enable_suffix_decoding": true}')
    assert settings["draft_proposer"] == {"method": "eagle3", "draft_model": "/ckpt/head", "enable_suffix_decoding": "true"}
    with pytest.raises(SpeculativeConfigError, match=r"'enable_suffix_decoding' must be true or false, got 'yes'"):
        sc.parse('{"method": "eagle3", "enable_suffix_decoding": "yes"}')


def test_a_bare_model_means_a_draft_model():
    assert sc.parse('{"model": "/ckpt/draft"}')["draft_proposer"] == {"draft_model": "/ckpt/draft",
                                                                      "method": "draft_model"}  # fmt: skip


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"method": "suffix", "bogus_key": 1}', r"unknown key 'bogus_key'; supported keys: \[.*'method'"),
        ('{"method": "deepseek_mtp"}', r"method 'deepseek_mtp' is not supported yet; built: \[.*'mtp', 'dflash'\]"),
        ('{"method": "lookahead"}', r"method must be one of \['draft_model', 'ngram', 'suffix', 'eagle3', 'mlp_speculator', 'medusa', 'mtp', 'dflash'\], got 'lookahead'"),
        ('{"draft_tensor_parallel_size": 2}', r"'draft_tensor_parallel_size' = 2 is not supported"),
        ('{"quantization": "fp8"}', r"key 'quantization' is not supported"),
        ('{"num_speculative_tokens": "8"}', r"'num_speculative_tokens' must be int, got '8'"),
        ('{"num_speculative_tokens": 2.5}', r"must be int, got 2.5"),
        ('{"num_speculative_tokens": true}', r"must be int, got True"),
        ('{"method": "suffix",}', r"not valid JSON"),
        ('[1, 2]', r"must be a JSON object, got list"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(text, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        sc.parse(text)


def test_apply_overrides_unset_and_shipped_values(tmp_path):
    env = {sc.ENV_VAR: '{"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 6}'}
    raw = {"method": "suffix", "prompt_lookup_max": "", "dtype": "auto"}  # suffix: the shipped method
    assert sc.apply("draft_proposer", raw, repository(tmp_path), env) == {
        "method": "ngram", "prompt_lookup_max": "3", "dtype": "auto"}  # fmt: skip
    for shipped_table in ("1:8,5:0", "1:8,3:0"):  # today's, and the one older copies of the repository hold
        orchestrator = {"num_speculative_tokens": "8", "num_speculative_tokens_per_batch_size": shipped_table}
        assert sc.apply("speculative_decoding", orchestrator, tmp_path, env) == {
            "num_speculative_tokens": "6", "num_speculative_tokens_per_batch_size": ""}  # fmt: skip
    # a model the JSON says nothing about, and no JSON at all: unchanged
    assert sc.apply("target_verifier", {"dtype": "auto"}, tmp_path, env) == {"dtype": "auto"}
    assert sc.apply("draft_proposer", raw, tmp_path, {}) == raw


def test_a_per_model_key_set_otherwise_is_a_conflict_naming_both(tmp_path):
    env = {sc.ENV_VAR: '{"method": "suffix"}'}
    with pytest.raises(SpeculativeConfigError, match=r"draft_proposer: config.pbtxt sets 'method' = 'ngram' but "
                                                     r"speculative_config sets it to 'suffix'"):  # fmt: skip
        sc.apply("draft_proposer", {"method": "ngram"}, repository(tmp_path), env)
    table = {"num_speculative_tokens_per_batch_size": "1:2"}
    with pytest.raises(SpeculativeConfigError, match="'num_speculative_tokens_per_batch_size' = '1:2'"):
        sc.apply("speculative_decoding", table, tmp_path, env)


def test_the_repository_parameter_is_read_and_must_agree_with_the_environment(tmp_path):
    text = '{"method": "suffix", "num_speculative_tokens": 8}'
    repo = repository(tmp_path, text)
    assert sc.configured_text(repo, {}) == text
    assert sc.apply("draft_proposer", {"method": ""}, repo, {}) == {"method": "suffix"}
    same = json.dumps({"num_speculative_tokens": 8, "method": "suffix"})
    assert sc.configured_text(repo, {sc.ENV_VAR: same}) == same
    with pytest.raises(SpeculativeConfigError, match="differs between SPECDEC_SPECULATIVE_CONFIG"):
        sc.configured_text(repo, {sc.ENV_VAR: '{"method": "ngram"}'})


def test_check_prints_the_json_to_serve_or_the_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config_file = tmp_path / "spec.json"
    config_file.write_text('{"model": "drafts/small", "num_speculative_tokens": 3}')
    assert sc.main(["--check", f"@{config_file}"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(tmp_path / "drafts" / "small")
    assert sc.main(["--check", '{"method": "suffix", "bogus_key": 1}']) == 2
    assert "unknown key 'bogus_key'" in capsys.readouterr().err
    assert sc.main(["--check", "@/nowhere.json"]) == 2


def test_every_shipped_value_counts_as_unset(tmp_path):
    """A JSON must override the committed repository as shipped: its values are the 'unset' ones."""
    root = Path(__file__).resolve().parents[1] / "model_repository"
    for setting in [*sc.SETTINGS.values(), *sc._IMPLIED]:
        config = text_format.Parse((root / setting.model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        shipped = config.parameters[setting.key].string_value if setting.key in config.parameters else ""
        assert shipped in setting.unset, (setting.model, setting.key, shipped)
