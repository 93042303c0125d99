"""Target verifier and model loading: cache rollback by position, release, limits, outputs."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdec.models import CachedCausalLM, load_causal_lm, resolve_dtype
from specdec.tokenizer import load_tokenizer
from specdec.sampling import process_logits
from specdec.types import SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
TOKENS = [(7 * i + 3) % 256 for i in range(24)]  # [24] an arbitrary sequence


def fresh_logits(model, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def request(position: int, token_ids: list[int], num_logits: int, sampling=GREEDY, seq_id="s", **kwargs):
    return VerifyRequest(seq_id, position, token_ids, num_logits, sampling, **kwargs)


def _architectures():
    small = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    llama_like = dict(small, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=128)
    return {
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**llama_like)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**llama_like, sliding_window=8)),
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
        ),
        "opt": lambda: OPTForCausalLM(
            OPTConfig(**small, ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32)
        ),
    }


@pytest.fixture(params=["llama", *_architectures()])
def any_model(request, target_model):
    if request.param == "llama":
        return target_model
    torch.manual_seed(0)
    return _architectures()[request.param]().eval()


def test_rollback_by_position_matches_a_fresh_run(any_model):
    verifier = TargetVerifier(CachedCausalLM(any_model))
    reference = fresh_logits(any_model, TOKENS)  # [24, vocab]
    (prefill,) = verifier.verify([request(0, TOKENS[:10], 1)])
    assert prefill.argmax.tolist() == reference[9:10].argmax(-1).tolist()
    verifier.verify([request(10, TOKENS[10:16], 6)])  # the cache now holds 16 tokens
    # Reject everything after position 12: a call at 12 cuts the cache back and continues.
    (after_rollback,) = verifier.verify([request(12, TOKENS[12:20], 8, SAMPLED)])
    torch.testing.assert_close(after_rollback.probs, process_logits(reference[12:20], SAMPLED), atol=1e-5, rtol=0)
    # Continue at exactly the cached length.
    (continued,) = verifier.verify([request(20, TOKENS[20:], 4, SAMPLED)])
    torch.testing.assert_close(continued.probs, process_logits(reference[20:], SAMPLED), atol=1e-5, rtol=0)
    # Position 0 restarts the sequence.
    (restart,) = verifier.verify([request(0, TOKENS[5:12], 3, SAMPLED)])
    torch.testing.assert_close(
        restart.probs, process_logits(fresh_logits(any_model, TOKENS[5:12])[-3:], SAMPLED), atol=1e-5, rtol=0
    )


def test_greedy_returns_argmax_only_and_applies_banned_rows(target_model):
    verifier = TargetVerifier(CachedCausalLM(target_model))
    reference = fresh_logits(target_model, TOKENS[:8])  # [8, vocab]
    top = reference[-3:].argmax(-1)  # [3]
    (plain,) = verifier.verify([request(0, TOKENS[:8], 3)])
    assert plain.probs is None and plain.argmax.tolist() == top.tolist()
    banned = (int(top[0]), int(top[1]))
    (masked,) = verifier.verify([request(0, TOKENS[:8], 3, num_banned_rows=2, banned_token_ids=banned)])
    assert int(masked.argmax[0]) not in banned and int(masked.argmax[1]) not in banned
    assert int(masked.argmax[2]) == int(top[2])  # rows past num_banned_rows are untouched


def test_sampled_returns_processed_probs_with_banned_rows(target_model):
    verifier = TargetVerifier(CachedCausalLM(target_model))
    logits = fresh_logits(target_model, TOKENS[:8])[-4:]  # [4, vocab]
    banned = tuple(torch.topk(logits[0], 2).indices.tolist())  # the two likeliest tokens of row 0
    (result,) = verifier.verify([request(0, TOKENS[:8], 4, SAMPLED, num_banned_rows=1, banned_token_ids=banned)])
    assert result.probs.shape == (4, verifier.vocab_size) and result.probs.dtype == torch.float32
    torch.testing.assert_close(result.probs.sum(-1), torch.ones(4))
    assert result.probs[0, list(banned)].sum() == 0
    assert int(result.argmax[0]) not in banned
    torch.testing.assert_close(result.probs, process_logits(logits, SAMPLED, 1, banned), atol=1e-5, rtol=0)


def test_release_frees_each_sequence(target_model):
    verifier = TargetVerifier(CachedCausalLM(target_model))
    verifier.verify([request(0, TOKENS[:4], 1, seq_id="a"), request(0, TOKENS[:6], 1, seq_id="b")])
    assert verifier.num_active_sequences == 2
    verifier.release("a")
    assert verifier.num_active_sequences == 1
    verifier.release("a")  # releasing twice is harmless
    verifier.release("b")
    assert verifier.num_active_sequences == 0
    with pytest.raises(ValueError, match="position 2"):  # released: nothing is cached any more
        verifier.verify([request(2, TOKENS[2:4], 1, seq_id="a")])


def test_position_beyond_the_cache_raises(target_model):
    verifier = TargetVerifier(CachedCausalLM(target_model))
    verifier.verify([request(0, TOKENS[:5], 1)])
    with pytest.raises(ValueError, match="position 6 is outside the 5 tokens cached"):
        verifier.verify([request(6, TOKENS[6:8], 1)])
    with pytest.raises(ValueError, match="position"):
        verifier.verify([request(3, TOKENS[3:5], 1, seq_id="never-seen")])


@pytest.mark.parametrize(
    ("position", "token_ids", "num_logits", "match"),
    [(0, [], 1, "token_ids must not be empty"), (0, [1, 2], 3, "num_logits"), (0, [1, 2], 0, "num_logits")],
)
def test_malformed_requests_raise(target_model, position, token_ids, num_logits, match):
    with pytest.raises(ValueError, match=match):
        TargetVerifier(CachedCausalLM(target_model)).verify([request(position, token_ids, num_logits)])


def test_max_model_len_is_enforced(target_model):
    verifier = TargetVerifier(CachedCausalLM(target_model, max_model_len=12))
    assert verifier.max_model_len == 12
    verifier.verify([request(0, TOKENS[:12], 1)])
    with pytest.raises(ValueError, match="max_model_len=12"):
        verifier.verify([request(10, TOKENS[10:13], 1)])
    assert TargetVerifier(CachedCausalLM(target_model)).max_model_len == target_model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len"):
        TargetVerifier(CachedCausalLM(target_model, max_model_len=0))
    limit = target_model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's max_position_embeddings={limit}"):
        TargetVerifier(CachedCausalLM(target_model, max_model_len=limit + 1))


def test_vocab_size_is_the_logits_width(target_model):
    assert TargetVerifier(CachedCausalLM(target_model)).vocab_size == target_model.config.vocab_size


@pytest.mark.parametrize(
    ("name", "expected"), [("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16),
                           ("float16", torch.float16)]
)
def test_resolve_dtype(name, expected):
    assert resolve_dtype(name) == expected


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="dtype must be one of .*'float64'"):
        resolve_dtype("float64")


def test_load_causal_lm_reads_a_local_checkpoint(target_model, tmp_path):
    target_model.save_pretrained(tmp_path)
    loaded = load_causal_lm(tmp_path, dtype="bfloat16")
    assert not loaded.training and loaded.dtype == torch.bfloat16
    torch.testing.assert_close(
        loaded.lm_head.weight.float(), target_model.lm_head.weight.to(torch.bfloat16).float()
    )


def test_loaders_name_a_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_tokenizer(missing)
