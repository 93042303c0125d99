"""Proposer strategies, one per file, behind the ``Proposer`` protocol.

Names are imported on first use (PEP 562): a process that needs one proposer, or only
the model-free ones, does not import every drafter's model code.
"""
from __future__ import annotations

import importlib

# method -> (module, class): one proposer class per method of specdec.methods.METHODS, in its order
_PROPOSER_CLASSES = {
    "draft_model": ("draft_model", "DraftModelProposer"),
    "ngram": ("ngram", "NgramProposer"),
    "suffix": ("suffix", "SuffixProposer"),
    "eagle3": ("eagle3", "Eagle3Proposer"),  # reads the target's hidden states (specdec.heads)
    "mlp_speculator": ("mlp_speculator", "MLPSpeculatorProposer"),
    "medusa": ("medusa", "MedusaProposer"),
    "mtp": ("mtp", "MTPProposer"),  # the target's own MTP layer (specdec.heads.mtp)
    "dflash": ("dflash", "DFlashProposer"),
}
# every other public name -> its module
_NAMES = {
    **{cls: module for module, cls in _PROPOSER_CLASSES.values()},
    "Proposer": "base",
    "check_propose_requests": "base",
    "check_draft_compatible": "draft_model",
    "MODEL_FREE_METHODS": "model_free",
    "describe_model_free": "model_free",
    "model_free_proposer": "model_free",
    "NGRAM_DESCRIPTION": "ngram",
    "read_mask_token": "pard",
    "ParallelDraftProposer": "pard",
    "PEagleProposer": "peagle",  # eagle3 with parallel_drafting: a P-EAGLE head
    "SUFFIX_DESCRIPTION": "suffix",
    "SuffixConfig": "suffix",
}


def proposer_class(method: str) -> type:
    """The proposer class of ``method``, its module imported now."""
    if method not in _PROPOSER_CLASSES:
        raise ValueError(f"method must be one of {tuple(_PROPOSER_CLASSES)}, got {method!r}")
    module, cls = _PROPOSER_CLASSES[method]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_proposer(method: str, **kwargs):
    """Build the proposer named ``method`` with its constructor's keyword arguments."""
    return proposer_class(method)(**kwargs)


def __getattr__(name: str):
    if name == "PROPOSERS":  # method -> class, every drafter imported
        return {method: proposer_class(method) for method in _PROPOSER_CLASSES}
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PROPOSERS", "make_proposer", "proposer_class", *_NAMES]
