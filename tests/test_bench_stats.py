"""bench/stats.py: latency, acceptance, Prometheus and Triton statistics."""
from __future__ import annotations

import math

import pytest

from bench.stats import (
    Acceptance,
    ModelCounters,
    RequestTiming,
    StageTimes,
    acceptance_from_metrics,
    counters_delta,
    counters_sum,
    latency_summary,
    metric_by_label,
    metric_total,
    model_counters,
    parse_prometheus,
    with_socket_calls,
    percentile,
    samples_delta,
    samples_sum,
    step_overhead_ms,
)


def test_percentile_interpolates_and_handles_empty():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_request_timing_splits_multi_token_chunks_into_per_token_latencies():
    t = RequestTiming(sent=10.0)
    t.record(10.5, 1)  # first token after 0.5 s
    t.record(10.5, 0)  # an empty final response is not a chunk
    t.record(11.1, 3)  # one step delivering 3 tokens after 0.6 s
    t.record(11.3, 1)
    assert t.num_tokens == 5
    assert t.ttft == pytest.approx(0.5)
    assert t.latency == pytest.approx(1.3)
    assert t.chunk_gaps() == pytest.approx([0.6, 0.2])
    assert t.inter_token_latencies() == pytest.approx([0.2, 0.2, 0.2, 0.2])


def test_latency_summary_aggregates_streams():
    a, b = RequestTiming(sent=0.0), RequestTiming(sent=0.0)
    a.record(0.1, 1)
    a.record(0.3, 2)  # 3 tokens in 0.3 s
    b.record(0.2, 1)
    b.record(0.6, 1)  # 2 tokens in 0.6 s
    s = latency_summary([a, b, RequestTiming(sent=0.0)], elapsed_s=1.0)
    assert s["requests"] == 2 and s["output_tokens"] == 5
    assert s["tokens_per_s_aggregate"] == pytest.approx(5.0)
    assert s["tokens_per_s_per_stream"] == pytest.approx((10.0 + 10.0 / 3) / 2)
    assert s["ttft_ms_p50"] == pytest.approx(150.0)
    assert s["itl_ms_p50"] == pytest.approx(100.0)  # [100, 100, 400]
    assert s["chunk_gap_ms_p50"] == pytest.approx(300.0)  # [200, 400]
    assert s["tokens_per_chunk"] == pytest.approx(5 / 4)


METRICS_BEFORE = """\
# HELP spec_decode_num_drafts Number of speculative steps
# TYPE spec_decode_num_drafts counter
spec_decode_num_drafts{model="speculative_decoding",version="1"} 10
spec_decode_num_draft_tokens{model="speculative_decoding",version="1"} 40
spec_decode_num_accepted_tokens{model="speculative_decoding",version="1"} 20
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="0",version="1"} 9
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="1",version="1"} 6
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="2",version="1"} 3
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="3",version="1"} 2
nv_inference_count{model="target_verifier",version="1"} 1.5e1
"""


METRICS_AFTER = """\
spec_decode_num_drafts{model="speculative_decoding",version="1"} 30
spec_decode_num_draft_tokens{model="speculative_decoding",version="1"} 120
spec_decode_num_accepted_tokens{model="speculative_decoding",version="1"} 70
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="0",version="1"} 27
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="1",version="1"} 21
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="2",version="1"} 3
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="3",version="1"} 2
spec_decode_num_accepted_tokens_per_pos{model="speculative_decoding",position="5",version="1"} 1
"""


def test_parse_prometheus_reads_labels_values_and_skips_comments():
    samples = parse_prometheus(METRICS_BEFORE + "garbage line\nbad_value{a=\"b\"} notanumber\n")
    assert samples[("nv_inference_count", (("model", "target_verifier"), ("version", "1")))] == 15.0
    assert metric_total(samples, "spec_decode_num_drafts") == 10
    assert metric_total(samples, "spec_decode_num_drafts", model="other") == 0
    assert metric_by_label(samples, "spec_decode_num_accepted_tokens_per_pos", "position") == {
        "0": 9, "1": 6, "2": 3, "3": 2}
    assert not any(name.startswith(("garbage", "bad_value")) for name, _ in samples)


def test_acceptance_from_metric_deltas():
    delta = samples_delta(parse_prometheus(METRICS_AFTER), parse_prometheus(METRICS_BEFORE))
    acc = acceptance_from_metrics(delta)
    assert acc == Acceptance(num_drafts=20, num_draft_tokens=80, num_accepted_tokens=50,
                             accepted_per_position=(18, 15, 0, 0, 0, 1))
    assert acc.acceptance_rate == pytest.approx(50 / 80)
    assert acc.mean_accepted_length == pytest.approx(1 + 50 / 20)
    assert acc.per_position_rate[:2] == pytest.approx([0.9, 0.75])
    assert acceptance_from_metrics(parse_prometheus("nv_inference_count 3\n")) is None


def test_acceptance_without_drafts_is_nan_not_an_error():
    acc = Acceptance(0, 0, 0, (0, 0))
    assert math.isnan(acc.acceptance_rate) and math.isnan(acc.mean_accepted_length)
    assert acc.per_position_rate == []


def _stats(verify_count: int, verify_ns: int, bls_ns: int) -> dict:
    return {"model_stats": [
        {"name": "target_verifier", "version": "1", "inference_count": str(verify_count),
         "execution_count": str(verify_count),
         "inference_stats": {"compute_infer": {"count": "1", "ns": str(verify_ns)},
                             "queue": {"count": "1", "ns": "250"}}},
        {"name": "draft_proposer", "version": "1", "inference_count": "4", "execution_count": "4",
         "inference_stats": {"compute_infer": {"count": "4", "ns": "1000000"}}},
        {"name": "speculative_decoding", "version": "1",
         "inference_stats": {"compute_infer": {"ns": str(bls_ns)}}},
    ]}


def test_model_counters_parse_string_ints_and_missing_fields():
    counters = model_counters(_stats(7, 5_000_000, 9))
    assert counters["target_verifier"] == ModelCounters(7, 7, 5_000_000, queue_ns=250)
    assert counters["speculative_decoding"] == ModelCounters(0, 0, 9)


def test_stage_times_split_the_orchestrators_wait_into_queue_execution_and_round_trip():
    labels = (("model", "speculative_decoding"), ("stage", "verify"))
    samples = {("spec_decode_stage_calls", labels): 4.0, ("spec_decode_stage_sequences", labels): 10.0,
               ("spec_decode_stage_seconds", labels): 0.04}  # fmt: skip
    times = StageTimes.of(samples, "verify", ModelCounters(5, 5, compute_infer_ns=24_000_000, queue_ns=4_000_000))
    assert (times.calls, times.sequences) == (4.0, 10.0)
    assert times.ms_per_call == pytest.approx(10.0)
    assert (times.queue_ms_per_call, times.execute_ms_per_call) == (pytest.approx(1.0), pytest.approx(6.0))
    assert times.round_trip_ms_per_call == pytest.approx(3.0)
    assert StageTimes.of(samples, "propose", None) is None  # no calls to that stage
    assert math.isnan(StageTimes.of(samples, "verify", None).round_trip_ms_per_call)  # the model's side unknown


def test_step_overhead_subtracts_the_compute_of_the_named_models_only():
    before = model_counters(_stats(10, 10_000_000, 0))
    after = model_counters(_stats(20, 30_000_000, 10**12))
    after["draft_proposer"] = ModelCounters(14, 14, 11_000_000)  # +10 ms of draft compute
    delta = counters_delta(after, before)
    out = step_overhead_ms(0.05, delta, 10, ("draft_proposer", "target_verifier", "rejection_sampler"))
    assert out["steps"] == 10
    assert out["step_wall_ms"] == pytest.approx(5.0)
    assert out["step_compute_ms"] == pytest.approx(3.0)  # (20 ms verify + 10 ms draft) / 10 steps
    assert out["step_overhead_ms"] == pytest.approx(2.0)
    assert out["compute_ms_per_step_by_model"]["speculative_decoding"] == pytest.approx(1e5)
    assert math.isnan(step_overhead_ms(1.0, delta, 0, ("target_verifier",))["step_overhead_ms"])


def test_rounds_add_up_counter_deltas():
    a = {("spec_decode_num_steps", (("model", "sd"),)): 10.0, ("x", ()): 1.0}
    b = {("spec_decode_num_steps", (("model", "sd"),)): 5.0, ("y", ()): 2.0}
    assert samples_sum(a, b) == {("spec_decode_num_steps", (("model", "sd"),)): 15.0, ("x", ()): 1.0, ("y", ()): 2.0}
    first = {"target_verifier": ModelCounters(3, 2, 100)}
    second = {"target_verifier": ModelCounters(1, 1, 50), "draft_proposer": ModelCounters(4, 4, 10)}
    assert counters_sum(first, second) == {"target_verifier": ModelCounters(4, 3, 150),
                                           "draft_proposer": ModelCounters(4, 4, 10)}  # fmt: skip


def test_calls_a_model_answered_on_its_socket_count_as_its_executions():
    metrics = {
        ("spec_decode_socket_calls", (("model", "target_verifier"),)): 10.0,
        ("spec_decode_socket_call_seconds", (("model", "target_verifier"),)): 0.02,
        ("spec_decode_socket_calls", (("model", "draft_proposer"),)): 4.0,
        ("spec_decode_socket_call_seconds", (("model", "draft_proposer"),)): 0.004,
    }
    delta = {"target_verifier": ModelCounters(2, 1, 1_000_000, 5), "rejection_sampler": ModelCounters(3, 3, 7)}
    out = with_socket_calls(delta, metrics)
    assert out["target_verifier"] == ModelCounters(12, 11, 21_000_000, 5)  # 2 describes by BLS + 10 socket calls
    assert out["draft_proposer"] == ModelCounters(4, 4, 4_000_000, 0)
    assert out["rejection_sampler"] == delta["rejection_sampler"]
    assert with_socket_calls(delta, {}) == delta  # a server calling by BLS
    step = step_overhead_ms(0.05, out, 10, ("draft_proposer", "target_verifier"))
    assert step["step_compute_ms"] == pytest.approx(2.5)
