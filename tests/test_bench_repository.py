"""bench/repository.py: model repository variants."""
from __future__ import annotations

import pytest

from pathlib import Path

from bench.repository import get_parameters, make_variant, parameter_edits, set_parameters

REPO_ROOT = Path(__file__).resolve().parent.parent


PBTXT = """name: "draft_proposer"
backend: "python"
parameters: {
  key: "method"
  value: { string_value: "draft_model" }
}
parameters [
  { key: "draft_model", value: { string_value: "../models/tiny-draft" } },
  { key: "num_speculative_tokens" value: {string_value: "4"} }
]
"""


def test_get_and_set_parameters():
    assert get_parameters(PBTXT) == {"method": "draft_model", "draft_model": "../models/tiny-draft",
                                     "num_speculative_tokens": "4"}
    edited = set_parameters(PBTXT, {"method": "ngram", "draft_model": '/abs/"q"'})
    assert get_parameters(edited) == {"method": "ngram", "draft_model": '/abs/\\"q\\"', "num_speculative_tokens": "4"}
    assert edited.replace("ngram", "draft_model").replace('/abs/\\"q\\"', "../models/tiny-draft") == PBTXT
    with pytest.raises(KeyError, match="no parameter 'methd'.*'method'"):
        set_parameters(PBTXT, {"methd": "ngram"})


def test_parameter_edits_from_the_command_line():
    settings = ["speculative_decoding.micro_batches=1", "draft_proposer.method=ngram", "draft_proposer.k=a=b"]
    assert parameter_edits(settings) == {
        "speculative_decoding": {"micro_batches": "1"},
        "draft_proposer": {"method": "ngram", "k": "a=b"},  # the value is everything after the first '='
    }
    for bad in ("micro_batches=1", "speculative_decoding.micro_batches", ".x=1"):
        with pytest.raises(ValueError, match="--param must look like MODEL.KEY=VALUE"):
            parameter_edits([bad])


def test_make_variant_copies_edits_and_makes_relative_paths_absolute(tmp_path):
    src = tmp_path / "repo"
    (src / "draft_proposer" / "1").mkdir(parents=True)
    (tmp_path / "models" / "tiny-draft").mkdir(parents=True)
    (src / "draft_proposer" / "config.pbtxt").write_text(PBTXT)
    (src / "draft_proposer" / "1" / "model.py").write_text("pass\n")
    dest = make_variant(src, tmp_path / "elsewhere" / "variant", {"draft_proposer": {"method": "ngram"}})
    params = get_parameters((dest / "draft_proposer" / "config.pbtxt").read_text())
    assert params == {"method": "ngram", "draft_model": str(tmp_path / "models" / "tiny-draft"),
                      "num_speculative_tokens": "4"}
    assert (dest / "draft_proposer" / "1" / "model.py").read_text() == "pass\n"
    assert (src / "draft_proposer" / "config.pbtxt").read_text() == PBTXT
    with pytest.raises(KeyError, match="no model 'nope'.*draft_proposer"):
        make_variant(src, tmp_path / "v2", {"nope": {}})


def test_the_repeat_benchmark_serves_each_config_from_a_repository_of_its_own(tmp_path):
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_repeat", REPO_ROOT / "scripts" / "benchmark_repeat.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    models = REPO_ROOT / "models"
    args = argparse.Namespace(target=models / "tiny-target", draft=models / "tiny-draft", head=models / "tiny-eagle3",
                              repository=REPO_ROOT / "model_repository", model_k=3, suffix_min_score=None)  # fmt: skip
    plain = script.server_repository(args, "eagle3", 4, tmp_path)
    assert get_parameters((plain / "draft_proposer" / "config.pbtxt").read_text())["method"] == "eagle3"
    suffix_first = get_parameters((script.server_repository(args, "eagle3+suffix", 8, tmp_path) / "draft_proposer"
                                   / "config.pbtxt").read_text())  # fmt: skip
    assert (suffix_first["method"], suffix_first["enable_suffix_decoding"]) == ("eagle3", "true")
    assert suffix_first["model_num_speculative_tokens"] == "3" and suffix_first["run_with_target"] == "false"
    assert get_parameters((plain / "draft_proposer" / "config.pbtxt").read_text())["enable_suffix_decoding"] == "false"
    beside = get_parameters((script.server_repository(args, "eagle3+suffix+beside", 8, tmp_path) / "draft_proposer"
                             / "config.pbtxt").read_text())  # fmt: skip
    assert (beside["run_with_target"], beside["enable_suffix_decoding"], beside["method"]) == ("true", "true", "eagle3")
    assert get_parameters((plain / "draft_proposer" / "config.pbtxt").read_text())["run_with_target"] == "false"


def test_the_served_benchmark_points_each_method_at_its_checkpoint_and_the_target(tmp_path):
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark", REPO_ROOT / "scripts" / "benchmark.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    target, draft, eagle3, mlp, medusa, dflash = (tmp_path / name for name in ("target", "draft", "eagle3", "mlp",
                                                                               "medusa", "dflash"))  # fmt: skip
    args = argparse.Namespace(target=target, draft=draft, eagle3=eagle3, mlp_speculator=mlp, medusa=medusa,
                              dflash=dflash, ks=[2], synthetic_acceptance_rate=None)  # fmt: skip
    for method, checkpoint in (("draft_model", draft), ("eagle3", eagle3), ("mlp_speculator", mlp),
                               ("medusa", medusa), ("dflash", dflash), ("ngram", None)):  # fmt: skip
        proposer = script.server_edits(args, method, shipped_k=4, fixed=True)["draft_proposer"]
        assert proposer["method"] == method
        assert proposer["target_model"] == ""  # a head drafts for target_verifier's, which is the target
        assert script.server_edits(args, method, 4, True)["target_verifier"]["target_model"] == str(target.resolve())
        assert proposer.get("draft_model") == (str(checkpoint.resolve()) if checkpoint else None)
