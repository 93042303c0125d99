"""Composing models loaded in the orchestrator's process, when their config asks for it.

``run_in_orchestrator: true`` in ``target_verifier/config.pbtxt`` moves the target's
weights and KV cache into ``speculative_decoding``'s process, which then verifies with a
function call instead of a BLS request per step; the same setting in
``draft_proposer/config.pbtxt`` does so for a draft model or head
(:mod:`specdec_triton.in_process` says what that saves). ngram and suffix run in the
orchestrator's process always (:mod:`specdec.proposers.model_free`), so for them the
setting changes nothing.

Each model stays configured in one place: the orchestrator reads the model's
``config.pbtxt`` from the repository directory, with the ``speculative_config`` overrides
the model itself would apply, and checks it with the same config class. The device
follows the model's ``instance_group``: ``KIND_GPU`` its first listed GPU (0 if none is
listed), ``KIND_AUTO`` GPU 0 when one is visible, otherwise the CPU. Without the setting
(or without the model's directory) nothing more is checked here: the model checks its own
configuration when it loads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.fast.checkpoint import read_config
from specdec.heads import HEAD_METHODS, build_head_proposer, describe_head
from specdec.proposers import DraftModelProposer, NgramProposer, SuffixProposer, describe_model_free
from specdec.types import ModelDescription
from specdec.verifier import TargetVerifier
from specdec_triton import wire
from specdec_triton.configs import DraftProposerConfig, TargetVerifierConfig
from specdec_triton.plumbing import Parameters
from specdec_triton.repository_config import model_settings

SETTING = "run_in_orchestrator"
MODEL_FREE = ("ngram", "suffix")  # run in the orchestrator's process whatever the setting says


@dataclass(frozen=True)
class SettingsHere:
    """A model's settings, read as the model would, and the device its instance_group names."""

    config: TargetVerifierConfig | DraftProposerConfig
    device: str


@dataclass(frozen=True)
class LoadedTarget:
    verifier: TargetVerifier
    description: ModelDescription


@dataclass(frozen=True)
class LoadedDraft:
    proposer: object  # a specdec Proposer: DraftModelProposer, Eagle3Proposer or MLPSpeculatorProposer
    description: ModelDescription


def build_proposer(config: DraftProposerConfig, device: str, log=None) -> LoadedDraft:
    """The proposer ``config`` names, and its description: what draft_proposer serves, wherever it runs."""
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        return LoadedDraft(proposer, describe_model_free(proposer))
    if config.method == "suffix":
        proposer = SuffixProposer(config.suffix)
        return LoadedDraft(proposer, describe_model_free(proposer))
    if config.method in HEAD_METHODS:
        proposer = build_head_proposer(config.method, config.draft_model, config.target_model, config.dtype, device,
                                       config.max_num_seqs, config.cpu_compile, max_model_len=config.max_model_len)
        return LoadedDraft(proposer, _with_suffix_first(describe_head(proposer, config.draft_model), config))
    _check_draft_window(config)
    lm = build_lm(config.draft_model, config.engine, config.dtype, device, config.max_num_seqs, config.max_model_len,
                  log=log, cpu_compile=config.cpu_compile)  # fmt: skip
    description = describe_lm(lm, config.draft_model, "draft_model")
    return LoadedDraft(DraftModelProposer(lm), _with_suffix_first(description, config))


def _with_suffix_first(description: ModelDescription, config: DraftProposerConfig) -> ModelDescription:
    """A model's description, carrying suffix decoding's settings when it runs in front (the orchestrator runs it)."""
    if config.suffix_first is None:
        return description
    return replace(description, settings=config.suffix_first.settings())


def _check_draft_window(config: DraftProposerConfig) -> None:
    """A fast-engine draft trained for fewer positions than its window (often target_verifier's) is refused
    with the fix, before the engine's own refusal, which names only the draft's setting."""
    if config.max_model_len is None or config.engine != "fast":
        return
    positions = read_config(config.draft_model).max_position_embeddings
    if config.max_model_len > positions:
        raise ValueError(
            f"draft model {config.draft_model!r} has max_position_embeddings {positions} but would hold "
            f"{config.max_model_len} tokens of a sequence (draft_proposer's max_model_len, or target_verifier's "
            f"where that is empty): lower target_verifier's max_model_len to at most {positions}, or serve a "
            f"draft trained for as many positions as the target serves"
        )


def _settings_here(repository_dir: str | os.PathLike, model: str) -> tuple[Parameters, str] | None:
    """``model``'s parameters as it would read them and the device of its instance_group, when it sets
    ``run_in_orchestrator``; None when it does not, or when the repository has no such model (a
    repository laid out otherwise: the BLS describe names what is missing)."""
    found = model_settings(repository_dir, model)
    if found is None:
        return None
    params, config = found
    if not params.get_bool(SETTING, False):
        return None  # the model checks the rest of its configuration itself
    return params, _device(config.instance_group)


def read_target_config(repository_dir: str | os.PathLike) -> SettingsHere | None:
    """target_verifier's settings when it sets ``run_in_orchestrator``, else None."""
    found = _settings_here(repository_dir, wire.TARGET_VERIFIER)
    return None if found is None else SettingsHere(TargetVerifierConfig.from_parameters(found[0]), found[1])


def read_draft_config(repository_dir: str | os.PathLike) -> SettingsHere | None:
    """draft_proposer's settings when it sets ``run_in_orchestrator`` for a draft model or head, or
    ``run_with_target`` while the target runs here; else None."""
    found = model_settings(repository_dir, wire.DRAFT_PROPOSER)
    if found is None:
        return None
    params, model_config = found
    if params.get_bool(SETTING, False):
        device = _device(model_config.instance_group)
    elif params.get_bool("run_with_target", False) and (target := read_target_config(repository_dir)) is not None:
        device = target.device  # beside the target, on its device
    else:
        return None  # the model checks the rest of its configuration itself
    config = DraftProposerConfig.from_parameters(params)
    return None if config.method in MODEL_FREE else SettingsHere(config, device)


def read_draft_beside_target(repository_dir: str | os.PathLike) -> DraftProposerConfig | None:
    """draft_proposer's settings when target_verifier's process is to load its draft model or head
    (``run_with_target``, the target not in the orchestrator's process), else None."""
    found = model_settings(repository_dir, wire.DRAFT_PROPOSER)
    if found is None or not found[0].get_bool("run_with_target", False) or read_target_config(repository_dir):
        return None
    config = DraftProposerConfig.from_parameters(found[0])
    return config if config.beside_target else None


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


def load_draft_here(repository_dir: str | os.PathLike, log=None) -> LoadedDraft | None:
    """The draft model or head built here when draft_proposer sets ``run_in_orchestrator``; None when it
    does not, or when its method is ngram or suffix (they run here anyway)."""
    here = read_draft_config(repository_dir)
    return None if here is None else build_proposer(here.config, here.device, log)
