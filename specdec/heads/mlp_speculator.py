"""IBM's MLP speculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/
Embedding Speculators"), with the ``MLPSpeculator`` checkpoint layout vLLM and fms-extras load.

Stage ``i`` of ``n_predict`` turns the running state (at first the target's last hidden
state, the one its own next-token logits come from) and the last token into the next:
``state = GELU(LN_i(proj_i(state) + w * emb_i(token)))``, and ``head_i(state)`` gives the
logits of draft ``i + 1``. The state weight ``0.5 ** (0.5 / n_predict)`` and the embedding
weight ``sqrt((1 - state_weight ** 2) * inner_dim / 2)`` are the published model's, and so
are the keys of ``config.json``: ``n_predict``, ``inner_dim``, ``emb_dim`` (the target's
hidden size), ``vocab_size``, ``top_k_tokens_per_head``, ``tie_weights`` (one embedding,
head and norm for every stage, and one projection after the first) and ``scale_input``
(normalise the target's state first). No KV cache: a stage reads only the state and one token.
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specdec.cached_lm import check_model_dir
from specdec.fast.checkpoint import read_config
from specdec.heads.formats import read_head_weights

MLP_SPECULATOR = "mlp_speculator"


class SpeculatorLayerNorm(nn.Module):
    """RMS-style normalisation with an optional elementwise scale and shift (the published model's)."""

    def __init__(self, dim: int, affine: bool, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else self.weight * x + self.bias


class MLPSpeculator(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        n, v = config["n_predict"], config["vocab_size"]
        emb_dim = config["emb_dim"]
        inner = config.get("inner_dim") or emb_dim
        self.n_predict, self.vocab_size, self.emb_dim, self.inner_dim = n, v, emb_dim, inner
        if config.get("tie_weights", False):
            emb, head, ln = nn.Embedding(v, inner), nn.Linear(inner, v, bias=False), SpeculatorLayerNorm(inner, True)
            first, tied = nn.Linear(emb_dim, inner, bias=False), nn.Linear(inner, inner, bias=False)
            self.emb = nn.ModuleList([emb] * n)
            self.proj = nn.ModuleList([first] + [tied] * (n - 1))
            self.head, self.ln = nn.ModuleList([head] * n), nn.ModuleList([ln] * n)
        else:
            self.emb = nn.ModuleList(nn.Embedding(v, inner) for _ in range(n))
            self.proj = nn.ModuleList(nn.Linear(emb_dim if i == 0 else inner, inner, bias=False) for i in range(n))
            self.head = nn.ModuleList(nn.Linear(inner, v, bias=False) for _ in range(n))
            self.ln = nn.ModuleList(SpeculatorLayerNorm(inner, True) for _ in range(n))
        self.ln0 = SpeculatorLayerNorm(emb_dim, False) if config.get("scale_input", False) else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner / 2))

    @property
    def dtype(self) -> torch.dtype:
        return self.head[0].weight.dtype

    def first_state(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, emb_dim]: the target's last hidden state
        hidden = hidden.to(self.dtype)
        return self.ln0(hidden) / math.sqrt(2) if self.ln0 is not None else hidden

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """State [B, emb_dim or inner], tokens [B] -> (logits [B, vocab], next state [B, inner])."""
        z = self.emb[i](tokens)  # [B, inner]
        state = self.proj[i](state) + z * (self.emb_weight / self.state_weight)
        state = F.gelu(self.ln[i](state))
        return self.head[i](state), state


def first_stages(model: MLPSpeculator, stages: int) -> MLPSpeculator:
    """The speculator cut to its first ``stages`` stages, computing what they computed before.

    A stage reads only the stages before it, but the format derives the weights of state and
    embedding from ``n_predict`` (``state_weight = 0.5 ** (0.5 / n_predict)``): the cut's
    embeddings are rescaled so that ``emb * emb_weight / state_weight`` stays the same.
    """
    if not 1 <= stages <= model.n_predict:
        raise ValueError(f"stages must be in 1..{model.n_predict} (n_predict), got {stages}")
    config = {**model.config, "n_predict": stages}
    if "top_k_tokens_per_head" in config:
        config["top_k_tokens_per_head"] = config["top_k_tokens_per_head"][:stages]
    cut = MLPSpeculator(config).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items() if k.startswith("ln0.") or int(k.split(".")[1]) < stages}
    cut.load_state_dict(state)
    rescale = (model.emb_weight / model.state_weight) / (cut.emb_weight / cut.state_weight)
    with torch.no_grad():
        for emb in {id(e): e for e in cut.emb}.values():  # tied stages share one table: scaled once
            emb.weight.mul_(rescale)
    return cut


def mlp_speculator_config(path: str | os.PathLike, target_path: str | os.PathLike) -> dict:
    """The speculator's ``config.json``, checked against the target's (no weights read)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    missing = [k for k in ("n_predict", "emb_dim", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"MLP speculator {os.fspath(path)!r}: config.json lacks {missing}")
    target = read_config(target_path)
    if config["emb_dim"] != target.hidden_size or config["vocab_size"] != target.vocab_size:
        raise ValueError(
            f"MLP speculator {os.path.realpath(path)!r} (emb_dim {config['emb_dim']}, vocab_size "
            f"{config['vocab_size']}) does not fit target {os.path.realpath(target_path)!r} (hidden size "
            f"{target.hidden_size}, vocabulary {target.vocab_size})"
        )
    return config


def load_mlp_speculator(
    path: str | os.PathLike, target_path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str
) -> MLPSpeculator:
    """Load the speculator at ``path`` for the target at ``target_path``; one for another target is refused."""
    path, target_path = check_model_dir(path), check_model_dir(target_path)
    model = MLPSpeculator(mlp_speculator_config(path, target_path))
    params = dict(model.named_parameters())  # tied stages: only the first stage's names
    loaded = set()
    for name, tensor in read_head_weights(path).items():
        key = name.removeprefix("speculator.")
        if key in params:  # with tie_weights, the repeated stages' names share the first's tensors
            if tuple(tensor.shape) != tuple(params[key].shape):
                raise ValueError(f"MLP speculator {path!r}: {name} is {tuple(tensor.shape)}, its config.json "
                                 f"makes it {tuple(params[key].shape)}")  # fmt: skip
            with torch.no_grad():
                params[key].copy_(tensor)
            loaded.add(key)
    if set(params) - loaded:
        raise ValueError(f"MLP speculator {path!r}: weights missing for {sorted(set(params) - loaded)}")
    return model.to(device=device, dtype=dtype).eval()


def save_mlp_speculator(model: MLPSpeculator, out: str | os.PathLike) -> None:
    os.makedirs(out, exist_ok=True)
    # tied stages share tensors: each is written once, under its first stage's name (as vLLM loads it)
    state = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    save_file(state, os.path.join(out, "model.safetensors"))
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MLP_SPECULATOR, **model.config}
    config.setdefault("top_k_tokens_per_head", [1] * model.n_predict)
    config.setdefault("n_candidates", 1)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
