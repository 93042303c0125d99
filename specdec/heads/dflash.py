"""The DFlash block drafter (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv 2602.06036), in the checkpoint layout of z-lab's release (``DFlashDraftModel``), which SGLang
(``--speculative-algorithm DFLASH``) and vLLM (``method: dflash``) load.

One forward drafts a whole block. The block is the last token, not yet verified, at position
``N - 1``, followed by ``block_size - 1`` copies of ``mask_token_id``; the drafter's layers
attend, non-causally within the block, to the block and to *context* keys and values made from
the target's hidden states at the verified positions ``0 .. N - 2`` (several layers
concatenated, fused by ``fc`` and normed by ``hidden_norm``, once per position, shared by every
layer, each projecting them with its own ``k_proj`` / ``v_proj``). Block position ``j`` predicts
the token *at* position ``N - 1 + j`` (the mask it stands on is filled in: one denoising step),
so the drafts are the argmaxes (or draws) of positions ``1 .. k``.

The drafter owns no vocabulary: the block's embeddings are the target's ``embed_tokens`` and its
logits the target's ``lm_head``, both read from the target checkpoint at load (as the reference
and the engines share them).

``config.json`` (a Qwen3 config: the layers have per-head ``q_norm`` / ``k_norm``):
``architectures: ["DFlashDraftModel"]``, ``hidden_size`` (the target's: ``fc`` maps
``len(target_layer_ids) * hidden_size`` features to it), ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
``rms_norm_eps``, rope (``rope_theta`` / ``rope_parameters``), ``attention_bias``,
``num_target_layers``, ``vocab_size``, and ``dflash_config``: ``block_size`` (default 16),
``mask_token_id``, ``target_layer_ids`` (0-based decoder-layer *outputs* of the target, so
layer ``i`` is transformers' ``hidden_states[i + 1]``, this project's hidden-state id ``i + 1``;
absent, the reference's spread over ``num_target_layers``), and optionally
``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``. Keys the first
release kept at the top level (``block_size``, ``mask_token_id``) are read there too.
Weights (safetensors): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and per layer
``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (``.bias`` with ``attention_bias``),
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``.

Refused by name: ``DFlash2DraftModel`` (its candidate selector and causal convolutions are not
built), sliding-window layers (``layer_types`` ``sliding_attention``: the context is attended
whole), and a drafter for another target (hidden size, vocabulary or layer count).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specdec.cached_lm import check_model_dir
from specdec.fast.checkpoint import LlamaArchConfig, read_config, safetensors_files
from specdec.fast.llama import RMSNorm, rope_inv_freq, rotate_half
from specdec.heads.formats import read_head_config, read_head_weights

DFLASH = "dflash"
ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16  # the reference's default when the config names none


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """The reference's choice: the middle layer for one drafter layer, else one per drafter layer
    spread evenly over layers 1 .. L - 3 (0-based layer outputs)."""
    if num_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_layers - 1))) for i in range(num_layers))


@dataclass(frozen=True)
class DFlashConfig:
    layer: LlamaArchConfig  # the drafter's decoder layers; hidden size and vocabulary are the target's
    block_size: int  # the last token and block_size - 1 masks: at most block_size - 1 drafts a pass
    mask_token_id: int  # a target id; its embedding stands for every position still to draft
    target_layer_ids: tuple[int, ...]  # the format's: 0-based decoder-layer outputs of the target
    num_target_layers: int
    attention_bias: bool = False
    input_embedding_scale: float = 1.0  # the block's embeddings are scaled by it
    output_multiplier: float = 1.0  # the logits are scaled by it, then soft-capped
    final_logit_softcapping: float | None = None

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        """The target hidden states read, as ``VerifyRequest.hidden_layers`` ids (transformers' indices)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def to_json(self) -> dict:
        layer = self.layer
        return {
            "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": layer.hidden_size,
            "intermediate_size": layer.intermediate_size, "num_hidden_layers": layer.num_layers,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "rms_norm_eps": layer.rms_norm_eps, "hidden_act": "silu",
            "rope_theta": layer.rope_theta, "max_position_embeddings": layer.max_position_embeddings,
            "vocab_size": layer.vocab_size, "attention_bias": self.attention_bias, "tie_word_embeddings": False,
            "is_causal": False, "layer_types": ["full_attention"] * layer.num_layers, "use_sliding_window": False,
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids),
                              "input_embedding_scale": self.input_embedding_scale,
                              "output_multiplier": self.output_multiplier,
                              **({"final_logit_softcapping": self.final_logit_softcapping}
                                 if self.final_logit_softcapping else {})},
        }  # fmt: skip


def dflash_config_for(
    target: LlamaArchConfig, block_size: int, mask_token_id: int, num_layers: int = 1,
    target_layer_ids=None, intermediate_size: int | None = None,
) -> DFlashConfig:  # fmt: skip
    """A drafter of ``num_layers`` Qwen3-style layers shaped like ``target``'s (its width, heads and rope)."""
    layer = LlamaArchConfig(**{
        **target.__dict__, "model_type": "qwen3", "qk_norm": True, "num_layers": num_layers,
        "tie_word_embeddings": False, "sliding_window": None,
        "intermediate_size": intermediate_size or target.intermediate_size,
    })  # fmt: skip
    ids = tuple(target_layer_ids) if target_layer_ids else default_target_layer_ids(target.num_layers, num_layers)
    return DFlashConfig(layer, block_size, mask_token_id, ids, target.num_layers)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*positions.shape, head_dim]`` for integer ``positions``."""
    freqs = positions[..., None].float() * inv_freq  # [..., head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context (made once per position) and the block."""

    def __init__(self, layer: LlamaArchConfig, bias: bool):
        super().__init__()
        h, d = layer.hidden_size, layer.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, d
        self.q_proj = nn.Linear(h, layer.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, layer.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, layer.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(layer.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, layer.rms_norm_eps) if layer.qk_norm else None
        self.k_norm = RMSNorm(d, layer.rms_norm_eps) if layer.qk_norm else None

    def keys_values(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:  # x [..., h] -> [..., kv_heads, D] x 2
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., 1, D]
        return k * cos + rotate_half(k) * sin, self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # [B, S, h]: the block, normed
        cos: torch.Tensor,  # [B, S, D]: the block's positions
        sin: torch.Tensor,
        context_k: torch.Tensor,  # [B, kv_heads, L, D]: normed and rotated at the context's positions
        context_v: torch.Tensor,  # [B, kv_heads, L, D]
        mask: torch.Tensor,  # [B, 1, S, L + S] bool, True = visible
    ) -> torch.Tensor:  # [B, S, h]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = (q * cos[:, :, None] + rotate_half(q) * sin[:, :, None]).transpose(1, 2)  # [B, H, S, D]
        k, v = self.keys_values(x, cos, sin)  # [B, S, kv_heads, D] each
        keys = torch.cat([context_k, k.transpose(1, 2)], 2)  # [B, kv_heads, L + S, D]
        values = torch.cat([context_v, v.transpose(1, 2)], 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DFlashMLP(nn.Module):
    def __init__(self, layer: LlamaArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(layer.hidden_size, layer.intermediate_size, bias=False)
        self.up_proj = nn.Linear(layer.hidden_size, layer.intermediate_size, bias=False)
        self.down_proj = nn.Linear(layer.intermediate_size, layer.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # SwiGLU, [..., h]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, layer: LlamaArchConfig, bias: bool):
        super().__init__()
        self.self_attn = DFlashAttention(layer, bias)
        self.mlp = DFlashMLP(layer)
        self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)

    def forward(self, x, cos, sin, context_k, context_v, mask) -> torch.Tensor:  # [B, S, h]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights (the format's) beside the target's embedding and LM head (``target_*``)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        layer, h = config.layer, config.layer.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, layer.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer, config.attention_bias) for _ in range(layer.num_layers))
        self.norm = RMSNorm(h, layer.rms_norm_eps)
        self.target_embed_tokens = nn.Embedding(layer.vocab_size, h)  # the target's, frozen; not written
        self.target_lm_head = nn.Linear(h, layer.vocab_size, bias=False)  # the target's, frozen; not written
        self.target_embed_tokens.requires_grad_(False)
        self.target_lm_head.requires_grad_(False)
        self.register_buffer("inv_freq", rope_inv_freq(layer), persistent=False)  # [head_dim // 2]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the format holds (the target's embedding and LM head left out)."""
        return {n: t for n, t in self.state_dict().items() if not n.startswith("target_")}

    def context(self, features: torch.Tensor) -> torch.Tensor:  # [..., n_layers * h] -> [..., h]
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_keys_values(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values ``[..., kv_heads, D]`` for context rows ``[..., h]`` at ``positions`` [...]."""
        cos, sin = rope_tables(self.inv_freq, positions, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, h]
        embeds = self.target_embed_tokens(block_ids)
        scale = self.config.input_embedding_scale
        return embeds * scale if scale != 1.0 else embeds

    def forward(
        self,
        block_ids: torch.Tensor,  # [B, S]: the last token, then masks (training: several blocks side by side)
        positions: torch.Tensor,  # [B, S]
        context: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: keys, values [B, kv_heads, L, D]
        mask: torch.Tensor,  # [B, 1, S, L + S] bool
    ) -> torch.Tensor:  # [B, S, h], after the final norm
        x = self.embed_block(block_ids)
        cos, sin = rope_tables(self.inv_freq, positions, x.dtype)  # [B, S, D]
        for layer, (keys, values) in zip(self.layers, context):
            x = layer(x, cos, sin, keys, values, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., vocab] float32
        logits = self.target_lm_head(hidden).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


def dflash_config(path: str | os.PathLike, target_path: str | os.PathLike) -> DFlashConfig:
    """The drafter's ``config.json``, checked against the target's; no weights read."""
    raw, name = read_head_config(path), os.fspath(path)
    architectures = raw.get("architectures") or []
    if any("DFlash2" in a for a in architectures):
        raise ValueError(f"DFlash drafter {name!r} is a {architectures[0]}: its candidate selector and causal "
                         f"convolutions are not built; method dflash serves {ARCHITECTURE} checkpoints")  # fmt: skip
    types = raw.get("layer_types") or []
    if "sliding_attention" in types or raw.get("use_sliding_window"):
        raise ValueError(f"DFlash drafter {name!r}: layer_types {types} (use_sliding_window "
                         f"{raw.get('use_sliding_window')}) ask for sliding-window attention; method dflash "
                         f"attends to the whole context (full_attention layers only)")  # fmt: skip
    own = raw.get("dflash_config") or {}

    def value(key, fallback=None):
        return own.get(key, raw.get(key, fallback))

    target = read_config(target_path)
    layer = LlamaArchConfig.from_dict({**raw, "model_type": raw.get("model_type", "qwen3"), "sliding_window": None})
    if layer.hidden_size != target.hidden_size or layer.vocab_size != target.vocab_size:
        raise ValueError(
            f"DFlash drafter {os.path.realpath(path)!r} (hidden_size {layer.hidden_size}, vocab_size "
            f"{layer.vocab_size}) does not fit target {os.path.realpath(target_path)!r} (hidden size "
            f"{target.hidden_size}, vocabulary {target.vocab_size}): it reads the target's embedding and LM head"
        )
    num_target_layers = int(raw.get("num_target_layers", target.num_layers))
    if num_target_layers != target.num_layers:
        raise ValueError(f"DFlash drafter {name!r} has num_target_layers {num_target_layers}; target "
                         f"{os.fspath(target_path)!r} has {target.num_layers} layers")  # fmt: skip
    ids = value("target_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else default_target_layer_ids(num_target_layers, layer.num_layers)
    if not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"DFlash drafter {name!r}: dflash_config target_layer_ids {list(ids)} must be layers "
                         f"0 .. {num_target_layers - 1} of the target")  # fmt: skip
    block_size, mask = int(value("block_size", DEFAULT_BLOCK_SIZE)), value("mask_token_id")
    if block_size < 2:
        raise ValueError(f"DFlash drafter {name!r}: dflash_config block_size {block_size} must be >= 2 "
                         f"(the last token and at least one mask)")  # fmt: skip
    if mask is None or not 0 <= int(mask) < layer.vocab_size:
        raise ValueError(f"DFlash drafter {name!r}: dflash_config mask_token_id {mask!r} must be an id of the "
                         f"target's vocabulary (0 .. {layer.vocab_size - 1})")  # fmt: skip
    cap = value("final_logit_softcapping")
    return DFlashConfig(
        layer, block_size, int(mask), ids, num_target_layers, bool(raw.get("attention_bias", False)),
        float(value("input_embedding_scale", 1.0)), float(value("output_multiplier", 1.0)),
        float(cap) if cap else None,
    )  # fmt: skip


def target_embedding_and_head(target_path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's ``model.embed_tokens.weight`` and ``lm_head.weight`` (the embedding where they are tied)."""
    found = {}
    for file in safetensors_files(target_path):
        with safe_open(file, framework="pt") as f:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in f.keys():
                    found[key] = f.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"target {os.fspath(target_path)!r} has no model.embed_tokens.weight for the DFlash "
                         f"drafter to share")  # fmt: skip
    embedding = found["model.embed_tokens.weight"]
    return embedding, found.get("lm_head.weight", embedding)


def load_dflash(
    path: str | os.PathLike, target_path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str
) -> DFlashDrafter:
    """The drafter at ``path`` with the embedding and LM head of the target at ``target_path``."""
    path, target_path = check_model_dir(path), check_model_dir(target_path)
    config = dflash_config(path, target_path)
    model = DFlashDrafter(config)
    state = read_head_weights(path)
    expected = {n: tuple(t.shape) for n, t in model.own_state_dict().items()}
    got = {n: tuple(t.shape) for n, t in state.items() if n in expected}
    missing = sorted(expected.keys() - got.keys())
    wrong = sorted(n for n in got if got[n] != expected[n])
    if missing or wrong:
        raise ValueError(
            f"DFlash drafter {path!r}: weights do not match its config.json ({config.layer.num_layers} layers, "
            f"{len(config.target_layer_ids)} target layers): missing {missing}, wrong shape "
            f"{[(n, got[n], expected[n]) for n in wrong]}"
        )
    embedding, lm_head = target_embedding_and_head(target_path)
    state = {n: state[n] for n in expected}
    state["target_embed_tokens.weight"], state["target_lm_head.weight"] = embedding, lm_head
    model.load_state_dict({n: t.float() for n, t in state.items()}, strict=False)
    return model.to(device=device, dtype=dtype).eval()


def save_dflash(model: DFlashDrafter, out: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write the drafter's own weights and ``config.json`` as the reference lays them out."""
    os.makedirs(out, exist_ok=True)
    state = {n: t.detach().to(dtype or t.dtype).contiguous().cpu() for n, t in model.own_state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.config.to_json(), f, indent=2)
