"""The orchestrator (specdec_triton.orchestrator) over local stages: same tokens as the in-process engine.

The stages here call the real proposer, verifier and sampler objects directly, and
yield to the event loop between calls the way BLS awaits do, so concurrent requests
exercise the step scheduler and per-sequence state exactly as the server does --
without a server.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import numpy as np
import pytest
from byte_tokenizer import byte_level_tokenizer

from specdec.engine import GenerationParams, generate
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, NgramProposer, SuffixProposer, describe_model_free
from specdec.rejection_sampler import RejectionSampler
from specdec.scheduler import SequenceCancelled
from specdec.speculation_length import SpeculationLength
from specdec.suffix_first import SuffixFirstConfig
from specdec.types import ModelDescription
from specdec.verifier import TargetVerifier
from specdec_triton.configs import OrchestratorConfig
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters, SuffixCacheGauges
from specdec_triton.orchestrator import Descriptions, Orchestrator, Tokenized
from specdec_triton.plumbing import RequestError, ServingError
from specdec_triton.request import GenerateRequest, check_parameters
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
        self.fail_verify_after: int | None = None  # fail every verify call reaching this position
        self.max_num_seqs: int | None = None
        self.draft_vocab_size: int | None = None  # what the draft describes, if not its own
        self.tokenizer_vocab_size: int | None = None  # what the tokenizer describes, if not its own
        # what the proposer describes, if not its own: a model-free one's, or suffix decoding's in front of a model
        self.describe_settings: tuple | None = None
        self.describe_failures = 0  # describe calls still to fail
        self.peak_sequences = 0
        self.sent: list[tuple[str, int]] = []  # (stage, sequences) of each propose / verify / sample call, in order

    async def tokenize(self, text, stop_words):
        await asyncio.sleep(0)
        return Tokenized(
            self.codec.encode_prompt(text),
            tuple(tuple(s) for s in self.codec.encode_stop_words(stop_words)),
            tuple(self.codec.eos_token_ids),
        )

    async def describe(self):
        await asyncio.sleep(0)
        if self.describe_failures:
            self.describe_failures -= 1
            raise RuntimeError("target_verifier is not ready")
        vocab = self.verifier.vocab_size
        if isinstance(self.proposer, (NgramProposer, SuffixProposer)):
            draft = describe_model_free(self.proposer)  # the orchestrator runs its own from these settings
        else:
            draft = ModelDescription("/models/draft", self.draft_vocab_size or vocab, None, None, "draft_model")
        if self.describe_settings is not None:
            draft = replace(draft, settings=self.describe_settings)
        return Descriptions(
            tokenizer=ModelDescription(self.codec.tokenizer_dir, self.tokenizer_vocab_size or len(self.codec.tokenizer),
                                       None, None, "tokenizer"),
            draft=draft,
            target=ModelDescription("/models/target", vocab, MAX_MODEL_LEN, self.max_num_seqs, "target"),
            sampler=ModelDescription("rejection_sampler", None, None, None, self.sampler.method),
        )

    async def propose(self, requests):
        await asyncio.sleep(0)
        self.sent.append(("propose", len(requests)))
        return self.proposer.propose(requests)

    async def verify(self, requests):
        await asyncio.sleep(0)
        self.sent.append(("verify", len(requests)))
        if self.fail_verify_after is not None and any(r.position >= self.fail_verify_after for r in requests):
            raise RuntimeError("verifier failed")
        results = self.verifier.verify(requests)
        self.peak_sequences = max(self.peak_sequences, self.verifier.num_active_sequences)
        return results

    async def sample(self, calls):
        await asyncio.sleep(0)
        self.sent.append(("sample", len(calls)))
        return [self.sampler(c.draft_token_ids, c.draft_probs, c.verify, c.seed, c.method, c.position) for c in calls]

    async def release(self, ended):
        for seq_id, response in ended.items():
            self.proposer.release(seq_id, response)
            self.verifier.release(seq_id)
        self.released.extend(ended)


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    byte_level_tokenizer().save_pretrained(path)
    return TextCodec(str(path))


@pytest.fixture(scope="module")
def models(codec, tiny_llama):
    vocab = len(codec.tokenizer)
    return tiny_llama(seed=0, vocab_size=vocab), tiny_llama(seed=1, vocab_size=vocab, num_hidden_layers=1)


def make_pair(models, method):
    target, draft = models
    proposer = {"draft_model": lambda: DraftModelProposer(CachedCausalLM(draft)), "ngram": lambda: NgramProposer(1, 3),
                "suffix": SuffixProposer}[method]()  # fmt: skip
    return proposer, TargetVerifier(CachedCausalLM(target, max_model_len=MAX_MODEL_LEN))


def make_orchestrator(codec, models, method="draft_model", k=K, sampler=None, speculation=None):
    proposer, verifier = make_pair(models, method)
    stages = LocalStages(codec, proposer, verifier, sampler or RejectionSampler())
    FakeFamily.metrics = {}
    counters = SpecDecodeCounters("sd", k, family_type=FakeFamily)
    active = ActiveSequences("sd", family_type=FakeFamily)
    config = OrchestratorConfig(k, 16, speculation or SpeculationLength(k))
    suffix_gauges = SuffixCacheGauges("sd", family_type=FakeFamily)
    return Orchestrator(stages, config, counters, active, suffix_gauges=suffix_gauges), stages


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
    proposer, verifier = make_pair(models, method)
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
        drafts = [int(out["total_draft_tokens"][0]) for out, _ in pieces]
        assert drafts == sorted(drafts) and drafts[-1] == int(whole[0][0]["total_draft_tokens"][0])


def test_prompt_is_prepended_unless_excluded(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    excluded = text_of(run(orchestrator, request("the fox")))
    assert text_of(run(orchestrator, request("the fox", exclude_input_in_output=False))) == "the fox" + excluded


def run_together(orchestrator, prompts, *, overrides_of=lambda i: {}, **overrides) -> list:
    """All prompts as concurrent requests on one event loop; their texts (or exceptions) in order."""

    async def together():
        sent = [[] for _ in prompts]

        async def one(i):
            await orchestrator.generate(request(prompts[i], **{**overrides, **overrides_of(i)}),
                                        lambda out, final: sent[i].append((out, final)), lambda: False)

        outcomes = await asyncio.gather(*(one(i) for i in range(len(prompts))), return_exceptions=True)
        return [err if err is not None else text_of(s) for err, s in zip(outcomes, sent)]

    return asyncio.run(together())


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
    assert value["spec_decode_num_steps"] == sum(n for stage, n in stages.sent if stage == "verify")  # a pass per sequence-step
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


def test_a_failing_send_frees_the_sequence(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)

    def send(outputs, final):
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        asyncio.run(orchestrator.generate(request("the quick", stream=True, max_tokens=60), send, lambda: False))
    assert len(stages.released) == 1 and stages.verifier.num_active_sequences == 0
    assert sum(n for stage, n in stages.sent if stage == "verify") < 30  # stopped long before 60 tokens
