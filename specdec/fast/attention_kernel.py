"""A Triton kernel for attention of a few query tokens per sequence over the slot KV cache.

The torch path gathers each sequence's slot (``index_select``) and runs SDPA with a
position mask; with CUDA graphs that gather spans the whole ``max_model_len``. This
kernel instead reads keys and values in place, one program per (query token, head),
and stops at the query's own position, accumulating the softmax online (Milakov &
Gimelshein 2018, as in FlashAttention's decoding kernels). Grid and shapes depend
only on the batch shape, so the kernel can be captured in a CUDA graph.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_BLOCK_N = 32  # keys per loop iteration


def check_available() -> None:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("triton_attention=True needs a CUDA device or TRITON_INTERPRET=1")


@triton.jit(do_not_specialize=["num_tokens"])  # a prompt's length must not compile a kernel of its own
def _slot_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, positions_ptr, scale,
    q_stride_b, q_stride_h, q_stride_s,
    k_stride_slot, k_stride_h, k_stride_l,
    v_stride_slot, v_stride_h, v_stride_l,
    o_stride_b, o_stride_h, o_stride_s,
    num_tokens, group: tl.constexpr, head_dim: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # b * num_tokens + s
    head = tl.program_id(1)
    b = row // num_tokens
    s = row % num_tokens
    slot = tl.load(slots_ptr + b)
    position = tl.load(positions_ptr + row)  # attends keys [0, position]
    kv_head = head // group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * q_stride_b + head * q_stride_h + s * q_stride_s + d, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * scale  # [BLOCK_D]
    k_base = k_ptr + slot * k_stride_slot + kv_head * k_stride_h
    v_base = v_ptr + slot * v_stride_slot + kv_head * v_stride_h
    m = tl.full((), float("-inf"), tl.float32)  # running max of the scores
    denom = tl.full((), 0.0, tl.float32)  # running softmax denominator
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)  # running weighted sum of values
    for start in range(0, position + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = n <= position
        tile_mask = n_mask[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + n[:, None] * k_stride_l + d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.where(n_mask, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)  # [BLOCK_N]
        v = tl.load(v_base + n[:, None] * v_stride_l + d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / denom
    tl.store(out_ptr + b * o_stride_b + head * o_stride_h + s * o_stride_s + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def slot_attention(
    q: torch.Tensor,  # [B, H, S, D] queries (rotary applied)
    k_cache: torch.Tensor,  # [num_slots, KVH, max_model_len, D], one layer's keys
    v_cache: torch.Tensor,  # [num_slots, KVH, max_model_len, D]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, S] int64, each < max_model_len: query (b, s) attends keys [0, position]
    scale: float,
) -> torch.Tensor:  # [B, H, S, D]
    b, h, s, d = q.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("slot_attention needs the head dimension contiguous in q and the caches")
    out = torch.empty_like(q)
    positions = positions.contiguous()
    _slot_attention_kernel[(b * s, h)](
        q, k_cache, v_cache, out, slots, positions, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        num_tokens=s, group=h // k_cache.shape[1], head_dim=d,
        BLOCK_N=_BLOCK_N, BLOCK_D=triton.next_power_of_2(d),
    )
    return out
