"""The orchestrator (specdec_triton.orchestrator) over local stages (tests/local_orchestrator.py): the same
tokens as the in-process engine, alone and together, and each step's calls counted."""
from __future__ import annotations

import pytest
from local_orchestrator import (PROMPTS, K, FakeFamily, codec, engine_text, make_orchestrator, models, request, run,
                                run_together, text_of)

from specdec.engine import GenerationParams
from specdec.rejection_sampler import RejectionSampler
from specdec.speculation_length import SpeculationLength
from specdec.suffix_first import SuffixFirstConfig
from specdec_triton.plumbing import ServingError

__all__ = ["codec", "models"]  # fixtures


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_same_text_as_the_in_process_engine(codec, models, method, sampling):
    orchestrator, stages = make_orchestrator(codec, models, method)
    for prompt in PROMPTS:
        generate_request = request(prompt, **sampling)
        sent = run(orchestrator, generate_request)
        assert len(sent) == 1 and sent[0][1] is True
        params = generate_request.generation_params(16, K, codec.eos_token_ids, (), len(codec.tokenizer))
        assert text_of(sent) == engine_text(codec, models, prompt, params, method)
    assert len(stages.released) == len(PROMPTS)
    assert stages.verifier.num_active_sequences == 0


def test_streamed_pieces_add_up_to_the_single_response(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    for prompt in PROMPTS:
        whole = run(orchestrator, request(prompt))
        pieces = run(orchestrator, request(prompt, stream=True))
        assert len(pieces) > 1 and [final for _, final in pieces] == [False] * (len(pieces) - 1) + [True]
        assert text_of(pieces) == text_of(whole)
        assert [out["finish_reason"][0] for out, _ in pieces[:-1]] == [b""] * (len(pieces) - 1)
        assert pieces[-1][0]["finish_reason"][0] == whole[0][0]["finish_reason"][0] == b"length"
        counts = [int(out["num_output_tokens"][0]) for out, _ in pieces]
        assert counts == sorted(counts) and counts[-1] == 20
        drafts = [int(out["total_draft_tokens"][0]) for out, _ in pieces]
        assert drafts == sorted(drafts) and drafts[-1] == int(whole[0][0]["total_draft_tokens"][0])


def test_prompt_is_prepended_unless_excluded(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    excluded = text_of(run(orchestrator, request("the fox")))
    assert text_of(run(orchestrator, request("the fox", exclude_input_in_output=False))) == "the fox" + excluded


def test_concurrent_requests_match_one_by_one(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    alone = [text_of(run(orchestrator, request(p))) for p in PROMPTS]
    stages.sent.clear()
    assert run_together(orchestrator, PROMPTS) == alone
    assert stages.peak_sequences == len(PROMPTS)  # they really overlapped
    verify_sizes = [n for stage, n in stages.sent if stage == "verify"]
    assert verify_sizes[0] == len(PROMPTS)  # the prefills in one call, then every step one call for all
    assert orchestrator.num_active_requests == 0 and stages.verifier.num_active_sequences == 0


def test_every_stage_call_and_step_shape_is_counted(codec, models):
    orchestrator, stages = make_orchestrator(codec, models, sampler=RejectionSampler("synthetic", 0.5))
    run_together(orchestrator, PROMPTS, seed=3)
    for stage in ("propose", "verify", "sample"):
        labels = (("model", "sd"), ("stage", stage))
        assert FakeFamily.metrics[("spec_decode_stage_calls", labels)].value == sum(
            1 for s, _ in stages.sent if s == stage)
        assert FakeFamily.metrics[("spec_decode_stage_sequences", labels)].value == sum(
            n for s, n in stages.sent if s == stage)
        assert FakeFamily.metrics[("spec_decode_stage_seconds", labels)].value > 0
    by_size = {int(dict(labels)["sequences"]): metric.value for (name, labels), metric in FakeFamily.metrics.items()
               if name == "spec_decode_steps_by_batch_size"}  # fmt: skip
    assert sum(by_size.values()) == sum(1 for s, _ in stages.sent if s == "verify")
    assert max(by_size) == len(PROMPTS)
    by_k = {int(dict(labels)["k"]): metric.value for (name, labels), metric in FakeFamily.metrics.items()
            if name == "spec_decode_steps_by_k"}  # fmt: skip
    assert by_k == {K: sum(by_size.values())}


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_the_batch_size_table_keeps_the_texts(codec, models, method):
    reference, _ = make_orchestrator(codec, models, method)
    alone = [text_of(run(reference, request(p))) for p in PROMPTS]
    table = SpeculationLength(K, per_batch_size=((1, K), (2, 1)), disable_by_batch_size=3)
    orchestrator, stages = make_orchestrator(codec, models, method, speculation=table)
    assert run_together(orchestrator, PROMPTS, overrides_of=lambda i: {"max_tokens": 8 + 4 * i}) == [
        text_of(run(reference, request(p, max_tokens=8 + 4 * i))) for i, p in enumerate(PROMPTS)]
    by_k = {int(dict(labels)["k"]) for (name, labels), _ in FakeFamily.metrics.items() if name == "spec_decode_steps_by_k"}
    assert by_k == {0, 1, K}
    assert alone  # the reference ran


@pytest.mark.parametrize("sampler_method", ["probabilistic", "strict"])
def test_greedy_steps_are_matched_without_the_sampler(codec, models, sampler_method):
    """Against a greedy target rejection sampling is a comparison of ids: no sampler round trip."""
    orchestrator, stages = make_orchestrator(codec, models, "ngram", sampler=RejectionSampler(sampler_method))
    outputs = run(orchestrator, request("abcabcabcabc", max_tokens=24))[-1][0]
    assert {stage for stage, _ in stages.sent} == {"verify"}  # n-gram lookup runs in the orchestrator
    assert int(outputs["total_accepted_draft_tokens"][0]) > 0  # drafts were matched and kept
    run(orchestrator, request(PROMPTS[0], temperature=0.8, seed=1))
    assert "sample" in {stage for stage, _ in stages.sent}  # a sampled target still goes to the sampler


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_methods_propose_in_the_orchestrator(codec, models, method):
    """They read only the tokens the orchestrator holds: no propose call leaves it, and it frees what it kept."""
    orchestrator, stages = make_orchestrator(codec, models, method)
    outputs = run(orchestrator, request("abcabcabcabcabcabc", max_tokens=24))[-1][0]
    assert "propose" not in {stage for stage, _ in stages.sent}
    assert int(outputs["total_accepted_draft_tokens"][0]) > 0
    here = orchestrator.scheduler.stages.proposer
    assert here is not stages.proposer and type(here) is type(stages.proposer)
    assert here.config == stages.proposer.config  # built from the settings the stage described
    assert here.num_active_sequences == 0 and stages.proposer.num_active_sequences == 0
    assert stages.released  # the stages still free the verifier's state


def test_the_suffix_trees_outlive_the_recovery_of_another_model_and_are_gauged(codec, models):
    orchestrator, stages = make_orchestrator(codec, models, "suffix")
    prompt = "the quick brown fox jumps"
    first = run(orchestrator, request(prompt, max_tokens=24))[-1][0]
    gauge = FakeFamily.metrics[("spec_decode_suffix_cached_responses", (("model", "sd"),))]
    assert gauge.value == 1
    orchestrator.stage_failed(["target_verifier"])
    orchestrator.recovered()
    again = run(orchestrator, request(prompt, max_tokens=24))[-1][0]  # drafted from the kept response
    assert again["text_output"][0] == first["text_output"][0]
    assert int(again["total_accepted_draft_tokens"][0]) > int(first["total_accepted_draft_tokens"][0])
    assert gauge.value == 2


def test_suffix_decoding_in_front_of_the_draft_model_is_run_here_and_counted_by_source(codec, models):
    orchestrator, stages = make_orchestrator(codec, models, "draft_model")
    stages.describe_settings = SuffixFirstConfig(min_score=1.0).settings()  # enable_suffix_decoding
    prompt = "abcabcabcabcabc the quick brown fox"
    params = GenerationParams(max_tokens=24, num_speculative_tokens=K)
    for _ in range(2):  # the second request drafts from the first's response too
        sent = run(orchestrator, request(prompt, max_tokens=24))
        assert text_of(sent) == engine_text(codec, models, prompt, params)
    def by_source(name: str) -> dict[str, float]:
        return {source: FakeFamily.metrics[(f"spec_decode_suffix_first_{name}", (("model", "sd"), ("source", source)))].value
                for source in ("suffix", "model")}  # fmt: skip

    steps = by_source("proposals")
    assert steps["suffix"] > 0 and steps["model"] > 0
    proposed = sum(n for stage, n in stages.sent if stage == "propose")  # what reached the draft model
    assert proposed == steps["model"]
    total = {name: FakeFamily.metrics[(f"spec_decode_num_{name}", (("model", "sd"),))].value
             for name in ("drafts", "draft_tokens", "accepted_tokens")}  # fmt: skip
    assert sum(steps.values()) == total["drafts"]  # every drafting step came from one source
    assert sum(by_source("draft_tokens").values()) == total["draft_tokens"]
    accepted = by_source("accepted_tokens")
    assert sum(accepted.values()) == total["accepted_tokens"] and accepted["suffix"] > 0
    assert FakeFamily.metrics[("spec_decode_suffix_cached_responses", (("model", "sd"),))].value == 2
    assert stages.proposer.num_active_sequences == 0


def test_a_model_free_method_described_without_its_settings_is_refused(codec, models):
    orchestrator, stages = make_orchestrator(codec, models, "ngram")
    stages.describe_settings = ()  # a draft_proposer of another version
    with pytest.raises(ServingError, match=r"draft_proposer: method 'ngram' was described with settings \[\]"):
        run(orchestrator, request("the fox"))
    assert stages.sent == []


def test_synthetic_sampler_sees_greedy_steps_too(codec, models):
    """The benchmarking method accepts whatever the tokens are, so greedy steps must reach it."""
    orchestrator, stages = make_orchestrator(codec, models, sampler=RejectionSampler("synthetic", 1.0))
    outputs = run(orchestrator, request(PROMPTS[0]))[-1][0]
    num_samples = sum(n for stage, n in stages.sent if stage == "sample")
    assert num_samples == sum(n for stage, n in stages.sent if stage == "verify") > 0
    assert int(outputs["total_accepted_draft_tokens"][0]) == int(outputs["total_draft_tokens"][0]) > 0




def test_the_sequences_of_running_requests_are_renewed_while_they_run(codec, models, monkeypatch):
    """The stateful stages hear that live requests still hold their sequences, steps or not (specdec_triton.leases)."""
    import specdec_triton.orchestrator as orchestrator_module

    monkeypatch.setattr(orchestrator_module, "RENEW_INTERVAL_S", 0.001)
    orchestrator, stages = make_orchestrator(codec, models)
    stages.verifier.verify = slowly(stages.verifier.verify)
    sent = run(orchestrator, request(PROMPTS[0], max_tokens=8))
    renewed = {seq_id for call in stages.renewed for seq_id in call}
    assert sent[-1][1] and len(renewed) == 1 and renewed <= set(stages.released)  # the request's one sequence


def slowly(function, seconds=0.01):
    """``function``, each call taking ``seconds`` longer (in the event loop's thread: a blocking stage)."""
    import time

    def slow(*args):
        time.sleep(seconds)
        return function(*args)

    return slow
