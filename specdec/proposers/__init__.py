"""Proposer strategies, one per file, behind the ``Proposer`` protocol."""
from __future__ import annotations

from specdec.proposers.base import Proposer
from specdec.proposers.draft_model import DraftModelProposer, check_vocab_compatible
from specdec.proposers.ngram import NgramProposer

PROPOSERS = {"draft_model": DraftModelProposer, "ngram": NgramProposer}


def make_proposer(method: str, **kwargs) -> Proposer:
    """Build the proposer named ``method`` with its constructor's keyword arguments."""
    if method not in PROPOSERS:
        raise ValueError(f"method must be one of {tuple(PROPOSERS)}, got {method!r}")
    return PROPOSERS[method](**kwargs)


__all__ = ["PROPOSERS", "DraftModelProposer", "NgramProposer", "Proposer", "check_vocab_compatible", "make_proposer"]
