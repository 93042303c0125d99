"""The target_verifier tensors for penalties, bad words and log probabilities (``specdec.penalties``).

Part of the verify wire (:mod:`specdec_triton.wire` calls these): a request leaves every
one of these inputs out unless one of its sequences has penalties or asks for log
probabilities, so plain steps carry nothing more. Per sequence: ``[S]`` penalty values
and ``num_prompt_tokens`` (where output tokens start, for presence and frequency
counts); bad words as one flat id array, ``bad_words_lens`` (one length per word, every
sequence's words in order) and ``num_bad_words`` ``[S]``. Back come, for the sequences
that asked, one ``log_kept_mass`` float per row (``target_log_mass``), flagged by
``has_target_log_mass``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from specdec.penalties import Penalties
from specdec.types import VerifyRequest, VerifyResult
from specdec_triton.packing import cut, each, flat, i32, i64
from specdec_triton.plumbing import RequestError

PENALTY_INPUTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "num_prompt_tokens", "bad_words_ids",
                  "bad_words_lens", "num_bad_words", "return_log_probs", "num_top_log_probs")  # fmt: skip
LOG_PROB_OUTPUTS = ("target_log_mass", "has_target_log_mass", "target_top_token_ids", "target_top_log_probs",
                    "num_target_top")  # fmt: skip


def penalty_inputs(requests: Sequence[VerifyRequest]) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    if any(r.penalties.active for r in requests):
        penalties = [r.penalties for r in requests]
        inputs.update({
            "repetition_penalty": np.array([p.repetition_penalty for p in penalties], np.float32),  # [S]
            "presence_penalty": np.array([p.presence_penalty for p in penalties], np.float32),  # [S]
            "frequency_penalty": np.array([p.frequency_penalty for p in penalties], np.float32),  # [S]
            "num_prompt_tokens": i64([r.num_prompt_tokens for r in requests]),  # [S]
            "bad_words_ids": flat([word for p in penalties for word in p.bad_words]),  # every word, concatenated
            "bad_words_lens": i32([len(word) for p in penalties for word in p.bad_words]),  # [words]
            "num_bad_words": i32([len(p.bad_words) for p in penalties]),  # [S]
        })  # fmt: skip
    if any(r.log_probs for r in requests):
        inputs["return_log_probs"] = np.array([r.log_probs for r in requests], dtype=np.bool_)  # [S]
    if any(r.num_top_log_probs for r in requests):
        inputs["num_top_log_probs"] = i32([r.num_top_log_probs for r in requests])  # [S]
    return inputs


def top_counts_of(inputs: Mapping[str, np.ndarray], count: int) -> list[int]:
    """Each sequence's num_top_log_probs (0: none)."""
    return each(inputs, "num_top_log_probs", count, int, 0)


def penalties_of(inputs: Mapping[str, np.ndarray], count: int) -> list[tuple[Penalties, int, bool]]:
    """Each sequence's (penalties, num_prompt_tokens, log_probs)."""
    repetition = each(inputs, "repetition_penalty", count, float, 1.0)
    presence = each(inputs, "presence_penalty", count, float, 0.0)
    frequency = each(inputs, "frequency_penalty", count, float, 0.0)
    prompt_lengths = each(inputs, "num_prompt_tokens", count, int, 0)
    log_probs = each(inputs, "return_log_probs", count, bool, False)
    return [
        (Penalties(r, p, f, words), n, lp)
        for r, p, f, words, n, lp in zip(repetition, presence, frequency, _bad_words_of(inputs, count),
                                         prompt_lengths, log_probs)  # fmt: skip
    ]


def _bad_words_of(inputs: Mapping[str, np.ndarray], count: int) -> list[tuple[tuple[int, ...], ...]]:
    if "num_bad_words" not in inputs:
        return [()] * count
    ids = i64(inputs.get("bad_words_ids", np.zeros(0, np.int64))).tolist()
    lengths = i32(inputs.get("bad_words_lens", np.zeros(0, np.int32))).tolist()
    per_sequence = each(inputs, "num_bad_words", count, int, 0)
    if sum(per_sequence) != len(lengths) or sum(lengths) != len(ids):
        raise RequestError(
            f"inputs 'num_bad_words' ({sum(per_sequence)} words), 'bad_words_lens' ({len(lengths)} words, "
            f"{sum(lengths)} ids) and 'bad_words_ids' ({len(ids)} ids) do not add up"
        )
    words = [tuple(word) for word in cut(ids, lengths)]
    return [tuple(sequence) for sequence in cut(words, per_sequence)]


def log_mass_outputs(results: Sequence[VerifyResult]) -> dict[str, np.ndarray]:
    """The log masses; and each row's top alternatives (``num_target_top`` [S] per row, 0: none), rows flattened."""
    masses = [r.log_mass for r in results]
    tops = [(r.top_token_ids, r.top_log_probs) if r.top_token_ids is not None else None for r in results]
    return {
        "target_log_mass": np.array([v for m in masses if m is not None for v in m.cpu().tolist()], np.float32),
        "has_target_log_mass": np.array([m is not None for m in masses], dtype=np.bool_),  # [S]
        "target_top_token_ids": np.array([v for t in tops if t for v in t[0].reshape(-1).tolist()], np.int64),
        "target_top_log_probs": np.array([v for t in tops if t for v in t[1].reshape(-1).tolist()], np.float32),
        "num_target_top": i32([t[0].shape[-1] if t else 0 for t in tops]),  # [S]
    }


def tops_of(outputs: Mapping[str, np.ndarray], num_logits: Sequence[int]) -> list[tuple[torch.Tensor | None, ...]]:
    """Each sequence's (top ids [num_logits, n], their log probs [num_logits, n]), or (None, None)."""
    if "num_target_top" not in outputs:
        return [(None, None)] * len(num_logits)
    ids = np.asarray(outputs["target_top_token_ids"], np.int64).reshape(-1)
    values = np.asarray(outputs["target_top_log_probs"], np.float32).reshape(-1)
    out, start = [], 0
    for n, rows in zip(i32(outputs["num_target_top"]).reshape(-1).tolist(), num_logits):
        if not n:
            out.append((None, None))
            continue
        end = start + rows * n
        out.append((torch.from_numpy(ids[start:end].reshape(rows, n).copy()),
                    torch.from_numpy(values[start:end].reshape(rows, n).copy())))  # fmt: skip
        start = end
    return out


def log_masses_of(outputs: Mapping[str, np.ndarray], num_logits: Sequence[int]) -> list[torch.Tensor | None]:
    """Each sequence's ``[num_logits]`` log masses, or None where it asked for none (or none were requested)."""
    if "has_target_log_mass" not in outputs:
        return [None] * len(num_logits)
    values = np.asarray(outputs["target_log_mass"], dtype=np.float32).reshape(-1)
    out, start = [], 0
    for has, rows in zip(np.asarray(outputs["has_target_log_mass"]).reshape(-1).tolist(), num_logits):
        out.append(torch.from_numpy(values[start : start + rows].copy()) if has else None)
        start += rows if has else 0
    return out
