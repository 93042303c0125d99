"""EAGLE-3 heads on disk: the target's hidden states, the ``speculators`` format and the original layout
round-tripped, and heads that are missing, malformed or for another target refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_heads import DRAFT_VOCAB, PROMPTS, VOCAB, pair, two_layer_pair
from tiny_llama import build_tiny_llama
from specdec.cached_lm import ForwardCall
from specdec.fast.checkpoint import read_config
from specdec.fast.runner import FastCausalLM
from specdec.heads import build_head_proposer, describe_head
from specdec.heads.formats import load_eagle3
from specdec.models import CachedCausalLM

__all__ = ["pair", "two_layer_pair"]  # fixtures



@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_hidden_states_are_transformers_own(pair, engine):
    target, target_dir, _ = pair
    lm = FastCausalLM(target_dir, max_num_seqs=2) if engine == "fast" else CachedCausalLM(target)
    ids, layers = PROMPTS[3], (2, 3, 6)
    with torch.inference_mode():
        reference = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.cat([reference[i][0] for i in layers], -1)  # [len(ids), 3 * hidden]
    _, first = lm.forward_with_hidden([ForwardCall("a", 0, ids[:12], 1), ForwardCall("b", 0, ids[:4], 2)], layers)
    _, rest = lm.forward_with_hidden([ForwardCall("a", 12, ids[12:], 3)], layers)
    torch.testing.assert_close(torch.cat([first[0], rest[0]]).float(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1].float(), expected[:4], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"hidden_layers must be ids in \[0, 6\] \(the target has 6 layers\)"):
        lm.forward_with_hidden([ForwardCall("c", 0, ids, 1)], (7,))


def test_speculators_format_round_trips_and_reads_the_original_layout(pair, tmp_path):
    _, target_dir, head_dir = pair
    raw = json.loads((head_dir / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["draft_vocab_size"] == DRAFT_VOCAB
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu")
    # The original EAGLE-3 release: a Llama config.json and the layer's weights under midlayer.*
    original = tmp_path / "original"
    original.mkdir()
    weights = load_file(head_dir / "model.safetensors")
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in weights.items() if k != "embed_tokens.weight"},
              original / "model.safetensors")  # fmt: skip
    layer = dict(raw["transformer_layer_config"], architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    (original / "config.json").write_text(json.dumps(layer))
    shared = load_eagle3(original, target_dir, torch.float32, "cpu")  # no embed_tokens: the target's
    target_embedding = load_file(target_dir / "model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(shared.embed_tokens.weight, target_embedding)
    for name, tensor in head.state_dict().items():
        if name != "embed_tokens.weight":
            torch.testing.assert_close(shared.state_dict()[name], tensor)
    # as its releases ship it: pytorch_model.bin, read as tensors only
    (original / "model.safetensors").unlink()
    torch.save(load_file(head_dir / "model.safetensors"), original / "pytorch_model.bin")
    from_bin = load_eagle3(original, target_dir, torch.float32, "cpu")
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(from_bin.state_dict()[name], tensor)


def test_a_head_whose_layer_config_names_another_family_loads_as_llama_layers(pair, tmp_path):
    """As vLLM builds them: a head for a Qwen3 target may name qwen3 and has no query and key norms."""
    _, target_dir, head_dir = pair
    head = tmp_path / "head"
    shutil.copytree(head_dir, head)
    raw = json.loads((head / "config.json").read_text())
    raw["transformer_layer_config"]["model_type"] = "qwen3"
    (head / "config.json").write_text(json.dumps(raw))
    loaded, shipped = (load_eagle3(d, target_dir, torch.float32, "cpu") for d in (head, head_dir))
    assert loaded.layers[0].self_attn.q_norm is None
    for name, tensor in shipped.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


class _NotATensor:
    pass


def test_head_weights_that_are_missing_or_not_tensors_are_refused_naming_the_files(pair, tmp_path):
    _, target_dir, head_dir = pair
    head = tmp_path / "head"
    head.mkdir()
    shutil.copy(head_dir / "config.json", head / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no weights: none of model.safetensors, .*pytorch_model.bin"):
        load_eagle3(head, target_dir, torch.float32, "cpu")
    torch.save({"fc.weight": _NotATensor()}, head / "pytorch_model.bin")  # a pickle that would build an object
    with pytest.raises(ValueError, match=r"pytorch_model.bin is not a file of tensors"):
        load_eagle3(head, target_dir, torch.float32, "cpu")


def test_a_two_layer_head_round_trips_with_its_layers_named_as_vllm_loads_them(two_layer_pair):
    _, target_dir, head_dir = two_layer_pair
    assert json.loads((head_dir / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"] == 2
    names = load_file(head_dir / "model.safetensors").keys()
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "layers.1.input_layernorm.weight"} <= names
    assert "layers.1.hidden_norm.weight" not in names and "layers.0.hidden_norm.weight" in names  # only the first reads [emb; hidden]
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu")
    assert len(head.layers) == 2 and head.layers[1].self_attn.qkv_proj.in_features == head.config.hidden_size
    assert build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=2).cache.kv.shape[0] == 2  # a cache layer each


def test_a_head_for_another_target_is_refused_naming_both(pair, tmp_path):
    _, target_dir, head_dir = pair
    other = tmp_path / "other"
    build_tiny_llama(seed=2, vocab_size=VOCAB, hidden_size=48, num_hidden_layers=6).save_pretrained(other)
    with pytest.raises(ValueError, match=rf"draft head '{head_dir}' does not fit target '{other}'.*hidden size 32 "
                                         rf"\(target has 48\)"):  # fmt: skip
        build_head_proposer("eagle3", head_dir, other)
    bigger = tmp_path / "bigger"
    build_tiny_llama(seed=2, vocab_size=64, hidden_size=32, num_hidden_layers=6).save_pretrained(bigger)
    with pytest.raises(ValueError, match=r"vocabulary of 32 tokens \(target has 64\)"):
        build_head_proposer("eagle3", head_dir, bigger)
    with pytest.raises(ValueError, match=r"is a eagle3 checkpoint, not mlp_speculator"):
        build_head_proposer("mlp_speculator", head_dir, target_dir)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        build_head_proposer("eagle3", tmp_path, target_dir)


def test_a_heads_cache_and_features_span_max_model_len_when_given(pair):
    """Sized by the target's max_position_embeddings by default; draft_proposer's max_model_len narrows it."""
    _, target_dir, head_dir = pair
    positions = read_config(target_dir).max_position_embeddings
    assert build_head_proposer("eagle3", head_dir, target_dir).max_model_len == positions
    narrow = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=2, max_model_len=64)
    assert narrow.max_model_len == 64 and narrow.cache.kv.shape[-2] == 64 and narrow._fused.shape[:2] == (2, 64)
    assert describe_head(narrow, head_dir).max_model_len == 64
    with pytest.raises(ValueError, match=rf"max_model_len {positions + 1} exceeds target '{target_dir}'"):
        build_head_proposer("eagle3", head_dir, target_dir, max_model_len=positions + 1)
