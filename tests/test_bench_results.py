"""bench/results.py: rows: ratios, bounds, efficiency, outputs against the reference."""
from __future__ import annotations

import math

import pytest

from bench.repository import method_of, suffix_first, variant_edits
from bench.results import annotate, fixed_name, k0_name, match_reference, step_time_keys, tokens_per_step


def test_tokens_per_step_leaves_out_the_prefill_pass():
    # 2 requests of 9 tokens: 1 from each prefill, 16 from 6 decode passes
    assert tokens_per_step(output_tokens=18, requests=2, decode_steps=6) == pytest.approx(16 / 6)
    assert math.isnan(tokens_per_step(output_tokens=2, requests=2, decode_steps=0))


def test_annotate_compares_each_row_with_k0_of_its_server_and_with_hf_plain():
    times = {"target_1": 10.0, "target_3": 12.0, "draft_1": 1.0}
    base = {"kind": "k0", "k": 0, "proposer": None, "baseline": "base"}
    draft = {"kind": "fixed", "k": 2, "proposer": "draft_model", "baseline": "base"}
    ngram = {"kind": "fixed", "k": 2, "proposer": "ngram", "baseline": "base"}
    rows = annotate([
        {"config": "hf plain", "kind": "hf_plain", "concurrency": 1, "k": 0, "proposer": None,
         "baseline": "hf plain", "tokens_per_s_aggregate": 80.0},
        {"config": "hf assisted k=2", "kind": "hf_assisted", "concurrency": 1, "k": 2, "proposer": "draft_model",
         "baseline": "hf plain", "tokens_per_s_aggregate": 120.0, "tokens_per_step": 2.8},
        {"config": "base", "concurrency": 1, **base, "tokens_per_s_aggregate": 100.0},
        {"config": "base", "concurrency": 4, **base, "tokens_per_s_aggregate": 200.0},
        {"config": "draft k=2", "concurrency": 1, **draft, "tokens_per_s_aggregate": 150.0,
         "mean_accepted_length": 2.8, "num_drafts": 10, "decode_steps": 10},
        {"config": "draft k=2", "concurrency": 4, **draft, "tokens_per_s_aggregate": 300.0,
         "mean_accepted_length": 2.8, "num_drafts": 10, "decode_steps": 10},
        {"config": "ngram k=2", "concurrency": 1, **ngram, "tokens_per_s_aggregate": 120.0,
         "mean_accepted_length": 3.0, "num_drafts": 5, "decode_steps": 10},
        {"config": "ngram k=2", "concurrency": 4, **ngram, "tokens_per_s_aggregate": 60.0},
        {"config": "empty ngram k=2", "concurrency": 1, **ngram, "tokens_per_s_aggregate": 60.0,
         "num_drafts": 0, "decode_steps": 0},
        {"config": "default", "concurrency": 1, "kind": "default", "k": None, "proposer": "draft_model",
         "baseline": "base", "tokens_per_s_aggregate": 130.0},
    ], times)
    by = {(r["config"], r["concurrency"]): r for r in rows}
    assert by[("base", 1)]["x_k0"] == 1.0 and "speedup_bound" not in by[("base", 1)]
    assert by[("base", 4)]["x_hf_plain"] == pytest.approx(2.5)  # aggregate over HF plain's one-at-a-time rate
    assert by[("draft k=2", 4)]["x_k0"] == pytest.approx(1.5)  # against k = 0 at concurrency 4
    assert by[("draft k=2", 1)]["speedup_bound"] == pytest.approx(2.8 * 10 / (12 + 2 * 1))
    assert by[("draft k=2", 1)]["efficiency"] == pytest.approx(1.5 / 2.0)
    assert "speedup_bound" not in by[("draft k=2", 4)]  # the bound is that of one stream
    assert by[("ngram k=2", 1)]["speedup_bound"] == pytest.approx(2 * 10 / 11)  # from L and the drafting share
    assert math.isnan(by[("empty ngram k=2", 1)]["speedup_bound"])
    assert "efficiency" not in by[("empty ngram k=2", 1)]
    assert by[("ngram k=2", 4)]["x_k0"] == pytest.approx(0.3)
    assert by[("default", 1)]["x_k0"] == pytest.approx(1.3) and "speedup_bound" not in by[("default", 1)]
    hf = by[("hf assisted k=2", 1)]
    assert hf["x_k0"] == hf["x_hf_plain"] == pytest.approx(1.5)
    assert hf["speedup_bound"] == pytest.approx(2.8 * 10 / 14)  # tokens per pass, every pass drafting
    assert step_time_keys([1, 2, 4]) == [("target_1", 1), ("target_2", 2), ("target_3", 3), ("target_5", 5),
                                         ("draft_1", 1)]


def test_no_bound_where_the_proposer_s_draft_cost_was_not_timed():
    """A head's drafted token costs what its own passes do, not the draft model's; suffix decoding in
    front of a model drafts from either: neither gets a bound from another proposer's time."""
    times = {"target_1": 10.0, "target_3": 12.0, "draft_1": 1.0}
    measured = {"kind": "fixed", "k": 2, "baseline": "base", "concurrency": 1, "tokens_per_s_aggregate": 150.0,
                "mean_accepted_length": 2.8, "num_drafts": 10, "decode_steps": 10}
    rows = annotate([
        {"config": "base", "kind": "k0", "k": 0, "proposer": None, "baseline": "base", "concurrency": 1,
         "tokens_per_s_aggregate": 100.0},
        {"config": "head", "proposer": "eagle3", **measured},
        {"config": "head+suffix", "proposer": "eagle3", "suffix_share": 0.4, **measured},
    ], times)
    by = {r["config"]: r for r in rows}
    assert math.isnan(by["head"]["speedup_bound"]) and "efficiency" not in by["head"]
    assert math.isnan(by["head+suffix"]["speedup_bound"])
    timed = annotate([dict(by["base"]), {"config": "head", "proposer": "eagle3", **measured}],
                     {**times, "eagle3_propose_2": 1.0})  # fmt: skip
    assert timed[1]["speedup_bound"] == pytest.approx(2.8 * 10 / (12 + 2 * 0.5))


def test_annotate_leaves_ratios_out_where_a_baseline_is_missing():
    rows = annotate([{"config": "ngram k=1", "kind": "fixed", "concurrency": 2, "k": 1, "proposer": "ngram",
                      "baseline": "k=0 (ngram server)", "tokens_per_s_aggregate": 50.0}], {})
    assert "x_k0" not in rows[0] and "x_hf_plain" not in rows[0]


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


def test_x_k0_median_pairs_each_round_with_its_baseline():
    rows = [
        {"config": "k0", "concurrency": 1, "tokens_per_s_aggregate": 100.0, "tokens_per_s_rounds": [100, 50, 80]},
        {"config": "k2", "concurrency": 1, "baseline": "k0", "tokens_per_s_aggregate": 120.0,
         "tokens_per_s_rounds": [110, 70, 160]},
    ]
    annotate(rows, {})
    assert rows[1]["x_k0_median"] == pytest.approx(1.4)  # ratios 1.1, 1.4, 2.0: drift between rounds cancels
    rows[1]["tokens_per_s_rounds"] = [110, 70]
    del rows[1]["x_k0_median"]
    annotate(rows, {})
    assert "x_k0_median" not in rows[1]  # rounds that do not pair give no median


def test_x_hf_plain_median_pairs_each_round_with_hf_plain_measured_beside_the_server():
    rows = [{"config": "k2", "concurrency": 1, "tokens_per_s_aggregate": 150.0, "tokens_per_s_rounds": [150, 120, 180],
             "hf_plain_tokens_per_s_rounds": [200, 100, 150]}]
    annotate(rows, {})
    assert rows[0]["x_hf_plain_median"] == pytest.approx(1.2)  # ratios 0.75, 1.2, 1.2


def test_a_beside_server_serves_its_method_under_names_of_its_own():
    assert method_of("eagle3+beside") == "eagle3" and method_of("eagle3") == "eagle3"
    assert fixed_name("eagle3+beside", 3) != fixed_name("eagle3", 3)  # both servers' rows in one run stay apart
    assert k0_name("eagle3+beside") != k0_name("eagle3")
    assert variant_edits("eagle3+beside", {"draft_proposer": {"method": "eagle3"}}) == {
        "draft_proposer": {"method": "eagle3", "run_with_target": "true"},
    }
    assert variant_edits("eagle3", {"draft_proposer": {"method": "eagle3"}}) == {"draft_proposer": {"method": "eagle3"}}


def test_a_suffix_first_server_serves_its_model_method_with_suffix_decoding_in_front():
    assert method_of("eagle3+suffix") == method_of("eagle3+suffix+beside") == "eagle3"
    assert suffix_first("eagle3+suffix+beside") and not suffix_first("suffix") and not suffix_first("eagle3+beside")
    assert variant_edits("draft_model+suffix+beside", {}, model_k=4) == {
        "draft_proposer": {"run_with_target": "true", "enable_suffix_decoding": "true",
                           "model_num_speculative_tokens": "4", "suffix_decoding_min_score": ""},
    }  # fmt: skip
    assert variant_edits("eagle3+suffix", {})["draft_proposer"]["model_num_speculative_tokens"] == ""  # the step's k
    assert variant_edits("eagle3+suffix", {}, min_score=1.0)["draft_proposer"]["suffix_decoding_min_score"] == "1.0"
