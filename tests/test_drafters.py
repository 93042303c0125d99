"""Where a drafter runs, read from draft_proposer's config as the models read it, and the drafter built."""
from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from specdec.proposers import DraftModelProposer
from specdec_triton.configs import DraftProposerConfig, TargetVerifierConfig, read_draft_beside_target
from specdec_triton.drafters import build_proposer
from specdec_triton.plumbing import ParameterError, Parameters
from specdec_triton.repository_config import model_settings

DRAFT_CONFIG = """
name: "draft_proposer"
backend: "python"
parameters [
  {{ key: "method" value: {{ string_value: "{method}" }} }},
  {{ key: "draft_model" value: {{ string_value: "{draft}" }} }},
  {{ key: "run_with_target" value: {{ string_value: "{beside}" }} }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""
TINY_DRAFT = str(Path(__file__).resolve().parents[1] / "models" / "tiny-draft")


def write_draft(tmp_path, method="draft_model", beside="true"):
    model_dir = tmp_path / "draft_proposer"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(DRAFT_CONFIG.format(method=method, draft=TINY_DRAFT, beside=beside))
    return tmp_path


def test_target_verifier_loads_a_model_drafter_only_when_it_runs_with_the_target(tmp_path):
    assert read_draft_beside_target(write_draft(tmp_path)).draft_model == TINY_DRAFT
    assert read_draft_beside_target(write_draft(tmp_path, beside="false")) is None
    assert read_draft_beside_target(tmp_path / "elsewhere") is None  # no draft_proposer directory
    for method in ("ngram", "suffix"):  # model-free: the orchestrator runs it, wherever the setting says
        assert read_draft_beside_target(write_draft(tmp_path, method=method)) is None
    warning = DraftProposerConfig("suffix", None, None, None, "auto", "fast", 8, run_with_target=True).unread_settings()
    assert "run_with_target changes nothing for method 'suffix'" in warning[0]


def test_an_unreadable_config_is_refused_naming_the_file(tmp_path):
    (tmp_path / "draft_proposer").mkdir()
    (tmp_path / "draft_proposer" / "config.pbtxt").write_text("parameters [ { key: ")
    with pytest.raises(ParameterError, match="draft_proposer: cannot read .*config.pbtxt"):
        model_settings(tmp_path, "draft_proposer")


@pytest.mark.parametrize("config_type, model, checkpoint", [
    (TargetVerifierConfig, "target_verifier", {"target_model": TINY_DRAFT}),
    (DraftProposerConfig, "draft_proposer", {"draft_model": TINY_DRAFT}),
])  # fmt: skip
def test_the_removed_placement_is_refused_with_where_the_model_runs_now(config_type, model, checkpoint):
    """A repository written before run_in_orchestrator's removal loads with it false, and says what to do with true."""
    config_type.from_parameters(Parameters({**checkpoint, "run_in_orchestrator": "false"}, component=model))
    with pytest.raises(ParameterError, match=rf"{model}: parameter 'run_in_orchestrator' was removed: the target "
                                             r"runs in target_verifier.*run_with_target"):  # fmt: skip
        config_type.from_parameters(Parameters({**checkpoint, "run_in_orchestrator": "true"}, component=model))


def test_a_draft_model_is_built_with_its_description():
    config = DraftProposerConfig(method="draft_model", draft_model=TINY_DRAFT, prompt_lookup_min=None,
                                 prompt_lookup_max=None, dtype="float32", engine="fast", max_num_seqs=1)  # fmt: skip
    loaded = build_proposer(config, "cpu")
    assert isinstance(loaded.proposer, DraftModelProposer) and loaded.description.method == "draft_model"
    assert loaded.description.model == TINY_DRAFT


def test_a_draft_trained_for_fewer_positions_than_its_window_is_refused_with_the_fix():
    """The window often comes from target_verifier: the message says to lower that, not the draft's own."""
    config = DraftProposerConfig(method="draft_model", draft_model=TINY_DRAFT, prompt_lookup_min=None,
                                 prompt_lookup_max=None, dtype="float32", engine="fast", max_num_seqs=1,
                                 max_model_len=4096)  # fmt: skip
    with pytest.raises(ValueError, match=rf"draft model '{re.escape(TINY_DRAFT)}' has max_position_embeddings 2048 "
                                         r"but would hold 4096 tokens .* lower target_verifier's max_model_len to at "
                                         r"most 2048"):  # fmt: skip
        build_proposer(config, "cpu")
    assert build_proposer(replace(config, max_model_len=2048), "cpu").description.max_model_len == 2048


SHIPPED = Path(__file__).resolve().parents[1] / "models"


def write_mlp_repository(tmp_path, num_speculative_tokens: int, extra: str = "", method: str = "mlp_speculator",
                         head: str = "tiny-mlp-speculator"):  # fmt: skip
    for model, parameters in (
        ("speculative_decoding", f'{{ key: "num_speculative_tokens" value: {{ string_value: "{num_speculative_tokens}" }} }}'),
        ("target_verifier", f'{{ key: "target_model" value: {{ string_value: "{SHIPPED / "tiny-target"}" }} }}'),
        ("draft_proposer", f'{{ key: "method" value: {{ string_value: "{method}" }} }}, '
                           f'{{ key: "draft_model" value: {{ string_value: "{SHIPPED / head}" }} }}{extra}'),
    ):  # fmt: skip
        (tmp_path / model).mkdir(parents=True, exist_ok=True)
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"\nparameters [ {parameters} ]\n')
    return DraftProposerConfig.from_parameters(model_settings(tmp_path, "draft_proposer")[0])


def test_an_mlp_speculator_with_fewer_stages_than_a_step_asks_fails_its_load_naming_both(tmp_path):
    """The shipped head has n_predict=3: a repository that drafts 8 would say ready and fail every request."""
    config = write_mlp_repository(tmp_path, 8)
    assert config.most_drafts == 8
    with pytest.raises(ValueError, match=r"has n_predict=3 stages, but a step may ask it for 8 drafts: set "
                                         r"speculative_decoding's num_speculative_tokens .* to at most 3"):  # fmt: skip
        build_proposer(config, "cpu")
    assert build_proposer(write_mlp_repository(tmp_path, 3), "cpu").description.method == "mlp_speculator"
    behind_suffix = write_mlp_repository(tmp_path, 8, ', { key: "enable_suffix_decoding" value: { string_value: '
                                                      '"true" } }, { key: "model_num_speculative_tokens" value: '
                                                      '{ string_value: "2" } }')  # fmt: skip
    assert behind_suffix.most_drafts == 2 and build_proposer(behind_suffix, "cpu").description.method == "mlp_speculator"


def test_mtp_is_served_from_the_targets_own_checkpoint(tmp_path):
    """The shipped target carries an MTP layer; draft_proposer's draft_model is not read for it."""
    loaded = build_proposer(write_mlp_repository(tmp_path, 2, method="mtp", head="tiny-draft"), "cpu")
    assert loaded.description.method == "mtp" and loaded.description.hidden_state_layers == (6,)
    assert loaded.description.model == os.path.realpath(SHIPPED / "tiny-target")
    write_mlp_repository(tmp_path, 2, ', { key: "run_with_target" value: { string_value: "true" } }', method="mtp",
                         head="tiny-draft")  # fmt: skip
    beside = read_draft_beside_target(tmp_path)  # target_verifier loads it beside the target
    assert beside is not None and build_proposer(beside, "cpu").description == loaded.description


def write_tree_repository(tmp_path, method: str, tree: str, num_speculative_tokens: int, extra: str = ""):
    draft = {"eagle3": "tiny-eagle3", "mlp_speculator": "tiny-mlp-speculator"}.get(method, "tiny-draft")
    for model, parameters in (
        ("speculative_decoding", f'{{ key: "num_speculative_tokens" value: {{ string_value: "{num_speculative_tokens}" }} }}'),
        ("target_verifier", f'{{ key: "target_model" value: {{ string_value: "{SHIPPED / "tiny-target"}" }} }}'),
        ("draft_proposer", f'{{ key: "method" value: {{ string_value: "{method}" }} }}, '
                           f'{{ key: "draft_model" value: {{ string_value: "{SHIPPED / draft}" }} }}, '
                           f'{{ key: "speculative_token_tree" value: {{ string_value: "{tree}" }} }}{extra}'),
    ):  # fmt: skip
        (tmp_path / model).mkdir(parents=True, exist_ok=True)
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"\nparameters [ {parameters} ]\n')
    return lambda: DraftProposerConfig.from_parameters(model_settings(tmp_path, "draft_proposer")[0])


TREE = "[(0,), (1,), (0, 0)]"


@pytest.mark.parametrize("method", ["eagle3", "mlp_speculator", "draft_model"])
@pytest.mark.parametrize("beside", [False, True])
def test_a_static_tree_loads_and_reaches_its_proposer(tmp_path, method, beside):
    extra = ', { key: "run_with_target" value: { string_value: "true" } }' if beside else ""
    config = write_tree_repository(tmp_path, method, TREE, 3, extra)()
    assert config.beside_target == beside
    assert config.token_tree.parents == (-1, -1, 0)
    assert build_proposer(config, "cpu").proposer.tree == config.token_tree


@pytest.mark.parametrize("method, tree, k, extra, named", [
    ("eagle3", "[(0,), (0, 0, 0)]", 2, "", "not closed under prefixes"),
    ("eagle3", TREE, 8, "", "has 3 nodes, but num_speculative_tokens is 8"),
    ("eagle3", "[(0,), (1,)", 2, "", "Python literal"),
    ("ngram", TREE, 3, "", "is for methods ['draft_model', 'eagle3', 'mlp_speculator', 'medusa'], not 'ngram'"),
    ("mtp", TREE, 3, "", "is for methods ['draft_model', 'eagle3', 'mlp_speculator', 'medusa'], not 'mtp'"),
    ("suffix", TREE, 3, "", "suffix_decoding_use_tree_spec"),
    ("draft_model", TREE, 3, ', { key: "engine" value: { string_value: "hf" } }', "got engine 'hf'"),
    ("draft_model", TREE, 3, ', { key: "parallel_drafting" value: { string_value: "true" } }', "parallel_drafting true"),
    ("eagle3", TREE, 3, ', { key: "parallel_drafting" value: { string_value: "true" } }', "parallel_drafting true"),
    ("dflash", TREE, 3, "", "is for methods ['draft_model', 'eagle3', 'mlp_speculator', 'medusa'], not 'dflash'"),
])  # fmt: skip
def test_a_bad_tree_fails_the_load_naming_the_key(tmp_path, method, tree, k, extra, named):
    with pytest.raises(ParameterError, match="speculative_token_tree") as err:
        write_tree_repository(tmp_path, method, tree, k, extra)()
    assert named in str(err.value)


def test_a_dynamic_tree_loads_from_sglangs_keys_and_refuses_half_of_them(tmp_path):
    def keys(topk, steps):
        return (f', {{ key: "speculative_eagle_topk" value: {{ string_value: "{topk}" }} }}, '
                f'{{ key: "speculative_num_steps" value: {{ string_value: "{steps}" }} }}')  # fmt: skip

    config = write_tree_repository(tmp_path, "eagle3", "", 8, keys(2, 4))()
    assert (config.token_tree.topk, config.token_tree.depth) == (2, 4)
    assert build_proposer(config, "cpu").proposer.tree == config.token_tree
    with pytest.raises(ParameterError, match="make a dynamic tree together; got 2 and 0"):
        write_tree_repository(tmp_path, "eagle3", "", 8, keys(2, 0))()
    with pytest.raises(ParameterError, match="exclude each other"):
        write_tree_repository(tmp_path, "eagle3", TREE, 3, keys(2, 4))()


def test_medusa_with_fewer_heads_than_a_step_asks_fails_its_load_naming_both(tmp_path):
    """The shipped Medusa head has num_heads=4: a repository that drafts 8 would say ready and fail every request."""
    config = write_mlp_repository(tmp_path, 8, method="medusa", head="tiny-medusa")
    with pytest.raises(ValueError, match=r"Medusa head .* has num_heads=4 heads, but a step may ask it for 8 drafts: "
                                         r"set speculative_decoding's num_speculative_tokens .* to at most 4"):  # fmt: skip
        build_proposer(config, "cpu")
    loaded = build_proposer(write_mlp_repository(tmp_path, 4, method="medusa", head="tiny-medusa"), "cpu")
    assert loaded.description.method == "medusa" and loaded.description.hidden_state_layers == (6,)


def test_dflash_asked_more_drafts_than_its_block_holds_fails_its_load_naming_block_size(tmp_path):
    """The shipped drafter has block_size=9: the last token and 8 masks, so at most 8 drafts a step."""
    config = write_mlp_repository(tmp_path, 9, method="dflash", head="tiny-dflash")
    with pytest.raises(ValueError, match=r"DFlash drafter .* has block_size=9 \(the last token and 8 masks\), but a "
                                         r"step may ask it for 9 drafts: set speculative_decoding's "
                                         r"num_speculative_tokens .* to at most 8"):  # fmt: skip
        build_proposer(config, "cpu")
    loaded = build_proposer(write_mlp_repository(tmp_path, 8, method="dflash", head="tiny-dflash"), "cpu")
    assert loaded.description.method == "dflash" and loaded.description.hidden_state_layers == (2, 4, 6)


def test_target_verifier_warms_tree_passes_only_when_the_drafter_makes_trees(tmp_path):
    from specdec_triton.drafters import drafts_trees

    write_tree_repository(tmp_path / "static", "eagle3", TREE, 3)
    write_tree_repository(tmp_path / "chain", "eagle3", "", 3)
    write_tree_repository(tmp_path / "suffix", "suffix", "", 3, ', { key: "suffix_decoding_use_tree_spec" value: '
                                                                 '{ string_value: "true" } }')  # fmt: skip
    write_tree_repository(tmp_path / "bad", "ngram", TREE, 3)  # its own load names the fault
    assert [drafts_trees(tmp_path / name) for name in ("static", "chain", "suffix", "bad", "none")] == [
        True, False, True, False, False]
