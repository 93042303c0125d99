"""The target_verifier tensors of structured output: each row's allowed-token bitmask (``specdec.grammar``).

Part of the verify wire (:mod:`specdec_triton.wire` calls these): a request leaves them
out unless one of its sequences has a grammar, so other steps carry nothing more. The
masks are the orchestrator's (the grammar matcher lives with the sequence's tokens);
target_verifier applies them to its logits before argmax and ``p``.
``allowed_tokens`` is every masked row's ``ceil(vocab / 32)`` int32 words, rows of the
sequences in order, flattened; ``num_allowed_rows`` ``[S]`` says how many rows each
sequence has (its ``num_logits``, or 0: no grammar).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.types import VerifyRequest
from specdec_triton.packing import each
from specdec_triton.plumbing import RequestError

GRAMMAR_INPUTS = ("allowed_tokens", "num_allowed_rows")


def grammar_inputs(requests: Sequence[VerifyRequest]) -> dict[str, np.ndarray]:
    masks = [r.allowed_tokens for r in requests]
    if all(m is None for m in masks):
        return {}
    rows = [0 if m is None else m.shape[0] for m in masks]
    words = np.concatenate([m.cpu().numpy().reshape(-1) for m in masks if m is not None]).astype(np.int32)
    return {"allowed_tokens": words, "num_allowed_rows": np.array(rows, np.int32)}  # [rows * words], [S]


def with_allowed_tokens(requests: list[VerifyRequest], inputs: Mapping[str, np.ndarray]) -> list[VerifyRequest]:
    """``requests`` with their masks; each masked sequence's rows must be its ``num_logits``."""
    if "num_allowed_rows" not in inputs:
        return requests
    rows = each(inputs, "num_allowed_rows", len(requests), int, 0)
    words = np.asarray(inputs.get("allowed_tokens", np.zeros(0, np.int32)), dtype=np.int32).reshape(-1)
    total = sum(rows)
    if total == 0 or len(words) % total:
        raise RequestError(f"input 'allowed_tokens' holds {len(words)} words, not a whole number of words for each "
                           f"of the {total} rows 'num_allowed_rows' counts")  # fmt: skip
    width = len(words) // total
    out, start = [], 0
    for request, n in zip(requests, rows):
        if n and n != request.num_logits:
            raise RequestError(f"seq {request.seq_id!r}: input 'num_allowed_rows' is {n}, but num_logits is "
                               f"{request.num_logits}: every row of a masked sequence needs its mask")  # fmt: skip
        mask = torch.from_numpy(words[start : start + n * width].reshape(n, width).copy()) if n else None
        out.append(replace(request, allowed_tokens=mask) if n else request)
        start += n * width
    return out
