"""The tensors that cross between the served models, and their conversion to ``specdec.types``.

Both ends of every BLS call use these functions -- the orchestrator encodes, the
composing model decodes -- so the tensor names and layouts live in one place and
round-trip tests cover them. Every array is what ``pb_utils.Tensor`` takes (numpy)
without a batch dimension: for the dynamically batched models (draft_proposer,
target_verifier) ``plumbing.bls(batched=True)`` and ``plumbing.answer_batch`` add and
strip the one batch item per request.

A distribution that is absent (greedy ``p``, one-hot ``q``) travels as a
``[0, 0]`` array, so every model always returns the same outputs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec.rejection_sampler import METHODS
from specdec.types import Proposal, ProposeRequest, SampleResult, SamplingParams, VerifyRequest, VerifyResult
from specdec_triton.plumbing import RequestError, bytes_array, scalar, text

TOKENIZER = "tokenizer"
DETOKENIZER = "detokenizer"
DRAFT_PROPOSER = "draft_proposer"
TARGET_VERIFIER = "target_verifier"
REJECTION_SAMPLER = "rejection_sampler"

SAMPLING_INPUTS = ("temperature", "top_k", "top_p")
PROPOSE_INPUTS = ("seq_id", "release", "token_ids", "num_tokens", *SAMPLING_INPUTS, "seed",
                  "num_banned_tokens", "banned_token_ids")  # fmt: skip
PROPOSE_OUTPUTS = ("draft_token_ids", "draft_probs", "max_num_seqs")
VERIFY_INPUTS = ("seq_id", "release", "position", "token_ids", "num_logits", *SAMPLING_INPUTS,
                 "num_banned_rows", "banned_token_ids")  # fmt: skip
VERIFY_OUTPUTS = ("target_token_ids", "target_probs", "max_model_len", "vocab_size", "max_num_seqs")
SAMPLE_INPUTS = ("draft_token_ids", "draft_probs", "target_probs", "target_token_ids", "seed",
                 "rejection_sample_method")  # fmt: skip
SAMPLE_OUTPUTS = ("output_token_ids", "num_accepted")
TOKENIZE_INPUTS = ("text_input", "stop_words")
TOKENIZE_OUTPUTS = ("input_ids", "stop_words_ids", "stop_words_lens", "end_ids")
DETOKENIZE_INPUTS = ("token_ids",)
DETOKENIZE_OUTPUTS = ("text_output",)

_NO_PROBS = np.zeros((0, 0), dtype=np.float32)


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _one(value, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)


def _probs_array(probs: torch.Tensor | None) -> np.ndarray:
    return _NO_PROBS if probs is None else probs.detach().float().cpu().numpy()


def _probs_tensor(array: np.ndarray | None) -> torch.Tensor | None:
    return None if array is None or array.size == 0 else torch.from_numpy(np.ascontiguousarray(array, np.float32))


def _required(inputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in inputs:
        raise RequestError(f"input '{name}' is required")
    return inputs[name]


# --- per-sequence state: seq_id and release ----------------------------------------------------


def release_inputs(seq_id: str) -> dict[str, np.ndarray]:
    return {"seq_id": bytes_array([seq_id]), "release": _one(True, np.bool_)}


def seq_id_of(inputs: Mapping[str, np.ndarray]) -> str:
    seq_id = text(inputs, "seq_id")
    if seq_id is None:
        raise RequestError("input 'seq_id' is required")
    return seq_id


def is_release(inputs: Mapping[str, np.ndarray]) -> bool:
    return scalar(inputs, "release", bool, False)


def _sampling_inputs(sampling: SamplingParams) -> dict[str, np.ndarray]:
    return {
        "temperature": _one(sampling.temperature, np.float32),
        "top_k": _one(sampling.top_k, np.int32),
        "top_p": _one(sampling.top_p, np.float32),
    }


def _sampling_of(inputs: Mapping[str, np.ndarray]) -> SamplingParams:
    return SamplingParams(
        temperature=scalar(inputs, "temperature", float, 0.0),
        top_k=scalar(inputs, "top_k", int, 0),
        top_p=scalar(inputs, "top_p", float, 1.0),
    )


def _ban_inputs(count_name: str, count: int, banned_token_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """min_tokens: how many positions (drafts or target rows) may not emit ``banned_token_ids``; none: no inputs."""
    if not count:
        return {}
    return {count_name: _one(count, np.int32), "banned_token_ids": _i64(banned_token_ids)}


def _banned_ids_of(inputs: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    banned = inputs.get("banned_token_ids")
    return () if banned is None else tuple(banned.reshape(-1).tolist())


# --- draft_proposer ----------------------------------------------------------------------------


def propose_inputs(request: ProposeRequest) -> dict[str, np.ndarray]:
    return {
        "seq_id": bytes_array([request.seq_id]),
        "token_ids": _i64(request.token_ids),  # [seq_len]: prompt + output so far
        "num_tokens": _one(request.num_tokens, np.int32),
        **_sampling_inputs(request.sampling),
        "seed": _one(request.seed, np.uint64),
        **_ban_inputs("num_banned_tokens", request.num_banned_tokens, request.banned_token_ids),
    }


def propose_request_of(inputs: Mapping[str, np.ndarray]) -> ProposeRequest:
    return ProposeRequest(
        seq_id=seq_id_of(inputs),
        token_ids=_required(inputs, "token_ids").reshape(-1).tolist(),
        num_tokens=scalar(inputs, "num_tokens", int, 0),
        sampling=_sampling_of(inputs),
        seed=scalar(inputs, "seed", int, 0),
        num_banned_tokens=scalar(inputs, "num_banned_tokens", int, 0),
        banned_token_ids=_banned_ids_of(inputs),
    )


def proposal_outputs(proposal: Proposal | None, max_num_seqs: int | None) -> dict[str, np.ndarray]:
    """``proposal`` None answers a release. ``max_num_seqs``: the sequences it can hold (None: no limit)."""
    return {
        "draft_token_ids": _i64([] if proposal is None else proposal.token_ids.cpu().numpy()),  # [k']
        "draft_probs": _probs_array(None if proposal is None else proposal.probs),  # [k', vocab] q or [0, 0]
        "max_num_seqs": _one(max_num_seqs or 0, np.int64),  # 0: no limit
    }


def proposal_of(outputs: Mapping[str, np.ndarray]) -> Proposal:
    return Proposal(
        token_ids=torch.from_numpy(_i64(outputs["draft_token_ids"]).copy()),
        probs=_probs_tensor(outputs.get("draft_probs")),
    )


# --- target_verifier ---------------------------------------------------------------------------


def verify_inputs(request: VerifyRequest) -> dict[str, np.ndarray]:
    return {
        "seq_id": bytes_array([request.seq_id]),
        "position": _one(request.position, np.int64),
        "token_ids": _i64(request.token_ids),  # [n]: tokens not yet in the target's cache
        "num_logits": _one(request.num_logits, np.int32),
        **_sampling_inputs(request.sampling),
        **_ban_inputs("num_banned_rows", request.num_banned_rows, request.banned_token_ids),
    }


def verify_request_of(inputs: Mapping[str, np.ndarray]) -> VerifyRequest:
    return VerifyRequest(
        seq_id=seq_id_of(inputs),
        position=scalar(inputs, "position", int, 0),
        token_ids=_required(inputs, "token_ids").reshape(-1).tolist(),
        num_logits=scalar(inputs, "num_logits", int, 1),
        sampling=_sampling_of(inputs),
        num_banned_rows=scalar(inputs, "num_banned_rows", int, 0),
        banned_token_ids=_banned_ids_of(inputs),
    )


def verify_outputs(
    result: VerifyResult | None, max_model_len: int | None, vocab_size: int, max_num_seqs: int | None
) -> dict[str, np.ndarray]:
    """``result`` None answers a release. Every response also reports the limits requests are checked against."""
    return {
        "target_token_ids": _i64([] if result is None else result.argmax.cpu().numpy()),  # [num_logits]
        "target_probs": _probs_array(None if result is None else result.probs),  # [num_logits, vocab] p or [0, 0]
        "max_model_len": _one(max_model_len or 0, np.int64),  # 0: no limit
        "vocab_size": _one(vocab_size, np.int64),
        "max_num_seqs": _one(max_num_seqs or 0, np.int64),  # 0: no limit
    }


def verify_result_of(outputs: Mapping[str, np.ndarray]) -> VerifyResult:
    return VerifyResult(
        argmax=torch.from_numpy(_i64(outputs["target_token_ids"]).copy()),
        probs=_probs_tensor(outputs.get("target_probs")),
    )


def optional_limit(outputs: Mapping[str, np.ndarray], name: str) -> int | None:
    """A limit reported by a proposer or verifier response; None when it reports 0 (no limit)."""
    return int(outputs[name].reshape(-1)[0]) or None


# --- rejection_sampler -------------------------------------------------------------------------


def sample_inputs(
    draft_token_ids: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab] q or None (one-hot)
    verify: VerifyResult,
    seed: int,
) -> dict[str, np.ndarray]:
    inputs = {
        "draft_token_ids": _i64(draft_token_ids.cpu().numpy()),
        "target_token_ids": _i64(verify.argmax.cpu().numpy()),  # [k + 1]
        "seed": _one(seed, np.uint64),
    }
    if draft_probs is not None:
        inputs["draft_probs"] = _probs_array(draft_probs)
    if verify.probs is not None:
        inputs["target_probs"] = _probs_array(verify.probs)  # [k + 1, vocab]
    return inputs


@dataclass(frozen=True)
class SampleCall:
    """One rejection_sampler request, decoded."""

    draft_token_ids: torch.Tensor  # [k] int64
    draft_probs: torch.Tensor | None  # [k, vocab] q; None -> one-hot at the drafts
    verify: VerifyResult  # argmax [k + 1]; probs [k + 1, vocab] p or None (greedy)
    seed: int | None  # None -> a fresh random seed
    method: str | None  # per-request override of the configured method

    def to(self, device: str) -> SampleCall:
        probs = self.verify.probs
        return replace(
            self,
            draft_token_ids=self.draft_token_ids.to(device),
            draft_probs=None if self.draft_probs is None else self.draft_probs.to(device),
            verify=VerifyResult(self.verify.argmax.to(device), None if probs is None else probs.to(device)),
        )


def sample_call_of(inputs: Mapping[str, np.ndarray]) -> SampleCall:
    draft_token_ids = torch.from_numpy(_i64(_required(inputs, "draft_token_ids")).copy())
    target_probs = _probs_tensor(inputs.get("target_probs"))
    if "target_token_ids" in inputs:
        argmax = torch.from_numpy(_i64(inputs["target_token_ids"]).copy())
    elif target_probs is not None:
        argmax = target_probs.argmax(dim=-1)  # [k + 1]
    else:
        raise RequestError("one of the inputs 'target_probs' or 'target_token_ids' is required")
    method = text(inputs, "rejection_sample_method")
    if method is not None and method not in METHODS:
        raise RequestError(f"input 'rejection_sample_method' must be one of {METHODS}, got {method!r}")
    return SampleCall(
        draft_token_ids=draft_token_ids,
        draft_probs=_probs_tensor(inputs.get("draft_probs")),
        verify=VerifyResult(argmax=argmax, probs=target_probs),
        seed=scalar(inputs, "seed", int),
        method=method,
    )


def sample_result_outputs(result: SampleResult) -> dict[str, np.ndarray]:
    return {
        "output_token_ids": _i64(result.output_token_ids.cpu().numpy()),  # [num_accepted + 1]
        "num_accepted": _one(result.num_accepted, np.int32),
    }


def sample_result_of(outputs: Mapping[str, np.ndarray]) -> SampleResult:
    return SampleResult(
        output_token_ids=torch.from_numpy(_i64(outputs["output_token_ids"]).copy()),
        num_accepted=int(outputs["num_accepted"][0]),
    )


# --- tokenizer: stop words travel as one flat id array plus lengths -----------------------------


def stop_words_arrays(sequences: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    return {
        "stop_words_ids": _i64([t for seq in sequences for t in seq]),  # [sum of lengths]
        "stop_words_lens": np.array([len(seq) for seq in sequences], dtype=np.int32),  # [num stop words]
    }


def stop_sequences_of(outputs: Mapping[str, np.ndarray]) -> tuple[tuple[int, ...], ...]:
    flat = _i64(outputs["stop_words_ids"]).tolist()
    sequences, start = [], 0
    for length in outputs["stop_words_lens"].reshape(-1).tolist():
        sequences.append(tuple(flat[start : start + length]))
        start += length
    return tuple(sequences)
