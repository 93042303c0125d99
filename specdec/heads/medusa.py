"""Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"), in the checkpoint layout vLLM loads (``vllm/model_executor/models/medusa.py``).

Head ``i`` of ``num_heads`` reads the target's final normed hidden state at position ``t``
(the one the target's own logits for token ``t + 1`` come from) and predicts token
``t + 2 + i``: ``num_hidden_layers`` residual blocks ``x + SiLU(Linear(x))``, then an LM head.
The heads never see a drafted token, so one pass drafts every depth at once.

``config.json``: ``model_type: "medusa"``, ``num_heads``, ``num_hidden_layers`` (blocks per
head; the original release's ``medusa_num_heads`` and ``medusa_num_layers`` are read as vLLM
reads them: a key with ``num`` and ``heads``, or ``num`` and ``layers``), ``hidden_size``,
``vocab_size``, and optionally ``truncated_vocab_size`` (with a ``token_map`` tensor: the LM
heads' rows are the target ids it lists, the other ids never drafted), ``medusa_fc_bias``
(the blocks' biases; absent, whether the weights carry them, as the original release writes
them), ``original_lm_head`` (one LM head for every head, stored as ``lm_heads.0.weight``) and
``logit_scale``. Weights: ``blocks.{head}.layers.{layer}.weight`` / ``.bias`` and
``lm_heads.{head}.weight``, optionally under ``medusa_heads.``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specdec.cached_lm import check_model_dir
from specdec.fast.checkpoint import read_config
from specdec.heads.formats import read_head_config, read_head_weights

MEDUSA = "medusa"
PREFIX = "medusa_heads."  # the original release's names


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int  # drafts per pass: head i predicts the token i + 2 past the hidden state's position
    num_layers: int  # residual blocks per head (the format's num_hidden_layers)
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    truncated_vocab_size: int  # the LM heads' rows: vocab_size, or fewer with a token_map
    bias: bool = True  # the blocks' Linear biases (medusa_fc_bias)
    shared_lm_head: bool = False  # one LM head for every head (original_lm_head)
    logit_scale: float = 1.0

    def to_json(self) -> dict:
        return {
            "architectures": ["MedusaModel"], "model_type": MEDUSA, "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "truncated_vocab_size": self.truncated_vocab_size, "medusa_fc_bias": self.bias,
            "original_lm_head": self.shared_lm_head, "logit_scale": self.logit_scale,
        }  # fmt: skip


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class Medusa(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.num_heads, self.vocab_size = config.num_heads, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(config.hidden_size, config.num_layers, config.bias)
                                    for _ in range(config.num_heads))  # fmt: skip
        count = 1 if config.shared_lm_head else config.num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, config.truncated_vocab_size, bias=False)
                                      for _ in range(count))  # fmt: skip
        # [truncated_vocab]: the target id of each LM-head row; None: the whole vocabulary, in order
        self.register_buffer("token_map", None if config.truncated_vocab_size == config.vocab_size else
                             torch.arange(config.truncated_vocab_size))  # fmt: skip

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_heads[0].weight.dtype

    def lm_head(self, i: int) -> nn.Linear:
        return self.lm_heads[0 if self.config.shared_lm_head else i]

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Hidden ``[..., h]`` (the target's final normed state) -> logits ``[num_heads, ..., vocab]`` over the
        target's vocabulary, head ``i``'s for the token ``i + 2`` past the state's position."""
        hidden = hidden.to(self.dtype)
        heads = range(self.num_heads if num_heads is None else num_heads)
        logits = torch.stack([self.lm_head(i)(self.blocks[i](hidden)) for i in heads])  # [n, ..., truncated]
        logits = logits.float() * self.config.logit_scale
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # ids outside the map: never
        return full.index_copy_(-1, self.token_map, logits)


def medusa_config(path: str | os.PathLike, target_path: str | os.PathLike) -> MedusaConfig:
    """The heads' ``config.json`` (either release's key names), checked against the target's; no weights read."""
    raw = read_head_config(path)
    for key in list(raw):  # vLLM's MedusaConfig.from_pretrained: medusa_num_heads, medusa_num_layers
        if "num" in key and key not in ("num_heads", "num_hidden_layers"):
            if "heads" in key:
                raw.setdefault("num_heads", raw[key])
            elif "layers" in key:
                raw.setdefault("num_hidden_layers", raw[key])
    missing = [k for k in ("num_heads", "hidden_size", "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"Medusa head {os.fspath(path)!r}: config.json lacks {missing}")
    num_heads, vocab = int(raw["num_heads"]), int(raw["vocab_size"])
    truncated = int(raw.get("truncated_vocab_size") or vocab)
    if num_heads < 1 or not 1 <= truncated <= vocab:
        raise ValueError(f"Medusa head {os.fspath(path)!r}: num_heads {num_heads} must be >= 1 and "
                         f"truncated_vocab_size {truncated} in 1..vocab_size {vocab}")  # fmt: skip
    target = read_config(target_path)
    if raw["hidden_size"] != target.hidden_size or vocab != target.vocab_size:
        raise ValueError(
            f"Medusa head {os.path.realpath(path)!r} (hidden_size {raw['hidden_size']}, vocab_size {vocab}) does "
            f"not fit target {os.path.realpath(target_path)!r} (hidden size {target.hidden_size}, vocabulary "
            f"{target.vocab_size})"
        )
    bias = raw.get("medusa_fc_bias")
    return MedusaConfig(
        num_heads, int(raw.get("num_hidden_layers", 1)), target.hidden_size, vocab, truncated,
        bias=True if bias is None else bool(bias), shared_lm_head=bool(raw.get("original_lm_head", False)),
        logit_scale=float(raw.get("logit_scale", 1.0)),
    )  # fmt: skip


def load_medusa(
    path: str | os.PathLike, target_path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str
) -> Medusa:
    """Load the heads at ``path`` for the target at ``target_path``; heads for another target are refused."""
    path, target_path = check_model_dir(path), check_model_dir(target_path)
    config = medusa_config(path, target_path)
    state = {name.removeprefix(PREFIX): tensor for name, tensor in read_head_weights(path).items()}
    token_map = state.pop("token_map", None)
    if "medusa_fc_bias" not in read_head_config(path):  # the original release: biases where its weights have them
        config = MedusaConfig(**{**asdict(config), "bias": "blocks.0.layers.0.bias" in state})
    if config.truncated_vocab_size < config.vocab_size:
        if token_map is None:
            raise ValueError(f"Medusa head {path!r}: truncated_vocab_size {config.truncated_vocab_size} < vocab_size "
                             f"{config.vocab_size} needs a token_map tensor, and the weights have none")  # fmt: skip
        token_map = token_map.long().flatten()
        for name in [n for n in state if n.startswith("lm_heads.")]:  # rows for every id: keep the map's (as vLLM)
            if state[name].shape[0] > token_map.shape[0]:
                state[name] = state[name][token_map]
        state["token_map"] = token_map
    model = Medusa(config)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    got = {n: tuple(t.shape) for n, t in state.items() if n in expected}
    missing = sorted(expected.keys() - got.keys())
    wrong = sorted(n for n in got if got[n] != expected[n])
    if missing or wrong:
        raise ValueError(
            f"Medusa head {path!r}: weights do not match its config.json ({config.num_heads} heads of "
            f"{config.num_layers} blocks): missing {missing}, wrong shape {[(n, got[n], expected[n]) for n in wrong]}"
        )
    if token_map is not None and not (0 <= int(token_map.min()) and int(token_map.max()) < config.vocab_size):
        raise ValueError(f"Medusa head {path!r}: token_map holds ids outside the vocabulary of {config.vocab_size}")
    model.load_state_dict({n: t for n, t in state.items() if n in expected})
    return model.to(device=device, dtype=dtype).eval()  # the token map stays int64: .to(dtype) leaves integers


def save_medusa(model: Medusa, out: str | os.PathLike) -> None:
    """Write ``model`` as vLLM loads it: ``config.json`` and ``model.safetensors``."""
    os.makedirs(out, exist_ok=True)
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.config.to_json(), f, indent=2)
