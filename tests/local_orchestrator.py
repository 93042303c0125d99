"""A local harness for the orchestrator (specdec_triton.orchestrator): real proposer, verifier and
sampler objects as its stages, no server.

The stages call the objects directly and yield to the event loop between calls the way BLS
awaits do, so concurrent requests exercise the step scheduler and per-sequence state exactly
as the server does. The ``codec`` and ``models`` fixtures are imported by the test modules.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from byte_tokenizer import byte_level_tokenizer

from specdec.generate import generate
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, NgramProposer, SuffixProposer, describe_model_free
from specdec.rejection_sampler import RejectionSampler
from specdec.scheduler import StepCapabilities
from specdec.speculation_length import SpeculationLength
from specdec.types import ModelDescription
from specdec.verifier import TargetVerifier
from specdec_triton.configs import OrchestratorConfig
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters, SuffixCacheGauges
from specdec_triton.orchestrator import Descriptions, Orchestrator, Tokenized
from specdec_triton.request import GenerateRequest
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
    capabilities = StepCapabilities()  # sampled steps go to ``sample``; each stage its own call

    def __init__(self, codec, proposer, verifier, sampler):
        self.codec, self.proposer, self.verifier, self.sampler = codec, proposer, verifier, sampler
        self.released: list[str] = []
        self.renewed: list[list[str]] = []  # the seq_ids of each renewal
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
        return [self.sampler(c.draft_token_ids, c.draft_probs, c.verify, c.seed, c.method, c.position, c.parents)
                for c in calls]

    async def release(self, ended):
        for seq_id, response in ended.items():
            self.proposer.release(seq_id, response)
            self.verifier.release(seq_id)
        self.released.extend(ended)

    async def renew(self, seq_ids):
        self.renewed.append(list(seq_ids))


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
    return GenerateRequest.from_inputs({name: request_array(value) for name, value in fields.items()})


def request_array(value):
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
