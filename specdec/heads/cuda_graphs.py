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

from specdec.fast.cuda_graphs import DEFAULT_GRAPH_NUM_TOKENS, StaticShapeRunner, capture_passes
from specdec.fast.kv_cache import StaticKVCache
from specdec.heads.eagle3 import Eagle3Head

# (draft logits [B, S, draft_vocab], pre-norm [B, S, h]) of the bucket's (B, S)
HeadOutput = tuple[torch.Tensor, torch.Tensor]


class StaticHeadRunner(StaticShapeRunner):
    """The target's fixed-shape runner with one more persistent input: the hidden rows each token reads."""

    def __init__(self, head: Eagle3Head, cache: StaticKVCache, num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS):
        super().__init__(head, cache, num_tokens)
        max_b, max_s = self.batch_sizes[-1], self.num_tokens[-1]
        self.hidden = torch.zeros((max_b, max_s, head.config.hidden_size), dtype=head.dtype,
                                  device=cache.kv.device)  # [max_b, max_s, h]  # fmt: skip

    def run_head(
        self,
        bucket: tuple[int, int],
        input_ids: torch.Tensor,  # [b, s] int64, right-padded
        hidden: torch.Tensor,  # [b, s, h]
        starts: torch.Tensor,  # [b]
        num_new: torch.Tensor,  # [b]
        slots: torch.Tensor,  # [b]
    ) -> HeadOutput:  # may be overwritten by the next run
        b, s = input_ids.shape
        self.hidden[:b, :s].copy_(hidden)
        return self.run(bucket, input_ids, starts, num_new, slots)

    def _forward(self, b: int, s: int) -> HeadOutput:
        return self.model(
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
