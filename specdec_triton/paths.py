"""Checkpoint and tokenizer paths in ``config.pbtxt``: the rule that lets a repository move.

A copy of ``model_repository/`` (the way to tune it) must still find its checkpoints,
so a path parameter is resolved in this order:

1. ``$$TRITON_MODEL_DIRECTORY`` at its start is the model's own directory (Triton's
   spelling; the Python backend expands it only in ``EXECUTION_ENV_PATH``, so it is
   expanded here): a checkpoint kept inside the model directory travels with a copy.
2. ``${NAME}`` is the environment variable ``NAME``; unset or empty fails the load,
   naming it, except ``SPECDEC_MODELS_DIR``, which defaults to ``models/`` beside the
   repository (the checkout's layout), so ``tritonserver --model-repository
   model_repository`` works in a checkout as it is. The shipped configs name
   ``${SPECDEC_MODELS_DIR}/tiny-target``; the container images set it to the models
   they carry, and a copy elsewhere sets it (or names absolute paths).
3. What is then still relative resolves against the model repository directory.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
MODELS_DIR_VARIABLE = "SPECDEC_MODELS_DIR"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def resolve_path(
    value: str,
    repository_dir: str | None,
    model_dir: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """``value`` as a normalized path by the rule above; ValueError names what is missing."""
    if value.startswith(MODEL_DIRECTORY):
        if model_dir is None:
            raise ValueError(f"{MODEL_DIRECTORY} needs the model's directory, and none is known here")
        value = model_dir + value[len(MODEL_DIRECTORY) :]

    def variable(match: re.Match) -> str:
        name = match.group(1)
        if name == MODELS_DIR_VARIABLE and not environ.get(name) and repository_dir is not None:
            return os.path.join(repository_dir, os.pardir, "models")
        if not environ.get(name):
            hint = " (scripts/serve.sh sets it to the checkout's models/)" if name == MODELS_DIR_VARIABLE else ""
            raise ValueError(f"environment variable {name} is not set{hint}")
        return environ[name]

    value = _VARIABLE.sub(variable, value)
    if os.path.isabs(value) or repository_dir is None:
        return os.path.normpath(value)
    return os.path.normpath(os.path.join(repository_dir, value))
