"""The fast Llama-family forward against transformers, and ragged batching / rollback against itself.

Tiny random checkpoints are written with ``save_pretrained`` and read back by the
fast loader (safetensors + config.json, no transformers modeling code).
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specdec.fast import FastCausalLM, ForwardCall
from specdec.fast.runner import padding_bounded_passes
from specdec.fast.checkpoint import LlamaArchConfig, read_config
from specdec.fast.cpu_linear import PackedLinear

ATOL = 1e-4
VOCAB = 128

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-mha-tied": (LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}, "rope_theta": 500000.0},
    ),
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 256}),
    # heads wider than hidden / heads, as Qwen3's are (head_dim 128 on a 1024-wide 0.6B)
    "qwen3-tied": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "tie_word_embeddings": True}),
}


def save_checkpoint(directory, family: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides):
    """A random HF checkpoint on disk plus the model itself (eval, float32) as the reference."""
    config_cls, model_cls, family_overrides = FAMILIES[family]
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    kwargs.update(family_overrides, **overrides)
    model = model_cls(config_cls(**kwargs)).eval()
    if family.startswith("qwen2"):  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    if family.startswith("qwen3"):  # and the query and key norms to ones
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory, model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("llama"))


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("linears", ["packed", "plain"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_logits_match_hf(tmp_path, family, linears, monkeypatch):
    """Both CPU linear paths: every linear prepacked for oneDNN, and ``nn.Linear`` (a torch without oneDNN)."""
    if linears == "packed":
        monkeypatch.setattr("specdec.fast.cpu_linear.PACK_MIN_ELEMENTS", 0)  # the test model's weights are tiny
    else:
        monkeypatch.setattr("specdec.fast.llama.cpu_packing_available", lambda dtype: False)
    path, hf = save_checkpoint(tmp_path, family)
    lm = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=64)
    expected_type = PackedLinear if linears == "packed" else torch.nn.Linear
    assert all(isinstance(layer.mlp.down_proj, expected_type) for layer in lm.model.model.layers)
    ids = random_ids(12, seed=1)
    ref = hf_logits(hf, ids)  # [12, vocab]
    prefill = lm.forward([ForwardCall("s", 0, ids[:8], num_logits=8)])[0]  # [8, vocab]
    torch.testing.assert_close(prefill, ref[:8], atol=ATOL, rtol=0)
    for pos in range(8, 12):  # incremental decode, one token at a time
        step = lm.forward([ForwardCall("s", pos, [ids[pos]], num_logits=1)])[0]  # [1, vocab]
        torch.testing.assert_close(step, ref[pos : pos + 1], atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path):
    path, hf = save_checkpoint(tmp_path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    lm = FastCausalLM(path, dtype="float32", max_num_seqs=1, max_model_len=32)
    ids = random_ids(5, seed=2)
    torch.testing.assert_close(lm.forward([ForwardCall("s", 0, ids, 5)])[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_ragged_batch_equals_one_by_one(llama):
    path, hf = llama
    ids = {"a": random_ids(9, 3), "b": random_ids(12, 4), "c": random_ids(6, 5)}
    # a continues from 5 cached tokens, b rolls back from 10 to 7, c is a fresh prefill.
    setup = [ForwardCall("a", 0, ids["a"][:5], 1), ForwardCall("b", 0, ids["b"][:10], 1)]
    batch = [
        ForwardCall("a", 5, ids["a"][5:8], num_logits=3),
        ForwardCall("b", 7, ids["b"][7:9], num_logits=1),
        ForwardCall("c", 0, ids["c"], num_logits=2),
    ]
    batched, single = (FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=32) for _ in range(2))
    batched.forward(setup)
    together = batched.forward(batch)
    for call in setup:
        single.forward([call])
    one_by_one = [single.forward([call])[0] for call in batch]
    for got, want in zip(together, one_by_one):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for got, call in zip(together, batch):  # and both agree with HF on the full prefix
        full = ids[call.seq_id][: call.position + len(call.token_ids)]
        torch.testing.assert_close(got, hf_logits(hf, full)[-call.num_logits :], atol=ATOL, rtol=0)
    assert [batched.cached_length(s) for s in "abc"] == [8, 9, 6]


@pytest.mark.parametrize(
    "lengths, passes",
    [
        ([5, 5, 5, 135], [[0, 1, 2], [3]]),  # a prefill next to decode steps runs on its own
        ([135, 140, 5], [[2], [0, 1]]),  # prefills of similar length share a pass
        ([5, 5, 1, 5], [[2, 0, 1, 3]]),  # a little padding is cheaper than another pass
        ([100 + 2 * i for i in range(16)], [list(range(16))]),  # 15% padding on 16 prefills: one pass
        ([], []),
    ],
)
def test_passes_bound_the_padding(lengths, passes):
    assert padding_bounded_passes(lengths) == passes


def test_a_long_prefill_beside_decode_steps_runs_in_its_own_pass(llama, monkeypatch):
    path, hf = llama
    ids = {"a": random_ids(8, 6), "b": random_ids(8, 7), "p": random_ids(30, 8)}
    batched, single = (FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=32) for _ in range(2))
    for lm in (batched, single):
        lm.forward([ForwardCall(s, 0, ids[s][:6], 1) for s in "ab"])
    batch = [
        ForwardCall("a", 6, ids["a"][6:], 2), ForwardCall("p", 0, ids["p"], 3), ForwardCall("b", 6, ids["b"][6:], 1)
    ]
    pass_sizes = []
    run = batched._run
    monkeypatch.setattr(batched, "_run", lambda calls, *layers: pass_sizes.append(len(calls)) or run(calls, *layers))
    together = batched.forward(batch)
    assert sorted(pass_sizes) == [1, 2]  # two passes: the decode steps, then the prefill
    for got, call in zip(together, batch):  # in call order, as if each had run alone
        torch.testing.assert_close(got, single.forward([call])[0], atol=ATOL, rtol=0)
    assert [batched.cached_length(s) for s in "apb"] == [8, 30, 8]


def test_rollback_by_position_equals_fresh_run(llama):
    path, _ = llama
    lm = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=32)
    first, other = random_ids(10, 6), random_ids(3, 7)
    lm.forward([ForwardCall("s", 0, first, 1)])
    rolled = lm.forward([ForwardCall("s", 4, other, 3)])[0]  # [3, vocab]
    fresh = lm.forward([ForwardCall("fresh", 0, first[:4] + other, 7)])[0][-3:]
    torch.testing.assert_close(rolled, fresh, atol=ATOL, rtol=0)
    assert lm.cached_length("s") == 7


def test_request_errors_leave_state_untouched(llama):
    path, _ = llama
    lm = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=16)
    lm.forward([ForwardCall("s", 0, [1, 2, 3], 1)])
    with pytest.raises(ValueError, match="position 4 is outside the 3 tokens cached"):
        lm.forward([ForwardCall("s", 4, [1], 1)])
    with pytest.raises(ValueError, match="position 1 is outside the 0 tokens cached"):
        lm.forward([ForwardCall("new", 1, [1], 1)])
    with pytest.raises(ValueError, match="num_logits must be in"):
        lm.forward([ForwardCall("s", 3, [1], 2)])
    with pytest.raises(ValueError, match="exceed max_model_len=16"):
        lm.forward([ForwardCall("s", 3, [1] * 14, 1)])
    with pytest.raises(ValueError, match="token_ids must be in"):
        lm.forward([ForwardCall("s", 3, [VOCAB], 1)])
    with pytest.raises(ValueError, match="each seq_id once"):
        lm.forward([ForwardCall("s", 3, [1], 1), ForwardCall("s", 3, [1], 1)])
    assert lm.cached_length("s") == 3 and lm.num_active_sequences == 1


def test_sliding_window_shorter_than_max_model_len_is_rejected(tmp_path):
    path, _ = save_checkpoint(tmp_path, "mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8"):
        FastCausalLM(path, dtype="float32", max_model_len=16)


def test_max_model_len_past_the_trained_positions_is_rejected(tmp_path):
    path, _ = save_checkpoint(tmp_path)  # max_position_embeddings 256
    assert FastCausalLM(path, dtype="float32", max_model_len=256).max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len=257 exceeds the model's max_position_embeddings=256"):
        FastCausalLM(path, dtype="float32", max_model_len=257)


def test_config_validation_names_the_field(tmp_path):
    path, _ = save_checkpoint(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    assert read_config(path).num_kv_heads == 2
    with pytest.raises(ValueError, match="model_type must be one of"):
        LlamaArchConfig.from_dict({**raw, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type must be one of"):
        LlamaArchConfig.from_dict({**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        FastCausalLM(path, dtype="float32", device="cpu", cuda_graphs=True)


def test_sequence_fills_max_model_len_inside_a_padded_batch(llama):
    """Padding past the end of a full sequence must not land on its last cached position."""
    path, hf = llama
    lm = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=16)
    full, short = random_ids(16, 8), random_ids(4, 9)
    lm.forward([ForwardCall("full", 0, full[:15], 1), ForwardCall("short", 0, short[:1], 1)])
    last, _ = lm.forward([ForwardCall("full", 15, full[15:], 1), ForwardCall("short", 1, short[1:], 3)])
    torch.testing.assert_close(last, hf_logits(hf, full)[-1:], atol=ATOL, rtol=0)
    assert lm.cached_length("full") == 16
