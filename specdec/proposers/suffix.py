"""Suffix decoding: drafts from the request's own text and from past responses.

SuffixDecoding (Oliaro et al. 2024), as in Arctic Inference and vLLM's ``suffix``
method: each live sequence has a local tree of its prompt and what it has generated
so far, and one global tree holds the responses of finished requests (evicted oldest
first beyond ``max_cached_requests``). Each step matches the latest tokens in both
trees and drafts along the most frequent continuation, as long as its estimated
probability stays >= ``min_token_prob`` and for at most ``match length *
max_spec_factor`` tokens; the tree whose draft scores higher (expected matches) wins.
So the draft length varies per sequence and per step, and a sequence with no match
drafts nothing, costing the step no extra verify positions.

Only responses of requests that completed enter the global tree (``release`` with the
response); a cancelled or failed request leaves nothing behind. The trees live in the
proposer's memory: a restart starts empty. No model runs, so ``q`` is one-hot at the
drafts (``Proposal.probs`` is None), as for n-gram lookup.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.proposers.base import Proposer, check_propose_requests
from specdec.suffix_tree import APPROX_NODE_BYTES, Draft, SuffixTree, speculate_in_sequence
from specdec.types import ModelDescription, Proposal, ProposeRequest

SUFFIX_DESCRIPTION = ModelDescription(model="suffix", vocab_size=None, max_model_len=None, max_num_seqs=None,
                                      method="suffix")  # fmt: skip


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's ``suffix_decoding_*`` keys, with its defaults."""

    max_tree_depth: int = 24  # longest match (and the depth of every tree): deeper costs memory per token
    max_cached_requests: int = 10000  # responses the global tree keeps, oldest evicted first; 0: no global tree
    max_spec_factor: float = 1.0  # a match of m tokens drafts at most m * factor: short matches are weak evidence
    min_token_prob: float = 0.1  # stop drafting where the continuation's estimated probability falls below
    # draft a speculation tree (Arctic Inference's use_tree_spec): the num_speculative_tokens most probable
    # continuations, branches included, verified as a tree (specdec.tree); False: the most frequent path alone
    use_tree_spec: bool = False

    def __post_init__(self) -> None:
        checks = {
            "suffix_decoding_max_tree_depth": (self.max_tree_depth, self.max_tree_depth >= 1, ">= 1"),
            "suffix_decoding_max_cached_requests": (self.max_cached_requests, self.max_cached_requests >= 0, ">= 0"),
            "suffix_decoding_max_spec_factor": (self.max_spec_factor, self.max_spec_factor > 0, "> 0"),
            "suffix_decoding_min_token_prob": (self.min_token_prob, 0 <= self.min_token_prob <= 1, "in [0, 1]"),
        }
        for name, (value, ok, rule) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value}")


@dataclass(frozen=True)
class SuffixCacheStats:
    """What the global tree holds; exported as gauges."""

    cached_responses: int
    cached_tokens: int
    tree_nodes: int  # of the global tree (a live sequence's local matches need no tree)

    @property
    def approx_bytes(self) -> int:
        return self.tree_nodes * APPROX_NODE_BYTES


class SuffixProposer(Proposer):
    """Suffix decoding over a local tree per live sequence and one global tree of finished responses."""

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self._tokens: dict[str, list[int]] = {}  # each live sequence's tokens, prompt then output
        self._global = SuffixTree(self.config.max_tree_depth)
        self._cached: collections.deque[int] = collections.deque()  # global tree keys, oldest first
        self._next_key = itertools.count()

    @property
    def num_active_sequences(self) -> int:
        return len(self._tokens)

    def stats(self) -> SuffixCacheStats:
        return SuffixCacheStats(len(self._cached), self._global.num_tokens, self._global.num_nodes)

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return [proposal for proposal, _ in self.propose_scored(requests)]

    def propose_scored(self, requests: list[ProposeRequest]) -> list[tuple[Proposal, float]]:
        """Each request's proposal and its draft's score (expected matching tokens; ``specdec.suffix_first``)."""
        check_propose_requests(requests, lambda seq_id: len(self._tokens.get(seq_id, ())))
        return [self._propose_one(request) for request in requests]

    def sequence(self, seq_id: str) -> list[int]:
        """The tokens held for ``seq_id`` (prompt, then output), as sent; the caller must not change them."""
        return self._tokens[seq_id]

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:
        """Forget the sequence; ``response``, given when the request completed, joins the global tree."""
        self._tokens.pop(seq_id, None)
        if response and self.config.max_cached_requests > 0:
            key = next(self._next_key)
            self._global.extend(key, response)
            self._cached.append(key)
            while len(self._cached) > self.config.max_cached_requests:
                self._global.remove(self._cached.popleft())

    def _propose_one(self, request: ProposeRequest) -> tuple[Proposal, float]:
        tokens = self._tokens.setdefault(request.seq_id, [])
        del tokens[request.position :]  # nothing, unless a request is sent again
        tokens.extend(request.token_ids)
        draft = self._speculate(tokens, request.num_tokens)
        if draft.parents is not None:
            return _tree_proposal(draft, request)
        drafts = draft.token_ids
        if request.num_banned_tokens:  # min_tokens: a banned draft is sure to be rejected, and all after it
            banned = set(request.banned_token_ids)
            cut = next((i for i, t in enumerate(drafts[: request.num_banned_tokens]) if t in banned), len(drafts))
            drafts = drafts[:cut]
        score = sum(draft.probs[: len(drafts)])  # of the drafts kept
        return Proposal(token_ids=torch.tensor(drafts, dtype=torch.long), probs=None), score

    def _speculate(self, tokens: list[int], num_tokens: int) -> Draft:
        """The local "tree" is the sequence itself (``speculate_in_sequence``): the same counts, no nodes."""
        if num_tokens <= 0:
            return Draft()
        config = self.config
        args = (num_tokens, config.max_spec_factor, config.min_token_prob, config.use_tree_spec)
        from_local = speculate_in_sequence(tokens, config.max_tree_depth, *args)
        context = tokens[-config.max_tree_depth :]
        from_global = self._global.speculate(context, *args) if self._cached else Draft()
        return from_local if from_local.score >= from_global.score else from_global


def _tree_proposal(draft: Draft, request: ProposeRequest) -> tuple[Proposal, float]:
    """A speculation tree's proposal and score; under ``min_tokens`` a banned node goes with its subtree.

    A tree that grew as one path is sent as a chain (``parents`` None), which verifies on the chain's path.
    """
    keep, kept_index, parents = [], {}, []
    banned = set(request.banned_token_ids) if request.num_banned_tokens else set()
    depths: list[int] = []
    for i, (token, parent) in enumerate(zip(draft.token_ids, draft.parents)):
        depth = 1 if parent < 0 else depths[parent] + 1
        depths.append(depth)
        if (parent >= 0 and parent not in kept_index) or (depth <= request.num_banned_tokens and token in banned):
            continue
        kept_index[i] = len(keep)
        keep.append(i)
        parents.append(-1 if parent < 0 else kept_index[parent])
    tokens = torch.tensor([draft.token_ids[i] for i in keep], dtype=torch.long)
    score = sum(draft.probs[i] for i in keep)
    is_chain = parents == list(range(-1, len(parents) - 1))
    return Proposal(token_ids=tokens, probs=None, parents=None if is_chain else tuple(parents)), score
