"""Read a Llama-family Hugging Face checkpoint (config.json + safetensors) without transformers.

Llama, Mistral, Qwen2 and Qwen3 share one decoder block (RMSNorm, rotary attention with
grouped-query heads, SwiGLU MLP); they differ only in configuration: rope base and
scaling, norm epsilon, head counts and width, q/k/v biases (Qwen2), per-head query and key
norms (Qwen3) and tied embeddings. This
module turns ``config.json`` into one validated, frozen ``LlamaArchConfig`` and the
safetensors files (single or sharded) into a state dict named as in transformers.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdec.cached_lm import check_model_dir
from specdec.models import check_within_positions

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
QK_NORM_MODEL_TYPES = ("qwen3",)  # RMSNorm over each head's queries and keys before the rotary embedding
ROPE_TYPES = ("default", "linear", "llama3")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LlamaArchConfig:
    """The architecture fields the fast engine reads; every other config.json key is ignored."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention (Ainslie et al. 2023)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0  # linear and llama3 scaling
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_len: int = 8192  # llama3 only
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # the fast engine only runs where the window covers max_model_len
    qk_norm: bool = False  # queries and keys normed per head before rotary (Qwen3)

    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def check_max_model_len(self, max_model_len: int) -> None:
        """Within the positions the model was trained for, and where full attention equals its sliding window."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        check_within_positions(max_model_len, self.max_position_embeddings)
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding_window={self.sliding_window}; "
                f"the fast engine implements full attention only"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> LlamaArchConfig:
        num_heads = raw["num_attention_heads"]
        # transformers >= 5 writes rope settings under rope_parameters; older files use rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor must be 1.0, got {rope['partial_rotary_factor']}")
        # qwen2 and qwen3 set the flag explicitly (and name a window they do not use by default)
        uses_window = raw.get("use_sliding_window", raw["model_type"] not in ("qwen2", "qwen3"))
        config = cls(
            model_type=raw["model_type"],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            rope_factor=rope.get("factor", 1.0),
            rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
            rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
            rope_original_max_len=rope.get("original_max_position_embeddings", 8192),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            sliding_window=raw.get("sliding_window") if uses_window else None,
            qk_norm=raw["model_type"] in QK_NORM_MODEL_TYPES,
        )
        config.validate()
        return config


def read_config(path: str | os.PathLike) -> LlamaArchConfig:
    config_path = os.path.join(check_model_dir(path), "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model path {os.fspath(path)!r}")
    with open(config_path) as f:
        raw = json.load(f)
    try:
        return LlamaArchConfig.from_dict(raw)
    except KeyError as missing:  # a head's or another architecture's config.json
        raise ValueError(
            f"{config_path} is not a Llama-family model's config: it has no {missing.args[0]!r} "
            f"(model_type {raw.get('model_type')!r})"
        ) from None


def weight_files(path: str | os.PathLike, single: str = SINGLE_FILE, index: str = SHARD_INDEX) -> list[str] | None:
    """The checkpoint's ``single`` weight file, or the shards its ``index`` names; None where it has neither."""
    single, index = os.path.join(path, single), os.path.join(path, index)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    return None


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The checkpoint's weight files: ``model.safetensors`` or the shards its index names."""
    path = check_model_dir(path)
    files = weight_files(path)
    if files is None:
        raise FileNotFoundError(f"model path {path!r} has neither {SINGLE_FILE} nor {SHARD_INDEX}")
    return files


def weight_names(path: str | os.PathLike) -> set[str]:
    """Tensor names in the checkpoint, read from the headers only (decides which projections have biases)."""
    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def is_mtp_weight(name: str, num_layers: int) -> bool:
    """Whether ``name`` is a multi-token-prediction layer's (``model.layers.{L}.*`` with ``L >= num_layers``,
    DeepSeek-V3's layout, ``specdec.heads.mtp``): the model alone skips it, as vLLM's and transformers' do."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def load_state_dict(
    path: str | os.PathLike, dtype: torch.dtype, device: torch.device, tie_word_embeddings: bool,
    num_layers: int | None = None,
) -> dict[str, torch.Tensor]:
    """The model's tensors; with ``num_layers``, without the MTP layers stored beside them."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(file, device=str(device)).items():
            if num_layers is not None and is_mtp_weight(name, num_layers):
                continue
            if name.startswith("model.") or name == "lm_head.weight":  # skips e.g. rotary inv_freq buffers
                state[name] = tensor.to(dtype)
    if tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


FUSED_PROJECTIONS = {  # fused module -> the Hugging Face projections it concatenates, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Concatenate each layer's q/k/v and gate/up weights (and biases) along the output rows.

    One GEMM then reads the input once instead of three and two times; on CPU it also
    halves the per-call overhead that dominates small models (as vLLM's QKVParallelLinear
    and MergedColumnParallelLinear do). A projection without a bias gets zeros where
    another of its group has one.
    """
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for fused, parts in FUSED_PROJECTIONS.items():
            weights = [state.pop(f"{prefix}{part}.weight") for part in parts]  # each [rows_i, hidden]
            biases = [state.pop(f"{prefix}{part}.bias", None) for part in parts]
            state[f"{prefix}{fused}.weight"] = torch.cat(weights)  # [sum rows_i, hidden]
            if any(b is not None for b in biases):
                state[f"{prefix}{fused}.bias"] = torch.cat([
                    b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)
                ])  # fmt: skip
    return state
