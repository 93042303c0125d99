"""The Llama decoder (Llama, Mistral, Qwen2, Qwen3) as a ragged, batched forward over a slot KV cache.

Numerics follow transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` line for line
(RMSNorm in float32, rotary tables in float32 cast to the model dtype, SwiGLU MLP;
Touvron et al. 2023), so float32 logits agree with Hugging Face to ~1e-5. The
structure follows gpt-fast: each batch row is one sequence with its own cache slot,
start position and number of new tokens (rows are right-padded to the longest); new
keys and values are written into the slot at their positions and every query attends
causally over ``cache[slot, :start + s + 1]``: by default (CPU) a gather and SDPA with a
position mask, where ``kv_len = max_model_len`` makes every shape static, which is what CUDA
graphs need; on CUDA the Triton slot kernel (``attention_kernel.py``), whose reads stop at
each query's position, so a captured step costs what the sequence's length costs rather
than what ``max_model_len`` does.
Module names mirror transformers', except that q/k/v and gate/up run as one fused
projection each (``qkv_proj``, ``gate_up_proj``); ``checkpoint.fuse_projections``
concatenates a Hugging Face state dict's weights to match.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.fast.checkpoint import LlamaArchConfig, fuse_projections, load_state_dict, read_config, weight_names
from specdec.fast.cpu_linear import cpu_packing_available, pack_linears


def default_triton_attention(device: torch.device | str) -> bool:
    """The Triton kernel wherever the model runs on CUDA.

    A CUDA graph fixes its shapes, so the torch path gathers and masks the whole
    ``max_model_len`` of every row on every step: at 4096 positions that doubled a 1.5 B
    target's graphed step on an H100, and a Llama 3 config's 131072 would swamp it. The
    kernel reads only keys up to each query's position, from device tensors, so one graph
    serves every length at that length's cost (``kernel_attends`` says which passes use it).
    On CPU it would run interpreted.
    """
    return torch.device(device).type == "cuda"


def kernel_attends(triton_attention: bool, kv_len: int, max_model_len: int) -> bool:
    """The kernel in passes over the whole cache (the fixed shapes of CUDA graphs), SDPA elsewhere.

    An eager pass gathers only ``kv_len`` = its longest row, so SDPA's fused kernels serve it
    well, a long prefill above all; the slot kernel's one program per query token and head
    loops over every key before it, fine for a few tokens a row, quadratic work for a prompt.
    """
    return triton_attention and kv_len == max_model_len


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019; normalised in float32, scaled in the model dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: LlamaArchConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """Rotary inverse frequencies (Su et al. 2021) with linear or Llama 3 frequency scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":  # keep high frequencies, divide low ones by factor, blend in between
        factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        old_len = config.rope_original_max_len
        wavelen = 2 * math.pi / inv_freq  # [head_dim // 2]
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaArchConfig, biases: set[str], triton_attention: bool):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.kernel = None  # the Triton slot-attention kernel, imported only when asked for
        if triton_attention:
            from specdec.fast.attention_kernel import slot_attention

            self.kernel = slot_attention
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.grouped = config.num_heads != config.num_kv_heads  # GQA: a static flag, so a compiled graph need not branch
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bool({"q_proj", "k_proj", "v_proj"} & biases))
        self.o_proj = nn.Linear(config.num_heads * d, h, bias="o_proj" in biases)
        # Qwen3: each head's queries and keys RMS-normed over head_dim before rotary; None elsewhere (a static
        # attribute, so a compiled graph need not branch)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        cos: torch.Tensor,  # [B, 1, S, head_dim]
        sin: torch.Tensor,  # [B, 1, S, head_dim]
        cache: torch.Tensor,  # [num_layers, 2, num_slots, kv_heads, max_model_len, head_dim], every layer's
        layer: int,  # this attention's layer in the cache
        batch: BatchIndex,
    ) -> torch.Tensor:  # [B, S, hidden]
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KVH, S, D]
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)  # [B, S, KVH, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over D, each head and token
        q = q * cos + rotate_half(q) * sin  # [B, H, S, D]
        k = k * cos + rotate_half(k) * sin  # [B, KVH, S, D]
        write = write_kv if torch.compiler.is_compiling() else write_kv_in_place  # the compiled form where traced
        write(cache, layer, batch.write_slot, batch.write_pos, k.transpose(1, 2), v)  # [B, S, KVH, D] each
        kv = cache[layer]  # [2, num_slots, KVH, max_model_len, D]
        if batch.mask is None:  # a pass over the whole cache with the kernel (kernel_attends)
            out = self.kernel(q, kv[0], kv[1], batch.slots, batch.write_pos, self.head_dim**-0.5)  # [B, H, S, D]
        else:
            out = torch_slot_attention(q, kv, batch, self.head_dim**-0.5, self.grouped)  # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


def write_kv(
    cache: torch.Tensor,  # [num_layers, 2, num_slots, KVH, max_model_len, D]
    layer: int,
    write_slot: torch.Tensor,  # [B, S] int64
    write_pos: torch.Tensor,  # [B, S] int64
    keys: torch.Tensor,  # [B, S, KVH, D]
    values: torch.Tensor,  # [B, S, KVH, D]
) -> None:
    """Write a pass's new keys and values of one layer into their slots, indexing the whole cache.

    The form ``torch.compile`` needs (``cpu_compile.py``): a write into a view of the cache
    (``cache[layer, 0][...]``) is functionalised into a copy of the whole cache on every
    pass, while an index write into the cache tensor itself is done in place. So the layer
    and the key/value half are index tensors too, broadcast against ``[B, S]``.
    """
    layer_index = torch.full((1,), layer, dtype=torch.long, device=cache.device)  # [1]
    cache[layer_index, torch.zeros_like(layer_index), write_slot, :, write_pos] = keys
    cache[layer_index, torch.ones_like(layer_index), write_slot, :, write_pos] = values


def write_kv_in_place(cache, layer: int, write_slot, write_pos, keys, values) -> None:
    """``write_kv`` through views: fewer small tensors, for eager passes and CUDA graph captures."""
    cache[layer, 0][write_slot, :, write_pos] = keys
    cache[layer, 1][write_slot, :, write_pos] = values


# SDPA's backends for passes on CUDA: cuDNN's is left out. With a boolean mask it builds an
# execution plan for each new shape, and an eager pass's shape (tokens a row, kv_len) changes
# with every prompt and step: on an H200 an EAGLE-3 head's pass that mixed one prompt with
# decoding rows took 80-780 ms against 4 ms with the memory-efficient kernel, and a head's
# 4-draft proposal 164 ms.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q, keys, values, mask, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, on CUDA without cuDNN's backend (``CUDA_SDPA_BACKENDS``)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **kwargs)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **kwargs)


def torch_slot_attention(
    q: torch.Tensor,  # [B, H, S, D]
    kv: torch.Tensor,  # [2, num_slots, KVH, max_model_len, D]
    batch: BatchIndex,
    scale: float,
    grouped: bool,  # fewer key/value heads than query heads
) -> torch.Tensor:  # [B, H, S, D]
    """Gather each row's slot up to ``kv_len`` and attend causally by position (SDPA, as transformers does)."""
    keys = kv[0, :, :, : batch.kv_len].index_select(0, batch.slots)  # [B, KVH, kv_len, D]
    values = kv[1, :, :, : batch.kv_len].index_select(0, batch.slots)  # [B, KVH, kv_len, D]
    return attend(q, keys, values, batch.mask, scale=scale, enable_gqa=grouped)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaArchConfig, biases: set[str]):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=bool({"gate_proj", "up_proj"} & biases))
        self.down_proj = nn.Linear(i, h, bias="down_proj" in biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [B, S, intermediate]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaArchConfig, biases: set[str], triton_attention: bool):
        super().__init__()
        self.self_attn = Attention(config, biases, triton_attention)
        self.mlp = MLP(config, biases)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer: int, batch: BatchIndex) -> torch.Tensor:  # x: [B, S, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: LlamaArchConfig, biases: set[str], triton_attention: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, biases, triton_attention) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class BatchIndex:
    """Where a padded batch reads and writes the cache; built once per forward, shared by all layers."""

    def __init__(
        self,
        starts: torch.Tensor,  # [B] int64: cached length of each row's sequence before this pass
        num_new: torch.Tensor,  # [B] int64: real (unpadded) tokens in each row, 0 for an unused row
        slots: torch.Tensor,  # [B] int64: each row's cache slot
        num_tokens: int,  # S: padded tokens per row
        kv_len: int,  # cache positions attended over (max_model_len for a static shape)
        scratch_slot: int,
        max_model_len: int,
        with_mask: bool = True,  # False: the Triton attention kernel masks by position itself
        tree: TreeAttention | None = None,  # draft trees in the pass: who sees whom, and rotary positions
    ):
        offsets = torch.arange(num_tokens, device=starts.device)  # [S]
        self.positions = starts[:, None] + offsets  # [B, S]: where each token's key and value are written
        real = offsets[None, :] < num_new[:, None]  # [B, S]
        self.write_slot = torch.where(real, slots[:, None], scratch_slot)  # [B, S]: padding goes to scratch
        self.write_pos = self.positions.clamp(max=max_model_len - 1)  # [B, S]
        self.rope_positions = self.positions if tree is None else tree.positions  # [B, S]
        self.slots = slots  # [B]
        self.kv_len = kv_len
        # [B, 1, S, kv_len]: key j is visible to the query at position p iff j <= p (built here, not lazily:
        # torch.compile traces no cached_property); in a tree, by tree.visible
        self.mask: torch.Tensor | None = None
        if with_mask or tree is not None:
            key_pos = torch.arange(kv_len, device=starts.device)  # [kv_len]
            if tree is None:
                self.mask = (key_pos[None, None, :] <= self.positions[:, :, None])[:, None]
            else:
                self.mask = tree.mask(key_pos)[:, None]


class TreeAttention:
    """Attention over draft trees (``specdec.tree``): each token sees the cache before ``base`` and, of the
    ``W`` positions from ``base`` on, those ``visible`` marks; it rotates at ``positions`` (its depth)."""

    def __init__(
        self,
        base: torch.Tensor,  # [B] int64: the first tree position of each row (the root, for a verify)
        positions: torch.Tensor,  # [B, S] int64: rotary position of each token
        visible: torch.Tensor,  # [B, S, W] bool: token s sees the key at base + w
    ):
        self.base, self.positions, self.visible = base, positions, visible

    def mask(self, key_pos: torch.Tensor) -> torch.Tensor:  # key_pos: [kv_len] -> [B, S, kv_len] bool
        b, s, w = self.visible.shape
        rel = key_pos[None, :] - self.base[:, None]  # [B, kv_len]
        inside = (rel >= 0) & (rel < w)
        seen = self.visible.gather(2, rel.clamp(0, w - 1)[:, None, :].expand(b, s, rel.shape[1]))  # [B, S, kv_len]
        return (rel < 0)[:, None, :] | (inside[:, None, :] & seen)


class FastLlama(nn.Module):
    def __init__(self, config: LlamaArchConfig, biases: set[str], triton_attention: bool = False):
        super().__init__()
        self.config = config
        self.triton_attention = triton_attention  # the kernel attends in passes over the whole cache
        self.model = Backbone(config, biases, triton_attention)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # [head_dim // 2]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64, right-padded
        starts: torch.Tensor,  # [B] int64
        num_new: torch.Tensor,  # [B] int64
        slots: torch.Tensor,  # [B] int64
        kv: torch.Tensor,  # [num_layers, 2, num_slots, kv_heads, max_model_len, head_dim]
        kv_len: int,
        logit_rows: torch.Tensor | None = None,  # [R] int64 indices into the flattened [B * S] rows; None = all
        hidden_layers: tuple[int, ...] = (),
        hidden_rows: torch.Tensor | None = None,  # [N] int64 indices into the flattened [B * S] rows; None = all
        tree: TreeAttention | None = None,  # draft trees in the pass (specdec.tree); None: causal by position
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[R, vocab]`` in the model dtype; with ``hidden_layers``, also ``[N, len(layers) * hidden]``.

        ``hidden_layers`` index transformers' ``output_hidden_states`` tuple (``check_hidden_layers``):
        the features EAGLE-3 and the MLP speculator read from the target.
        """
        b, s = input_ids.shape
        with_mask = not kernel_attends(self.triton_attention, kv_len, kv.shape[4])
        batch = BatchIndex(starts, num_new, slots, s, kv_len, kv.shape[2] - 1, kv.shape[4], with_mask, tree)
        freqs = batch.rope_positions[..., None].float() * self.inv_freq  # [B, S, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, head_dim]
        x = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)  # [B, 1, S, head_dim]
        # (id, [B, S, hidden]) for each id asked for; matched by comparison, not used as dict keys:
        # torch.compile with dynamic shapes traces the ids as symbols, which compare but do not hash
        taken: list[tuple[int, torch.Tensor]] = []
        for i, layer in enumerate(self.model.layers):
            if any(i == wanted for wanted in hidden_layers):
                taken.append((i, x))
            x = layer(x, cos, sin, kv, i, batch)
        x = x.reshape(b * s, -1)  # [B * S, hidden]
        if hidden_layers:
            taken.append((self.config.num_layers, self.model.norm(x)))  # [B * S, hidden]
            hidden = torch.cat(
                [next(state for i, state in taken if i == wanted).reshape(b * s, -1) for wanted in hidden_layers], dim=-1
            )  # [B * S, n * hidden]
            if hidden_rows is not None:
                hidden = hidden.index_select(0, hidden_rows)  # [N, n * hidden]
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)  # [R, hidden]: the lm_head runs only where logits are wanted
        logits = self.lm_head(self.model.norm(x))
        return (logits, hidden) if hidden_layers else logits


def check_hidden_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Hidden-state ids are transformers' ``output_hidden_states`` indices: 0 .. num_layers.

    ``i < num_layers`` is the input of decoder layer ``i`` (0: the embeddings; vLLM's
    ``aux_hidden_state_layers`` count the same way), ``num_layers`` the final normed state.
    """
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(
            f"hidden_layers must be ids in [0, {num_layers}] (the target has {num_layers} layers), got {layers}"
        )
    return tuple(layers)


def load_fast_llama(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device | str,
    triton_attention: bool = False,
    pack_cpu_weights: bool | None = None,
) -> FastLlama:
    """Build the model from ``config.json`` and load the safetensors weights straight onto ``device``.

    ``triton_attention`` runs attention with the Triton slot kernel (``attention_kernel.py``).
    ``pack_cpu_weights`` prepacks every linear for oneDNN (``cpu_linear.py``); ``None`` does so
    on CPU wherever the torch build supports it for ``dtype``.
    """
    device = torch.device(device)
    if triton_attention:
        from specdec.fast.attention_kernel import check_available

        check_available()
    config = read_config(path)
    names = weight_names(path)
    biases = {n.split(".")[-2] for n in names if n.startswith("model.layers.0.") and n.endswith(".bias")}
    with torch.device("meta"):
        model = FastLlama(config, biases, triton_attention)
    state = load_state_dict(path, dtype, device, config.tie_word_embeddings, config.num_layers)  # no MTP layers
    state = fuse_projections(state, config.num_layers)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device).eval()
    if pack_cpu_weights is None:
        pack_cpu_weights = device.type == "cpu" and cpu_packing_available(dtype)
    if pack_cpu_weights:
        pack_linears(model)
    return model
