"""Growing a static draft tree (``specdec.tree.DraftTree``) level by level, one drafter pass a level.

A drafter that reads the token it drafted before (the draft model, the MLP speculator)
ranks a node's children from a row of its own: the node's token fed where its parent's
row left off. So a tree of depth ``D`` costs ``D`` passes, each over every node of the level
before that has children, for every sequence at once; leaves need none. The node whose
path of ranks ends in ``r`` takes the ``r``-th likeliest candidate of its parent's row
(EAGLE-2's and vLLM's static-tree rule).

Children are chosen, not sampled, for greedy and sampled requests alike: the tree's
verification (``specdec.tree_sampler``) is lossless for any choice, so no ``q`` is sent.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.sampling import apply_logit_bias
from specdec.tree import ROOT, DraftTree
from specdec.types import ProposeRequest

Row = tuple[int, int]  # (request index, node index; ROOT for the sequence's last token)
# (depth, rows, tokens) -> each row's candidates for its children, likeliest first: one drafter pass over the
# rows, nodes of ``depth`` (ROOT rows at depth 0); ``tokens`` holds each request's node tokens down to ``depth``
RankRows = Callable[[int, list[Row], list[list[int]]], list[list[int]]]


def grow_tree(trees: Sequence[DraftTree], rank: RankRows) -> list[list[int]]:
    """Each request's node tokens in node order (breadth-first), ``trees[i]`` being request ``i``'s cut."""
    tokens: list[list[int]] = [[] for _ in trees]
    candidates: list[dict[int, list[int]]] = [{} for _ in trees]  # node -> its children's candidates
    has_children = [set(t.parents) for t in trees]
    rows = [(i, ROOT) for i, t in enumerate(trees) if t.num_nodes]
    depth = 0
    while rows:
        for (i, node), top in zip(rows, rank(depth, rows, tokens)):
            candidates[i][node] = top
        depth += 1
        rows = []
        for i, t in enumerate(trees):
            for node in (n for n, d in enumerate(t.depths) if d == depth):
                tokens[i].append(candidates[i][t.parents[node]][t.paths[node][-1]])
                if node in has_children[i]:
                    rows.append((i, node))
    return tokens


def ranked_candidates(logits: torch.Tensor, requests: Sequence[ProposeRequest], depth: int, ranks: int) -> list[list[int]]:
    """The ``ranks`` likeliest ids of each row of ``logits`` ``[R, vocab]``, row ``r`` drafting for ``requests[r]``
    at output index ``depth`` past the step's first: its logit bias applied, its banned ids out while ``min_tokens``
    bans them there."""
    logits = logits.float()  # [R, vocab]
    for n, r in enumerate(requests):  # rows a request changes: few, and most requests change none
        if r.sampling.logit_bias:  # as the target's
            logits[n] = apply_logit_bias(logits[n : n + 1], r.sampling.logit_bias)[0]
        if r.banned_token_ids and depth < r.num_banned_tokens:
            logits[n, list(r.banned_token_ids)] = float("-inf")
    return logits.topk(ranks, dim=-1).indices.tolist()  # the level's one copy to the host
