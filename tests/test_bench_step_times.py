"""The served benchmark reads each model's settings as the model does."""
from __future__ import annotations

import shutil
from pathlib import Path

from bench.phase import PROPOSER_MODEL, TARGET_MODEL
from bench.step_times import server_compiles, server_parameter

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"


def test_a_models_parameter_is_read_from_its_config_or_defaulted(tmp_path):
    assert server_parameter(REPOSITORY, TARGET_MODEL, "engine", "hf") == "fast"
    assert server_parameter(REPOSITORY, TARGET_MODEL, "no_such_key", "given") == "given"
    assert server_parameter(tmp_path, TARGET_MODEL, "engine", "given") == "given"  # no config.pbtxt there


def test_cpu_compile_is_read_as_the_model_reads_a_boolean(tmp_path):
    assert server_compiles(REPOSITORY, TARGET_MODEL) and server_compiles(REPOSITORY, PROPOSER_MODEL)
    shutil.copytree(REPOSITORY / TARGET_MODEL, tmp_path / TARGET_MODEL, ignore=shutil.ignore_patterns("*.py"))
    config = tmp_path / TARGET_MODEL / "config.pbtxt"
    shipped = '{ key: "cpu_compile" value: { string_value: "true" } }'
    assert shipped in config.read_text()
    config.write_text(config.read_text().replace(shipped, shipped.replace("true", "off")))
    assert not server_compiles(tmp_path, TARGET_MODEL)
    config.write_text(config.read_text().replace(shipped.replace("true", "off"), ""))
    assert not server_compiles(tmp_path, TARGET_MODEL)  # the default
