"""The serving loop (specdec_triton.orchestrator) over local stages: same tokens as the in-process engine.

The stages here call the real proposer, verifier and sampler objects directly, and
yield to the event loop between calls the way BLS awaits do, so interleaved requests
exercise per-sequence state exactly as the server does -- without a server.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re

import numpy as np
import pytest
from byte_tokenizer import byte_level_tokenizer

from specdec.call_costs import CallCosts, measure_propose_costs, measure_verify_costs
from specdec.engine import generate
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.verifier import TargetVerifier
from specdec_triton.configs import OrchestratorConfig
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters
from specdec_triton.orchestrator import Limits, Orchestrator, Tokenized
from specdec_triton.plumbing import RequestCancelled, RequestError
from specdec_triton.request import GenerateRequest, check_parameters
from specdec_triton.speculation_length import AdaptiveSpeculationLength
from specdec_triton.text import TextCodec

K = 3
MAX_MODEL_LEN = 96
PROMPTS = ["the quick brown fox", "Grüße aus München", "東京は", "def f(x):\n    return"]


class FakeMetric:
    def __init__(self):
        self.value = 0
        self.updates = 0  # calls that would each be a round trip to the server

    def increment(self, amount):
        self.value += amount
        self.updates += 1

    def set(self, value):
        self.value = value


class FakeFamily:
    """Stands in for pb_utils.MetricFamily; records every metric by (name, labels)."""

    COUNTER, GAUGE = "counter", "gauge"
    metrics: dict = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):
        return FakeFamily.metrics.setdefault((self.name, tuple(sorted(labels.items()))), FakeMetric())


class LocalStages:
    def __init__(self, codec, proposer, verifier, sampler):
        self.codec, self.proposer, self.verifier, self.sampler = codec, proposer, verifier, sampler
        self.released: list[str] = []
        self.fail_verify_after: int | None = None
        self.fail_detokenize_at: int | None = None  # fail every detokenize call of at least this many tokens
        self.max_num_seqs: int | None = None
        self.peak_sequences = 0
        self.sent: list[tuple[str, int]] = []  # (stage, sequences) of each propose / verify / sample call, in order
        self.draft_delays: dict[str, int] = {}  # seq_id -> extra event-loop turns each of its proposals takes
        self.on_call = lambda stage, requests: None  # called at each propose / verify call
        self.call_costs: tuple[CallCosts, CallCosts] | None = None  # (verify, propose) what limits reports if asked
        self.take_call_costs = False  # verify and propose calls last as long as call_costs says

    async def tokenize(self, text, stop_words):
        await asyncio.sleep(0)
        return Tokenized(
            self.codec.encode_prompt(text),
            tuple(tuple(s) for s in self.codec.encode_stop_words(stop_words)),
            tuple(self.codec.eos_token_ids),
        )

    async def detokenize(self, token_id_lists):
        for _ in range(len(token_id_lists[0]) % 3):
            await asyncio.sleep(0)  # some calls return later than the next ones start: order must hold
        if self.fail_detokenize_at is not None and any(len(ids) >= self.fail_detokenize_at for ids in token_id_lists):
            raise RuntimeError("detokenizer failed")
        return [self.codec.decode(ids) for ids in token_id_lists]

    async def limits(self, call_costs=False):
        costs = self.call_costs if call_costs else (None, None)
        return Limits(
            self.verifier.max_model_len, self.verifier.vocab_size, self.max_num_seqs, self.sampler.method, *costs
        )

    async def propose(self, requests):
        await asyncio.sleep(0)
        self.sent.append(("propose", len(requests)))
        self.on_call("propose", requests)
        await self._take_cost(1, len(requests), max(r.num_tokens for r in requests))
        delays = [self.draft_delays.setdefault(r.seq_id, len(self.draft_delays) % 3) for r in requests]
        for _ in range(max(delays)):
            await asyncio.sleep(0)  # sequences draft at different speeds, as they do in a server
        return self.proposer.propose(requests)

    async def verify(self, requests):
        await asyncio.sleep(0)
        self.sent.append(("verify", len(requests)))
        self.on_call("verify", requests)
        await self._take_cost(0, len(requests), max(len(r.token_ids) for r in requests))
        if self.fail_verify_after is not None and any(r.position >= self.fail_verify_after for r in requests):
            raise RuntimeError("verifier failed")
        results = self.verifier.verify(requests)
        self.peak_sequences = max(self.peak_sequences, self.verifier.num_active_sequences)
        return results

    async def _take_cost(self, which, num_sequences, num_tokens):
        if self.take_call_costs and num_tokens <= self.call_costs[which].tokens[-1]:
            await asyncio.sleep(self.call_costs[which](num_sequences, num_tokens))

    async def sample(self, calls):
        await asyncio.sleep(0)
        self.sent.append(("sample", len(calls)))
        return [self.sampler(c.draft_token_ids, c.draft_probs, c.verify, c.seed, c.method) for c in calls]

    async def release(self, seq_id):
        self.proposer.release(seq_id)
        self.verifier.release(seq_id)
        self.released.append(seq_id)


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    byte_level_tokenizer().save_pretrained(path)
    return TextCodec(str(path))


@pytest.fixture(scope="module")
def models(codec, tiny_llama):
    vocab = len(codec.tokenizer)
    return tiny_llama(seed=0, vocab_size=vocab), tiny_llama(seed=1, vocab_size=vocab, num_hidden_layers=1)


def make_orchestrator(codec, models, method="draft_model", k=K, sampler=None, micro_batches=1):
    target, draft = models
    proposer = DraftModelProposer(draft) if method == "draft_model" else NgramProposer(1, 3)
    verifier = TargetVerifier(target, max_model_len=MAX_MODEL_LEN)
    stages = LocalStages(codec, proposer, verifier, sampler or RejectionSampler())
    FakeFamily.metrics = {}
    counters = SpecDecodeCounters("sd", k, family_type=FakeFamily)
    active = ActiveSequences("sd", family_type=FakeFamily)
    return Orchestrator(stages, OrchestratorConfig(k, 16, micro_batches), counters, active), stages


def request(text, **overrides):
    fields = dict(text_input=text, max_tokens=20, stream=False, exclude_input_in_output=True)
    fields.update(overrides)
    return GenerateRequest.from_inputs({name: _array(value) for name, value in fields.items()})


def _array(value):
    if isinstance(value, str):
        return np.array([value.encode()], dtype=np.object_)
    if isinstance(value, list):
        return np.array([v.encode() for v in value], dtype=np.object_)
    return np.array([value])


def run(orchestrator, generate_request, is_cancelled=lambda: False):
    """Returns the list of (outputs, final) responses the request sent."""
    sent = []
    asyncio.run(orchestrator.generate(generate_request, lambda out, final: sent.append((out, final)), is_cancelled))
    return sent


def text_of(sent):
    return "".join(out["text_output"][0].decode() for out, _ in sent)


def engine_text(codec, models, prompt, params, method="draft_model"):
    target, draft = models
    proposer = DraftModelProposer(draft) if method == "draft_model" else NgramProposer(1, 3)
    verifier = TargetVerifier(target, max_model_len=MAX_MODEL_LEN)
    steps = generate(proposer, verifier, RejectionSampler(), codec.encode_prompt(prompt), params)
    return codec.decode([t for step in steps for t in step.new_token_ids])


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


def test_prompt_is_prepended_unless_excluded(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    excluded = text_of(run(orchestrator, request("the fox")))
    assert text_of(run(orchestrator, request("the fox", exclude_input_in_output=False))) == "the fox" + excluded


def run_together(orchestrator, prompts, *, stagger_turns=0, overrides_of=lambda i: {}, **overrides) -> list[str]:
    """All prompts as concurrent requests on one event loop; their texts in order.

    Request ``i`` starts ``i * stagger_turns`` event-loop turns late and gets
    ``overrides_of(i)`` on top of ``overrides``.
    """

    async def together():
        sent = [[] for _ in prompts]

        async def one(i):
            for _ in range(stagger_turns * i):
                await asyncio.sleep(0)
            await orchestrator.generate(request(prompts[i], **{**overrides, **overrides_of(i)}),
                                        lambda out, final: sent[i].append((out, final)), lambda: False)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return [text_of(s) for s in sent]

    return asyncio.run(together())


def test_concurrent_requests_match_one_by_one(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    alone = [text_of(run(orchestrator, request(p))) for p in PROMPTS]
    assert run_together(orchestrator, PROMPTS) == alone
    assert stages.peak_sequences == len(PROMPTS)  # they really overlapped
    assert orchestrator.num_active_sequences == 0 and stages.verifier.num_active_sequences == 0


def test_concurrent_steps_share_stage_calls(codec, models):
    orchestrator, stages = make_orchestrator(codec, models, sampler=RejectionSampler("synthetic", 0.5))
    alone = [text_of(run(orchestrator, request(p, seed=3))) for p in PROMPTS]  # the synthetic draws are seeded
    one_by_one = len(stages.sent)
    sent_alone = list(stages.sent)
    stages.sent.clear()
    assert run_together(orchestrator, PROMPTS, seed=3) == alone
    sizes = {stage: [n for s, n in stages.sent if s == stage] for stage in ("propose", "verify", "sample")}
    for stage, calls in sizes.items():  # the same sequence-steps, in fewer and fuller calls
        assert max(calls) == len(PROMPTS), stage
    assert sum(n for _, n in stages.sent) == one_by_one and len(stages.sent) < one_by_one / 2
    for stage in ("propose", "verify", "sample"):  # the per-stage counters saw every call, since the start
        stage_labels = (("model", "sd"), ("stage", stage))
        num_calls = FakeFamily.metrics[("spec_decode_stage_calls", stage_labels)].value
        num_sequences = FakeFamily.metrics[("spec_decode_stage_sequences", stage_labels)].value
        assert num_calls == len([s for s, _ in stages.sent if s == stage]) + sum(
            1 for s, _ in sent_alone if s == stage)
        assert num_sequences == sum(sizes[stage]) + sum(n for s, n in sent_alone if s == stage)
        assert FakeFamily.metrics[("spec_decode_stage_seconds", stage_labels)].value > 0


def test_micro_batches_split_the_live_sequences(codec, models):
    """With 2, a draft or verify call carries at most half the live sequences; the texts do not change."""
    orchestrator, stages = make_orchestrator(codec, models, micro_batches=2)
    alone = [text_of(run(orchestrator, request(p))) for p in PROMPTS]
    stages.sent.clear()
    assert run_together(orchestrator, PROMPTS) == alone
    for stage in ("propose", "verify"):
        sizes = [n for s, n in stages.sent if s == stage]
        assert max(sizes) == len(PROMPTS) // 2, stage
    assert orchestrator.verifications.max_batch_size == 1  # back to a lone sequence's share once all ended


def test_plain_decoding_sequences_share_every_forward(codec, models):
    """At k = 0 a sequence goes from verify straight back to verify: the live ones share each call.

    The first request starts alone, so the others reach the verifier while its prefill is
    in flight, the arrangement in which they used to settle into taking turns.
    """
    orchestrator, stages = make_orchestrator(codec, models)
    alone = [text_of(run(orchestrator, request(p, num_speculative_tokens=0))) for p in PROMPTS]
    stages.sent.clear()

    # the first is in flight when the next arrives
    assert run_together(orchestrator, PROMPTS, stagger_turns=8, num_speculative_tokens=0) == alone
    sizes = [n for stage, n in stages.sent if stage == "verify"]
    assert max(sizes) == len(PROMPTS)
    assert len(sizes) <= 20 + len(PROMPTS)  # 20 steps each: about one call per step once they are together


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculation_pauses_while_more_sequences_than_disable_by_batch_size_are_live(codec, models, method):
    """Above the limit steps draft nothing; the texts do not change, and drafting resumes below it."""
    orchestrator, stages = make_orchestrator(codec, models, method)
    alone = [text_of(run(orchestrator, request(p, max_tokens=12 + 4 * i))) for i, p in enumerate(PROMPTS)]
    orchestrator.config = dataclasses.replace(orchestrator.config, disable_by_batch_size=2)
    live_at: list[tuple[str, int]] = []
    stages.on_call = lambda stage, requests: live_at.append((stage, orchestrator.num_active_sequences))

    assert len(PROMPTS) > 2
    # different lengths, so the live count falls as requests end
    assert run_together(orchestrator, PROMPTS, overrides_of=lambda i: {"max_tokens": 12 + 4 * i}) == alone
    assert max(live for stage, live in live_at if stage == "verify") == len(PROMPTS)  # steps ran above the limit
    assert max(live for stage, live in live_at if stage == "propose") <= 2  # but drafted only at or below it
    assert any(stage == "propose" for stage, _ in live_at)  # and drafting resumed


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_adaptive_length_keeps_the_texts(codec, models, method):
    """Costs measured on the local stages; concurrent requests still give the texts of fixed k, one by one."""
    orchestrator, stages = make_orchestrator(codec, models, method)
    alone = [text_of(run(orchestrator, request(p))) for p in PROMPTS]
    adaptive, stages = make_orchestrator(codec, models, method)
    adaptive.config = dataclasses.replace(adaptive.config, length_policy="adaptive")
    stages.call_costs = (
        measure_verify_costs(stages.verifier, len(PROMPTS), stages.verifier.vocab_size),
        measure_propose_costs(stages.proposer, len(PROMPTS), stages.verifier.vocab_size),
    )
    assert run_together(adaptive, PROMPTS) == alone
    assert adaptive.length_policy is not None and adaptive.length_policy.verify_costs is stages.call_costs[0]
    assert stages.verifier.num_active_sequences == 0
    assert orchestrator.length_policy is None  # fixed: nothing measured, nothing chosen


def test_adaptive_length_drafts_less_under_load(codec, models):
    """Stages that take 5 ms a call and 8 ms a row: one draft pays alone (acceptance 0.8), none with 4 live."""

    def linear(fixed_ms, per_row_ms, tokens):
        return CallCosts((1, 2, 4), tokens, tuple(tuple((fixed_ms + per_row_ms * n * t) / 1e3 for t in tokens)
                                                  for n in (1, 2, 4)))

    orchestrator, stages = make_orchestrator(codec, models, sampler=RejectionSampler("synthetic", 0.8))
    orchestrator.config = dataclasses.replace(orchestrator.config, length_policy="adaptive")
    stages.call_costs = (linear(5, 8, (1, 2, 4)), linear(0, 0.1, (1, 2, 4)))
    stages.take_call_costs = True
    asked: list[tuple[int, int]] = []  # (live sequences, drafts asked) of each propose request

    def record(stage, requests):
        if stage == "propose":
            asked.extend((orchestrator.num_active_sequences, r.num_tokens) for r in requests)

    stages.on_call = record
    run(orchestrator, request(PROMPTS[0], max_tokens=60, seed=1))
    assert asked[0][1] == K  # the maximum until the acceptance rate is known
    settled = [k for _, k in asked[len(asked) // 2:]]
    assert settled and all(1 <= k < K for k in settled)
    asked.clear()
    run_together(orchestrator, PROMPTS, seed=2)
    assert all(live < len(PROMPTS) for live, _ in asked)  # no drafts while all four were live


def test_with_micro_batches_the_length_policy_learns_at_the_load_it_chooses_at(codec, models, monkeypatch):
    """Four live in calls of at most two: choices and what the calls taught are both at load 2, not 4."""
    orchestrator, stages = make_orchestrator(codec, models, micro_batches=2)
    orchestrator.config = dataclasses.replace(orchestrator.config, length_policy="adaptive")
    stages.call_costs = (
        measure_verify_costs(stages.verifier, 2, stages.verifier.vocab_size),
        measure_propose_costs(stages.proposer, 2, stages.verifier.vocab_size),
    )
    chosen_at, taught_at = set(), set()
    choose, record_call = AdaptiveSpeculationLength.choose, AdaptiveSpeculationLength.record_call

    def spy_choose(self, num_sequences, max_k):
        chosen_at.add(num_sequences)
        return choose(self, num_sequences, max_k)

    def spy_record_call(self, stage, num_sequences, tokens, seconds, num_live):
        taught_at.add(num_live)
        return record_call(self, stage, num_sequences, tokens, seconds, num_live)

    monkeypatch.setattr(AdaptiveSpeculationLength, "choose", spy_choose)
    monkeypatch.setattr(AdaptiveSpeculationLength, "record_call", spy_record_call)
    run_together(orchestrator, PROMPTS)
    assert max(chosen_at) == max(taught_at) == 2


@pytest.mark.parametrize("sampler_method", ["probabilistic", "strict"])
def test_greedy_steps_are_matched_without_the_sampler(codec, models, sampler_method):
    """Against a greedy target rejection sampling is a comparison of ids: no sampler round trip."""
    orchestrator, stages = make_orchestrator(codec, models, "ngram", sampler=RejectionSampler(sampler_method))
    outputs = run(orchestrator, request("abcabcabcabc", max_tokens=24))[-1][0]
    assert {stage for stage, _ in stages.sent} == {"propose", "verify"}
    assert int(outputs["total_accepted_draft_tokens"][0]) > 0  # drafts were matched and kept
    run(orchestrator, request(PROMPTS[0], temperature=0.8, seed=1))
    assert "sample" in {stage for stage, _ in stages.sent}  # a sampled target still goes to the sampler


def test_synthetic_sampler_sees_greedy_steps_too(codec, models):
    """The benchmarking method accepts whatever the tokens are, so greedy steps must reach it."""
    orchestrator, stages = make_orchestrator(codec, models, sampler=RejectionSampler("synthetic", 1.0))
    outputs = run(orchestrator, request(PROMPTS[0]))[-1][0]
    num_samples = sum(n for stage, n in stages.sent if stage == "sample")
    assert num_samples == sum(n for stage, n in stages.sent if stage == "verify") > 0
    # rate 1.0 keeps every draft, which the draft model's greedy tokens alone would not get
    assert int(outputs["total_accepted_draft_tokens"][0]) == int(outputs["total_draft_tokens"][0]) > 0


def test_one_failing_sequence_does_not_fail_the_others(codec, models):
    """A failed batched call is retried per sequence: only the sequence that fails alone gets the error."""
    orchestrator, stages = make_orchestrator(codec, models)
    short, long = "ab", "the quick brown fox jumps over"
    expected = text_of(run(orchestrator, request(short, max_tokens=4)))
    stages.fail_verify_after = len(codec.encode_prompt(long)) + 2  # only the long prompt gets that far

    async def together():
        return await asyncio.gather(
            orchestrator.generate(request(short, max_tokens=4), lambda out, final: got.append((out, final)),
                                  lambda: False),
            orchestrator.generate(request(long), lambda out, final: None, lambda: False),
            return_exceptions=True,
        )  # fmt: skip

    got = []
    first, second = asyncio.run(together())
    assert first is None and text_of(got) == expected
    assert isinstance(second, RuntimeError) and "verifier failed" in str(second)
    assert len(stages.released) == 3 and orchestrator.num_active_sequences == 0


def test_a_failed_stage_call_is_counted_but_teaches_the_length_policy_nothing(codec, models, monkeypatch):
    orchestrator, stages = make_orchestrator(codec, models)
    orchestrator.config = dataclasses.replace(orchestrator.config, length_policy="adaptive")
    stages.call_costs = (
        measure_verify_costs(stages.verifier, 1, stages.verifier.vocab_size),
        measure_propose_costs(stages.proposer, 1, stages.verifier.vocab_size),
    )
    taught = []
    monkeypatch.setattr(AdaptiveSpeculationLength, "record_call", lambda self, stage, *rest: taught.append(stage))
    stages.fail_verify_after = 12
    with pytest.raises(RuntimeError, match="verifier failed"):
        run(orchestrator, request("the quick brown fox"))
    num_verify_calls = sum(1 for stage, _ in stages.sent if stage == "verify")
    assert num_verify_calls > 1 and taught.count("verify") == num_verify_calls - 1  # all but the failed one
    calls = FakeFamily.metrics[("spec_decode_stage_calls", (("model", "sd"), ("stage", "verify")))].value
    assert calls == num_verify_calls


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
    with pytest.raises(RequestCancelled):
        asyncio.run(orchestrator.generate(
            request("the quick", stream=True, max_tokens=60),
            lambda out, final: sent.append(final),
            is_cancelled=lambda: len(sent) >= 2,
        ))  # fmt: skip
    assert sent == [False, False]
    assert len(stages.released) == 1 and stages.verifier.num_active_sequences == 0
    assert FakeFamily.metrics[("spec_decode_num_active_sequences", (("model", "sd"),))].value == 0


def test_a_failing_stage_still_releases(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    stages.fail_verify_after = 8
    with pytest.raises(RuntimeError, match="verifier failed"):
        run(orchestrator, request("the quick brown fox"))
    assert len(stages.released) == 1 and orchestrator.num_active_sequences == 0


def test_a_failing_streaming_detokenize_fails_the_request_and_releases(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    stages.fail_detokenize_at = 5
    sent = []
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        asyncio.run(orchestrator.generate(
            request("the quick brown fox", stream=True), lambda out, final: sent.append(final), lambda: False
        ))  # fmt: skip
    assert True not in sent  # no final response after a failure
    assert len(stages.released) == 1 and orchestrator.num_active_sequences == 0


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
    assert stages.released == [] and stages.verifier.num_active_sequences == 0


def test_an_error_over_the_default_max_tokens_says_it_was_the_default(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)  # default_max_tokens 16
    no_max_tokens = GenerateRequest.from_inputs({"text_input": _array("x" * 90)})
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
    assert value["spec_decode_num_steps"] == sum(n for stage, n in stages.sent if stage == "verify")  # a pass per step
    assert value["spec_decode_num_drafts"] + len(outputs) <= value["spec_decode_num_steps"]


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
