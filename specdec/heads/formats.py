"""Read and write draft-head checkpoints: the ``speculators`` format and the original EAGLE-3 layout.

* ``speculators`` (vllm-project/speculators, which vLLM loads directly): ``config.json`` with
  ``speculators_model_type``, ``speculators_config`` {algorithm, proposal_methods, verifier},
  ``transformer_layer_config`` (the decoder layers, a Llama config whose ``vocab_size`` is the
  target's), ``draft_vocab_size`` and optionally ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``; weights in safetensors
  named ``fc``, ``layers.{i}.*`` (one per ``num_hidden_layers``; q/k/v and gate/up apart),
  ``norm``, ``lm_head``, ``d2t``, ``t2d`` and optionally ``embed_tokens``.
* the original EAGLE-3 release: a Llama ``config.json`` (``num_hidden_layers`` 1,
  ``draft_vocab_size``) and the layer's weights under ``midlayer.*``, in safetensors or in
  the ``pytorch_model.bin`` its releases ship (read with ``weights_only``: tensors, no code).

A head without ``embed_tokens`` shares the target's (as vLLM does), so loading names the
target checkpoint; it also fixes the default hidden-state layers and is what a head is
checked against: a head for another target is refused naming both.

A P-EAGLE head (``specdec.heads.peagle``) is a speculators EAGLE-3 checkpoint with ``mask_hidden``
among its weights and ``parallel_drafting`` and ``mask_token_id`` in its ``config.json``. Loaded with
``parallel_drafting`` it is a ``PEagleHead``, and a checkpoint without either is refused naming the key;
loaded without, it is the EAGLE-3 head it also is (``mask_hidden`` unread), as vLLM serves it then.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.cached_lm import check_model_dir
from specdec.fast.checkpoint import (
    SHARD_INDEX, SINGLE_FILE, LlamaArchConfig, read_config, safetensors_files, weight_files,
)  # fmt: skip
from specdec.heads.eagle3 import EAGLE3, Eagle3Config, Eagle3Head, default_aux_layers
from specdec.heads.peagle import MASK_HIDDEN, MASK_TOKEN_KEYS, PARALLEL_DRAFTING_KEY, PEagleHead

SPECULATORS_VERSION = "0.1.0"
TORCH_SINGLE_FILE, TORCH_SHARD_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
FUSED = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj", "up_proj")))


def read_head_config(path: str | os.PathLike) -> dict:
    config_path = os.path.join(check_model_dir(path), "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"draft head {os.fspath(path)!r} has no config.json")
    with open(config_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"draft head {os.fspath(path)!r}: config.json is not JSON ({err})") from None


def head_kind(raw: dict) -> str | None:
    """``eagle3``, ``mlp_speculator``, ``medusa``, ``dflash`` or None (a plain causal LM) for a ``config.json``."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        return kind
    if "dflash_config" in raw or any("dflash" in a.lower() for a in raw.get("architectures") or ()):
        return "dflash"  # z-lab's DFlashDraftModel (and DFlash2DraftModel, which the loader refuses by name)
    if raw.get("model_type") == "mlp_speculator":
        return "mlp_speculator"
    if raw.get("model_type") == "medusa" or "medusa_num_heads" in raw:  # vLLM's layout, or the original release's
        return "medusa"
    if any("eagle3" in a.lower() for a in raw.get("architectures") or ()) or "draft_vocab_size" in raw:
        return EAGLE3
    return None


def read_head_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the head: safetensors (one file or shards), else a ``pytorch_model.bin`` (or its shards)."""
    if weight_files(path) is None:
        torch_files = weight_files(path, TORCH_SINGLE_FILE, TORCH_SHARD_INDEX)
        if torch_files is None:
            raise FileNotFoundError(f"draft head {path!r} has no weights: none of {SINGLE_FILE}, {SHARD_INDEX}, "
                                    f"{TORCH_SINGLE_FILE}, {TORCH_SHARD_INDEX}")  # fmt: skip
        state = {}
        for file in torch_files:
            try:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
            except Exception as err:  # weights_only refuses anything but tensors and plain containers
                raise ValueError(f"draft head {path!r}: {os.path.basename(file)} is not a file of tensors ({err})") from None
        return state
    state = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            state.update({name: f.get_tensor(name) for name in f.keys()})
    return state


def eagle3_config(path: str | os.PathLike, target: LlamaArchConfig, target_path: str) -> Eagle3Config:
    """The head's config, checked against the target's; either layout."""
    raw = read_head_config(path)
    if head_kind(raw) != EAGLE3:
        raise ValueError(
            f"draft head {os.fspath(path)!r} is not an EAGLE-3 head (its config.json names {head_kind(raw)!r})"
        )
    # the decoder layers are Llama layers whatever family the config names (a Qwen3 target's head
    # has no query and key norms), as vLLM's llama_eagle3 builds them
    layer_raw = {**(raw.get("transformer_layer_config") or raw), "model_type": "llama"}
    layer = LlamaArchConfig.from_dict(layer_raw)
    target_hidden = raw.get("target_hidden_size") or layer.hidden_size
    aux = tuple(raw.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers))
    mismatches = []
    if target_hidden != target.hidden_size:
        mismatches.append(f"hidden size {target_hidden} (target has {target.hidden_size})")
    if layer.vocab_size != target.vocab_size:
        mismatches.append(f"vocabulary of {layer.vocab_size} tokens (target has {target.vocab_size})")
    if any(not 0 <= i <= target.num_layers for i in aux):
        mismatches.append(f"hidden-state layers {aux} (target has {target.num_layers} layers)")
    if mismatches:
        raise ValueError(
            f"draft head {os.path.realpath(path)!r} does not fit target {os.path.realpath(target_path)!r}: "
            f"it was built for {', '.join(mismatches)}"
        )
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=target_hidden,
        aux_layers=aux,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def _eagle3_state(raw: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Map either layout's names onto ``Eagle3Head``'s (fused q/k/v and gate/up, as the fast engine runs them)."""
    state = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        state[name] = tensor
    for i in range(config.num_layers):
        for fused, parts in FUSED:
            prefix = f"layers.{i}.{fused.split('.')[0]}."
            names = [f"{prefix}{p}.weight" for p in parts]
            if all(n in state for n in names):
                state[f"layers.{i}.{fused}.weight"] = torch.cat([state.pop(n) for n in names])
    if "d2t" not in state:  # a head over the whole target vocabulary
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(config.draft_vocab_size) + state["d2t"]] = True
    return state


def peagle_mask_token(path: str | os.PathLike) -> int:
    """The mask token id of the P-EAGLE head at ``path``, from its config.json and weight names alone;
    refused naming the key a head trained only to draft a chain lacks, and where to get one that has it."""
    raw = read_head_config(path)
    token = next((raw[key] for key in MASK_TOKEN_KEYS if raw.get(key) is not None), None)
    if token is None:
        raise _not_peagle(path, f"names no mask token ({' or '.join(map(repr, MASK_TOKEN_KEYS))} in its config.json)")
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"draft head {os.fspath(path)!r}: mask token must be a token id, got {token!r}")
    if MASK_HIDDEN not in _weight_names(os.fspath(path)):
        raise _not_peagle(path, f"has no {MASK_HIDDEN!r} among its weights")
    return token


def _not_peagle(path, what: str) -> ValueError:
    return ValueError(
        f"parallel_drafting with method eagle3 needs a P-EAGLE head: draft head {os.fspath(path)!r} {what}; serve "
        f"one trained to draft in parallel (models/tiny-peagle, scripts/train_draft_head.py --method eagle3 "
        f"--parallel-drafting) or set parallel_drafting false"
    )


def _weight_names(path: str) -> set[str]:
    """The names of the head's tensors: read from the safetensors headers, or the weights loaded where it has none."""
    if weight_files(path) is None:
        return set(read_head_weights(path))
    names = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def load_eagle3(
    path: str | os.PathLike, target_path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str,
    parallel_drafting: bool = False,
) -> Eagle3Head:
    """Load an EAGLE-3 head for the target at ``target_path``; refuses one built for another target.

    ``parallel_drafting``: a ``PEagleHead``, refused for a checkpoint without a mask token or ``mask_hidden``."""
    path, target_path = check_model_dir(path), check_model_dir(target_path)
    config = eagle3_config(path, read_config(target_path), target_path)
    mask_token = peagle_mask_token(path) if parallel_drafting else None
    weights = read_head_weights(path)
    if not parallel_drafting:
        weights.pop(MASK_HIDDEN, None)  # a P-EAGLE head drafting a chain: its mask feature is not read
    state = _eagle3_state(weights, config)
    if "embed_tokens.weight" not in state:
        if config.hidden_size != config.target_hidden_size:
            raise ValueError(
                f"draft head {path!r} has no embed_tokens and is {config.hidden_size} wide: it cannot share the "
                f"{config.target_hidden_size}-wide embedding of target {target_path!r}; save the head's own"
            )
        state["embed_tokens.weight"] = _target_embedding(target_path)
    head = Eagle3Head(config) if mask_token is None else PEagleHead(config, mask_token)
    expected = {n: tuple(t.shape) for n, t in head.state_dict().items()}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if expected != got:
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
        raise ValueError(
            f"draft head {path!r}: weights do not match its config.json: missing {missing}, unexpected {extra}, "
            f"wrong shape {[(n, got[n], expected[n]) for n in wrong]}"
        )
    head.load_state_dict({n: t if t.dtype in (torch.long, torch.bool) else t.to(dtype) for n, t in state.items()})
    return head.to(device=device, dtype=dtype).eval()


def _target_embedding(target_path: str) -> torch.Tensor:
    for file in safetensors_files(target_path):
        with safe_open(file, framework="pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                return f.get_tensor("model.embed_tokens.weight")
    raise ValueError(f"target {target_path!r} has no model.embed_tokens.weight for the draft head to share")


def save_eagle3(
    head: Eagle3Head, out: str | os.PathLike, verifier: str, num_speculative_tokens: int = 4, embedding: bool = True
) -> None:
    """Write ``head`` in the ``speculators`` format; ``verifier``: the target it was trained for.

    ``embedding=False`` leaves ``embed_tokens`` out, for a head that uses the target's own
    (the loader, like vLLM, then shares the target's). A ``PEagleHead`` also writes ``mask_hidden``, and
    ``parallel_drafting`` and its mask token id (``mask_token_id``) in config.json.
    """
    config = head.config
    layer = config.layer
    os.makedirs(out, exist_ok=True)
    state = {n: t.detach().contiguous().cpu() for n, t in head.state_dict().items()}
    if not embedding:
        del state["embed_tokens.weight"]
    for fused, parts, sizes in (
        ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
         (layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim)),
        ("mlp.gate_up_proj", ("gate_proj", "up_proj"), (layer.intermediate_size, layer.intermediate_size)),
    ):  # fmt: skip
        for i in range(config.num_layers):
            weights = state.pop(f"layers.{i}.{fused}.weight").split(list(sizes))
            for part, weight in zip(parts, weights):
                state[f"layers.{i}.{fused.split('.')[0]}.{part}.weight"] = weight.contiguous()
    save_file(state, os.path.join(out, "model.safetensors"))
    raw = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": EAGLE3,
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "transformer_layer_config": _layer_dict(layer),
        "speculators_config": {
            "algorithm": EAGLE3,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }
    if isinstance(head, PEagleHead):
        raw.update({PARALLEL_DRAFTING_KEY: True, MASK_TOKEN_KEYS[0]: head.mask_token_id})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)


def _layer_dict(layer: LlamaArchConfig) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": layer.vocab_size,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": layer.num_layers,
        "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "max_position_embeddings": layer.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
