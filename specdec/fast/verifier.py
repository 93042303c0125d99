"""Batched target verification on the fast engine (same contract as ``specdec.verifier.TargetVerifier``).

Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) scores ``[last, d_1 .. d_k]``
in one target pass and reads ``k + 1`` distributions ``p``. Here every request of a
``verify`` call shares that pass: a ragged batch over one static slot KV cache, which
on CUDA replays a captured graph when the batch fits a bucket.
"""
from __future__ import annotations

import os

import torch

from specdec.fast.cuda_graphs import DEFAULT_GRAPH_NUM_TOKENS
from specdec.fast.runner import FastCausalLM, ForwardCall
from specdec.types import VerifyRequest, VerifyResult
from specdec.verifier import verify_result


class FastTargetVerifier:
    """A Llama-family target loaded from safetensors; all requests of a call run as one forward."""

    def __init__(
        self,
        path: str | os.PathLike,
        dtype: str = "auto",
        device: str | torch.device = "cpu",
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        cuda_graphs: bool | None = None,
        *,
        graph_num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS,
        triton_attention: bool = False,
    ):
        self._lm = FastCausalLM(
            path, dtype, device, max_num_seqs, max_model_len, cuda_graphs,
            graph_num_tokens=graph_num_tokens, triton_attention=triton_attention,
        )

    @property
    def num_active_sequences(self) -> int:
        return self._lm.num_sequences

    @property
    def vocab_size(self) -> int:
        return self._lm.vocab_size

    @property
    def max_model_len(self) -> int:
        return self._lm.max_model_len

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        calls = [ForwardCall(r.seq_id, r.position, list(r.token_ids), r.num_logits) for r in requests]
        return [verify_result(logits, r) for logits, r in zip(self._lm.forward(calls), requests)]

    def release(self, seq_id: str) -> None:
        self._lm.release(seq_id)
