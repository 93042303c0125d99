"""The orchestrator over local stages when things go wrong: failing stages and sends, cancellation,
misfit models, bad requests; and its counters."""
from __future__ import annotations

import asyncio
import gc
import re
import weakref

import pytest
from local_orchestrator import (MAX_MODEL_LEN, PROMPTS, K, FakeFamily, codec, make_orchestrator, models, request,
                                request_array, run, run_together, text_of)

from specdec.scheduler import SequenceCancelled
from specdec_triton.metrics import SpecDecodeCounters
from specdec_triton.plumbing import RequestError, ServingError
from specdec_triton.request import GenerateRequest, check_parameters

__all__ = ["codec", "models"]  # fixtures


def test_one_failing_sequence_does_not_fail_the_others(codec, models):
    """A failed batched call is sent again per sequence: only the sequence that fails alone gets the error."""
    orchestrator, stages = make_orchestrator(codec, models)
    short, long = "ab", "the quick brown fox jumps over"
    expected = text_of(run(orchestrator, request(short, max_tokens=4)))
    stages.fail_verify_after = len(codec.encode_prompt(long)) + 2  # only the long prompt gets that far
    first, second = run_together(orchestrator, [short, long], overrides_of=lambda i: {"max_tokens": 4 if i == 0 else 20})
    assert first == expected
    assert isinstance(second, RuntimeError) and "verifier failed" in str(second)
    assert len(stages.released) == 3 and orchestrator.num_active_requests == 0


def test_no_more_sequences_than_the_stages_hold(codec, models):
    reference, _ = make_orchestrator(codec, models)
    alone = [text_of(run(reference, request(p))) for p in PROMPTS]
    orchestrator, stages = make_orchestrator(codec, models)
    stages.max_num_seqs = 2
    assert run_together(orchestrator, PROMPTS) == alone
    assert stages.peak_sequences == 2


def test_cancellation_stops_between_steps_and_releases(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    sent = []
    with pytest.raises(SequenceCancelled):
        asyncio.run(orchestrator.generate(
            request("the quick", stream=True, max_tokens=60),
            lambda out, final: sent.append(final),
            is_cancelled=lambda: len(sent) >= 2,
        ))  # fmt: skip
    assert sent[:2] == [False, False] and True not in sent
    assert len(stages.released) == 1 and stages.verifier.num_active_sequences == 0
    assert FakeFamily.metrics[("spec_decode_num_active_sequences", (("model", "sd"),))].value == 0


def test_a_failing_stage_still_releases(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    stages.fail_verify_after = 8
    with pytest.raises(RuntimeError, match="verifier failed"):
        run(orchestrator, request("the quick brown fox"))
    assert len(stages.released) == 1 and orchestrator.num_active_requests == 0


@pytest.mark.parametrize(
    "misfit, message",
    [
        ("draft_vocab_size", r"/models/draft.*/models/target|/models/target.*/models/draft"),
        ("tokenizer_vocab_size", r"tokenizer .* has \d+ tokens but target model '/models/target'"),
    ],
)
def test_models_that_do_not_fit_the_target_are_refused_naming_both(codec, models, misfit, message):
    """A draft with another vocabulary, or a tokenizer with more tokens than the target has logits."""
    orchestrator, stages = make_orchestrator(codec, models)
    setattr(stages, misfit, stages.verifier.vocab_size + 5)
    with pytest.raises(ServingError, match=message):
        run(orchestrator, request("the fox"))
    assert stages.sent == []


def test_a_failed_describe_is_asked_again_by_the_next_request(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    stages.describe_failures = 1
    with pytest.raises(RuntimeError, match="not ready"):
        run(orchestrator, request("the fox"))
    assert text_of(run(orchestrator, request("the fox")))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_speculative_tokens": K + 1}, r"'num_speculative_tokens' must be in \[0, 3\]"),
        ({"num_speculative_tokens": -1}, r"'num_speculative_tokens' must be in \[0, 3\]"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1"),
        ({"max_tokens": MAX_MODEL_LEN}, r"exceeds max_model_len=96"),
        ({"temperature": -1.0}, r"temperature must be >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k must be >= 0"),
        ({"end_id": 10**6}, r"'end_id' must be a token id in \[0, \d+\), got 1000000"),
        ({"end_id": -1}, r"'end_id' must be a token id in \[0, \d+\), got -1"),
        ({"text_input": "x" * 200}, r"prompt \(\d+ tokens\) \+ max_tokens \(20\) exceeds max_model_len=96"),
        ({"stop_words": ["end", ""]}, r"input 'stop_words' must not contain an empty string"),
    ],
)
def test_bad_requests_fail_before_any_model_call(codec, models, overrides, message):
    orchestrator, stages = make_orchestrator(codec, models)
    prompt = overrides.pop("text_input", "the fox")
    with pytest.raises(RequestError, match=message):
        run(orchestrator, request(prompt, **overrides))
    assert stages.released == [] and stages.sent == [] and stages.verifier.num_active_sequences == 0


def test_an_error_over_the_default_max_tokens_says_it_was_the_default(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)  # default_max_tokens 16
    no_max_tokens = GenerateRequest.from_inputs({"text_input": request_array("x" * 90)})
    with pytest.raises(RequestError, match=r"max_tokens \(16\) exceeds .* sent no max_tokens: .*default_max_tokens"):
        run(orchestrator, no_max_tokens)
def test_request_parameters_are_refused_naming_them_and_the_closest_input():
    check_parameters({})
    check_parameters({"triton_enable_empty_final_response": True})  # Triton's own
    with pytest.raises(RequestError, match=r"unknown request parameter 'max_token' \(did you mean 'max_tokens'\?\)"):
        check_parameters({"max_token": 8})
    with pytest.raises(RequestError, match=r"parameters 'foo', 'tempreature' \(did you mean 'temperature'\?\): .*"
                                           r"one of text_input, max_tokens"):
        check_parameters({"tempreature": 0.5, "foo": 1})
    forwarded = re.compile("x-.*")  # as in --http-header-forward-pattern x-.*
    check_parameters({"x-request-id": "abc", "x-tenant": "t1"}, forwarded)
    with pytest.raises(RequestError, match="unknown request parameter 'max_token'"):
        check_parameters({"x-request-id": "abc", "max_token": 8}, forwarded)
    with pytest.raises(RequestError, match="'y-x-id'"):
        check_parameters({"y-x-id": "abc"}, forwarded)  # the whole name must match


def test_counters_add_up(codec, models):
    orchestrator, stages = make_orchestrator(codec, models, method="ngram")
    outputs = [run(orchestrator, request(p, max_tokens=24))[-1][0] for p in ["abcabcabcabc", "the the the the"]]
    value = {name: metric.value for (name, labels), metric in FakeFamily.metrics.items() if len(labels) == 1}
    per_position = [FakeFamily.metrics[("spec_decode_num_accepted_tokens_per_pos",
                                        (("model", "sd"), ("position", str(i))))].value for i in range(K)]  # fmt: skip
    assert value["spec_decode_num_draft_tokens"] == sum(int(o["total_draft_tokens"][0]) for o in outputs) > 0
    assert value["spec_decode_num_accepted_tokens"] == sum(int(o["total_accepted_draft_tokens"][0]) for o in outputs)
    assert value["spec_decode_num_output_tokens"] == 48
    assert 0 < value["spec_decode_num_accepted_tokens"] <= value["spec_decode_num_draft_tokens"]
    assert per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == value["spec_decode_num_accepted_tokens"]
    assert value["spec_decode_num_drafts"] <= value["spec_decode_num_draft_tokens"]
    assert value["spec_decode_num_steps"] == sum(n for stage, n in stages.sent if stage == "verify")  # a pass per sequence-step
    assert value["spec_decode_num_drafts"] + len(outputs) <= value["spec_decode_num_steps"]


def test_dropped_metrics_are_applied_first_and_then_let_go(codec, models):
    """``finalize`` drops the families (python_backend#429): what is pending is counted, nothing holds them,
    and a request after that is served, uncounted."""
    orchestrator, _ = make_orchestrator(codec, models, method="ngram")
    counters = weakref.ref(orchestrator.counters)
    steps = FakeFamily.metrics[("spec_decode_num_steps", (("model", "sd"),))]

    async def count_then_drop():
        orchestrator.counters.record_step(num_draft_tokens=2, num_accepted=1, num_output_tokens=2)
        assert steps.value == 0  # pending: the flush is scheduled on this loop
        orchestrator.drop_metrics()

    asyncio.run(count_then_drop())
    gc.collect()
    assert steps.value == 1 and counters() is None
    assert (orchestrator.active, orchestrator.suffix_gauges) == (None, None)
    assert text_of(run(orchestrator, request("abcabcabcabc", max_tokens=8)))
    assert steps.value == 1


def test_counter_updates_are_summed_and_applied_once_per_interval():
    FakeFamily.metrics = {}
    counters = SpecDecodeCounters("sd", 2, family_type=FakeFamily, flush_interval_s=0.05)
    steps = FakeFamily.metrics[("spec_decode_num_steps", (("model", "sd"),))]
    accepted = FakeFamily.metrics[("spec_decode_num_accepted_tokens", (("model", "sd"),))]

    async def steps_over_several_turns():
        for _ in range(4):
            counters.record_step(num_draft_tokens=2, num_accepted=1, num_output_tokens=2)
            await asyncio.sleep(0)
        assert steps.value == 0  # not applied within the interval
        await asyncio.sleep(0.2)
        assert (steps.value, steps.updates, accepted.value, accepted.updates) == (4, 1, 4, 1)
        counters.record_step(num_draft_tokens=2, num_accepted=1, num_output_tokens=2)
        counters.flush()  # at once, as before a final response
        assert (steps.value, steps.updates) == (5, 2)
        await asyncio.sleep(0.2)  # the flush took the scheduled one's place: no empty update
        assert steps.updates == 2

    asyncio.run(steps_over_several_turns())
    counters.record_step(num_draft_tokens=2, num_accepted=1, num_output_tokens=2)  # no loop: applied at once
    assert (steps.value, steps.updates) == (6, 3)

    async def ends_with_a_flush_pending():
        counters.record_step(num_draft_tokens=2, num_accepted=1, num_output_tokens=2)

    async def the_next_loop():  # the dead loop's pending flush does not hold this one's back
        counters.record_step(num_draft_tokens=2, num_accepted=1, num_output_tokens=2)
        await asyncio.sleep(0.2)
        assert (steps.value, steps.updates) == (8, 4)

    asyncio.run(ends_with_a_flush_pending())
    assert steps.value == 6
    asyncio.run(the_next_loop())


def test_a_failing_send_frees_the_sequence(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)

    def send(outputs, final):
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        asyncio.run(orchestrator.generate(request("the quick", stream=True, max_tokens=60), send, lambda: False))
    assert len(stages.released) == 1 and stages.verifier.num_active_sequences == 0
    assert sum(n for stage, n in stages.sent if stage == "verify") < 30  # stopped long before 60 tokens

