"""Triton kernel for rejection sampling, token for token equal to the torch path.

Same vocabulary and methods as :mod:`specdec.rejection_sampler` (``p`` target, ``q``
draft; accepted, recovered and bonus tokens; Leviathan et al. 2023, Chen et al. 2023).
One program serves one request: it walks the ``k`` draft positions, then finds the
recovered or bonus token with an exponential race (``argmax w * inv_exponential``)
over the vocabulary in blocks of ``BLOCK``. It consumes the randoms that
``draw_randoms`` drew and applies the same float32 operations as the torch path, so
both pick the same tokens; ties go to the lowest id in both.

Runs compiled on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (set before this module
is imported, since ``triton.jit`` reads it when decorating).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from specdec.rejection_sampler import METHODS, SamplerRandoms, effective_method
from specdec.types import PLACEHOLDER_TOKEN_ID

_STRICT: tl.constexpr = tl.constexpr(METHODS.index("strict"))
_PROBABILISTIC: tl.constexpr = tl.constexpr(METHODS.index("probabilistic"))
_SYNTHETIC: tl.constexpr = tl.constexpr(METHODS.index("synthetic"))
_PLACEHOLDER: tl.constexpr = tl.constexpr(PLACEHOLDER_TOKEN_ID)
_BLOCK = 1024  # vocabulary entries per step of the race; a power of two, as tl.arange needs


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,  # [batch, k] int64, ids in [0, vocab)
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] q; None -> one-hot q at the drafts
    target_probs: torch.Tensor | None,  # [batch, k + 1, vocab] p; None -> greedy target
    target_argmax: torch.Tensor | None,  # [batch, k + 1] int64; used when target_probs is None
    method: str,
    randoms: SamplerRandoms,
    synthetic_acceptance_rate: float = 0.0,
    block: int = _BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, k + 1] int64 padded with PLACEHOLDER_TOKEN_ID, [batch] int64
    """Drop-in for ``rejection_sample_batch``; ``block`` (a power of two) only changes speed."""
    device = draft_token_ids.device
    if device.type != "cuda" and not isinstance(_rejection_kernel, InterpretedFunction):
        raise RuntimeError("the Triton rejection kernel needs CUDA tensors unless TRITON_INTERPRET=1")
    batch, k = draft_token_ids.shape
    method = effective_method(method, target_probs is None, draft_probs is None)
    has_p, has_q = target_probs is not None, draft_probs is not None
    vocab = target_probs.shape[-1] if has_p else 1
    output = torch.empty(batch, k + 1, dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    # Absent or empty operands are never read (constexpr flags and k compile or skip
    # those loads); `output` stands in for their pointers, which must be valid.
    draft = _operand(draft_token_ids.long(), output)  # [batch, k]
    uniforms = _operand(randoms.uniforms.float(), output)  # [batch, k]
    p = _operand(target_probs.float() if has_p else None, output)  # [batch, k + 1, vocab]
    q = _operand(draft_probs.float() if has_q else None, output)  # [batch, k, vocab]
    inv_exponentials = _operand(randoms.inv_exponentials if has_p else None, output)  # [batch, k + 1, vocab]
    argmax = _operand(None if has_p else target_argmax.long(), output)  # [batch, k + 1]
    if batch:
        _rejection_kernel[(batch,)](
            output, num_accepted, draft, q, p, argmax, uniforms, inv_exponentials,
            float(synthetic_acceptance_rate), k, vocab,
            METHOD=METHODS.index(method), HAS_P=has_p, HAS_Q=has_q, BLOCK=block,
            enable_fp_fusion=False,  # no fused multiply-adds: every op rounds as in the torch path
        )
    return output, num_accepted


def _operand(tensor: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    return stand_in if tensor is None or tensor.numel() == 0 else tensor.contiguous()


@triton.jit
def _race_argmax(
    p_row,  # [vocab] p at one position
    q_row,  # [vocab] q at the same position (read when RESIDUAL and HAS_Q)
    inv_row,  # [vocab] 1 / Exp(1) draws for that position
    draft_id,  # the draft token there: the one-hot q when RESIDUAL and not HAS_Q
    vocab,
    RESIDUAL: tl.constexpr,  # race over max(p - q, 0) instead of p
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """(largest key, its lowest index) of ``weight * inv_exponential`` over the vocabulary."""
    best_key = tl.full((), -1.0, tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)  # [BLOCK]
        mask = offsets < vocab
        weight = tl.load(p_row + offsets, mask=mask, other=0.0)
        if RESIDUAL:
            if HAS_Q:
                q = tl.load(q_row + offsets, mask=mask, other=0.0)
            else:
                q = tl.where(offsets == draft_id, 1.0, 0.0)
            weight = tl.maximum(weight - q, 0.0)
        key = weight * tl.load(inv_row + offsets, mask=mask, other=0.0)
        key = tl.where(mask, key, -1.0)
        block_key = tl.max(key, axis=0)
        block_idx = tl.argmax(key, axis=0) + start
        better = block_key > best_key  # strict: earlier blocks win ties
        best_idx = tl.where(better, block_idx, best_idx)
        best_key = tl.where(better, block_key, best_key)
    return best_key, best_idx


@triton.jit
def _target_token(p_row, inv_row, argmax_ptr, vocab, HAS_P: tl.constexpr, BLOCK: tl.constexpr):
    """The target's own token at one position: drawn from p, or its argmax when greedy."""
    if HAS_P:
        _, token = _race_argmax(p_row, p_row, inv_row, 0, vocab, False, False, BLOCK)
        return token.to(tl.int64)
    else:
        return tl.load(argmax_ptr).to(tl.int64)


@triton.jit
def _rejection_kernel(
    output_ptr,  # [batch, k + 1] int64
    num_accepted_ptr,  # [batch] int64
    draft_ptr,  # [batch, k] int64
    q_ptr,  # [batch, k, vocab] float32
    p_ptr,  # [batch, k + 1, vocab] float32
    argmax_ptr,  # [batch, k + 1] int64
    uniforms_ptr,  # [batch, k] float32
    inv_exp_ptr,  # [batch, k + 1, vocab] float32
    rate,  # synthetic acceptance rate
    k,
    vocab,
    METHOD: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    num_accepted = tl.full((), 0, tl.int32)
    accepting = tl.full((), 1, tl.int32)  # 1 until the first rejection
    tl.store(output_ptr + req * (k + 1) + k, _PLACEHOLDER)  # bonus slot; overwritten below if reached
    for i in range(0, k):
        draft_id = tl.load(draft_ptr + req * k + i)
        is_draft = draft_id != _PLACEHOLDER  # a padded position: never accepted, and never read at id -1
        safe_id = tl.where(is_draft, draft_id, 0)
        row = req * (k + 1) + i  # position i in the [batch * (k + 1)] rows of p
        if METHOD == _SYNTHETIC:
            ok = tl.load(uniforms_ptr + req * k + i) < rate
        elif METHOD == _STRICT:
            ok = draft_id == _target_token(
                p_ptr + row * vocab, inv_exp_ptr + row * vocab, argmax_ptr + row, vocab, HAS_P, BLOCK
            )
        else:
            p_draft = tl.load(p_ptr + row * vocab + safe_id)
            if HAS_Q:
                q_draft = tl.load(q_ptr + (req * k + i) * vocab + safe_id)
            else:
                q_draft = 1.0
            ok = tl.load(uniforms_ptr + req * k + i) * q_draft < p_draft
        accepting = accepting & (ok & is_draft).to(tl.int32)
        num_accepted += accepting
        tl.store(output_ptr + row, tl.where(accepting == 1, draft_id, _PLACEHOLDER))

    # The target's own token at position num_accepted: emitted by strict and synthetic, the bonus
    # when all drafts were accepted, and the fallback of an all-zero residual.
    last = req * (k + 1) + num_accepted
    final = _target_token(p_ptr + last * vocab, inv_exp_ptr + last * vocab, argmax_ptr + last, vocab, HAS_P, BLOCK)
    if METHOD == _PROBABILISTIC:
        if num_accepted < k:
            draft_id = tl.load(draft_ptr + req * k + num_accepted)
            if draft_id != _PLACEHOLDER:  # a rejected draft; where a row's drafts end: the bonus, as drawn
                residual_key, recovered = _race_argmax(
                    p_ptr + last * vocab, q_ptr + (req * k + num_accepted) * vocab, inv_exp_ptr + last * vocab,
                    draft_id, vocab, True, HAS_Q, BLOCK,
                )
                final = tl.where(residual_key > 0, recovered.to(tl.int64), final)
    tl.store(output_ptr + last, final)
    tl.store(num_accepted_ptr + req, num_accepted.to(tl.int64))
