"""Draft-model proposer: a small causal LM drafts k tokens autoregressively.

Leviathan et al. 2023 and Chen et al. 2023: the draft samples ``d_i ~ q(. | x, d_<i)``
with the request's own temperature / top-k / top-p, and returns ``q`` so the
rejection sampler can accept ``d_i`` with probability ``min(1, p / q)``. Every request
of a call drafts together: one ragged forward feeds each sequence the tokens its
cache lacks, then ``k - 1`` single-token forwards extend every sequence still
drafting. On the fast engine each is one batched pass; on the ``hf`` engine the
``CachedLM`` loops over the sequences inside its forward.

The proposer owns the draft's cache alone. It keeps each sequence's tokens followed
by the drafts it fed itself; the tokens a request brings past ``position`` that equal
those drafts (the accepted ones) are already cached and are not fed again, and the
cache is cut back at the first that differs.

A static tree (``specdec.proposers.static_tree``, fast engine): each level is one tree
pass of the draft over the sequence's last token and the nodes so far (each attending to
its ancestors, ``ForwardCall.tree_parents``), whose rows at the level's nodes rank their
children. The nodes are written past the sequence's tokens and never kept: the next call
feeds the accepted ones as new tokens, over them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec.cached_lm import CachedLM, ForwardCall, OwnsOneModel
from specdec.grammar import guided_row
from specdec.proposers.base import Proposer, check_propose_requests, drafts_as_chain, proposals_in_order
from specdec.proposers.static_tree import Row, grow_tree, ranked_candidates
from specdec.sampling import apply_logit_bias, check_banned, greedy_tokens, make_generator, process_logits, sample_from_probs
from specdec.tree import ROOT, DraftTree
from specdec.types import ModelDescription, Proposal, ProposeRequest


def check_draft_compatible(draft: ModelDescription, target: ModelDescription) -> None:
    """Rejection sampling compares ``p`` and ``q`` token by token: a draft model needs the target's vocabulary.

    An n-gram draft copies the sequence's own tokens and has no vocabulary: it always passes.
    A draft that holds fewer tokens of a sequence than the target serves would fail the
    requests that reach its limit, so it is refused here, naming both limits.
    """
    if draft.vocab_size is not None and draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft.model!r} has vocab size {draft.vocab_size} but target model {target.model!r} "
            f"has vocab size {target.vocab_size}; the draft must share the target's tokenizer and output layer width"
        )
    if None not in (draft.max_model_len, target.max_model_len) and draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"draft model {draft.model!r} holds {draft.max_model_len} tokens of a sequence but target model "
            f"{target.model!r} serves {target.max_model_len}; raise draft_proposer's max_model_len (empty: "
            f"target_verifier's) or lower target_verifier's"
        )


@dataclass
class _Sequence:
    tokens: list[int]  # the tokens sent, then the drafts the proposer fed itself
    sent: int = 0  # how many of `tokens` the caller sent; a request's position may not pass it
    cached: int = 0  # how many of `tokens` the draft's KV cache holds


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer(OwnsOneModel, Proposer):
    def __init__(self, lm: CachedLM, tree: DraftTree | None = None):
        """``tree``: draft this static tree, cut to each request's ``num_tokens`` nodes (None or a chain: a chain)."""
        self.lm = lm
        self.tree = tree if tree is not None and not tree.is_chain else None
        self._seqs: dict[str, _Sequence] = {}

    @property
    def num_active_sequences(self) -> int:
        return len(self._seqs)

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:
        self._seqs.pop(seq_id, None)  # a response teaches a fixed draft model nothing
        self.lm.release(seq_id)

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        check_propose_requests(requests, lambda s: self._seqs[s].sent if s in self._seqs else 0)
        drafting = [r for r in requests if r.num_tokens > 0]
        as_chain = drafts_as_chain(self.tree, drafting)
        self._check_length(requests, as_chain)
        vocab = self.lm.vocab_size
        for r in requests:  # before any sequence is taken: a refused request leaves nothing held
            if not all(0 <= t < vocab for t in r.token_ids):
                raise ValueError(f"seq {r.seq_id!r}: token_ids must be in [0, {vocab})")
            check_banned(r.banned_token_ids, vocab)
        for r in requests:
            self._take(r)
        trees = None if as_chain else [self.tree.first(r.num_tokens) for r in drafting]
        try:
            drafts, q_rows = self._draft(drafting) if trees is None else (self._draft_tree(drafting, trees), None)
        except BaseException:
            for r in drafting:  # a half-extended cache costs only a re-prefill, never a wrong token
                self._drop_cache(r.seq_id)
            raise
        if trees is None:
            return proposals_in_order(requests, drafting, drafts, q_rows)
        parents = {r.seq_id: t.parents for r, t in zip(drafting, trees)}
        proposals = proposals_in_order(requests, drafting, drafts, [[] for _ in drafting])
        return [replace(p, parents=parents[r.seq_id]) if len(p.token_ids) else p for r, p in zip(requests, proposals)]

    def _take(self, request: ProposeRequest) -> None:
        """Append the request's tokens at its position; keep the cache up to the first token it changes."""
        seq = self._seqs.setdefault(request.seq_id, _Sequence([]))
        kept = request.position + _matching_prefix(seq.tokens[request.position :], request.token_ids)
        seq.cached = min(seq.cached, kept)
        del seq.tokens[request.position :]
        seq.tokens.extend(request.token_ids)
        seq.sent = len(seq.tokens)

    def _drop_cache(self, seq_id: str) -> None:
        """Keep the tokens sent (the caller will not send them again); the next call re-prefills them."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            del seq.tokens[seq.sent :]
            seq.cached = 0
        self.lm.release(seq_id)

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        seqs = [self._seqs[r.seq_id] for r in requests]
        calls = []
        for r, seq in zip(requests, seqs):
            # Feed at least the last token: its logits give the first draft.
            start = min(seq.cached, self.lm.cached_length(r.seq_id), len(seq.tokens) - 1)
            calls.append(ForwardCall(r.seq_id, start, seq.tokens[start:], num_logits=1))
        logits = self.lm.forward(calls)  # len(requests) x [1, vocab]
        for seq in seqs:
            seq.cached = len(seq.tokens)
        generators = [None if r.sampling.greedy else make_generator(r.seed, self.lm.device) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]  # per request, k x [1, vocab]
        live = list(range(len(requests)))
        for step in range(max((r.num_tokens for r in requests), default=0)):
            if step:
                live = [i for i in live if requests[i].num_tokens > step]
                calls = [ForwardCall(requests[i].seq_id, len(seqs[i].tokens), [drafts[i][-1]], 1) for i in live]
                for i, row in zip(live, self.lm.forward(calls)):
                    logits[i] = row
                    seqs[i].tokens.append(drafts[i][-1])
                    seqs[i].cached += 1
            tokens = []  # len(live) x [1]
            for i in live:
                banned = (int(step < requests[i].num_banned_tokens), requests[i].banned_token_ids)  # min_tokens
                row = apply_logit_bias(logits[i], requests[i].sampling.logit_bias)  # [1, vocab]: as the target's
                row = guided_row(row, requests[i].guide, drafts[i])  # structured output: what the grammar allows
                if generators[i] is None:
                    tokens.append(greedy_tokens(row, *banned))
                else:
                    q = process_logits(row, requests[i].sampling, *banned)  # [1, vocab]
                    tokens.append(sample_from_probs(q, generators[i]))
                    q_rows[i].append(q)
            for i, token in zip(live, torch.cat(tokens).tolist()):  # one device sync per step
                drafts[i].append(token)
        return drafts, q_rows

    def _draft_tree(self, requests: list[ProposeRequest], trees: list[DraftTree]) -> list[list[int]]:
        """Each request's tree tokens, node order: a pass of the draft per level (``grow_tree``)."""
        seqs = [self._seqs[r.seq_id] for r in requests]
        ranks = max(t.max_rank for t in trees)

        def rank(depth: int, rows: list[Row], tokens: list[list[int]]) -> list[list[int]]:
            calls, firsts = [], {}  # a call per request: its rows are the level's nodes, the last of the call
            for i in dict.fromkeys(i for i, _ in rows):
                seq, seq_id = seqs[i], requests[i].seq_id
                if depth == 0:  # the tokens the cache lacks; the last one's row ranks the root's children
                    start = min(seq.cached, self.lm.cached_length(seq_id), len(seq.tokens) - 1)
                    calls.append(ForwardCall(seq_id, start, seq.tokens[start:], num_logits=1))
                    seq.cached = len(seq.tokens)  # the sequence's own tokens: the nodes lie past them
                    firsts[i] = ROOT
                else:  # the last token again, as the tree's root, and the nodes down to this depth
                    n, firsts[i] = len(tokens[i]), trees[i].depths.index(depth)
                    calls.append(ForwardCall(seq_id, len(seq.tokens) - 1, [seq.tokens[-1], *tokens[i]],
                                             num_logits=n - firsts[i], tree_parents=trees[i].parents[:n]))  # fmt: skip
            out = dict(zip(firsts, self.lm.forward(calls)))  # request -> [nodes of the level (1: the root), vocab]
            logits = torch.stack([out[i][node - firsts[i]] for i, node in rows])  # [R, vocab]
            return ranked_candidates(logits, [requests[i] for i, _ in rows], depth, ranks)

        return grow_tree(trees, rank)

    def _check_length(self, requests: list[ProposeRequest], as_chain: bool) -> None:
        """k drafts feed k - 1 of them back (a tree, drafted as a tree, all of its nodes): they and the
        sequence must fit ``max_model_len``."""
        limit = self.lm.max_model_len
        for r in requests:
            length = r.position + len(r.token_ids)
            fed = r.num_tokens - 1 if as_chain else r.num_tokens
            if limit is not None and r.num_tokens > 0 and length + fed > limit:
                raise ValueError(
                    f"seq {r.seq_id!r}: {length} tokens + {r.num_tokens} drafts exceed max_model_len={limit}"
                )
