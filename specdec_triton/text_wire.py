"""The tensors of the text models: tokenizer (stop words as one flat id array plus lengths) and detokenizer.

Kept apart from ``wire``, the step's tensors: the text models sit at the edges of a request,
not in its steps.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specdec_triton.packing import cut, flat, i32, i64, required, split
from specdec_triton.plumbing import RequestError

TOKENIZE_INPUTS = ("text_input", "stop_words", "describe")
TOKENIZE_OUTPUTS = ("input_ids", "stop_words_ids", "stop_words_lens", "end_ids")
DETOKENIZE_INPUTS = ("token_ids", "num_token_ids")
DETOKENIZE_OUTPUTS = ("text_output",)


# --- detokenizer: one text per sequence ------------------------------------------------------------


def detokenize_inputs(token_id_lists: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    return {"token_ids": flat(token_id_lists), "num_token_ids": i32([len(ids) for ids in token_id_lists])}


def token_id_lists_of(inputs: Mapping[str, np.ndarray]) -> list[list[int]]:
    count = np.asarray(inputs["num_token_ids"]).size if "num_token_ids" in inputs else 1
    required(inputs, "token_ids")
    lists = split(inputs, "token_ids", "num_token_ids", count)
    for ids in lists:
        if any(t < 0 for t in ids):
            raise RequestError(f"input 'token_ids' must be >= 0, got {[t for t in ids if t < 0][:8]}")
    return lists


def texts_of(outputs: Mapping[str, np.ndarray]) -> list[str]:
    return [item.decode("utf-8") for item in np.asarray(outputs["text_output"]).reshape(-1)]


# --- tokenizer: stop words travel as one flat id array plus lengths -----------------------------


def stop_words_arrays(sequences: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    return {
        "stop_words_ids": i64([t for seq in sequences for t in seq]),  # [sum of lengths]
        "stop_words_lens": np.array([len(seq) for seq in sequences], dtype=np.int32),  # [num stop words]
    }


def stop_sequences_of(outputs: Mapping[str, np.ndarray]) -> tuple[tuple[int, ...], ...]:
    flat = i64(outputs["stop_words_ids"]).tolist()
    return tuple(tuple(s) for s in cut(flat, outputs["stop_words_lens"].reshape(-1).tolist()))
