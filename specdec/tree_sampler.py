"""Lossless verification of a draft tree: walk down from the root, following the target's own token.

Vocabulary as in :mod:`specdec.rejection_sampler`; a tree is addressed as in
:mod:`specdec.tree` (``parents``, nodes breadth-first, row 0 of ``p`` the root's and row
``j + 1`` node ``j``'s).

The rule is SpecInfer's multi-step speculative sampling (Miao et al. 2024, "SpecInfer",
Algorithm 2) for drafts that are chosen, not sampled: a tree's children are the drafter's
top-ranked tokens, so each sibling's ``q`` is one-hot. Tested in turn against a residual
that starts at ``p`` and loses each rejected sibling's mass (Jeon et al. 2024's recursive
rejection sampling without replacement reads the same), sibling ``x_c`` is accepted with
probability ``p(x_c)``, and if every sibling fails the token is drawn from ``p`` without
them. That is exactly the law of the target drawing its own token ``x ~ p`` and following
the child whose token is ``x``, emitting ``x`` itself when no child has it, which is what
:func:`sample_tree` does. Every emitted token is therefore distributed as ``p`` given the
tokens before it, whatever the tree; against a greedy target it is following the argmax
down the tree.

The target's draw at output index ``i`` uses the numbers the chain sampler uses for that
index (``draw_randoms_by_position``: a uniform, then ``1 / Exp(1)`` per token, from a
generator keyed by ``(seed, i)``), so a seeded request emits the same tokens with a tree,
a chain or no drafts at all. ``synthetic`` (benchmarks only, not lossless) accepts the
rank-0 child at each depth with its fixed rate and otherwise emits the target's token.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.sampling import derive_seed, make_generator
from specdec.tree import ROOT, check_parents
from specdec.types import Proposal, SampleResult, VerifyResult


def match_greedy_tree(
    draft_token_ids: Sequence[int],  # [n]
    parents: Sequence[int],  # [n]
    target_argmax: Sequence[int],  # [n + 1]: row 0 the root's
) -> SampleResult:
    """Follow the target's argmax down the tree, in plain Python (no draws)."""
    return _walk(draft_token_ids, parents, lambda row, depth: (int(target_argmax[row]), 0.0), "strict", 0.0)


def sample_tree(
    draft_token_ids: Sequence[int],  # [n]
    parents: Sequence[int],  # [n]
    verify: VerifyResult,  # argmax [n + 1]; probs [n + 1, vocab] p or None (greedy)
    seed: int,
    position: int | None,  # output index of the root's row: draws keyed by (seed, position + depth); None: one generator
    method: str = "strict",
    synthetic_acceptance_rate: float = 0.0,
) -> SampleResult:
    """The accepted path (``SampleResult.accepted_nodes``) and its tokens plus the recovered or bonus one."""
    n = len(draft_token_ids)
    check_parents(parents, n)
    if verify.argmax.shape[0] != n + 1:
        raise ValueError(f"a tree of {n} drafts needs {n + 1} target rows, got {verify.argmax.shape[0]}")
    probs = verify.probs
    if probs is None and method != "synthetic":
        return match_greedy_tree(draft_token_ids, parents, verify.argmax.tolist())
    device = verify.argmax.device if probs is None else probs.device
    vocab = 0 if probs is None else probs.shape[-1]
    one = make_generator(seed, device) if position is None else None

    def target_token(row: int, depth: int) -> tuple[int, float]:
        generator = one if one is not None else make_generator(derive_seed(seed, position + depth, 0), device)
        uniform = float(torch.rand(1, generator=generator, device=generator.device))
        if probs is None:
            return int(verify.argmax[row]), uniform
        exponentials = torch.empty(vocab, device=generator.device).exponential_(generator=generator)
        inv = exponentials.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()  # [vocab]
        return int((probs[row].float() * inv).argmax()), uniform

    return _walk([int(t) for t in draft_token_ids], parents, target_token, method, synthetic_acceptance_rate)


def _walk(drafts, parents, target_token, method: str, rate: float) -> SampleResult:
    children: list[list[int]] = [[] for _ in range(len(drafts) + 1)]
    for i, parent in enumerate(parents):
        children[parent].append(i)  # ROOT (-1) lands in the last list
    node, path, out = ROOT, [], []
    while True:
        token, uniform = target_token(node + 1, len(path))
        kids = children[node]
        if method == "synthetic":
            chosen = kids[0] if kids and uniform < rate else None
        else:
            chosen = next((c for c in kids if drafts[c] == token), None)
        if chosen is None:
            out.append(token)
            break
        out.append(drafts[chosen])
        path.append(chosen)
        node = chosen
    return SampleResult(torch.tensor(out, dtype=torch.long), len(path), accepted_nodes=tuple(path))


def match_greedy_either(proposal: Proposal, verified: VerifyResult) -> SampleResult:
    """A greedy target's verdict on a chain or a tree (``Proposal.parents``), without a call."""
    from specdec.rejection_sampler import match_greedy  # it imports this module for trees

    if proposal.parents is not None and len(proposal.token_ids):
        return match_greedy_tree(proposal.token_ids.tolist(), proposal.parents, verified.argmax.tolist())
    return match_greedy(proposal.token_ids.tolist(), verified.argmax.tolist())
