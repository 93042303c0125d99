"""The target's own multi-token-prediction (MTP) layer as a draft head (DeepSeek-AI 2024,
"DeepSeek-V3 Technical Report", section 2.2), laid out as DeepSeek-V3's checkpoints carry it
and vLLM's ``deepseek_mtp.py`` loads it.

A checkpoint with MTP says ``num_nextn_predict_layers`` in its ``config.json`` and keeps
MTP layer ``i`` beside the model's own, at layer index ``num_hidden_layers + i``::

    model.layers.{L}.enorm.weight, hnorm.weight         RMSNorms of the embedding and the hidden state
    model.layers.{L}.eh_proj.weight                      [hidden, 2 * hidden]
    model.layers.{L}.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*   a decoder block
    model.layers.{L}.shared_head.norm.weight             the norm before the LM head
    model.layers.{L}.embed_tokens / shared_head.head     only where not the model's own (DeepSeek-V3
                                                         stores copies; vLLM shares the first's)

Row ``t`` takes token ``x_{t+1}`` and a hidden state at ``t`` and predicts ``x_{t+2}``::

    h'_t = Block(eh_proj([enorm(Emb(x_{t+1})); hnorm(h_t)]))    logits_t = lm_head(shared_head.norm(h'_t))

with ``h_t`` the target's final hidden state (vLLM feeds the target model's output, after its
final norm: hidden-state id ``num_hidden_layers``) for the first draft, and the layer's own
``h'`` of the row before for each further one. As vLLM does, the embedding at position 0 is
zeroed ("not needed by MTP"). The layout is EAGLE-3's (``specdec.heads.eagle3``: a decoder
layer over the target's features with its own KV cache), so ``MTPHead`` keeps ``Eagle3Head``'s
interface and ``Eagle3Proposer``'s machinery drives it (``specdec.proposers.mtp``).

Only the first MTP layer is read: vLLM's proposer calls the MTP model at ``spec_step_idx`` 0
for every draft step, so every draft chains layer ``num_hidden_layers`` (the model's own
``spec_step_idx % num_nextn_predict_layers`` is not reached from its proposer). The released
checkpoints (DeepSeek-V3, GLM-4.5, MiMo, Qwen3-Next) carry one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.fast.checkpoint import (
    LlamaArchConfig, fuse_projections, is_mtp_weight, read_config, safetensors_files,
)  # fmt: skip
from specdec.fast.llama import BatchIndex, DecoderLayer, RMSNorm, kernel_attends, rope_inv_freq
from specdec.heads.eagle3 import _ttt_attention, _ttt_mask

MTP = "mtp"
NUM_LAYERS_KEY = "num_nextn_predict_layers"  # DeepSeek-V3's config.json key
# the MTP layer's own tensors, after ``model.layers.{L}.`` (the decoder block's come from the model's layers)
OWN_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


@dataclass(frozen=True)
class MTPConfig:
    layer: LlamaArchConfig  # the target's, with num_layers=1: the cache holds one layer
    target_num_layers: int  # L: the first MTP layer's index, and the hidden-state id it reads
    num_mtp_layers: int  # num_nextn_predict_layers; the first is the one drafted with

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def draft_vocab_size(self) -> int:  # the target's whole vocabulary (EAGLE-3's interface)
        return self.layer.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:  # one hidden state, the target's final one
        return self.layer.hidden_size

    @property
    def aux_layers(self) -> tuple[int, ...]:  # VerifyRequest.hidden_layers: the final normed state
        return (self.target_num_layers,)

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.target_num_layers}."


class SharedHead(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(h, eps)


class MTPLayer(DecoderLayer):
    """The decoder block (its usual names) with the MTP layer's norms, projection and shared head's norm."""

    def __init__(self, config: MTPConfig, biases: set[str]):
        super().__init__(config.layer, biases, triton_attention=False)
        h, eps = config.hidden_size, config.layer.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)  # [emb; hidden] -> h
        self.shared_head = SharedHead(h, eps)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # [B, S, h] each -> [B, S, h]
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class MTPHead(nn.Module):
    """``Eagle3Head``'s interface over one MTP layer: ``forward`` gives the logits and the pre-norm ``h'``."""

    def __init__(self, config: MTPConfig, biases: set[str] = frozenset()):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList([MTPLayer(config, set(biases))])
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.vocab_size, dtype=torch.long), persistent=False)  # identity
        self.register_buffer("inv_freq", rope_inv_freq(config.layer), persistent=False)  # [head_dim // 2]
        self.triton_attention = False

    def use_triton_attention(self) -> None:
        """As ``Eagle3Head.use_triton_attention``: the slot kernel over the cache the target's length spans."""
        from specdec.fast.attention_kernel import check_available, slot_attention

        check_available()
        self.layers[0].self_attn.kernel = slot_attention
        self.triton_attention = True

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].enorm.weight.dtype  # the linears may be packed for oneDNN (no .weight)

    @property
    def device(self) -> torch.device:
        return self.layers[0].enorm.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [..., h]: the target's state is read as it is
        return features.to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64, right-padded
        hidden: torch.Tensor,  # [B, S, h]: the target's final hidden states, or the layer's own h'
        starts: torch.Tensor,  # [B] int64: the position of each row's first token
        num_new: torch.Tensor,  # [B] int64
        slots: torch.Tensor,  # [B] int64
        kv: torch.Tensor,  # [1, 2, num_slots, kv_heads, max_model_len, head_dim]
        kv_len: int,
        tree=None,  # trees are refused for MTP (build_head_proposer); the argument keeps Eagle3Head's call
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, S, vocab], pre-norm h' [B, S, h]
        b, s = input_ids.shape
        with_mask = not kernel_attends(self.triton_attention, kv_len, kv.shape[4])
        batch = BatchIndex(starts, num_new, slots, s, kv_len, kv.shape[2] - 1, kv.shape[4], with_mask)
        freqs = batch.rope_positions[..., None].float() * self.inv_freq  # [B, S, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, head_dim]
        embeds = self.embed_tokens(input_ids) * (batch.rope_positions != 0)[..., None]  # [B, S, h]; position 0: 0
        cos, sin = emb.cos().to(embeds.dtype), emb.sin().to(embeds.dtype)
        layer = self.layers[0]
        x = layer(layer.project(embeds, hidden.to(embeds.dtype)), cos, sin, kv, 0, batch)  # [B, S, h]
        return self.lm_head(layer.shared_head.norm(x)), x

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n, vocab] float32
        return draft_logits.float()


def train_forward(
    head: MTPHead,
    input_ids: torch.Tensor,  # [B, T]: row t's token x_{t+1}
    hidden: torch.Tensor,  # [B, T, h]: the target's final hidden state at t
    num_steps: int,
) -> list[torch.Tensor]:  # num_steps x [B, T, vocab]; step j's row t predicts x_{t+2}, valid for t >= j
    """Step 0 is DeepSeek-V3's MTP objective; step j > 0 feeds each row the layer's own ``h'`` of step
    j - 1 at the row before, as chaining the layer for draft j + 1 does, with EAGLE-3's training-time-test
    attention mask (``specdec.heads.eagle3.train_forward``): training sees the inputs inference will."""
    t = input_ids.shape[1]
    layer = head.layers[0]
    positions = torch.arange(t, device=input_ids.device)  # [T]
    freqs = positions[:, None].float() * head.inv_freq  # [T, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(head.dtype), emb.sin().to(head.dtype)  # [T, head_dim]
    embeds = head.embed_tokens(input_ids) * (positions != 0)[None, :, None]  # [B, T, h]
    seen: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # the layer's keys and values of each step
    outputs = []
    for j in range(num_steps):
        mask = _ttt_mask(t, j, input_ids.device)  # [T, (j + 1) * T]
        x = layer.project(embeds, hidden.to(head.dtype))  # [B, T, h]
        x = x + _ttt_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, seen, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))  # [B, T, h]
        outputs.append(head.lm_head(layer.shared_head.norm(x)))
        hidden = torch.cat([x[:, :1], x[:, :-1]], 1)  # row t takes row t - 1's h' (row 0: unused)
    return outputs



def mtp_config(target_path: str | os.PathLike) -> MTPConfig:
    """The MTP layers ``target_path``'s ``config.json`` declares; a target without them is refused."""
    path = os.fspath(target_path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    count = raw.get(NUM_LAYERS_KEY) or 0
    if not isinstance(count, int) or count < 1:
        raise ValueError(
            f"method 'mtp' drafts with the target's own multi-token-prediction layers, but target {path!r} has "
            f"none ({NUM_LAYERS_KEY} = {raw.get(NUM_LAYERS_KEY)!r} in its config.json): serve a checkpoint "
            f"trained with MTP (scripts/train_mtp.py adds one to a target), or another method"
        )
    arch = read_config(path)
    return MTPConfig(replace(arch, num_layers=1), arch.num_layers, count)


def load_mtp(target_path: str | os.PathLike, dtype: torch.dtype, device: str | torch.device) -> MTPHead:
    """The first MTP layer of ``target_path`` with the embedding and LM head it shares with the model
    (its own copies where the checkpoint has them); missing weights are refused by name."""
    path = os.fspath(target_path)
    config = mtp_config(path)
    wanted = {config.prefix + n for n in (*OWN_TENSORS, *SHARED)} | set(SHARED.values())
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(config.prefix) or name in wanted:
                    state[name] = f.get_tensor(name)
    missing = [config.prefix + n for n in OWN_TENSORS if config.prefix + n not in state]
    if missing:
        raise ValueError(f"target {path!r} declares {NUM_LAYERS_KEY}={config.num_mtp_layers} but lacks the MTP "
                         f"layer's weights {missing}")  # fmt: skip
    for own, model_name in SHARED.items():  # the layer's own copy, else the model's
        if config.prefix + own not in state and model_name in state:
            state[config.prefix + own] = state[model_name]
    if config.prefix + "shared_head.head.weight" not in state:  # tied: the embedding is the LM head
        state[config.prefix + "shared_head.head.weight"] = state[config.prefix + "embed_tokens.weight"]
    block = {"model.layers.0." + n[len(config.prefix) :]: t for n, t in state.items()
             if n.startswith(config.prefix) and n[len(config.prefix) :] not in SHARED}  # fmt: skip
    block = {"layers.0." + n[len("model.layers.0.") :]: t for n, t in fuse_projections(block, 1).items()}
    block["embed_tokens.weight"] = state[config.prefix + "embed_tokens.weight"]
    block["lm_head.weight"] = state[config.prefix + "shared_head.head.weight"]
    biases = {n.split(".")[-2] for n in state if n.startswith(config.prefix) and n.endswith(".bias")}
    head = MTPHead(config, biases)
    expected = {n: tuple(t.shape) for n, t in head.state_dict().items()}
    got = {n: tuple(t.shape) for n, t in block.items()}
    if expected != got:
        raise ValueError(
            f"target {path!r}: MTP layer {config.prefix}* does not match the model's shapes: missing "
            f"{sorted(expected.keys() - got.keys())}, unexpected {sorted(got.keys() - expected.keys())}, wrong shape "
            f"{sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])}"
        )
    head.load_state_dict({n: t.to(dtype) for n, t in block.items()})
    return head.to(device=device, dtype=dtype).eval()


def layer_tensors(head: MTPHead) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under their checkpoint names (q/k/v and gate/up apart), without the
    embedding and LM head it shares with the model."""
    config, layer = head.config, head.layers[0]
    state = {config.prefix + n: t.detach().contiguous().cpu() for n, t in layer.state_dict().items()}
    arch = config.layer
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for fused, parts, sizes in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
                                ("mlp.gate_up_proj", ("gate_proj", "up_proj"), (arch.intermediate_size,) * 2)):  # fmt: skip
        for kind in ("weight", "bias"):
            fused_tensor = state.pop(f"{config.prefix}{fused}.{kind}", None)
            if fused_tensor is None:
                continue
            for part, piece in zip(parts, fused_tensor.split(list(sizes))):
                state[f"{config.prefix}{fused.split('.')[0]}.{part}.{kind}"] = piece.contiguous()
    return state


def write_into_target(head: MTPHead, target_path: str | os.PathLike) -> list[str]:
    """Add the MTP layer to the target's single ``model.safetensors`` (in its dtype) and
    ``num_nextn_predict_layers: 1`` to its ``config.json``; every existing tensor is written back
    unchanged (an MTP layer written before is replaced). Returns the names added."""
    path = os.fspath(target_path)
    files = safetensors_files(path)
    if len(files) != 1:
        raise ValueError(f"target {path!r}: writing an MTP layer needs one model.safetensors, found {files}")
    with safe_open(files[0], framework="pt") as f:
        metadata = f.metadata()
    config = head.config
    state = {n: t for n, t in load_file(files[0]).items() if not is_mtp_weight(n, config.target_num_layers)}
    dtype = state["model.embed_tokens.weight"].dtype
    added = {n: t.to(dtype) for n, t in layer_tensors(head).items()}
    mode = os.stat(files[0]).st_mode & 0o777
    save_file({**state, **added}, files[0], metadata=metadata)
    os.chmod(files[0], mode)  # as it was (save_file's new file may be private)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw[NUM_LAYERS_KEY] = 1
    with open(config_path, "w") as f:
        f.write(json.dumps(raw, indent=2) + "\n")
    return sorted(added)
