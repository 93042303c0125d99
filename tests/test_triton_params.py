"""Model-config parameter parsing (specdec_triton.plumbing.Parameters) and the per-model configs, without Triton."""
from __future__ import annotations

import json

import pytest

from specdec.speculation_length import SpeculationLength

from specdec_triton.configs import (
    DraftProposerConfig,
    OrchestratorConfig,
    RejectionSamplerConfig,
    TargetVerifierConfig,
    TokenizerConfig,
)
from specdec_triton.plumbing import ParameterError, Parameters, run_batch


def params(base_dir=None, **raw) -> Parameters:
    return Parameters({k: str(v) for k, v in raw.items()}, base_dir=base_dir, component="m")


SPELLINGS = [("true", True), ("1", True), ("YES", True), ("on", True),
             ("false", False), ("0", False), ("No", False), ("off", False)]  # fmt: skip


@pytest.mark.parametrize("value, expected", SPELLINGS)
def test_bool_spellings(value, expected):
    assert params(flag=value).get_bool("flag", not expected) is expected


def test_bool_rejects_other_words_naming_the_key():
    with pytest.raises(ParameterError, match=r"m: parameter 'flag' must be a boolean .*got 'maybe'"):
        params(flag="maybe").get_bool("flag", False)


def test_empty_and_missing_values_take_the_default():
    p = params(n="", s="  ")
    assert p.get_int("n", 7) == 7
    assert p.get_str("s", "d") == "d"
    assert p.get_float("absent", 0.5) == 0.5


def test_int_range_and_type_errors_name_key_and_range():
    assert params(n="3").get_int("n", 0, minimum=1, maximum=5) == 3
    with pytest.raises(ParameterError, match=r"'n' must be an integer in \[1, 5\], got '9'"):
        params(n="9").get_int("n", 0, minimum=1, maximum=5)
    with pytest.raises(ParameterError, match=r"'n' must be an integer >= 1, got '2.5'"):
        params(n="2.5").get_int("n", 0, minimum=1)


def test_float_rejects_nan_and_out_of_range():
    assert params(x="0.25").get_float("x", 0.0, minimum=0.0, maximum=1.0) == 0.25
    for bad in ("nan", "1.5", "abc"):
        with pytest.raises(ParameterError, match=r"'x' must be a number in \[0.0, 1.0\]"):
            params(x=bad).get_float("x", 0.0, minimum=0.0, maximum=1.0)


def test_choices_listed_in_the_error():
    with pytest.raises(ParameterError, match=r"'method' must be one of \('a', 'b'\), got 'c'"):
        params(method="c").get_str("method", "a", choices=("a", "b"))


def test_paths_resolve_against_the_repository_directory(tmp_path):
    (tmp_path / "models" / "t").mkdir(parents=True)
    repo = tmp_path / "repo"
    repo.mkdir()
    assert params(base_dir=str(repo), p="../models/t").get_path("p", None) == str(tmp_path / "models" / "t")
    assert params(base_dir=str(repo), p=str(tmp_path)).get_path("p", None) == str(tmp_path)
    with pytest.raises(ParameterError, match=r"'p' must be an existing path"):
        params(base_dir=str(repo), p="missing").get_path("p", None)
    assert params(base_dir=str(repo), p="missing").get_path("p", None, must_exist=False) == str(repo / "missing")


def test_paths_expand_variables_and_the_model_directory(tmp_path, monkeypatch):
    (tmp_path / "ckpt" / "t").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "weights").mkdir(parents=True)
    repo, model_dir = tmp_path / "repo", tmp_path / "repo" / "m"
    monkeypatch.setenv("SPECDEC_MODELS_DIR", str(tmp_path / "ckpt"))
    assert params(base_dir=str(repo), p="${SPECDEC_MODELS_DIR}/t").get_path("p", None) == str(tmp_path / "ckpt" / "t")
    within = Parameters({"p": "$$TRITON_MODEL_DIRECTORY/weights"}, base_dir=str(repo), model_dir=str(model_dir))
    assert within.get_path("p", None) == str(model_dir / "weights")
    monkeypatch.delenv("SPECDEC_MODELS_DIR")
    # unset: models/ beside the repository, the checkout's layout
    (tmp_path / "models" / "t").mkdir(parents=True)
    assert params(base_dir=str(repo), p="${SPECDEC_MODELS_DIR}/t").get_path("p", None) == str(tmp_path / "models" / "t")
    with pytest.raises(ParameterError, match=r"'p' must be an existing path .* set SPECDEC_MODELS_DIR to the directory"):
        params(base_dir=str(repo), p="${SPECDEC_MODELS_DIR}/missing").get_path("p", None)
    with pytest.raises(ParameterError, match=r"'p' must be a path whose variables are set: environment variable "
                                             r"OTHER_DIR is not set"):
        params(base_dir=str(repo), p="${OTHER_DIR}/t").get_path("p", None)
    with pytest.raises(ParameterError, match=r"\$\$TRITON_MODEL_DIRECTORY needs the model's directory"):
        params(base_dir=str(repo), p="$$TRITON_MODEL_DIRECTORY/weights").get_path("p", None)


def test_unknown_keys_fail_and_list_the_allowed_ones():
    p = params(known="1", typo="2")
    p.get_int("known", 0)
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['typo'\]; allowed: \['known'\]"):
        p.check_all_read()


def test_from_args_reads_the_triton_config_json(tmp_path):
    config = {"parameters": {"n": {"string_value": "5"}}}
    args = {"model_config": json.dumps(config), "model_repository": str(tmp_path / "m"), "model_name": "m"}
    p = Parameters.from_args(args)
    assert p.get_int("n", 0) == 5
    assert p.get_path("p", str(tmp_path), must_exist=True) == str(tmp_path)


def test_component_configs_parse_and_reject(tmp_path):
    (tmp_path / "target").mkdir()
    base = str(tmp_path)
    verifier = TargetVerifierConfig.from_parameters(params(base, target_model="target", max_model_len="128"))
    assert verifier == TargetVerifierConfig(str(tmp_path / "target"), "auto", 128, engine="fast", max_num_seqs=8)
    with pytest.raises(ParameterError, match=r"'engine' must be one of \('fast', 'hf'\), got 'vllm'"):
        TargetVerifierConfig.from_parameters(params(base, target_model="target", engine="vllm"))
    with pytest.raises(ParameterError, match=r"'dtype' must be one of \('auto', 'float32'"):
        TargetVerifierConfig.from_parameters(params(base, target_model="target", dtype="fp8"))
    assert TargetVerifierConfig.from_parameters(params(base, target_model="target", cpu_compile="true")).cpu_compile
    with pytest.raises(ParameterError, match=r"'cpu_compile' must be a boolean"):
        TargetVerifierConfig.from_parameters(params(base, target_model="target", cpu_compile="fast"))
    tokenizer = TokenizerConfig.from_parameters(params(base, tokenizer_dir="target"))
    assert tokenizer.tokenizer_dir == str(tmp_path / "target")
    sampler = RejectionSamplerConfig.from_parameters(params(rejection_sample_method="strict"))
    assert (sampler.method, sampler.synthetic_acceptance_rate, sampler.use_triton_kernel) == ("strict", 0.0, False)
    with pytest.raises(ParameterError, match=r"'rejection_sample_method' must be one of \('strict', 'probabilistic'"):
        RejectionSamplerConfig.from_parameters(params(rejection_sample_method="greedy"))
    with pytest.raises(ParameterError, match=r"'synthetic_acceptance_rate' must be a number in \[0.0, 1.0\]"):
        RejectionSamplerConfig.from_parameters(params(synthetic_acceptance_rate="2"))
    assert OrchestratorConfig.from_parameters(params()) == OrchestratorConfig(
        4, 64, SpeculationLength(4, follows_acceptance=True))  # on by default
    fixed = OrchestratorConfig.from_parameters(params(speculation_follows_acceptance="false")).speculation
    assert fixed == SpeculationLength(4, follows_acceptance=False)
    with pytest.raises(ParameterError, match=r"'speculation_follows_acceptance' must be a boolean"):
        OrchestratorConfig.from_parameters(params(speculation_follows_acceptance="sometimes"))
    with pytest.raises(ParameterError, match=r"'num_speculative_tokens' must be an integer >= 0, got '-1'"):
        OrchestratorConfig.from_parameters(params(num_speculative_tokens="-1"))
    speculation = OrchestratorConfig.from_parameters(params(speculative_disable_by_batch_size="8")).speculation
    assert speculation.disable_by_batch_size == 8 and speculation.k_for(9) == 0
    with pytest.raises(ParameterError, match=r"'speculative_disable_by_batch_size' must be an integer >= 0, got '-1'"):
        OrchestratorConfig.from_parameters(params(speculative_disable_by_batch_size="-1"))
    table = OrchestratorConfig.from_parameters(params(num_speculative_tokens_per_batch_size="1:4,2:2,4:0")).speculation
    assert [table.k_for(n) for n in range(1, 6)] == [4, 2, 2, 0, 0]
    with pytest.raises(ParameterError, match=r"'num_speculative_tokens_per_batch_size' entry '2' is not 'batch_size:k'"):
        OrchestratorConfig.from_parameters(params(num_speculative_tokens_per_batch_size="1:4,2"))
    with pytest.raises(ParameterError, match=r"asks for k = 6, more than num_speculative_tokens = 4"):
        OrchestratorConfig.from_parameters(params(num_speculative_tokens_per_batch_size="1:6"))
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['micro_batches'\]"):
        OrchestratorConfig.from_parameters(params(micro_batches="2"))
    assert OrchestratorConfig.from_parameters(params()).stage_calls == "socket"
    assert OrchestratorConfig.from_parameters(params(stage_calls="bls")).stage_calls == "bls"
    with pytest.raises(ParameterError, match=r"'stage_calls' must be one of \('socket', 'bls'\)"):
        OrchestratorConfig.from_parameters(params(stage_calls="pipe"))


def test_run_with_target_is_unread_by_model_free_methods(tmp_path):
    base = str(tmp_path)
    (tmp_path / "draft").mkdir()
    beside = DraftProposerConfig.from_parameters(params(base, draft_model="draft", run_with_target="true"))
    assert beside.beside_target and not beside.unread_settings()
    with_suffix = DraftProposerConfig.from_parameters(params(base, draft_model="draft", run_with_target="true",
                                                             enable_suffix_decoding="true"))  # fmt: skip
    assert with_suffix.beside_target and with_suffix.suffix_first is not None  # suffix decoding in the orchestrator
    ngram = DraftProposerConfig.from_parameters(params(base, method="ngram", run_with_target="true"))
    assert not ngram.beside_target
    assert ngram.unread_settings() == ["run_with_target changes nothing for method 'ngram': a model-free method "
                                       "runs in speculative_decoding's process always"]  # fmt: skip


def test_draft_proposer_config_per_method(tmp_path):
    base = str(tmp_path)
    ngram = DraftProposerConfig.from_parameters(params(base, method="ngram", prompt_lookup_max="3"))
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", None, 3)
    with pytest.raises(ParameterError, match=r"'method' must be one of \('draft_model', 'ngram', 'suffix', 'eagle3', 'mlp_speculator', 'medusa', 'mtp', 'dflash'\), got 'eagle'"):
        DraftProposerConfig.from_parameters(params(base, method="eagle"))
    with pytest.raises(ParameterError, match=r"'draft_model' must be an existing path"):
        DraftProposerConfig.from_parameters(params(base, method="draft_model", draft_model="nowhere"))
    with pytest.raises(ParameterError, match=r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"):
        DraftProposerConfig.from_parameters(params(base, method="ngram", prompt_lookup_min="4", prompt_lookup_max="2"))
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['lookup_max'\]"):
        DraftProposerConfig.from_parameters(params(base, method="ngram", lookup_max="2"))


def test_a_head_drafts_for_the_target_verifier_serves_unless_it_names_its_own(tmp_path):
    """One owner for the target checkpoint: draft_proposer's empty target_model is target_verifier's."""
    served, other, head = (tmp_path / name for name in ("served-target", "other-target", "head"))
    for directory in (served, other, head):
        directory.mkdir()
    (tmp_path / "target_verifier").mkdir()
    (tmp_path / "target_verifier" / "config.pbtxt").write_text(
        'name: "target_verifier"\nparameters [ { key: "target_model" value: { string_value: "served-target" } } ]\n')
    base = str(tmp_path)
    for method in ("eagle3", "mlp_speculator"):
        follows = DraftProposerConfig.from_parameters(params(base, method=method, draft_model="head", target_model=""))
        assert follows.target_model == str(served)
        own = DraftProposerConfig.from_parameters(params(base, method=method, draft_model="head",
                                                         target_model="other-target"))  # fmt: skip
        assert own.target_model == str(other)
    # a model-free method reads no target, and a value left from a head method is no unknown key
    ngram = DraftProposerConfig.from_parameters(params(base, method="ngram", target_model="other-target"))
    assert ngram.target_model is None
    (tmp_path / "target_verifier" / "config.pbtxt").write_text(
        'name: "target_verifier"\nparameters [ { key: "target_model" value: { string_value: "gone" } } ]\n')
    with pytest.raises(ParameterError, match=r"target_verifier: parameter 'target_model' must be an existing path"):
        DraftProposerConfig.from_parameters(params(base, method="eagle3", draft_model="head"))


def test_suffix_settings_take_vllm_keys_and_defaults(tmp_path):
    base = str(tmp_path)
    suffix = DraftProposerConfig.from_parameters(params(base, method="suffix", suffix_decoding_max_tree_depth="16",
                                                        suffix_decoding_min_token_prob=""))  # fmt: skip
    assert (suffix.suffix.max_tree_depth, suffix.suffix.max_cached_requests) == (16, 10000)
    assert (suffix.suffix.max_spec_factor, suffix.suffix.min_token_prob) == (1.0, 0.1)
    assert suffix.unread_settings() == []
    with pytest.raises(ParameterError, match=r"draft_proposer: parameter suffix_decoding_max_spec_factor must be > 0"):
        DraftProposerConfig.from_parameters(params(base, method="suffix", suffix_decoding_max_spec_factor="0"))
    with pytest.raises(ParameterError, match=r"'suffix_decoding_max_cached_requests' must be an integer"):
        DraftProposerConfig.from_parameters(params(base, method="suffix", suffix_decoding_max_cached_requests="x"))
    ngram = DraftProposerConfig.from_parameters(params(base, method="ngram", suffix_decoding_max_tree_depth="8"))
    assert ngram.unread_settings() == ["suffix_decoding_max_tree_depth is set but only method suffix reads it; "
                                       "method is 'ngram'"]  # fmt: skip


def test_suffix_decoding_in_front_of_a_model_reads_its_settings_and_refuses_what_cannot_apply(tmp_path):
    base, draft = str(tmp_path), str(tmp_path)
    config = DraftProposerConfig.from_parameters(params(base, draft_model=draft, enable_suffix_decoding="true",
                                                        suffix_decoding_max_tree_depth="12",
                                                        suffix_decoding_min_score="1.5",
                                                        model_num_speculative_tokens="3"))  # fmt: skip
    first = config.suffix_first
    assert (first.suffix.max_tree_depth, first.min_score, first.model_num_speculative_tokens) == (12, 1.5, 3)
    assert config.unread_settings() == []  # the suffix_decoding_* keys are read beside the model
    off = DraftProposerConfig.from_parameters(params(base, draft_model=draft, enable_suffix_decoding="false"))
    assert off.suffix_first is None
    left = DraftProposerConfig.from_parameters(params(base, draft_model=draft, suffix_decoding_min_score="1"))
    assert left.unread_settings() == ["suffix_decoding_min_score is set but only enable_suffix_decoding reads it; "
                                      "it is false"]  # fmt: skip
    with pytest.raises(ParameterError, match=r"enable_suffix_decoding puts suffix decoding in front of a model .*"
                                             r"method is 'suffix'"):  # fmt: skip
        DraftProposerConfig.from_parameters(params(base, method="suffix", enable_suffix_decoding="true"))
    with pytest.raises(ParameterError, match=r"suffix_decoding_min_score must be > 0, got 0.0"):
        DraftProposerConfig.from_parameters(params(base, draft_model=draft, enable_suffix_decoding="true",
                                                   suffix_decoding_min_score="0"))  # fmt: skip


def test_n_gram_settings_under_another_method_are_warned_of(tmp_path):
    base, draft = str(tmp_path), str(tmp_path)
    config = DraftProposerConfig.from_parameters(params(base, draft_model=draft, prompt_lookup_min="3"))
    assert config.unread_settings() == ["prompt_lookup_min is set but only method ngram reads it; method is "
                                        "'draft_model'"]  # fmt: skip
    ngram = DraftProposerConfig.from_parameters(params(base, method="ngram", draft_model=draft, prompt_lookup_min="3"))
    assert ngram.unread_settings() == []


def test_ignored_request_parameters_is_a_regular_expression():
    assert OrchestratorConfig.from_parameters(params()).ignored_request_parameters is None
    config = OrchestratorConfig.from_parameters(params(ignored_request_parameters="x-.*"))
    assert config.ignored_request_parameters.fullmatch("x-request-id")
    with pytest.raises(ParameterError, match=r"'ignored_request_parameters' must be a regular expression .*got 'x-\('"):
        OrchestratorConfig.from_parameters(params(ignored_request_parameters="x-("))


def test_run_batch_isolates_the_failing_item():
    def handler(items):
        if any(item < 0 for item in items):
            raise ValueError(f"negative item in {items}")
        return [item * 10 for item in items]

    assert run_batch([1, 2], handler) == [10, 20]
    results = run_batch([1, -2, 3], handler)
    assert results[0] == 10 and results[2] == 30
    assert isinstance(results[1], ValueError) and "[-2]" in str(results[1])
    (only,) = run_batch([-1], handler)
    assert isinstance(only, ValueError)


def test_recovery_and_expiry_settings_parse_and_reject(tmp_path):
    config = OrchestratorConfig.from_parameters(params(on_stub_failure="stop", health_check_interval_s="2",
                                                       max_request_seconds="30"))  # fmt: skip
    assert (config.on_stub_failure, config.health_check_interval_s, config.max_request_seconds) == ("stop", 2.0, 30.0)
    with pytest.raises(ParameterError, match=r"'on_stub_failure' must be one of \('reload', 'stop'\)"):
        OrchestratorConfig.from_parameters(params(on_stub_failure="restart"))
    with pytest.raises(ParameterError, match="'max_request_seconds' must be a number >= 0"):
        OrchestratorConfig.from_parameters(params(max_request_seconds="-1"))
    (tmp_path / "target").mkdir()
    verifier = TargetVerifierConfig.from_parameters(params(str(tmp_path), target_model="target",
                                                           sequence_idle_timeout_s="0"))  # fmt: skip
    assert verifier.sequence_idle_timeout_s == 0.0
    with pytest.raises(ParameterError, match="'sequence_idle_timeout_s' must be a number >= 0"):
        TargetVerifierConfig.from_parameters(params(str(tmp_path), target_model="target", sequence_idle_timeout_s="x"))


def test_a_draft_holds_as_much_of_a_sequence_as_the_target_serves_unless_told(tmp_path):
    """draft_proposer's empty max_model_len is target_verifier's; model-free methods hold no cache."""
    (tmp_path / "head").mkdir()
    (tmp_path / "target_verifier").mkdir()
    (tmp_path / "target_verifier" / "config.pbtxt").write_text(
        'name: "target_verifier"\nparameters [ { key: "max_model_len" value: { string_value: "4096" } } ]\n')
    base = str(tmp_path)
    for method in ("draft_model", "eagle3", "mlp_speculator"):
        follows = DraftProposerConfig.from_parameters(params(base, method=method, draft_model="head",
                                                             target_model="head", max_model_len=""))  # fmt: skip
        assert follows.max_model_len == 4096, method
        own = DraftProposerConfig.from_parameters(params(base, method=method, draft_model="head",
                                                         target_model="head", max_model_len="8192"))  # fmt: skip
        assert own.max_model_len == 8192
    assert DraftProposerConfig.from_parameters(params(base, method="suffix", max_model_len="")).max_model_len is None
    with pytest.raises(ParameterError, match="max_model_len"):
        DraftProposerConfig.from_parameters(params(base, draft_model="head", max_model_len="0"))
    (tmp_path / "target_verifier" / "config.pbtxt").write_text('name: "target_verifier"\nparameters [ ]\n')
    assert DraftProposerConfig.from_parameters(params(base, draft_model="head")).max_model_len is None
