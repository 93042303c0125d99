"""The describe exchange: each composing model states what it is and its limits, once, at load.

A request with ``describe`` set gets the model's ``ModelDescription`` as the
``describe_*`` outputs and nothing else; -1 encodes None (no limit, no vocabulary).
Re-exported by :mod:`specdec_triton.wire`. The draft proposer also answers
``describe_settings``: a model-free method's settings, which the orchestrator runs it
with in its own process (:mod:`specdec.proposers.model_free`).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from specdec.types import ModelDescription
from specdec_triton.packing import one
from specdec_triton.plumbing import bytes_array, scalar, text

DESCRIBE_OUTPUTS = ("describe_model", "describe_vocab_size", "describe_max_model_len", "describe_max_num_seqs",
                    "describe_method")  # fmt: skip
DESCRIBE_SETTINGS_OUTPUTS = ("describe_settings",)  # [1] JSON object; "{}" for a proposer that runs a model
# [1] the Unix socket a stateful model answers step calls on (specdec_triton.socket_calls); "": none
DESCRIBE_SOCKET_OUTPUTS = ("describe_socket",)


def describe_inputs() -> dict[str, np.ndarray]:
    return {"describe": one(True, np.bool_)}


def is_describe(inputs: Mapping[str, np.ndarray]) -> bool:
    return scalar(inputs, "describe", bool, False)


def _or_minus_one(value: int | None) -> np.ndarray:
    return one(-1 if value is None else value, np.int64)


def description_outputs(desc: ModelDescription) -> dict[str, np.ndarray]:
    return {
        "describe_model": bytes_array([desc.model]),  # [1]
        "describe_vocab_size": _or_minus_one(desc.vocab_size),  # [1]
        "describe_max_model_len": _or_minus_one(desc.max_model_len),  # [1]
        "describe_max_num_seqs": _or_minus_one(desc.max_num_seqs),  # [1]
        "describe_method": bytes_array([desc.method]),  # [1]
    }


def socket_outputs(address: str | None) -> dict[str, np.ndarray]:
    return {"describe_socket": bytes_array([address or ""])}  # [1]


def socket_of(outputs: Mapping[str, np.ndarray]) -> str | None:
    return text(outputs, "describe_socket") or None


def description_of(outputs: Mapping[str, np.ndarray]) -> ModelDescription:
    def limit(name: str) -> int | None:
        value = int(np.asarray(outputs[name]).reshape(-1)[0])
        return None if value == -1 else value

    return ModelDescription(
        model=text(outputs, "describe_model"),
        vocab_size=limit("describe_vocab_size"),
        max_model_len=limit("describe_max_model_len"),
        max_num_seqs=limit("describe_max_num_seqs"),
        method=text(outputs, "describe_method"),
    )


def settings_outputs(desc: ModelDescription) -> dict[str, np.ndarray]:
    return {"describe_settings": bytes_array([json.dumps(dict(desc.settings))])}  # [1]


def with_described_settings(desc: ModelDescription, outputs: Mapping[str, np.ndarray]) -> ModelDescription:
    """``desc`` with the settings the draft proposer described; refuses anything but names with numbers or flags."""
    described = text(outputs, "describe_settings")
    try:
        settings = json.loads(described)
    except json.JSONDecodeError:
        settings = None
    if not isinstance(settings, dict) or not all(isinstance(v, (int, float)) for v in settings.values()):
        raise ValueError(f"describe_settings must be a JSON object of numbers and booleans, got {described!r}")
    return replace(desc, settings=tuple(settings.items()))
