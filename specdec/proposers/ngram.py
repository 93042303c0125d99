"""Prompt-lookup (n-gram) proposer: drafts by copying what followed an earlier match.

Saxena 2023, "Prompt Lookup Decoding", as in vLLM's ``ngram`` method: take the
longest suffix of the sequence, of length n in ``[prompt_lookup_min,
prompt_lookup_max]``, that also occurs earlier in the sequence, and propose up to k
tokens that followed its earliest occurrence. No model runs, so ``q`` is one-hot at
the proposed tokens (``Proposal.probs`` is None). With no match it proposes nothing.

It keeps each sequence's tokens, appending what each request brings at its
``position``, so a request carries only the new tokens; ``release`` frees them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.proposers.base import Proposer, check_propose_requests
from specdec.types import ModelDescription, Proposal, ProposeRequest

DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither bound is given
# no model, no vocabulary, no limit on what it holds
NGRAM_DESCRIPTION = ModelDescription(model="ngram", vocab_size=None, max_model_len=None, max_num_seqs=None,
                                     method="ngram")  # fmt: skip


@dataclass(frozen=True)
class NgramConfig:
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # shortest suffix worth matching
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # longest suffix tried first

    @classmethod
    def from_optional(cls, prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> NgramConfig:
        """vLLM's rule: both default to 5; when only one is given the other mirrors it."""
        if prompt_lookup_min is None and prompt_lookup_max is None:
            return cls()
        if prompt_lookup_min is None:
            prompt_lookup_min = prompt_lookup_max
        if prompt_lookup_max is None:
            prompt_lookup_max = prompt_lookup_min
        return cls(prompt_lookup_min, prompt_lookup_max)

    def __post_init__(self) -> None:
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < 1:
            raise ValueError(f"prompt_lookup_max must be >= 1, got {self.prompt_lookup_max}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


def find_ngram_continuation(
    token_ids: np.ndarray,  # [seq_len] int64
    num_tokens: int,
    min_n: int,
    max_n: int,
) -> np.ndarray:  # [<= num_tokens] int64
    """Tokens that followed the earliest earlier occurrence of the longest matching suffix."""
    seq_len = len(token_ids)
    if num_tokens <= 0:
        return token_ids[:0]
    for n in range(min(max_n, seq_len - 1), min_n - 1, -1):
        suffix = token_ids[seq_len - n :]  # [n]
        # Windows starting before seq_len - n: an occurrence other than the suffix itself,
        # so at least one token follows it.
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[:-1], n)  # [seq_len - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = hits[0] + n
            return token_ids[start : start + num_tokens]
    return token_ids[:0]


class NgramProposer(Proposer):
    """Prompt lookup over the tokens each sequence has been sent, kept until ``release``."""

    def __init__(self, prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None):
        self.config = NgramConfig.from_optional(prompt_lookup_min, prompt_lookup_max)
        self._tokens: dict[str, list[int]] = {}  # each sequence's tokens, prompt then output

    @property
    def num_active_sequences(self) -> int:
        return len(self._tokens)

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        check_propose_requests(requests, lambda seq_id: len(self._tokens.get(seq_id, ())))
        return [self._propose_one(request) for request in requests]

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:
        self._tokens.pop(seq_id, None)  # a response teaches prompt lookup nothing

    def _propose_one(self, request: ProposeRequest) -> Proposal:
        held = self._tokens.setdefault(request.seq_id, [])
        del held[request.position :]
        held.extend(request.token_ids)
        tokens = np.asarray(held, dtype=np.int64)  # [seq_len]
        drafts = find_ngram_continuation(
            tokens, request.num_tokens, self.config.prompt_lookup_min, self.config.prompt_lookup_max
        )
        if request.num_banned_tokens:  # min_tokens: a banned draft is sure to be rejected, and all after it
            banned = np.flatnonzero(np.isin(drafts[: request.num_banned_tokens], request.banned_token_ids))
            drafts = drafts[: banned[0]] if banned.size else drafts
        return Proposal(token_ids=torch.from_numpy(drafts.copy()), probs=None)
