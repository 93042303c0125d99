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

from specdec.compile_locks import CompileProgress
from specdec.fast.cpu_compile import WARM_UP_PREFIX, compile_dynamic, warm_up_plan
from specdec.heads.eagle3 import Eagle3Head
from specdec.types import ProposeRequest, SamplingParams

STEPS_PER_CALL = 3  # the shipped head's k = 4: its first draft, then one call
# (new tokens, k) of each greedy warm-up request after the prefill: a step that accepted nothing, then
# one that accepted drafts, at every k the loop runs differently (no step, a pass, steps compiled
# together, and those followed by a pass); a sampled request's per-step loop makes the same passes
WARM_UP_STEPS = ((1, 1), (2, 2), (1, STEPS_PER_CALL + 1), (3, STEPS_PER_CALL + 2))


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


def warm_up(proposer, progress: CompileProgress) -> None:
    """Compile every graph a request of ``proposer`` (an ``Eagle3Proposer`` or one built on it) needs now,
    through its ``propose`` itself, on sequences released after.

    A graph's guards check how its inputs were made as well as their shapes (a view's
    storage offset, a stride, sizes 0 and 1 specialised), so passes fed made-up tensors
    left graphs for the first requests to compile: a stall of seconds at serving time. One
    sequence, then several at once, each sent a prefill and then ``WARM_UP_STEPS``.
    """
    seq_ids, _ = warm_up_plan(proposer.cache.num_free, proposer.max_model_len)
    steps = [(new, k, SamplingParams()) for new, k in WARM_UP_STEPS]  # (new tokens, k, sampling)
    if proposer.greedy_tree is not None:  # the whole tree: one compiled call greedy, a pass a level sampled
        nodes = proposer.tree.num_nodes
        steps += [(1, nodes, SamplingParams()), (1, nodes, SamplingParams(1.0))]
    needed = WARM_UP_PREFIX + sum(n for n, _, _ in steps) + max(k for _, k, _ in steps)
    if not seq_ids or needed > proposer.max_model_len:
        return  # a head this short compiles on its first passes instead
    width = proposer.head.config.feature_size
    for rows in sorted({1, len(seq_ids)}):  # one row and several: torch specialises size 1
        batch = seq_ids[:rows]
        progress.step(f"{rows} sequence(s): a prefill, then steps of up to {max(k for _, k, _ in steps)} drafts")
        try:
            proposer.propose([ProposeRequest(s, 0, [0] * WARM_UP_PREFIX, 1, SamplingParams(), 0,
                                             hidden_states=torch.zeros(WARM_UP_PREFIX - 1, width)) for s in batch])
            length = WARM_UP_PREFIX
            for new, k, sampling in steps:
                proposer.propose([ProposeRequest(s, length, [0] * new, k, sampling, 0, hidden_position=length - 1,
                                                 hidden_states=torch.zeros(new, width)) for s in batch])  # fmt: skip
                length += new
        finally:
            for seq_id in batch:
                proposer.release(seq_id)
