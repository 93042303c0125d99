"""Batched target verification on the fast engine (same contract as ``specdec.verifier.TargetVerifier``).

Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) scores ``[last, d_1 .. d_k]``
in one target pass and reads ``k + 1`` distributions ``p``. Here every request of a
``verify`` call shares that pass: a ragged batch over one static slot KV cache, which
on CUDA replays a captured graph when the batch fits a bucket.
"""
from __future__ import annotations

import os

from specdec.fast.runner import FastCausalLM, ForwardCall
from specdec.models import OwnsOneModel
from specdec.types import VerifyRequest, VerifyResult
from specdec.verifier import verify_result


class FastTargetVerifier(OwnsOneModel):
    """A Llama-family target loaded from safetensors; all requests of a call run as one forward."""

    def __init__(self, path: str | os.PathLike, *args, **kwargs):
        """Arguments: those of :class:`~specdec.fast.runner.FastCausalLM`, which owns the model and its cache."""
        self._lm = FastCausalLM(path, *args, **kwargs)

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        calls = [ForwardCall(r.seq_id, r.position, list(r.token_ids), r.num_logits) for r in requests]
        return [verify_result(logits, r) for logits, r in zip(self._lm.forward(calls), requests)]
