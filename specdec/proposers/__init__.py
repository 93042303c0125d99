"""Proposer strategies, one per file, behind the ``Proposer`` protocol."""
from __future__ import annotations

from specdec.proposers.base import Proposer, check_propose_requests
from specdec.proposers.dflash import DFlashProposer
from specdec.proposers.draft_model import DraftModelProposer, check_draft_compatible
from specdec.proposers.eagle3 import Eagle3Proposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.mlp_speculator import MLPSpeculatorProposer
from specdec.proposers.model_free import MODEL_FREE_METHODS, describe_model_free, model_free_proposer
from specdec.proposers.mtp import MTPProposer
from specdec.proposers.ngram import NGRAM_DESCRIPTION, NgramProposer
from specdec.proposers.pard import ParallelDraftProposer, read_mask_token
from specdec.proposers.suffix import SUFFIX_DESCRIPTION, SuffixConfig, SuffixProposer

PROPOSERS = {
    "draft_model": DraftModelProposer,
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
    "eagle3": Eagle3Proposer,  # reads the target's hidden states (specdec.heads)
    "mlp_speculator": MLPSpeculatorProposer,
    "medusa": MedusaProposer,
    "mtp": MTPProposer,  # the target's own MTP layer (specdec.heads.mtp)
    "dflash": DFlashProposer,
}


def make_proposer(method: str, **kwargs) -> Proposer:
    """Build the proposer named ``method`` with its constructor's keyword arguments."""
    if method not in PROPOSERS:
        raise ValueError(f"method must be one of {tuple(PROPOSERS)}, got {method!r}")
    return PROPOSERS[method](**kwargs)


__all__ = [
    "NGRAM_DESCRIPTION",
    "PROPOSERS",
    "DFlashProposer",
    "DraftModelProposer",
    "Eagle3Proposer",
    "MedusaProposer",
    "MLPSpeculatorProposer",
    "MODEL_FREE_METHODS",
    "MTPProposer",
    "NgramProposer",
    "ParallelDraftProposer",
    "SUFFIX_DESCRIPTION",
    "SuffixConfig",
    "SuffixProposer",
    "Proposer",
    "check_draft_compatible",
    "check_propose_requests",
    "describe_model_free",
    "make_proposer",
    "model_free_proposer",
    "read_mask_token",
]
