"""Unit tests of the benchmark's logic (specdec/bench): no server."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from specdec.bench.bound import efficiency, forward_ms, speedup_bound
from specdec.bench.client import Job, build_inputs
from specdec.bench.cpu import CpuSnapshot, process_label, process_tree
from specdec.bench.hf import generation_config, run_hf
from specdec.bench.report import COLUMNS, format_cell, markdown_section, markdown_table
from specdec.bench.repository import (
    get_parameters,
    make_variant,
    parameter_edits,
    set_parameters,
)
from specdec.bench.results import (
    annotate,
    match_reference,
    step_time_keys,
    tokens_per_step,
)
from specdec.bench.roofline import floor_ms, memory_bandwidth_gbps, target_over_floor, weight_bytes_per_step
from specdec.bench.stats import (
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
    percentile,
    samples_delta,
    samples_sum,
    step_overhead_ms,
)
from specdec.bench.workload import Prompt, held_out_texts, is_held_out, select_prompts
from specdec.fast import FastCausalLM
from specdec.models import load_causal_lm

# --- workload -----------------------------------------------------------------------


def test_is_held_out_matches_the_training_split():
    paths = [f"pkg{i}/mod{i}.py" for i in range(400)]
    held = [p for p in paths if is_held_out(p)]
    assert held == [p for p in paths if zlib.crc32(p.encode()) % 20 == 0]
    assert 0 < len(held) < len(paths) // 5


def test_held_out_texts_skips_training_files_and_site_packages(tmp_path):
    names = [f"m{i}.py" for i in range(200)]
    for name in names:
        (tmp_path / name).write_text(f"x = {name!r}\n")
    (tmp_path / "site-packages").mkdir()
    held_site = next(f"site-packages/s{i}.py" for i in range(1000) if is_held_out(f"site-packages/s{i}.py"))
    (tmp_path / held_site).write_text("y = 1\n")
    texts = held_out_texts(tmp_path)
    assert sorted(texts) == sorted(n for n in names if is_held_out(n))
    assert all(texts[n] == f"x = {n!r}\n" for n in texts)


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character


def test_select_prompts_cuts_whole_lines_of_enough_tokens():
    texts = {f"f{i}.py": "".join(f"line {i}-{j}\n" for j in range(50)) for i in range(3)}
    prompts = select_prompts(texts, _encode, num_prompts=7, prompt_tokens=30, seed=1)
    assert len(prompts) == 7
    for p in prompts:
        name, line = p.source.split(":")
        assert p.text in texts[name] and p.text.endswith("\n")
        assert texts[name].splitlines(keepends=True)[int(line) - 1] == p.text.splitlines(keepends=True)[0]
        assert len(p.token_ids) >= 30 and len(_encode(p.text.splitlines(keepends=True)[0])) < 30 + 12
        assert p.token_ids == _encode(p.text)
    assert prompts == select_prompts(texts, _encode, num_prompts=7, prompt_tokens=30, seed=1)
    assert prompts != select_prompts(texts, _encode, num_prompts=7, prompt_tokens=30, seed=2)


def test_select_prompts_fails_loudly_when_the_texts_are_too_short():
    with pytest.raises(ValueError, match="only 0 of 2 prompts"):
        select_prompts({"a.py": "x = 1\n"}, _encode, num_prompts=2, prompt_tokens=100)
    with pytest.raises(ValueError, match="num_prompts"):
        select_prompts({"a.py": "x = 1\n"}, _encode, num_prompts=0, prompt_tokens=1)


# --- latency statistics -------------------------------------------------------------------


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


# --- acceptance, Prometheus -----------------------------------------------------------

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


# --- Triton statistics ----------------------------------------------------------------


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


# --- analytic bound ---------------------------------------------------------------------


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


# --- report ---------------------------------------------------------------------------------


def test_markdown_table_formats_rows_and_dashes_missing_values():
    rows = [
        {"config": "server k=0", "concurrency": 1, "tokens_per_s_per_stream": 101.26, "tokens_per_s_aggregate": 101.26,
         "speedup": 1.0, "ttft_ms_p50": 5.04, "itl_ms_p50": 9.9, "itl_ms_p99": 12.0},
        {"config": "draft_model k=2", "concurrency": 4, "speedup": 1.734, "acceptance_rate": 0.8123,
         "mean_accepted_length": 2.5, "per_position_acceptance": [0.9, 0.75], "speedup_bound": 2.1,
         "efficiency": 0.8257, "step_overhead_ms": math.nan, "target_sequences_per_execution": 3.25},
    ]
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].count("|") == len(COLUMNS) + 1
    assert table[2].startswith("| server k=0 | 1 | 101.3 | 101.3 | 1.00x | 5.0 | 9.9 / 12.0 | - |")
    cells = [c.strip() for c in table[3].strip("|").split("|")]
    assert cells == ["draft_model k=2", "4", "-", "-", "1.73x", "-", "-", "0.81", "2.50", "-", "3.25", "0.90 0.75",
                     "2.10x", "83%", "-", "-"]
    assert format_cell({}, "per_position_acceptance", None) == "-"


def test_markdown_section_names_machine_command_and_date():
    text = markdown_section([], {"cpu": "Test CPU", "cores": 2, "gpu": None}, "python scripts/benchmark.py --x",
                            "2025-01-01 00:00", ["a note"])
    assert "### Serving benchmark run, 2025-01-01 00:00" in text
    assert "Test CPU, 2 cores, GPU: none" in text
    assert "`python scripts/benchmark.py --x`" in text and "- a note" in text


# --- model repository variants ------------------------------------------------------

PBTXT = """name: "draft_proposer"
backend: "python"
parameters: {
  key: "method"
  value: { string_value: "draft_model" }
}
parameters [
  { key: "draft_model", value: { string_value: "../models/tiny-draft" } },
  { key: "num_speculative_tokens" value: {string_value: "4"} }
]
"""


def test_get_and_set_parameters():
    assert get_parameters(PBTXT) == {"method": "draft_model", "draft_model": "../models/tiny-draft",
                                     "num_speculative_tokens": "4"}
    edited = set_parameters(PBTXT, {"method": "ngram", "draft_model": '/abs/"q"'})
    assert get_parameters(edited) == {"method": "ngram", "draft_model": '/abs/\\"q\\"', "num_speculative_tokens": "4"}
    assert edited.replace("ngram", "draft_model").replace('/abs/\\"q\\"', "../models/tiny-draft") == PBTXT
    with pytest.raises(KeyError, match="no parameter 'methd'.*'method'"):
        set_parameters(PBTXT, {"methd": "ngram"})


def test_parameter_edits_from_the_command_line():
    settings = ["speculative_decoding.micro_batches=1", "draft_proposer.method=ngram", "draft_proposer.k=a=b"]
    assert parameter_edits(settings) == {
        "speculative_decoding": {"micro_batches": "1"},
        "draft_proposer": {"method": "ngram", "k": "a=b"},  # the value is everything after the first '='
    }
    for bad in ("micro_batches=1", "speculative_decoding.micro_batches", ".x=1"):
        with pytest.raises(ValueError, match="--param must look like MODEL.KEY=VALUE"):
            parameter_edits([bad])


def test_make_variant_copies_edits_and_makes_relative_paths_absolute(tmp_path):
    src = tmp_path / "repo"
    (src / "draft_proposer" / "1").mkdir(parents=True)
    (tmp_path / "models" / "tiny-draft").mkdir(parents=True)
    (src / "draft_proposer" / "config.pbtxt").write_text(PBTXT)
    (src / "draft_proposer" / "1" / "model.py").write_text("pass\n")
    dest = make_variant(src, tmp_path / "elsewhere" / "variant", {"draft_proposer": {"method": "ngram"}})
    params = get_parameters((dest / "draft_proposer" / "config.pbtxt").read_text())
    assert params == {"method": "ngram", "draft_model": str(tmp_path / "models" / "tiny-draft"),
                      "num_speculative_tokens": "4"}
    assert (dest / "draft_proposer" / "1" / "model.py").read_text() == "pass\n"
    assert (src / "draft_proposer" / "config.pbtxt").read_text() == PBTXT
    with pytest.raises(KeyError, match="no model 'nope'.*draft_proposer"):
        make_variant(src, tmp_path / "v2", {"nope": {}})


# --- rows: speedups, bounds, efficiency -----------------------------------------------


def test_tokens_per_step_leaves_out_the_prefill_pass():
    # 2 requests of 9 tokens: 1 from each prefill, 16 from 6 decode passes
    assert tokens_per_step(output_tokens=18, requests=2, decode_steps=6) == pytest.approx(16 / 6)
    assert math.isnan(tokens_per_step(output_tokens=2, requests=2, decode_steps=0))


def test_annotate_compares_each_row_with_its_baseline_at_the_same_concurrency():
    times = {"target_1": 10.0, "target_3": 12.0, "draft_1": 1.0}
    rows = annotate([
        {"config": "base", "concurrency": 1, "k": 0, "proposer": None, "baseline": "base",
         "tokens_per_s_per_stream": 100.0},
        {"config": "base", "concurrency": 4, "k": 0, "proposer": None, "baseline": "base",
         "tokens_per_s_per_stream": 50.0},
        {"config": "draft k=2", "concurrency": 4, "k": 2, "proposer": "draft_model", "baseline": "base",
         "tokens_per_s_per_stream": 100.0, "tokens_per_step": 2.8},
        {"config": "ngram k=2", "concurrency": 1, "k": 2, "proposer": "ngram", "baseline": "base",
         "tokens_per_s_per_stream": 150.0, "tokens_per_step": 1.5},
        {"config": "ngram k=2", "concurrency": 4, "k": 2, "proposer": "ngram", "baseline": "base",
         "tokens_per_s_per_stream": 60.0, "tokens_per_step": math.nan},
        {"config": "other ngram k=2", "concurrency": 1, "k": 2, "proposer": "ngram", "baseline": "base",
         "tokens_per_s_per_stream": 120.0, "tokens_per_step": 2.0, "mean_accepted_length": 3.0,
         "num_drafts": 5, "decode_steps": 10},
        {"config": "ngram adaptive k<=2", "concurrency": 1, "k": 2, "proposer": "ngram", "baseline": "base",
         "tokens_per_s_per_stream": 130.0, "tokens_per_step": 2.0, "length_policy": "adaptive"},
    ], times)
    assert rows[0]["speedup"] == 1.0 and "speedup_bound" not in rows[0]
    assert rows[2]["speedup"] == pytest.approx(2.0)  # against the concurrency-4 baseline
    assert rows[2]["speedup_bound"] == pytest.approx(2.8 * 10 / (12 + 2 * 1))
    assert rows[2]["efficiency"] == pytest.approx(2.0 / (28 / 14))
    assert rows[3]["speedup_bound"] == pytest.approx(1.5 * 10 / 12)  # n-gram drafts cost nothing
    assert math.isnan(rows[4]["speedup_bound"]) and "efficiency" not in rows[4]
    assert rows[5]["speedup_bound"] == pytest.approx(2 * 10 / 11)  # from L and the drafting share
    assert rows[6]["speedup"] == pytest.approx(1.3) and "speedup_bound" not in rows[6]  # no fixed k to bound
    assert step_time_keys([1, 2, 4]) == [("target_1", 1), ("target_2", 2), ("target_3", 3), ("target_5", 5),
                                         ("draft_1", 1)]


# --- in-process pieces on a tiny random model --------------------------------------------


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


def test_client_builds_request_tensors_in_the_model_datatypes():
    job = Job(Prompt("a.py:1", "x = 1\n", [5, 6, 7]), max_tokens=12, num_speculative_tokens=0, ignore_eos=True)
    datatypes = {"text_input": "BYTES", "stream": "BOOL", "max_tokens": "INT32", "min_tokens": "INT32",
                 "num_speculative_tokens": "INT32", "temperature": "FP32"}
    tensors = {t.name(): t for t in build_inputs(job, datatypes)}
    assert sorted(tensors) == sorted(set(datatypes) - {"temperature"})
    assert tensors["text_input"].datatype() == "BYTES" and tensors["text_input"].shape() == [1]
    assert tensors["stream"].datatype() == "BOOL"
    assert tensors["min_tokens"].shape() == [1] and tensors["num_speculative_tokens"].datatype() == "INT32"
    no_k = Job(job.prompt, 12, None, ignore_eos=False)
    assert sorted(t.name() for t in build_inputs(no_k, datatypes)) == ["max_tokens", "stream", "text_input"]
    with pytest.raises(KeyError, match="no input 'min_tokens'"):
        build_inputs(job, {k: v for k, v in datatypes.items() if k != "min_tokens"})


def test_match_reference_compares_outputs_prompt_by_prompt():
    rows = [{"config": "hf plain", "concurrency": 1}, {"config": "ngram k=2", "concurrency": 4},
            {"config": "ngram k=2", "concurrency": 1}]
    outputs = {("hf plain", 1): ["a", "b", "c", "d"], ("ngram k=2", 4): ["a", "b", "x", "d"],
               ("ngram k=2", 1): ["a", "b", "c", "d"]}
    match_reference(rows, outputs, "hf plain")
    assert [r["identical_outputs"] for r in rows] == [1.0, 0.75, 1.0]
    match_reference(rows[1:2], outputs, "missing")
    assert rows[1]["identical_outputs"] == 0.75
    # several rounds of the same prompts, one after another, against one round of the reference
    outputs[("ngram k=2", 4)] = ["a", "b", "x", "d", "a", "b", "c", "d"]
    match_reference(rows, outputs, "hf plain")
    assert rows[1]["identical_outputs"] == 7 / 8


def test_rounds_add_up_counter_deltas():
    a = {("spec_decode_num_steps", (("model", "sd"),)): 10.0, ("x", ()): 1.0}
    b = {("spec_decode_num_steps", (("model", "sd"),)): 5.0, ("y", ()): 2.0}
    assert samples_sum(a, b) == {("spec_decode_num_steps", (("model", "sd"),)): 15.0, ("x", ()): 1.0, ("y", ()): 2.0}
    first = {"target_verifier": ModelCounters(3, 2, 100)}
    second = {"target_verifier": ModelCounters(1, 1, 50), "draft_proposer": ModelCounters(4, 4, 10)}
    assert counters_sum(first, second) == {"target_verifier": ModelCounters(4, 3, 150),
                                           "draft_proposer": ModelCounters(4, 4, 10)}  # fmt: skip


def test_process_labels_name_the_model_a_stub_serves():
    stub = ["/x/backends/python/triton_python_backend_stub", "/tmp/repo/target_verifier/1/model.py", "1", "2"]
    assert process_label(stub) == "target_verifier"
    assert process_label(["/usr/bin/tritonserver", "--model-repository=/r"]) == "tritonserver"
    assert process_label([]) == "?"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc (Linux)")
def test_cpu_snapshots_cover_a_process_tree():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        labels = process_tree(os.getpid())
        assert child.pid in labels and os.getpid() in labels
        before = CpuSnapshot.take(labels)
        sum(i * i for i in range(200_000))  # some CPU in this process
        per_label, busy = before.until(CpuSnapshot.take(labels))
        assert all(seconds >= 0 for seconds in per_label.values()) and 0.0 <= busy <= 1.0
    finally:
        child.kill()
        child.wait()


# --- memory-bandwidth floor ---------------------------------------------------------

SHIPPED_TARGET = Path(__file__).resolve().parent.parent / "models" / "tiny-target"


def test_weight_bytes_leave_out_an_untied_input_embedding_and_count_a_tied_one_once(tiny_llama):
    untied = tiny_llama(seed=0)  # vocab 256 x hidden 64, untied
    everything = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert weight_bytes_per_step(untied) == everything - 256 * 64 * 4
    tied = load_causal_lm(SHIPPED_TARGET, dtype="float32", device="cpu")  # tied input and output embeddings
    assert tied.get_output_embeddings().weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    # vocab 4096 x hidden 256 once; 6 layers of q, k, v, o (256 x 256), MLP 3 x 256 x 704 and two norms; final norm
    assert weight_bytes_per_step(tied) == 4 * (4096 * 256 + 6 * (4 * 256 * 256 + 3 * 256 * 704 + 2 * 256) + 256)


def test_floor_and_step_times_over_it():
    assert floor_ms(2_000_000, 1.0) == pytest.approx(2.0)  # 2 MB at 1 GB/s
    summary = target_over_floor(2_000_000, 1.0, {"target_1": 3.0, "target_5": 5.0, "draft_1": 1.0})
    assert summary["floor_ms"] == pytest.approx(2.0)
    assert summary["over_floor"] == {"target_1": pytest.approx(1.5), "target_5": pytest.approx(2.5)}
    with pytest.raises(ValueError, match="bandwidth > 0"):
        floor_ms(1, 0.0)


def test_memory_bandwidth_is_measured_and_checks_its_arguments():
    assert memory_bandwidth_gbps("cpu", buffer_mb=8, repeats=3) > 0
    with pytest.raises(ValueError, match="buffer_mb and repeats must be >= 1"):
        memory_bandwidth_gbps("cpu", buffer_mb=0)
