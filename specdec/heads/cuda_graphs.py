"""CUDA-graph capture of the EAGLE-3 head's pass at a few fixed (batch, tokens) shapes.

A head drafts k tokens one at a time, and each of its steps is one decoder layer: a few
dozen small kernels whose launches cost more than their arithmetic on a GPU. As for the
target (``specdec.fast.cuda_graphs``), the runner owns persistent inputs written by slice
before each replay, attention spans the head cache's whole length with a position mask,
and a batch is padded up to the next captured size with rows of no new tokens that write
only to the cache's scratch slot. Shapes outside the buckets run eagerly.

``StaticHeadRunner`` is the fixed-shape pass without capture (CPU tests check its padding
and buffers); ``HeadGraphRunner`` captures it.
"""
from __future__ import annotations

import torch

from specdec.fast.cuda_graphs import DEFAULT_GRAPH_NUM_TOKENS, batch_buckets, capture_passes, smallest_bucket
from specdec.fast.kv_cache import StaticKVCache
from specdec.heads.eagle3 import Eagle3Head

# (draft logits [B, S, draft_vocab], pre-norm [B, S, h]) of the bucket's (B, S)
HeadOutput = tuple[torch.Tensor, torch.Tensor]


class StaticHeadRunner:
    def __init__(self, head: Eagle3Head, cache: StaticKVCache, num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS):
        device, h = cache.kv.device, head.config.hidden_size
        self.head, self.cache = head, cache
        self.batch_sizes = batch_buckets(cache.max_num_seqs)
        self.num_tokens = tuple(sorted({n for n in num_tokens if n <= cache.max_model_len}))
        max_b, max_s = self.batch_sizes[-1], self.num_tokens[-1]
        self.input_ids = torch.zeros((max_b, max_s), dtype=torch.long, device=device)  # [max_b, max_s]
        self.hidden = torch.zeros((max_b, max_s, h), dtype=head.dtype, device=device)  # [max_b, max_s, h]
        self.starts = torch.zeros(max_b, dtype=torch.long, device=device)  # [max_b]
        self.num_new = torch.zeros(max_b, dtype=torch.long, device=device)  # [max_b]
        self.slots = torch.full((max_b,), cache.scratch_slot, dtype=torch.long, device=device)  # [max_b]

    def bucket(self, batch_size: int, num_tokens: int) -> tuple[int, int] | None:
        return smallest_bucket(self.batch_sizes, self.num_tokens, batch_size, num_tokens)

    def run(
        self,
        bucket: tuple[int, int],
        input_ids: torch.Tensor,  # [b, s] int64, right-padded, on the head's device
        hidden: torch.Tensor,  # [b, s, h]
        starts: torch.Tensor,  # [b]
        num_new: torch.Tensor,  # [b]
        slots: torch.Tensor,  # [b]
    ) -> HeadOutput:  # may be overwritten by the next run
        b, s = input_ids.shape
        big_b, big_s = bucket
        self.input_ids[:b, :s].copy_(input_ids)
        self.hidden[:b, :s].copy_(hidden)
        self.starts[:b].copy_(starts)
        self.num_new[:b].copy_(num_new)
        self.slots[:b].copy_(slots)
        self.starts[b:big_b].zero_()  # unused rows: no tokens, scratch slot
        self.num_new[b:big_b].zero_()
        self.slots[b:big_b].fill_(self.cache.scratch_slot)
        return self._execute(bucket)

    def _execute(self, bucket: tuple[int, int]) -> HeadOutput:
        return self._forward(*bucket)

    def _forward(self, b: int, s: int) -> HeadOutput:
        return self.head(
            self.input_ids[:b, :s], self.hidden[:b, :s], self.starts[:b], self.num_new[:b], self.slots[:b],
            self.cache.kv, self.cache.max_model_len,
        )


class HeadGraphRunner(StaticHeadRunner):
    def __init__(self, head: Eagle3Head, cache: StaticKVCache, num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS):
        if cache.kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {cache.kv.device}")
        super().__init__(head, cache, num_tokens)
        self.graphs, self.outputs, _ = capture_passes(self.batch_sizes, self.num_tokens, self._forward)

    def _execute(self, bucket: tuple[int, int]) -> HeadOutput:
        self.graphs[bucket].replay()
        return self.outputs[bucket]
