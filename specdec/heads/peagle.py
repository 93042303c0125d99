"""The P-EAGLE head (AWS 2026; the speculators library's ``peagle``, vLLM's ``parallel_drafting`` for
``eagle3``): an EAGLE-3 head that drafts all k tokens of a step in one forward.

It is an EAGLE-3 head (``specdec.heads.eagle3``) with one more learned tensor, ``mask_hidden``
``[1, 1, 3 * target_hidden_size]``: the feature of a position whose token is the checkpoint's mask
token. It is as wide as the target's concatenated hidden states, so it goes through the same ``fc``
as real features. A step feeds the rows EAGLE-3 reads (verified tokens shifted by one beside the
target's features at their positions, the newly sampled token last) and after them ``k - 1`` mask
positions, each the mask token beside ``fc(mask_hidden)``; one causal forward, and the logits at the
last real row and at the ``k - 1`` masks are drafts ``1 .. k`` (``specdec.proposers.peagle``).

Training (``parallel_train_forward``) runs what a step will run, for every anchor of a window at
once: the window's real rows (depth 0, the ordinary EAGLE-3 prediction of step 0) followed by
copies of its anchors at depths ``1 .. K - 1``, a depth-``d`` copy of anchor ``t`` at position
``t + d`` predicting the token ``d`` places past depth 0's. Each copy sees the real rows up to its
anchor and its own group's copies at depths ``1 .. d`` (an attention mask over ``[real rows ;
depth-1 copies ; depth-2 copies ...]``, as ``_ttt_mask`` is for the training-time test). Deeper
depths keep fewer anchors (COD sampling, :func:`cod_anchors`: depth ``d`` about ``n * r^d``), each
depth's a subset of the one before, so no copy misses a member of its group that inference feeds.

The format is vLLM's (speculators' ``peagle``, vLLM's ``PtdEagleProposer``): the speculators EAGLE-3
checkpoint with ``mask_hidden`` among its weights and ``"parallel_drafting": true`` and the mask token
id in its ``config.json`` (written as ``mask_token_id``; read from ``mask_token_id``, then
``ptd_token_id``: ``MASK_TOKEN_KEYS``).
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.heads.eagle3 import Eagle3Config, Eagle3Head, masked_layers, rope_cos_sin

MASK_HIDDEN = "mask_hidden"  # the learned feature of a mask position, in the head's weights
MASK_TOKEN_KEYS = ("mask_token_id", "ptd_token_id")  # config.json's mask token id, read in this order
PARALLEL_DRAFTING_KEY = "parallel_drafting"  # config.json: the head was trained to draft in parallel


class PEagleHead(Eagle3Head):
    """An EAGLE-3 head with the mask token and ``mask_hidden`` it drafts in parallel with."""

    def __init__(self, config: Eagle3Config, mask_token_id: int):
        super().__init__(config)
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask token {mask_token_id} is outside the head's vocabulary [0, {config.vocab_size})")
        self.mask_token_id = mask_token_id
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, config.feature_size))  # [1, 1, 3 * target_hidden]

    def mask_features(self) -> torch.Tensor:  # [1, h]
        """``fc(mask_hidden)``: the fused feature every mask position reads."""
        return self.fuse(self.mask_hidden.reshape(1, -1))


def cod_anchors(
    num_rows: int, depths: int, ratio: float, generator: torch.Generator, first: int = 0, min_kept: int = 1
) -> list[torch.Tensor]:  # depths - 1 sorted tensors of anchor rows, one per depth 1 .. depths - 1
    """COD sampling: the anchors each depth ``d >= 1`` trains, about ``n * ratio ** d`` of the ``n`` rows from ``first``.

    A depth-``d`` copy of anchor ``t`` is scored on row ``t + d``, so its anchor is at most
    ``num_rows - 1 - d``; each depth keeps a random share ``ratio`` of the one before's anchors
    (at least ``min_kept``), so every copy's group holds its shallower members.
    """
    kept = torch.arange(first, num_rows)
    groups = []
    for d in range(1, depths):
        kept = kept[kept <= num_rows - 1 - d]
        if ratio < 1.0 and len(kept) > min_kept:
            count = max(min_kept, round(len(kept) * ratio))
            kept = kept[torch.randperm(len(kept), generator=generator)[:count]].sort().values
        groups.append(kept)
    return groups


def group_mask(anchors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:  # [Q] each -> [Q, Q] bool
    """Who sees whom among ``[real rows ; copies]``: real rows causally; a copy the real rows up to its anchor
    and its group's copies up to its own depth (itself included). True = visible."""
    real_key = (depths[None, :] == 0) & (anchors[None, :] <= anchors[:, None])
    group_key = (depths[None, :] >= 1) & (anchors[None, :] == anchors[:, None]) & (depths[None, :] <= depths[:, None])
    return real_key | group_key


def parallel_train_forward(
    head: PEagleHead,
    input_ids: torch.Tensor,  # [B, T]: row t's token x_{t+1}
    features: torch.Tensor,  # [B, T, feature_size]: the target's at t
    groups: list[torch.Tensor],  # depth d >= 1's anchor rows (``cod_anchors``), each [n_d]
) -> list[torch.Tensor]:  # [B, T, draft_vocab] for depth 0, then [B, n_d, draft_vocab] per depth d
    """Every depth's logits from one forward: depth 0's row t predicts x_{t+2} (EAGLE-3's step 0), depth d's
    copy of anchor t predicts x_{t+2+d}."""
    b, t = input_ids.shape
    device = input_ids.device
    sizes = [len(g) for g in groups]
    anchors = torch.cat([torch.arange(t, device=device), *(g.to(device) for g in groups)])  # [Q]
    depths = torch.cat([torch.zeros(t, dtype=torch.long, device=device),
                        *(torch.full((n,), d, device=device) for d, n in enumerate(sizes, 1))])  # [Q]  # fmt: skip
    cos, sin = rope_cos_sin(head, anchors + depths)  # [Q, head_dim] each: a copy sits d places past its anchor
    copies = sum(sizes)
    ids = torch.cat([input_ids, input_ids.new_full((b, copies), head.mask_token_id)], 1)  # [B, Q]
    embeds = head.layers[0].input_layernorm(head.embed_tokens(ids))  # [B, Q, h]
    hidden = torch.cat([head.fuse(features), head.mask_features().expand(b, copies, -1)], 1)  # [B, Q, h]
    seen = [([], []) for _ in head.layers]
    x = masked_layers(head, embeds, hidden, cos, sin, seen, group_mask(anchors, depths))  # [B, Q, h]
    logits = head.lm_head(head.norm(x))  # [B, Q, draft_vocab]
    return list(logits.split([t, *sizes], 1))
