"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), laid out as vLLM's ``llama_eagle3.py`` loads it.

The head reads three hidden states of the target at each position (low, middle and high
layers, concatenated: ``features``), fuses them with ``fc`` (3h -> h), and runs a Llama
decoder layer whose attention sees ``[input_layernorm(embed(token)); hidden_norm(hidden)]``
(2h wide). A head may stack more decoder layers after that first one (plain Llama layers
over the running residual, as vLLM runs ``num_hidden_layers`` > 1: only the first reads the
embedding). Row ``t`` takes token ``x_{t+1}`` and the target's fused features at ``t`` and
predicts ``x_{t+2}``. To draft further it feeds itself: the next row takes the drafted token
and the head's own pre-norm output of the row before, which is why training runs the same
recurrence ("training-time test"). Logits cover a reduced draft vocabulary; ``d2t`` maps a
draft id to its target id (``target = draft + d2t[draft]``) and ``t2d`` marks the target ids
the head can propose, so ``target_logits`` puts them back on the target's vocabulary (the
others get ``-inf``) and the rejection sampler compares ``p`` and ``q`` token for token.

Numerics and the slot KV cache are the fast engine's (``specdec.fast.llama``): each of the
head's layers writes its keys and values into its own ``StaticKVCache`` at each row's position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.fast.checkpoint import LlamaArchConfig
from specdec.fast.llama import (
    MLP, Attention, BatchIndex, DecoderLayer, RMSNorm, TreeAttention, attend, kernel_attends, rope_inv_freq,
)

EAGLE3 = "eagle3"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and the EAGLE-3 reference's choice: a low, a middle and a high layer's input."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    layer: LlamaArchConfig  # the decoder layers: hidden size, heads, rope, how many; vocab_size is the target's
    draft_vocab_size: int  # rows of lm_head; d2t maps them onto the target's vocabulary
    target_hidden_size: int  # fc reads len(aux_layers) * target_hidden_size features
    aux_layers: tuple[int, ...]  # the target hidden states read (VerifyRequest.hidden_layers ids)
    norm_before_residual: bool = False  # the residual is the normed hidden (some published heads)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.target_hidden_size


class Eagle3DecoderLayer(nn.Module):
    """A Llama layer whose attention reads the normed embedding and normed hidden state side by side."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        layer, h = config.layer, config.hidden_size
        self.self_attn = Attention(layer, set(), triton_attention=False)
        self.self_attn.qkv_proj = nn.Linear(2 * h, self.self_attn.qkv_proj.out_features, bias=False)  # [emb; hidden]
        self.mlp = MLP(layer, set())
        self.input_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, layer.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, kv, batch) -> torch.Tensor:  # embeds, hidden: [B, S, h]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2h]
        x = residual + self.self_attn(x, cos, sin, kv, 0, batch)  # kv: the head's cache, layer 0
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, S, h], pre-norm


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        later = (DecoderLayer(config.layer, set(), triton_attention=False) for _ in range(config.num_layers - 1))
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config), *later])
        self.norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [draft_vocab]
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))  # [vocab]
        self.register_buffer("inv_freq", rope_inv_freq(config.layer), persistent=False)  # [head_dim // 2]
        self.triton_attention = False  # the kernel in passes over the whole cache (kernel_attends)

    def use_triton_attention(self) -> None:
        """Attend with the Triton slot kernel, as the fast engine does on CUDA (``default_triton_attention``).

        The head's cache spans the target's ``max_position_embeddings``; with the torch path
        every graphed draft pass would gather and mask all of it.
        """
        from specdec.fast.attention_kernel import check_available, slot_attention

        check_available()
        for layer in self.layers:
            layer.self_attn.kernel = slot_attention
        self.triton_attention = True

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the linears may be packed for oneDNN (no .weight)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [..., feature_size] -> [..., h]
        return self.fc(features.to(self.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64, right-padded
        hidden: torch.Tensor,  # [B, S, h]: fused target features, or the head's own pre-norm output
        starts: torch.Tensor,  # [B] int64: the position of each row's first token
        num_new: torch.Tensor,  # [B] int64
        slots: torch.Tensor,  # [B] int64
        kv: torch.Tensor,  # [num_layers, 2, num_slots, kv_heads, max_model_len, head_dim]
        kv_len: int,
        tree: TreeAttention | None = None,  # a draft tree's level (``specdec.proposers.eagle3_tree``); None: a chain
    ) -> tuple[torch.Tensor, torch.Tensor]:  # draft logits [B, S, draft_vocab], pre-norm [B, S, h]
        b, s = input_ids.shape
        with_mask = not kernel_attends(self.triton_attention, kv_len, kv.shape[4])
        batch = BatchIndex(starts, num_new, slots, s, kv_len, kv.shape[2] - 1, kv.shape[4], with_mask, tree)
        freqs = batch.rope_positions[..., None].float() * self.inv_freq  # [B, S, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, head_dim]
        embeds = self.embed_tokens(input_ids)  # [B, S, h]
        cos, sin = emb.cos().to(embeds.dtype), emb.sin().to(embeds.dtype)
        prenorm = self.layers[0](embeds, hidden.to(embeds.dtype), cos, sin, kv, batch)  # [B, S, h]
        for i, layer in enumerate(self.layers[1:], 1):
            prenorm = layer(prenorm, cos, sin, kv, i, batch)  # [B, S, h]
        return self.lm_head(self.norm(prenorm)), prenorm

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [n, draft_vocab] -> [n, vocab] float32
        """Draft logits on the target's vocabulary; ids the draft vocabulary lacks get ``-inf``."""
        out = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32)
        targets = torch.arange(self.config.draft_vocab_size, device=draft_logits.device) + self.d2t  # [draft_vocab]
        out[:, targets] = draft_logits.float()
        return out


def train_forward(
    head: Eagle3Head,
    input_ids: torch.Tensor,  # [B, T]: row t's token x_{t+1}
    features: torch.Tensor,  # [B, T, feature_size]: the target's at t
    num_steps: int,
) -> list[torch.Tensor]:  # num_steps x [B, T, draft_vocab]; step j's row t predicts x_{t+2}, valid for t >= j
    """The training-time test: step j feeds each row the head's own output of step j - 1 at the row before.

    At inference the head drafting ``j`` tokens past its last true row ``t0`` attends to the
    true rows ``<= t0`` and to its own rows ``t0 + 1 .. t0 + j``. Step ``j``'s query at row
    ``t`` (base ``t0 = t - j``) therefore sees step 0's keys at rows ``<= t - j`` and step
    ``i``'s key at row ``t - j + i`` for ``1 <= i <= j``: the mask built here (the same in
    every layer, each with its own keys), so training sees exactly the inputs inference will.
    """
    t = input_ids.shape[1]
    cos, sin = rope_cos_sin(head, torch.arange(t, device=input_ids.device))  # [T, head_dim] each
    embeds = head.layers[0].input_layernorm(head.embed_tokens(input_ids))  # [B, T, h]
    hidden = head.fuse(features)  # [B, T, h]
    seen: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in head.layers]  # each layer's keys, values
    outputs = []
    for j in range(num_steps):
        x = masked_layers(head, embeds, hidden, cos, sin, seen, _ttt_mask(t, j, input_ids.device))  # [B, T, h]
        outputs.append(head.lm_head(head.norm(x)))
        hidden = torch.cat([x[:, :1], x[:, :-1]], 1)  # row t takes row t - 1's pre-norm output (row 0: unused)
    return outputs


def rope_cos_sin(head: Eagle3Head, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin [T, head_dim] of the rows' positions [T], in the head's dtype."""
    freqs = positions[:, None].float() * head.inv_freq  # [T, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(head.dtype), emb.sin().to(head.dtype)


def masked_layers(
    head: Eagle3Head,
    embeds: torch.Tensor,  # [B, T, h]: the normed embeddings of the rows' tokens
    hidden: torch.Tensor,  # [B, T, h]: the rows' fused features (or the head's own pre-norm output)
    cos: torch.Tensor,  # [T, head_dim]: at each row's position
    sin: torch.Tensor,
    seen: list[tuple[list[torch.Tensor], list[torch.Tensor]]],  # each layer's keys and values before; appended to
    mask: torch.Tensor,  # [T, keys] bool: True = visible, keys = the earlier ones in ``seen`` and these rows'
) -> torch.Tensor:  # [B, T, h] pre-norm
    """The head's layers over whole rows under an explicit attention mask, for training: the training-time
    test's steps (``train_forward``) and P-EAGLE's parallel groups (``specdec.heads.peagle``)."""
    first = head.layers[0]
    normed = first.hidden_norm(hidden)
    residual = normed if head.config.norm_before_residual else hidden
    x = residual + _ttt_attention(first.self_attn, torch.cat([embeds, normed], -1), cos, sin, seen[0], mask)
    x = x + first.mlp(first.post_attention_layernorm(x))  # [B, T, h]
    for layer, keys_values in zip(head.layers[1:], seen[1:]):
        x = x + _ttt_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, keys_values, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))  # [B, T, h]
    return x


def _ttt_attention(
    attn: Attention,
    x: torch.Tensor,  # [B, T, in]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
    keys_values: tuple[list[torch.Tensor], list[torch.Tensor]],  # this layer's of the steps before; appended to
    mask: torch.Tensor,  # [T, keys] bool: (j + 1) * T keys at training-time test's step j
) -> torch.Tensor:  # [B, T, h]
    b, t, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
    q = q.reshape(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, H, T, D]
    k = k.reshape(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, KVH, T, D]
    v = v.reshape(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    keys, values = keys_values
    keys.append(k * cos + _rotate_half(k) * sin)
    values.append(v)
    q = q * cos + _rotate_half(q) * sin
    out = attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask, enable_gqa=attn.num_heads != attn.num_kv_heads)
    # [B, H, T, D]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _ttt_mask(t: int, j: int, device) -> torch.Tensor:  # [T, (j + 1) * T] bool: True = visible
    rows = torch.arange(t, device=device)[:, None]  # [T, 1]
    cols = torch.arange(t, device=device)[None, :]  # [1, T]
    blocks = [cols <= rows - j]  # step 0: the true rows up to the base
    blocks += [cols == rows - j + i for i in range(1, j + 1)]  # step i: its own row at base + i
    mask = torch.cat(blocks, 1)
    return mask | ~mask.any(1, keepdim=True)  # rows t < j have no base: let them see anything (never scored)


def eagle3_config_for(
    target: LlamaArchConfig,
    draft_vocab_size: int | None = None,
    aux_layers=None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_layers: int = 1,
) -> Eagle3Config:
    """A head shaped like ``num_layers`` layers of ``target`` (EAGLE-3 trains one), over ``draft_vocab_size`` tokens.

    ``hidden_size`` narrows the head below the target's width (``fc`` then maps the target's
    features down to it; the format keeps both as ``target_hidden_size`` and the layer's
    ``hidden_size``): a step's weights shrink with the square of the width, for a head that
    must cost less than a small draft model. Heads keep the target's ``head_dim``; the MLP
    keeps the target's ratio unless ``intermediate_size`` is given.
    """
    width = hidden_size or target.hidden_size
    if num_layers < 1:
        raise ValueError(f"an EAGLE-3 head needs at least one decoder layer, got num_layers={num_layers}")
    if width % target.head_dim:
        raise ValueError(f"hidden_size {width} is not a multiple of the target's head_dim {target.head_dim}")
    heads = width // target.head_dim
    layer = LlamaArchConfig(**{  # a Llama layer whatever the target's family, as EAGLE-3 heads are
        **target.__dict__, "model_type": "llama", "qk_norm": False, "num_layers": num_layers,
        "tie_word_embeddings": False, "hidden_size": width,
        "intermediate_size": intermediate_size or target.intermediate_size * width // target.hidden_size,
        "num_heads": heads, "num_kv_heads": max(1, heads * target.num_kv_heads // target.num_heads),
    })  # fmt: skip
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=draft_vocab_size or target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layers=tuple(aux_layers) if aux_layers is not None else default_aux_layers(target.num_layers),
    )
