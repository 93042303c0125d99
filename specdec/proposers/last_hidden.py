"""The sequences of a head that drafts from the target's last hidden state alone (MLP speculator, Medusa).

Such a head keeps no cache: per sequence, its tokens and the target's final hidden state at
the last verified position (``N - 2`` for ``N`` tokens: the one the target's own prediction
of token ``N - 1`` came from), which each request's ``hidden_states`` bring up to date.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.proposers.base import Proposer, check_propose_requests
from specdec.types import ProposeRequest


@dataclass
class LastHidden:
    tokens: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [hidden]: the target's final hidden state at ``position``
    position: int = -1


class LastHiddenSequences:
    """One owner of those sequences: ``take`` a call's requests, ``pop`` a released sequence."""

    def __init__(self, device: torch.device):
        self.device = device
        self._seqs: dict[str, LastHidden] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, seq_id: str) -> LastHidden:
        return self._seqs[seq_id]

    def pop(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def check(self, requests: list[ProposeRequest]) -> None:
        check_propose_requests(requests, lambda s: len(self._seqs[s].tokens) if s in self._seqs else 0)

    def take(self, requests: list[ProposeRequest]) -> list[ProposeRequest]:
        """Each request's tokens and hidden state; the requests that draft, each checked to hold the state it needs."""
        for r in requests:
            seq = self._seqs.setdefault(r.seq_id, LastHidden())
            del seq.tokens[r.position :]
            seq.tokens.extend(r.token_ids)
            if r.hidden_states is not None and r.hidden_states.shape[0]:
                seq.hidden = r.hidden_states[-1].to(self.device)
                seq.position = r.hidden_position + r.hidden_states.shape[0] - 1
        drafting = [r for r in requests if r.num_tokens > 0]
        for r in drafting:
            seq = self._seqs[r.seq_id]
            if seq.position != len(seq.tokens) - 2:
                raise ValueError(
                    f"seq {r.seq_id!r}: drafting after {len(seq.tokens)} tokens needs the target's hidden state at "
                    f"position {len(seq.tokens) - 2}, the proposer has it at {seq.position}"
                )
        return drafting


class DraftsFromLastHidden(Proposer):
    """What such a proposer shares: its sequences (``self._seqs``), their count, and release."""

    _seqs: LastHiddenSequences

    @property
    def num_active_sequences(self) -> int:
        return len(self._seqs)

    def release(self, seq_id: str, response=None) -> None:  # a response teaches a head nothing
        self._seqs.pop(seq_id)
