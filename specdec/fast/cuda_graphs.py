"""CUDA-graph capture of the fast forward pass at a few fixed (batch, tokens) shapes.

Decoding and verification launch hundreds of small kernels per step; replaying a
captured graph removes the launch overhead (as gpt-fast and vLLM do). A graph fixes
every shape and address, so the runner owns persistent input buffers, allocated once
and written by slice before each replay. Attention reads each row's length from those
buffers: the Triton slot kernel (the default on CUDA) stops at each query's position, the
torch path spans the whole ``max_model_len`` with a position mask. Batches are padded up
to the next captured size: unused rows get zero new tokens and the cache's scratch slot,
so they never touch a live sequence. Shapes outside the captured buckets run eagerly.

A runner built with ``hidden_layers`` also returns those hidden states of every row
(what an EAGLE-3 head or MLP speculator reads from the target), so a verify pass that
feeds a head replays a graph too instead of falling back to eager launches.

``StaticShapeRunner`` is the fixed-shape pass without capture (it runs anywhere, so
the padding and buffer logic is tested on CPU); ``CudaGraphRunner`` captures it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.fast.kv_cache import StaticKVCache
from specdec.fast.llama import FastLlama

DEFAULT_GRAPH_NUM_TOKENS = (1, 2, 4, 8)  # k + 1 for k up to 7, padded up to the next bucket
_WARMUP_RUNS = 2  # lets lazy allocations and kernel selection happen before capture


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes = {max_num_seqs}
    size = 1
    while size < max_num_seqs:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


@torch.inference_mode()
def capture_passes(batch_sizes: tuple[int, ...], num_tokens: tuple[int, ...], forward: Callable[[int, int], object],
                   pool=None) -> tuple[dict, dict, object]:  # fmt: skip
    """Capture ``forward(b, s)`` for every bucket: (graphs, their outputs, the memory pool), by (b, s).

    Largest first, so smaller graphs reuse the shared memory pool. Each shape runs a few
    times on a side stream first, so lazy allocations and kernel selection happen outside
    the capture. ``forward`` must read persistent buffers whose unused rows write nowhere
    that matters (the scratch slot).
    """
    graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
    outputs: dict[tuple[int, int], object] = {}
    for b in reversed(batch_sizes):
        for s in reversed(num_tokens):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_RUNS):
                    forward(b, s)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[(b, s)] = forward(b, s)
            pool = graph.pool()
            graphs[(b, s)] = graph
    torch.cuda.synchronize()
    return graphs, outputs, pool


# (logits [b * s, vocab], hidden states [b * s, len(hidden_layers) * hidden] or None)
PassOutput = tuple[torch.Tensor, torch.Tensor | None]


class StaticShapeRunner:
    def __init__(self, model: FastLlama, cache: StaticKVCache, num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS,
                 hidden_layers: tuple[int, ...] = ()):  # fmt: skip
        if not num_tokens or min(num_tokens) < 1:
            raise ValueError(f"graph_num_tokens must be non-empty and >= 1, got {num_tokens}")
        device = cache.kv.device
        self.model, self.cache = model, cache
        self.hidden_layers = tuple(hidden_layers)
        self.batch_sizes = batch_buckets(cache.max_num_seqs)
        self.num_tokens = tuple(sorted({n for n in num_tokens if n <= cache.max_model_len}))
        max_b, max_s = self.batch_sizes[-1], self.num_tokens[-1]
        # Persistent inputs: the pass for bucket (b, s) reads their leading [:b, :s] slice.
        self.input_ids = torch.zeros((max_b, max_s), dtype=torch.long, device=device)  # [max_b, max_s]
        self.starts = torch.zeros(max_b, dtype=torch.long, device=device)  # [max_b]
        self.num_new = torch.zeros(max_b, dtype=torch.long, device=device)  # [max_b]
        self.slots = torch.full((max_b,), cache.scratch_slot, dtype=torch.long, device=device)  # [max_b]

    def bucket(self, batch_size: int, num_tokens: int) -> tuple[int, int] | None:
        """The smallest (batch, tokens) shape that holds the pass, or None (run it eagerly)."""
        b = next((x for x in self.batch_sizes if x >= batch_size), None)
        s = next((x for x in self.num_tokens if x >= num_tokens), None)
        return None if b is None or s is None else (b, s)

    def run(
        self,
        bucket: tuple[int, int],
        input_ids: torch.Tensor,  # [b, s] int64 with b, s within the bucket
        starts: torch.Tensor,  # [b]
        num_new: torch.Tensor,  # [b]
        slots: torch.Tensor,  # [b]
    ) -> PassOutput:  # rows of the bucket's (B, S) pass; may be overwritten by the next run
        b, s = input_ids.shape
        big_b = bucket[0]
        self.input_ids[:b, :s].copy_(input_ids, non_blocking=True)
        self.starts[:b].copy_(starts, non_blocking=True)
        self.num_new[:b].copy_(num_new, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        self.starts[b:big_b].zero_()  # unused rows: no tokens, scratch slot
        self.num_new[b:big_b].zero_()
        self.slots[b:big_b].fill_(self.cache.scratch_slot)
        return self._execute(bucket)

    def _execute(self, bucket: tuple[int, int]) -> PassOutput:
        return self._forward(*bucket)

    def _forward(self, b: int, s: int) -> PassOutput:
        out = self.model(
            self.input_ids[:b, :s], self.starts[:b], self.num_new[:b], self.slots[:b],
            self.cache.kv, kv_len=self.cache.max_model_len, hidden_layers=self.hidden_layers,
        )
        return out if self.hidden_layers else (out, None)


class CudaGraphRunner(StaticShapeRunner):
    def __init__(self, model: FastLlama, cache: StaticKVCache, num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS,
                 hidden_layers: tuple[int, ...] = (), pool=None):  # fmt: skip
        """``pool``: a memory pool of graphs captured before (another runner's ``pool``), to share: the
        runners of one model never replay at once."""
        if cache.kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {cache.kv.device}")
        super().__init__(model, cache, num_tokens, hidden_layers)
        # (b, s) -> the pass's rows, written by each replay
        self.graphs, self.outputs, self.pool = capture_passes(self.batch_sizes, self.num_tokens, self._forward, pool)

    def _execute(self, bucket: tuple[int, int]) -> PassOutput:
        self.graphs[bucket].replay()
        return self.outputs[bucket]
