"""Logit processing shared by the target verifier and the draft proposer.

Both sides must apply the *same* processing (temperature, then top-k, then top-p,
the order Hugging Face and vLLM use) for rejection sampling to be lossless with
respect to the distribution the user asked for.
"""
from __future__ import annotations

import torch

from specdec.types import SamplingParams, check_logit_bias

_SEED_MASK = (1 << 63) - 1


def derive_seed(base_seed: int, step: int, stream: int) -> int:
    """A deterministic, well-mixed seed for one draw site (step, stream) of a request."""
    x = (base_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _SEED_MASK
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _SEED_MASK
    return x ^ (x >> 32)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


def process_logits(
    logits: torch.Tensor,  # [n, vocab]
    params: SamplingParams,
    num_banned_rows: int = 0,
    banned_token_ids: tuple[int, ...] = (),
) -> torch.Tensor:  # [n, vocab] float32 probabilities
    """Turn raw logits into the sampling distribution ``params`` describes.

    Greedy params give a one-hot distribution at the argmax, so callers that need
    probabilities for a greedy request still get a valid ``p``.
    """
    logits = _ban(logits.float(), num_banned_rows, banned_token_ids)
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    logits = logits / params.temperature
    if params.min_p > 0:  # vLLM's order: min-p after temperature, before top-k and top-p
        probs = logits.softmax(dim=-1)  # [n, vocab]
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p
        # (always keeps the most likely token).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def greedy_tokens(
    logits: torch.Tensor,  # [n, vocab]
    num_banned_rows: int = 0,
    banned_token_ids: tuple[int, ...] = (),
) -> torch.Tensor:  # [n] int64
    return _ban(logits, num_banned_rows, banned_token_ids).argmax(dim=-1)


def apply_logit_bias(
    logits: torch.Tensor,  # [n, vocab]
    logit_bias: tuple[tuple[int, float], ...],  # SamplingParams.logit_bias
) -> torch.Tensor:  # [n, vocab] float32 (``logits`` itself when there is no bias)
    """OpenAI's ``logit_bias``: each listed token's logit moved by its bias, in every row, before any processing.

    It changes the distribution a request samples from, so the verifier applies it to the
    target's logits (greedy argmax, ``p`` and log probabilities all see it) and the drafters
    to theirs: a draft that ignored it would stay lossless, but be rejected more often.
    """
    if not logit_bias:
        return logits
    check_logit_bias(logit_bias, logits.shape[-1])
    ids = torch.tensor([token for token, _ in logit_bias], dtype=torch.long, device=logits.device)  # [b]
    values = torch.tensor([bias for _, bias in logit_bias], dtype=torch.float32, device=logits.device)  # [b]
    return logits.float().index_add(-1, ids, values.expand(logits.shape[0], -1))


def check_banned(banned_token_ids: tuple[int, ...], vocab_size: int) -> None:
    """Refuse ids outside the vocabulary before any forward runs (a cache moved for nothing otherwise)."""
    if not all(0 <= t < vocab_size for t in banned_token_ids):
        raise ValueError(f"banned_token_ids must be in [0, {vocab_size}), got {sorted(banned_token_ids)[-1]}")


def _ban(logits: torch.Tensor, num_banned_rows: int, banned_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``logits`` ([n, vocab]) with the banned ids at -inf in the first ``num_banned_rows`` rows (a copy if any)."""
    if not (num_banned_rows and banned_token_ids):
        return logits
    check_banned(banned_token_ids, logits.shape[-1])
    logits = logits.clone()
    logits[: min(num_banned_rows, logits.shape[0]), list(banned_token_ids)] = float("-inf")
    return logits


def sample_from_probs(
    probs: torch.Tensor,  # [n, vocab]
    generator: torch.Generator,
) -> torch.Tensor:  # [n] int64
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
