"""The target's hidden states on the wire: target_verifier -> orchestrator -> draft_proposer.

Draft heads (EAGLE-3, MLP speculator) read the target's hidden states at the positions it
verified. The orchestrator asks target_verifier for the layers the draft proposer named in
its description (``describe_hidden_state_layer_ids``), keeps the rows of the tokens that
stay in the sequence (``SequenceState``), and sends them with the next propose request.
Tensors travel as float32 numpy arrays through the orchestrator: on a CPU instance that is
one small copy per step ([tokens, layers * hidden]); a GPU deployment pays a device-to-host
copy and back for it. The names and layouts live here, beside ``wire`` (same conventions:
no batch dimension, one or more sequences per request).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.types import ModelDescription, ProposeRequest, VerifyRequest, VerifyResult
from specdec.verifier import asked_hidden_layers
from specdec_triton.describe_wire import (
    DESCRIBE_OUTPUTS, DESCRIBE_SETTINGS_OUTPUTS, description_of, settings_outputs, with_described_settings,
)  # fmt: skip
from specdec_triton.packing import each, i32, i64
from specdec_triton.plumbing import RequestError

VERIFY_HIDDEN_INPUTS = ("hidden_state_layer_ids",)  # [L] int64, one list for every sequence of the request
VERIFY_HIDDEN_OUTPUTS = ("hidden_states",)  # [sum of num_token_ids, L * hidden] float32
PROPOSE_HIDDEN_INPUTS = ("hidden_states", "num_hidden_states", "hidden_position")
DESCRIBE_HIDDEN_OUTPUTS = ("describe_hidden_state_layer_ids",)  # [L] int64; [0]: the proposer reads none


def _f32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


# --- target_verifier ---------------------------------------------------------------------------


def verify_hidden_inputs(requests: Sequence[VerifyRequest]) -> dict[str, np.ndarray]:
    """One list of layers for every sequence of the request (``asked_hidden_layers``)."""
    ids = asked_hidden_layers(requests)
    return {"hidden_state_layer_ids": i64(ids)} if ids else {}


def with_hidden_layers(requests: list[VerifyRequest], inputs: Mapping[str, np.ndarray]) -> list[VerifyRequest]:
    if "hidden_state_layer_ids" not in inputs:
        return requests
    ids = tuple(i64(inputs["hidden_state_layer_ids"]).reshape(-1).tolist())
    return [replace(r, hidden_layers=ids) for r in requests]


def hidden_outputs(results: Sequence[VerifyResult]) -> dict[str, np.ndarray]:
    """Every sequence's rows, stacked; ``[0, 0]`` when none was asked for."""
    rows = [r.hidden_states for r in results if r.hidden_states is not None]
    if not rows:
        return {"hidden_states": np.zeros((0, 0), np.float32)}
    return {"hidden_states": _f32(torch.cat([h.to(rows[0].device) for h in rows]))}


def attach_hidden(
    results: list[VerifyResult], outputs: Mapping[str, np.ndarray], num_token_ids: Sequence[int]
) -> list[VerifyResult]:
    """The results with each sequence's rows (one per token it fed)."""
    hidden = np.asarray(outputs["hidden_states"])
    if hidden.shape[0] != sum(num_token_ids):
        raise RuntimeError(
            f"target_verifier returned {hidden.shape[0]} hidden-state rows for {sum(num_token_ids)} tokens"
        )
    parts = torch.from_numpy(np.ascontiguousarray(hidden)).split(list(num_token_ids))
    return [replace(r, hidden_states=h) for r, h in zip(results, parts)]


# --- draft_proposer ----------------------------------------------------------------------------


def propose_hidden_inputs(requests: Sequence[ProposeRequest]) -> dict[str, np.ndarray]:
    """Flattened rows (``[sum n * features]``: a ragged batch input is one-dimensional) and their counts."""
    rows = [r.hidden_states for r in requests if r.hidden_states is not None]
    if not rows:
        return {}
    return {
        "hidden_states": _f32(torch.cat([h.reshape(-1).cpu() for h in rows])),  # [sum of n * features]
        "num_hidden_states": i32([0 if r.hidden_states is None else r.hidden_states.shape[0] for r in requests]),
        "hidden_position": i64([r.hidden_position for r in requests]),  # [S]
    }


def with_hidden_states(requests: list[ProposeRequest], inputs: Mapping[str, np.ndarray]) -> list[ProposeRequest]:
    if "hidden_states" not in inputs:
        return requests
    count = len(requests)
    rows = each(inputs, "num_hidden_states", count, int, 0)
    positions = each(inputs, "hidden_position", count, int, 0)
    flat = np.asarray(inputs["hidden_states"], np.float32).reshape(-1)
    if sum(rows) == 0 or flat.size % sum(rows) or min(rows) < 0:
        raise RequestError(
            f"input 'hidden_states' holds {flat.size} values, not a whole number of rows for num_hidden_states={rows}"
        )
    width = flat.size // sum(rows)
    parts = torch.from_numpy(flat.copy()).reshape(sum(rows), width).split(rows)
    return [replace(r, hidden_states=h if n else None, hidden_position=p)
            for r, h, n, p in zip(requests, parts, rows, positions)]  # fmt: skip


def description_hidden_outputs(desc: ModelDescription) -> dict[str, np.ndarray]:
    return {"describe_hidden_state_layer_ids": i64(desc.hidden_state_layers)}


def with_described_layers(desc: ModelDescription, outputs: Mapping[str, np.ndarray]) -> ModelDescription:
    ids = tuple(i64(outputs["describe_hidden_state_layer_ids"]).reshape(-1).tolist())
    return replace(desc, hidden_state_layers=ids)


# What a draft describes beyond any model's description: the hidden states a head reads, and the
# settings of suffix decoding in front of it (or a model-free method's own). draft_proposer answers
# them, or target_verifier where the draft runs beside the target.
DRAFT_DESCRIBE_OUTPUTS = DESCRIBE_OUTPUTS + DESCRIBE_HIDDEN_OUTPUTS + DESCRIBE_SETTINGS_OUTPUTS


def draft_description_extras(desc: ModelDescription) -> dict[str, np.ndarray]:
    return {**description_hidden_outputs(desc), **settings_outputs(desc)}


def draft_description_of(outputs: Mapping[str, np.ndarray]) -> ModelDescription:
    return with_described_settings(with_described_layers(description_of(outputs), outputs), outputs)
