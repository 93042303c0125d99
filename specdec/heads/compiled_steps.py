"""Greedy drafting steps of an EAGLE-3 head, several to one compiled call (CPU, ``cpu_compile``).

After its first draft a head drafts one row per sequence per step: the last draft and the
head's own pre-norm output of the row before go in, the argmax over the draft vocabulary
(banned ids masked while ``min_tokens`` bans them), mapped to a target id, comes out. On a
CPU every compiled call pays a fixed entry (Dynamo's guards, AOTAutograd's wrapper) and the
proposer's Python between calls, which for a small head's one-row pass cost more than the
pass computes. Here ``STEPS_PER_CALL`` steps run unrolled in one graph and pay that once.

The unroll is a fixed count, not the request's k: a graph per k would have to be compiled
at load for every k a request may ask (each unrolled graph takes inductor seconds, more on a
cold cache), or stall the first request that asks a new one. A proposal whose steps are no multiple of it
takes the rest a pass a call, as without this, so the cache is written at exactly the
positions the per-step loop writes. On a GPU the head's passes replay CUDA graphs and this
is not used.
"""
from __future__ import annotations

import torch

from specdec.fast.cpu_compile import compile_dynamic
from specdec.heads.eagle3 import Eagle3Head

STEPS_PER_CALL = 3  # the shipped head's k = 4: its first draft, then one call


class CompiledGreedySteps:
    def __init__(self, head: Eagle3Head, draft_targets: torch.Tensor):
        """``draft_targets``: [draft_vocab] the target id of each draft id."""
        self.head = head
        self.draft_targets = draft_targets
        self._compiled = compile_dynamic(self._steps)

    @torch.inference_mode()  # at warm-up too: grad mode is part of a compiled graph's guards
    def run(
        self,
        last_ids: torch.Tensor,  # [B] int64: each row's last draft, a target id
        prenorm: torch.Tensor,  # [B, h]: the head's pre-norm output of the row that drafted it
        positions: torch.Tensor,  # [B] int64: the position of each row's first step
        slots: torch.Tensor,  # [B] int64
        kv: torch.Tensor,  # the head's cache
        kv_len: int,  # positions the first step attends (the host's count); each step one more
        banned: torch.Tensor,  # [B, draft_vocab] bool: ids masked while a row's bans bind
        bans_left: torch.Tensor,  # [B] int64: how many more drafts of each row the bans bind
    ) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [B, STEPS_PER_CALL] target ids, the last pre-norm [B, h]
        return self._compiled(last_ids, prenorm, positions, slots, kv, kv_len, banned, bans_left)

    def _steps(self, last_ids, prenorm, positions, slots, kv, kv_len: int, banned, bans_left):
        ones = torch.ones_like(positions)  # [B]: one new token a row
        drafts = []
        for i in range(STEPS_PER_CALL):
            logits, out = self.head(last_ids[:, None], prenorm[:, None], positions + i, ones, slots, kv, kv_len + i)
            prenorm = out[:, 0]  # [B, h]
            masked = logits[:, 0].masked_fill(banned & (bans_left > i)[:, None], float("-inf"))  # [B, draft_vocab]
            last_ids = self.draft_targets[masked.argmax(-1)]  # [B]
            drafts.append(last_ids)
        return torch.stack(drafts, 1), prenorm
