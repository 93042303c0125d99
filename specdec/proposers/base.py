"""The proposer protocol: a strategy that guesses the next k tokens of a sequence.

Modelled on transformers' ``CandidateGenerator``: two methods, one implementation
per file (``draft_model.py``, ``ngram.py``). Proposals only affect speed, never the
output distribution: the rejection sampler corrects whatever is proposed.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from specdec.types import Proposal, ProposeRequest


@runtime_checkable
class Proposer(Protocol):
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        """One proposal of at most ``request.num_tokens`` tokens per request, in order."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget any state kept for ``seq_id``; a no-op for unknown ids."""
        ...
