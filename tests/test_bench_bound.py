"""bench/bound.py: the analytic speedup bound and step-time measurement."""
from __future__ import annotations

import math

import pytest

from bench.bound import efficiency, forward_ms, head_propose_ms, speedup_bound
from specdec.fast import FastCausalLM


def test_speedup_bound_formula():
    # L=3, T_t(1)=10, T_t(5)=12, 4 drafts of 1 -> 30 / 16
    assert speedup_bound(3.0, k=4, t_target_1=10.0, t_target_k1=12.0, t_draft_1=1.0) == pytest.approx(30 / 16)
    # n-gram: no draft cost; all accepted with free verification gives k + 1
    assert speedup_bound(3.0, k=2, t_target_1=5.0, t_target_k1=5.0, t_draft_1=0.0) == pytest.approx(3.0)
    # nothing accepted, costly drafts: a slowdown
    assert speedup_bound(1.0, k=2, t_target_1=5.0, t_target_k1=6.0, t_draft_1=2.0) == pytest.approx(0.5)
    assert math.isnan(speedup_bound(math.nan, k=2, t_target_1=1.0, t_target_k1=1.0, t_draft_1=0.0))
    assert efficiency(1.5, 2.0) == pytest.approx(0.75)


def test_speedup_bound_counts_steps_without_drafts_as_plain_steps():
    # half the steps draft (L = 3 at cost 12), half are plain (1 token at cost 10): 2 tokens per 11
    bound = speedup_bound(3.0, k=2, t_target_1=10.0, t_target_k1=12.0, t_draft_1=0.0, drafting_fraction=0.5)
    assert bound == pytest.approx(2 * 10 / 11)
    assert speedup_bound(math.nan, k=2, t_target_1=10.0, t_target_k1=12.0, t_draft_1=0.0,
                         drafting_fraction=0.0) == 1.0
    assert speedup_bound(3.0, k=2, t_target_1=10.0, t_target_k1=12.0, t_draft_1=1.0,
                         drafting_fraction=1.0) == pytest.approx(30 / 14)
    with pytest.raises(ValueError, match="drafting_fraction"):
        speedup_bound(2.0, k=2, t_target_1=1.0, t_target_k1=1.0, t_draft_1=0.0, drafting_fraction=1.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mean_accepted_length=2.0, k=0, t_target_1=1.0, t_target_k1=1.0, t_draft_1=0.0), "k must be"),
        (dict(mean_accepted_length=4.0, k=2, t_target_1=1.0, t_target_k1=1.0, t_draft_1=0.0), "mean_accepted_length"),
        (dict(mean_accepted_length=2.0, k=2, t_target_1=0.0, t_target_k1=1.0, t_draft_1=0.0), "step times"),
    ],
)
def test_speedup_bound_rejects_impossible_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        speedup_bound(**kwargs)


def test_forward_ms_times_a_cached_forward(tiny_llama):
    model, small = tiny_llama(seed=0), tiny_llama(seed=1, hidden_size=32, num_hidden_layers=1)
    times = forward_ms({"target_1": (model, 1), "target_3": (model, 3), "draft_1": (small, 1)}, context_len=16,
                       repeats=3, warmup=1)
    assert sorted(times) == ["draft_1", "target_1", "target_3"] and all(0 < t < 1000 for t in times.values())
    with pytest.raises(ValueError, match="num_tokens"):
        forward_ms({"x": (model, 0)}, context_len=16)


def test_forward_ms_times_the_fast_engine_and_frees_its_slots(tiny_llama, tmp_path):
    tiny_llama(seed=0).save_pretrained(tmp_path)
    lm = FastCausalLM(tmp_path, dtype="float32", max_num_seqs=2, max_model_len=32)
    times = forward_ms({"target_1": (lm, 1), "target_3": (lm, 3)}, context_len=16, repeats=3, warmup=1)
    assert sorted(times) == ["target_1", "target_3"] and all(0 < t < 1000 for t in times.values())
    assert lm.num_active_sequences == 0


def test_a_head_s_proposals_are_timed_after_a_target_forward_each_and_leave_nothing_held():
    """The shipped heads, loaded as served: one time per k (an MLP speculator's up to n_predict)."""
    from pathlib import Path

    models = Path(__file__).resolve().parent.parent / "models"
    target = FastCausalLM(models / "tiny-target", dtype="float32", max_num_seqs=1, max_model_len=64)
    calls = []
    forward = target.forward
    target.forward = lambda batch: calls.append(len(batch)) or forward(batch)
    times = head_propose_ms("eagle3", models / "tiny-eagle3", models / "tiny-target", 256, [2, 4], "float32", "cpu",
                            False, None, context_len=16, repeats=3, target_lm=target)  # fmt: skip
    assert sorted(times) == ["eagle3_propose_2", "eagle3_propose_4"] and all(0 < t < 1000 for t in times.values())
    assert len(calls) == 1 + 2 * (5 + 3)  # the context once, then one before each of the warm-up and timed calls
    assert target.num_active_sequences == 0
    mlp = head_propose_ms("mlp_speculator", models / "tiny-mlp-speculator", models / "tiny-target", 256, [2, 4],
                          "float32", "cpu", False, None, context_len=16, repeats=2)  # fmt: skip
    assert sorted(mlp) == ["mlp_speculator_propose_2"]  # n_predict 3
