"""The draft distributions ``q`` a proposer left with the rejection sampler, until the step's sample call reads them.

Served, ``q`` ``[k, vocab]`` goes from draft_proposer straight to rejection_sampler
(one process boundary) instead of back to the orchestrator and on to the sampler
(two); the verifier's sample call then names the sequence, and the sampler takes the
``q`` held for it. So the sampler holds at most one ``q`` per sequence, for about one
step:

* ``hold`` replaces whatever the sequence held (its previous step's ``q`` is stale);
* ``take`` returns it only for the same drafts (or the first of them), so a ``q`` is never paired with drafts
  it was not drawn for; the caller ``discard``\\ s what it took once its sampling
  succeeded, so a sample call that fails and is sent again finds the ``q`` still there;
* an entry older than ``ttl_s`` goes at the next ``hold``: a sequence that failed or was
  cancelled between its propose and its verify leaves nothing behind for long.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch


class HeldDraftProbs:
    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._held: dict[str, tuple[tuple[int, ...], torch.Tensor, float]] = {}  # seq_id -> (drafts, q, held at)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, seq_id: str, draft_token_ids: Iterable[int], probs: torch.Tensor) -> None:
        """Keep ``probs`` ``[k, vocab]``, q of the ``k`` drafts, for the sequence's next sample call."""
        drafts = tuple(int(t) for t in draft_token_ids)
        if probs.dim() != 2 or probs.shape[0] != len(drafts):
            raise ValueError(f"seq {seq_id!r}: q must have one row per draft ({len(drafts)}), got {list(probs.shape)}")
        now = self._clock()
        self._expire(now)
        self._held[seq_id] = (drafts, probs, now)

    def take(self, seq_id: str, draft_token_ids: Iterable[int]) -> torch.Tensor:
        """The ``q`` held for these drafts, or for drafts they begin (a grammar cuts the drafts it forbids:
        ``specdec.grammar``); a ValueError naming the sequence when there is none."""
        drafts = tuple(int(t) for t in draft_token_ids)
        entry = self._held.get(seq_id)
        if entry is None:
            raise ValueError(f"seq {seq_id!r}: no draft distribution is held for it (it expired after "
                             f"{self.ttl_s:g} s, or its proposer never sent it)")  # fmt: skip
        if entry[0][: len(drafts)] != drafts:
            raise ValueError(f"seq {seq_id!r}: the draft distribution held is for drafts {list(entry[0])}, "
                             f"the sample call is for {list(drafts)}")  # fmt: skip
        return entry[1] if len(drafts) == len(entry[0]) else entry[1][: len(drafts)]

    def discard(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._held.pop(seq_id, None)

    def _expire(self, now: float) -> None:
        stale = [seq_id for seq_id, (_, _, at) in self._held.items() if now - at > self.ttl_s]
        self.discard(stale)
