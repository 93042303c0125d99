"""Another model's settings, read from the model repository as that model would read them.

A model of the repository sometimes needs a setting another model owns: target_verifier
loads the draft beside the target with draft_proposer's settings (``run_with_target``), and a
draft head drafts for the checkpoint ``target_verifier`` serves. Reading that model's
``config.pbtxt`` here, with the ``speculative_config`` overrides it would apply, keeps the
setting in one place instead of a copy that can drift.
"""
from __future__ import annotations

import os
from pathlib import Path

from specdec_triton import speculative_config
from specdec_triton.plumbing import ParameterError, Parameters


def read_model_config(path: Path, model: str):
    """``path`` (a ``config.pbtxt``) as Triton's ``ModelConfig`` message; a clear error if it cannot be read."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig(), allow_unknown_field=True)
    except (OSError, text_format.ParseError) as err:
        raise ParameterError(f"{model}: cannot read {path}: {err}") from None


def model_settings(repository_dir: str | os.PathLike, model: str):
    """``model``'s (parameters as it would read them, its ``ModelConfig``), or None when the
    repository has no ``<model>/config.pbtxt``."""
    repository_dir = Path(repository_dir)
    path = repository_dir / model / "config.pbtxt"
    if not path.is_file():
        return None
    config = read_model_config(path, model)
    raw = {key: value.string_value for key, value in config.parameters.items()}
    raw = speculative_config.apply(model, raw, str(repository_dir))
    return Parameters(raw, base_dir=str(repository_dir), component=model, model_dir=str(repository_dir / model)), config
