"""The target loaded in the orchestrator's process, when target_verifier's config asks for it.

``run_in_orchestrator: true`` in ``target_verifier/config.pbtxt`` moves the target's
weights and KV cache into ``speculative_decoding``'s process, which then verifies with a
function call instead of a BLS request per step (:mod:`specdec_triton.verify_in_process`
says what that saves). The target stays configured in one place: the orchestrator reads
target_verifier's ``config.pbtxt`` from the repository directory, with the
``speculative_config`` overrides the model itself would apply, and checks it with the same
:class:`~specdec_triton.configs.TargetVerifierConfig`. The device follows target_verifier's
``instance_group``: ``KIND_GPU`` its first listed GPU (0 if none is listed), ``KIND_AUTO``
GPU 0 when one is visible, otherwise the CPU. Without the setting (or without a
target_verifier directory) nothing here is checked: target_verifier checks its own
configuration when it loads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.types import ModelDescription
from specdec.verifier import TargetVerifier
from specdec_triton import speculative_config, wire
from specdec_triton.configs import TargetVerifierConfig
from specdec_triton.plumbing import ParameterError, Parameters

SETTING = "run_in_orchestrator"


@dataclass(frozen=True)
class TargetHere:
    config: TargetVerifierConfig
    device: str


@dataclass(frozen=True)
class LoadedTarget:
    verifier: TargetVerifier
    description: ModelDescription


def _model_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig(), allow_unknown_field=True)
    except (OSError, text_format.ParseError) as err:
        raise ParameterError(f"{wire.TARGET_VERIFIER}: cannot read {path}: {err}") from None


def _parameters(repository_dir: Path, config) -> Parameters:
    raw = {key: value.string_value for key, value in config.parameters.items()}
    raw = speculative_config.apply(wire.TARGET_VERIFIER, raw, str(repository_dir))
    model_dir = repository_dir / wire.TARGET_VERIFIER
    return Parameters(raw, base_dir=str(repository_dir), component=wire.TARGET_VERIFIER, model_dir=str(model_dir))


def read_target_config(repository_dir: str | os.PathLike) -> TargetHere | None:
    """target_verifier's settings as that model would read them, and the device its instance_group names,
    when it sets ``run_in_orchestrator``; None when it does not, or when there is no target_verifier here
    (a repository laid out otherwise: the BLS describe names what is missing)."""
    repository_dir = Path(repository_dir)
    path = repository_dir / wire.TARGET_VERIFIER / "config.pbtxt"
    if not path.is_file():
        return None
    config = _model_config(path)
    params = _parameters(repository_dir, config)
    if not params.get_bool(SETTING, False):
        return None  # target_verifier checks the rest of its configuration itself
    return TargetHere(TargetVerifierConfig.from_parameters(params), _device(config.instance_group))


def _device(instance_groups) -> str:
    from tritonclient.grpc import model_config_pb2

    kind = model_config_pb2.ModelInstanceGroup
    for group in instance_groups:
        gpu = group.kind == kind.KIND_GPU or (group.kind == kind.KIND_AUTO and torch.cuda.is_available())
        if gpu:
            return f"cuda:{group.gpus[0] if group.gpus else 0}"
        if group.kind in (kind.KIND_CPU, kind.KIND_AUTO):
            return "cpu"
    return "cuda:0" if torch.cuda.is_available() else "cpu"  # no instance_group: Triton's KIND_AUTO default


def load_target_here(repository_dir: str | os.PathLike, log=None) -> LoadedTarget | None:
    """The target built here when target_verifier sets ``run_in_orchestrator``; None when it does not."""
    here = read_target_config(repository_dir)
    if here is None:
        return None
    config = here.config
    lm = build_lm(config.target_model, config.engine, config.dtype, here.device, config.max_num_seqs,
                  config.max_model_len, log=log, cpu_compile=config.cpu_compile)  # fmt: skip
    return LoadedTarget(TargetVerifier(lm), describe_lm(lm, config.target_model, "target"))
