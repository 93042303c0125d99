"""scripts/new_repository.py, and the path rule that lets a copied repository find its checkpoints."""
from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from bench.repository import get_parameters
from specdec_triton import configs
from specdec_triton.plumbing import ParameterError, Parameters

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = REPO_ROOT / "models"
_spec = importlib.util.spec_from_file_location("new_repository", REPO_ROOT / "scripts" / "new_repository.py")
new_repository = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(new_repository)


def parameters(repository: Path, model: str) -> dict[str, str]:
    return get_parameters((repository / model / "config.pbtxt").read_text())


def path_parameters(repository: Path) -> dict[tuple[str, str], str]:
    return {(model, key): parameters(repository, model)[key]
            for model, keys in new_repository.PATH_PARAMETERS.items() for key in keys}  # fmt: skip


def test_a_copy_gets_absolute_checkpoint_paths_and_serves_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_MODELS_DIR", raising=False)
    target, draft = tmp_path / "ckpt" / "target", tmp_path / "ckpt" / "draft"
    shutil.copytree(MODELS / "tiny-target", target)
    shutil.copytree(MODELS / "tiny-draft", draft)
    dest = tmp_path / "elsewhere" / "repo"
    argv = [str(dest), "--target", str(target), "--draft", str(draft), "--param", "target_verifier.max_num_seqs=3"]
    assert new_repository.main(argv) == 0
    assert path_parameters(dest) == {
        ("tokenizer", "tokenizer_dir"): str(target), ("detokenizer", "tokenizer_dir"): str(target),
        ("draft_proposer", "draft_model"): str(draft), ("draft_proposer", "target_model"): "",
        ("target_verifier", "target_model"): str(target),
    }  # fmt: skip
    assert parameters(dest, "target_verifier")["max_num_seqs"] == "3"
    source = REPO_ROOT / "model_repository"
    assert sorted(p.relative_to(dest) for p in dest.rglob("*.py")) == sorted(
        p.relative_to(source) for p in source.rglob("*.py") if "__pycache__" not in p.parts)
    # every model's own config class accepts the copy, with the variable unset
    verifier = configs.TargetVerifierConfig.from_parameters(
        Parameters(parameters(dest, "target_verifier"), str(dest), "target_verifier"))
    assert (verifier.target_model, verifier.max_num_seqs) == (str(target), 3)
    new_repository.check_configs(dest)


def test_without_checkpoint_flags_the_copy_points_at_the_shipped_pair(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_MODELS_DIR", raising=False)
    assert new_repository.main([str(tmp_path / "repo"), "--ngram"]) == 0
    paths = path_parameters(tmp_path / "repo")
    assert paths[("target_verifier", "target_model")] == str(MODELS / "tiny-target")
    assert paths[("draft_proposer", "draft_model")] == str(MODELS / "tiny-draft")
    assert parameters(tmp_path / "repo", "draft_proposer")["method"] == "ngram"


def test_a_plain_copy_resolves_through_the_variable(tmp_path, monkeypatch):
    """``cp -r model_repository`` anywhere: the shipped paths follow SPECDEC_MODELS_DIR, not the copy's place."""
    copy = tmp_path / "deep" / "copy"
    shutil.copytree(REPO_ROOT / "model_repository", copy)
    monkeypatch.setenv("SPECDEC_MODELS_DIR", str(MODELS))
    new_repository.check_configs(copy)
    raw = parameters(copy, "target_verifier")
    assert Parameters(raw, str(copy)).get_path("target_model", None) == str(MODELS / "tiny-target")
    monkeypatch.delenv("SPECDEC_MODELS_DIR")
    with pytest.raises(ParameterError, match="set SPECDEC_MODELS_DIR to the directory holding it"):
        new_repository.check_configs(copy)


def test_bad_input_fails_naming_it_and_leaves_no_copy(tmp_path, capsys):
    dest = tmp_path / "repo"
    assert new_repository.main([str(dest), "--param", "target_verifier.dtype=fp8"]) == 1
    assert "bad parameter: target_verifier: parameter 'dtype' must be one of" in capsys.readouterr().err
    assert not dest.exists()
    assert new_repository.main([str(dest), "--param", "target_verifier.max_num_seq=4"]) == 1
    assert "no parameter 'max_num_seq'; it declares" in capsys.readouterr().err
    assert not dest.exists()
    for argv, message in (([str(tmp_path)], "exists; name a new directory"),
                          ([str(dest), "--draft", str(tmp_path / "no")], "--draft .*no: no such path"),
                          ([str(dest), "--draft", str(MODELS / "tiny-draft"), "--ngram"], "not allowed with"),
                          ([str(dest), "--eagle3", str(tmp_path / "no")], "--eagle3 .*no: no such path")):  # fmt: skip
        with pytest.raises(SystemExit):
            new_repository.main(argv)
        assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("flag, method, head", [("--eagle3", "eagle3", "tiny-eagle3"),
                                                ("--mlp-speculator", "mlp_speculator", "tiny-mlp-speculator"),
                                                ("--medusa", "medusa", "tiny-medusa")])
def test_a_head_is_served_for_the_target_it_names_and_checked_against_it(tmp_path, monkeypatch, flag, method, head):
    """The proposer checks a head against its own target_model: --target must reach it too."""
    monkeypatch.delenv("SPECDEC_MODELS_DIR", raising=False)
    target = tmp_path / "ckpt" / "target"
    shutil.copytree(MODELS / "tiny-target", target)
    dest = tmp_path / "repo"
    assert new_repository.main([str(dest), "--target", str(target), flag, str(MODELS / head)]) == 0
    proposer = parameters(dest, "draft_proposer")
    assert (proposer["method"], proposer["draft_model"], proposer["target_model"]) == (method, str(MODELS / head), "")
    raw = Parameters(proposer, str(dest), "draft_proposer", str(dest / "draft_proposer"))
    assert configs.DraftProposerConfig.from_parameters(raw).target_model == str(target)  # target_verifier's


def test_a_head_of_another_kind_or_for_another_target_is_refused_before_any_copy(tmp_path, capsys):
    dest = tmp_path / "repo"
    assert new_repository.main([str(dest), "--eagle3", str(MODELS / "tiny-mlp-speculator")]) == 1
    assert "is a mlp_speculator checkpoint, not eagle3" in capsys.readouterr().err
    assert not dest.exists()
    other = tmp_path / "other-target"  # the draft's shape: a narrower model than the heads were built for
    shutil.copytree(MODELS / "tiny-draft", other)
    for flag, head in (("--eagle3", "tiny-eagle3"), ("--mlp-speculator", "tiny-mlp-speculator"),
                       ("--medusa", "tiny-medusa")):  # fmt: skip
        assert new_repository.main([str(dest), "--target", str(other), flag, str(MODELS / head)]) == 1
        assert f"does not fit target {str(other)!r}" in capsys.readouterr().err
        assert not dest.exists()


def test_a_copy_for_an_mlp_speculator_drafts_at_most_its_n_predict(tmp_path, capsys):
    """The shipped k (8) and table are cut to n_predict, and said so; set above it, the copy is refused."""
    head = MODELS / "tiny-mlp-speculator"
    assert new_repository.main([str(tmp_path / "repo"), "--mlp-speculator", str(head)]) == 0
    orchestrator = parameters(tmp_path / "repo", "speculative_decoding")
    assert (orchestrator["num_speculative_tokens"], orchestrator["num_speculative_tokens_per_batch_size"]) == ("3", "1:3,5:0")
    assert "num_speculative_tokens 8 -> 3" in capsys.readouterr().out
    argv = [str(tmp_path / "refused"), "--mlp-speculator", str(head), "--param", "speculative_decoding.num_speculative_tokens=4",
            "--param", "speculative_decoding.num_speculative_tokens_per_batch_size=1:4"]
    assert new_repository.main(argv) == 1
    assert re.search(r"up to 4 drafts a step.*n_predict=3", capsys.readouterr().err)
    assert not (tmp_path / "refused").exists()
    argv = [str(tmp_path / "given"), "--mlp-speculator", str(head), "--param", "speculative_decoding.num_speculative_tokens=2",
            "--param", "speculative_decoding.num_speculative_tokens_per_batch_size=1:2,3:1"]
    assert new_repository.main(argv) == 0 and "num_speculative_tokens" not in capsys.readouterr().out  # nothing cut
    assert parameters(tmp_path / "given", "speculative_decoding")["num_speculative_tokens_per_batch_size"] == "1:2,3:1"


def test_a_copy_for_medusa_drafts_at_most_its_num_heads(tmp_path, capsys):
    head = MODELS / "tiny-medusa"
    assert new_repository.main([str(tmp_path / "repo"), "--medusa", str(head)]) == 0
    orchestrator = parameters(tmp_path / "repo", "speculative_decoding")
    assert (orchestrator["num_speculative_tokens"], orchestrator["num_speculative_tokens_per_batch_size"]) == ("4", "1:4,5:0")
    assert "num_speculative_tokens 8 -> 4 and num_speculative_tokens_per_batch_size '1:8,5:0' -> '1:4,5:0', the Medusa " \
           "head's num_heads=4" in capsys.readouterr().out
    argv = [str(tmp_path / "refused"), "--medusa", str(head), "--param", "speculative_decoding.num_speculative_tokens=6"]
    assert new_repository.main(argv) == 1
    assert re.search(r"up to 8 drafts a step, but the Medusa head .* num_heads=4", capsys.readouterr().err)


def test_a_copy_with_another_method_says_whose_k_it_keeps(tmp_path, capsys):
    assert new_repository.main([str(tmp_path / "repo"), "--eagle3", str(MODELS / "tiny-eagle3")]) == 0
    assert "kept num_speculative_tokens 8 and num_speculative_tokens_per_batch_size '1:8,5:0'" in capsys.readouterr().out
    assert new_repository.main([str(tmp_path / "same"), "--suffix"]) == 0  # the shipped method: nothing to say
    assert "note" not in capsys.readouterr().out


def test_a_copy_that_drafts_with_a_model_follows_acceptance_unless_told_not_to(tmp_path, capsys):
    assert parameters(REPO_ROOT / "model_repository", "speculative_decoding")["speculation_follows_acceptance"] == "false"
    assert new_repository.main([str(tmp_path / "eagle3"), "--eagle3", str(MODELS / "tiny-eagle3")]) == 0
    assert "speculation_follows_acceptance false -> true" in capsys.readouterr().out
    assert parameters(tmp_path / "eagle3", "speculative_decoding")["speculation_follows_acceptance"] == "true"
    assert new_repository.main([str(tmp_path / "ngram"), "--ngram"]) == 0  # model-free: as shipped
    assert parameters(tmp_path / "ngram", "speculative_decoding")["speculation_follows_acceptance"] == "false"
    told = ["--param", "speculative_decoding.speculation_follows_acceptance=false"]
    assert new_repository.main([str(tmp_path / "told"), "--eagle3", str(MODELS / "tiny-eagle3"), *told]) == 0
    assert parameters(tmp_path / "told", "speculative_decoding")["speculation_follows_acceptance"] == "false"
