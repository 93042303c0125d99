"""Slot allocation, length bookkeeping and release of the static KV cache."""
from __future__ import annotations

import pytest
import torch

from specdec.fast import FastCausalLM, ForwardCall, StaticKVCache
from test_fast_llama import save_checkpoint


def make_cache(max_num_seqs: int = 3, max_model_len: int = 8) -> StaticKVCache:
    return StaticKVCache(2, 1, 4, max_num_seqs, max_model_len, torch.float32, "cpu")


def test_shape_has_one_scratch_slot():
    cache = make_cache()
    assert cache.kv.shape == (2, 2, 4, 1, 8, 4)  # [layers, k/v, max_num_seqs + 1, kv_heads, max_model_len, head_dim]
    assert cache.scratch_slot == 3


def test_slots_are_freed_on_release_and_reused_lowest_first():
    cache = make_cache()
    assert [cache.allocate(s) for s in "abc"] == [0, 1, 2]
    cache.release("b")
    cache.release("a")
    assert cache.num_active == 1 and "a" not in cache
    assert cache.allocate("d") == 0
    assert cache.allocate("e") == 1
    cache.release("unknown")  # a no-op


def test_full_cache_error_names_max_num_seqs():
    cache = make_cache(max_num_seqs=2)
    cache.allocate("a")
    cache.allocate("b")
    with pytest.raises(RuntimeError, match="max_num_seqs=2"):
        cache.allocate("c")
    with pytest.raises(ValueError, match="already holds slot"):
        cache.allocate("a")


def test_rollback_moves_only_the_length():
    cache = make_cache()
    cache.allocate("a")
    cache.kv[:, :, 0, :, :6] = 1.0
    cache.set_length("a", 6)
    before = cache.kv.clone()
    cache.set_length("a", 2)
    assert cache.length("a") == 2 and torch.equal(cache.kv, before)
    with pytest.raises(ValueError, match=r"length must be in \[0, 8\]"):
        cache.set_length("a", 9)
    with pytest.raises(KeyError):
        cache.set_length("nobody", 1)
    assert cache.length("nobody") == 0


def test_runner_full_batch_fails_before_touching_any_sequence(tmp_path):
    path, _ = save_checkpoint(tmp_path)
    lm = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=16)
    lm.forward([ForwardCall("a", 0, [1, 2, 3, 4], 1)])
    with pytest.raises(RuntimeError, match="max_num_seqs=2"):
        lm.forward([ForwardCall("a", 2, [5], 1), ForwardCall("b", 0, [1], 1), ForwardCall("c", 0, [1], 1)])
    assert lm.num_active_sequences == 1 and lm.cached_length("a") == 4
    lm.release("a")
    assert lm.num_active_sequences == 0
    lm.forward([ForwardCall("b", 0, [1], 1), ForwardCall("c", 0, [2], 1)])
    assert lm.num_active_sequences == 2
