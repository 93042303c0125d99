"""TargetVerifier on the fast engine: the hf engine's results, every request in one batched forward."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from specdec.fast import FastCausalLM
from specdec.models import CachedCausalLM, load_causal_lm
from specdec.sampling import process_logits
from specdec.types import SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier
from test_fast_llama import random_ids, save_checkpoint

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
# Not imported from conftest: tests/e2e has a conftest module of the same name.
SHIPPED_TARGET = Path(__file__).resolve().parents[1] / "models" / "tiny-target"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("target"), seed=10)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


def test_batched_greedy_decode_equals_hf_generate(target):
    path, hf = target
    verifier = TargetVerifier(FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=64))
    prompts = {"a": random_ids(5, 11), "b": random_ids(9, 12), "c": random_ids(1, 13)}
    seqs = {s: list(p) for s, p in prompts.items()}
    results = verifier.verify([VerifyRequest(s, 0, p, 1, GREEDY) for s, p in prompts.items()])  # prefill
    for step in range(12):
        for s, result in zip(seqs, results):
            assert result.probs is None and result.argmax.shape == (1,)
            seqs[s].append(int(result.argmax[0]))
        results = verifier.verify([VerifyRequest(s, len(ids) - 1, ids[-1:], 1, GREEDY) for s, ids in seqs.items()])
    for s, prompt in prompts.items():
        assert seqs[s][len(prompt) :] == hf_greedy(hf, prompt, 12), s
    assert verifier.num_active_sequences == 3
    for s in prompts:
        verifier.release(s)
    assert verifier.num_active_sequences == 0


def test_results_match_generic_verifier_with_rollback_and_bans(target):
    path, hf = target
    fast = TargetVerifier(FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=64))
    generic = TargetVerifier(CachedCausalLM(hf, max_model_len=64))
    assert fast.vocab_size == generic.vocab_size and fast.max_model_len == 64
    ids = random_ids(20, 14)
    banned_token = int(hf(torch.tensor([ids[:10]])).logits[0, -1].argmax())  # x's greedy choice at row 0
    steps = [
        [VerifyRequest("x", 0, ids[:10], 1, SAMPLED), VerifyRequest("y", 0, ids[:6], 1, GREEDY)],
        # x verifies 4 drafts with EOS-style bans on the first 2 rows; y rolls back from 6 to 3.
        [VerifyRequest("x", 9, ids[9:14], 5, SAMPLED, num_banned_rows=2, banned_token_ids=(banned_token,)),
         VerifyRequest("y", 3, ids[3:7], 4, GREEDY, num_banned_rows=1, banned_token_ids=(banned_token,))],
        [VerifyRequest("x", 11, ids[11:13], 2, SAMPLED), VerifyRequest("y", 7, ids[7:8], 1, GREEDY)],
    ]
    for requests in steps:
        got, want = fast.verify(requests), generic.verify(requests)
        for g, w in zip(got, want):
            assert torch.equal(g.argmax, w.argmax)
            assert (g.probs is None) == (w.probs is None)
            if g.probs is not None:
                torch.testing.assert_close(g.probs, w.probs, atol=1e-5, rtol=0)
    free = fast.verify([VerifyRequest("x", 9, ids[9:14], 5, SAMPLED)])[0]
    banned = fast.verify([VerifyRequest("x", 9, ids[9:14], 5, SAMPLED, 2, (banned_token,))])[0]
    assert free.argmax[0] == banned_token and free.probs[0, banned_token] > 0
    assert banned.argmax[0] != banned_token and banned.probs[:2, banned_token].eq(0).all()
    torch.testing.assert_close(banned.probs[2:], free.probs[2:], atol=0, rtol=0)  # later rows untouched


def test_sampled_probs_are_process_logits_of_hf_logits(target):
    path, hf = target
    verifier = TargetVerifier(FastCausalLM(path, dtype="float32", max_num_seqs=1, max_model_len=64))
    ids = random_ids(8, 15)
    result = verifier.verify([VerifyRequest("s", 0, ids, 3, SAMPLED)])[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -3:]  # [3, vocab]
    torch.testing.assert_close(result.probs, process_logits(logits, SAMPLED), atol=1e-5, rtol=0)
    assert torch.equal(result.argmax, logits.argmax(-1))


def test_position_past_cache_is_rejected(target):
    path, _ = target
    verifier = TargetVerifier(FastCausalLM(path, dtype="float32", max_num_seqs=1, max_model_len=64))
    verifier.verify([VerifyRequest("s", 0, [1, 2], 1, GREEDY)])
    with pytest.raises(ValueError, match="position 3 is outside the 2 tokens cached"):
        verifier.verify([VerifyRequest("s", 3, [1], 1, GREEDY)])
    assert verifier.verify([]) == []


def test_shipped_target_matches_hf():
    if not SHIPPED_TARGET.is_dir():
        pytest.skip(f"shipped target not found at {SHIPPED_TARGET}")
    hf = load_causal_lm(SHIPPED_TARGET, dtype="float32")
    verifier = TargetVerifier(FastCausalLM(SHIPPED_TARGET, dtype="float32", max_num_seqs=1, max_model_len=64))
    prompt = random_ids(7, 16)
    out = list(prompt)
    result = verifier.verify([VerifyRequest("s", 0, prompt, 1, GREEDY)])[0]
    for _ in range(8):
        out.append(int(result.argmax[0]))
        result = verifier.verify([VerifyRequest("s", len(out) - 1, out[-1:], 1, GREEDY)])[0]
    assert out[len(prompt) :] == hf_greedy(hf, prompt, 8)
