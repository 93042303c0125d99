"""The CachedLM contract (specdec.cached_lm) kept by both engines, and build_lm (specdec.build)."""
from __future__ import annotations

import os

import pytest
import torch

from specdec.build import build_lm
from specdec.cached_lm import CachedLM, ForwardCall, describe_lm
from specdec.fast import FastCausalLM
from specdec.models import CachedCausalLM
from specdec.types import ModelDescription
from test_fast_llama import random_ids, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("lm"), seed=30)


@pytest.fixture(params=["fast", "hf"])
def lm(request, checkpoint) -> CachedLM:
    path, _ = checkpoint
    return build_lm(path, request.param, dtype="float32", max_num_seqs=2, max_model_len=32)


def test_build_lm_picks_the_engine(checkpoint):
    path, _ = checkpoint
    assert isinstance(build_lm(path, "fast", "float32", max_num_seqs=1), FastCausalLM)
    hf = build_lm(path, "hf", "float32")
    assert isinstance(hf, CachedCausalLM) and hf.max_num_seqs is None  # the hf engine may grow unbounded
    with pytest.raises(ValueError, match=r"engine must be one of \('fast', 'hf'\), got 'vllm'"):
        build_lm(path, "vllm")
    with pytest.raises(ValueError, match="max_num_seqs must be given"):
        build_lm(path, "fast")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        build_lm(os.path.join(path, "no-such-model"), "hf")


def test_both_engines_keep_the_contract_and_agree(lm, checkpoint):
    """A ragged batch with a rollback: every logits row equals a fresh run of the HF module."""
    _, hf = checkpoint
    assert isinstance(lm, CachedLM) and lm.max_num_seqs == 2 and lm.max_model_len == 32
    a, b = random_ids(9, 31), random_ids(4, 32)
    first = lm.forward([ForwardCall("a", 0, a[:6], 2), ForwardCall("b", 0, b, 1)])
    assert [t.shape for t in first] == [(2, lm.vocab_size), (1, lm.vocab_size)]
    assert lm.num_active_sequences == 2 and (lm.cached_length("a"), lm.cached_length("b")) == (6, 4)
    (rolled,) = lm.forward([ForwardCall("a", 4, a[4:], 3)])  # cut back from 6 to 4, then 5 more
    with torch.inference_mode():
        want = hf(torch.tensor([a])).logits[0].float()  # [9, vocab]
    torch.testing.assert_close(first[0], want[4:6], atol=1e-4, rtol=0)
    torch.testing.assert_close(rolled, want[-3:], atol=1e-4, rtol=0)
    lm.release("a")
    lm.release("a")
    assert lm.num_active_sequences == 1 and lm.cached_length("a") == 0


@pytest.mark.parametrize(
    ("calls", "match"),
    [
        ([ForwardCall("x", 0, [], 1)], "seq 'x': token_ids must not be empty"),
        ([ForwardCall("x", 1, [1], 1)], "seq 'x': position 1 is outside the 0 tokens cached"),
        ([ForwardCall("x", 0, [1, 2], 3)], r"seq 'x': num_logits must be in \[1, 2\]"),
        ([ForwardCall("x", 0, list(range(33)), 1)], "seq 'x': 33 tokens exceed max_model_len=32"),
        ([ForwardCall("x", 0, [1], 1), ForwardCall("x", 0, [2], 1)], "each seq_id once"),
        ([ForwardCall("x", 0, [10**6], 1)], r"seq 'x': token_ids must be in \[0, "),
    ],
)
def test_bad_calls_are_refused_by_both_engines_alike(lm, calls, match):
    with pytest.raises(ValueError, match=match):
        lm.forward(calls)
    assert lm.num_active_sequences == 0


def test_a_full_cache_is_refused_by_both_engines(lm):
    lm.forward([ForwardCall("a", 0, [1], 1), ForwardCall("b", 0, [2], 1)])
    with pytest.raises(RuntimeError, match="KV cache is full: 1 new sequences but only 0 of max_num_seqs=2"):
        lm.forward([ForwardCall("c", 0, [3], 1)])
    lm.forward([ForwardCall("a", 1, [4], 1)])  # held sequences go on


def test_describe_lm_names_the_resolved_checkpoint(lm, checkpoint):
    path, _ = checkpoint
    desc = describe_lm(lm, os.path.join(path, "."), "target")
    assert desc == ModelDescription(os.path.realpath(path), lm.vocab_size, 32, 2, "target")
