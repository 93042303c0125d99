"""bench/hf.py: the in-process Hugging Face baselines."""
from __future__ import annotations

import pytest

from bench.hf import generation_config, run_hf
from bench.workload import Prompt


def test_run_hf_streams_one_chunk_per_target_pass(tiny_llama):
    target = tiny_llama(seed=0)
    prompts = [Prompt("a.py:1", "", list(range(1, 9))), Prompt("b.py:1", "", list(range(20, 31)))]
    config = generation_config(max_tokens=10, eos_token_id=None, ignore_eos=True)
    plain, plain_ids = zip(*run_hf(target, prompts, config, "plain"))
    assert [t.tokens for t in plain] == [[1] * 10, [1] * 10]
    assert all(t.ttft > 0 and len(t.inter_token_latencies()) == 9 for t in plain)
    # the draft is the target itself: every draft is accepted, k + 1 tokens per pass
    assisted, assisted_ids = zip(*run_hf(target, prompts, config, "assisted", k=2, draft=tiny_llama(seed=0)))
    assert all(t.num_tokens == 10 and max(t.tokens) == 3 and len(t.tokens) <= 5 for t in assisted)
    lookup, lookup_ids = zip(*run_hf(target, prompts, config, "prompt_lookup", k=2))
    assert all(t.num_tokens == 10 and max(t.tokens) <= 3 for t in lookup)
    assert assisted_ids == lookup_ids == plain_ids and all(len(ids) == 10 for ids in plain_ids)
    assert config.prompt_lookup_num_tokens is None  # the caller's config is left as it was
    with pytest.raises(ValueError, match="mode must be one of"):
        list(run_hf(target, prompts, config, "beam"))


def test_generation_config_keeps_an_eos_id_of_zero_and_takes_a_list():
    from bench.hf import generation_config

    for eos, expected, pad in ((0, 0, 0), (5, 5, 5), ([3, 4], [3, 4], 3), (None, None, 0)):
        config = generation_config(8, eos, ignore_eos=True)
        assert (config.eos_token_id, config.pad_token_id, config.min_new_tokens) == (expected, pad, 8), eos
