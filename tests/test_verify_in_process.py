"""The target loaded in the orchestrator's process: its settings read from target_verifier's config,
its calls made on one thread, and the served text equal to the engine's (greedy: to HF ``generate``)."""
from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import replace

import pytest
import torch

from specdec.models import CachedCausalLM
from specdec.types import SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier
from specdec_triton import sample_hop, wire
from specdec_triton.internal import boot_secret
from specdec_triton.plumbing import ParameterError
from specdec_triton.target_here import load_target_here, read_target_config
from specdec_triton.verify_in_process import VerifyInProcess
from test_model_inputs import fake_pb_utils, load_model  # noqa: F401  (fake_pb_utils: the autouse fixture)
from test_triton_orchestrator import PROMPTS, make_orchestrator, request, run, text_of

CONFIG = """
name: "target_verifier"
backend: "python"
parameters [
  {{ key: "target_model" value: {{ string_value: "{target}" }} }},
  {{ key: "engine" value: {{ string_value: "fast" }} }},
  {{ key: "max_num_seqs" value: {{ string_value: "3" }} }},
  {{ key: "run_in_orchestrator" value: {{ string_value: "{here}" }} }}{extra}
]
instance_group [ {group} ]
"""


def write_repository(tmp_path, target, here="true", group="{ count: 1 kind: KIND_CPU }", extra=""):
    model_dir = tmp_path / "target_verifier"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(CONFIG.format(target=target, here=here, group=group, extra=extra))
    return tmp_path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_llama):
    path = tmp_path_factory.mktemp("target")
    tiny_llama(seed=0).save_pretrained(path)
    return path


def test_the_settings_are_target_verifiers_own(tmp_path, target_dir):
    here = read_target_config(write_repository(tmp_path, target_dir))
    assert here.config.run_in_orchestrator and here.config.max_num_seqs == 3 and here.device == "cpu"
    assert here.config.target_model == str(target_dir)


@pytest.mark.parametrize("group, device", [
    ("{ count: 1 kind: KIND_GPU gpus: [ 1 ] }", "cuda:1"),
    ("{ count: 1 kind: KIND_GPU }", "cuda:0"),
    ("{ count: 1 kind: KIND_AUTO }", "cuda:0" if torch.cuda.is_available() else "cpu"),
])  # fmt: skip
def test_the_device_follows_the_instance_group(tmp_path, target_dir, group, device):
    assert read_target_config(write_repository(tmp_path, target_dir, group=group)).device == device


def test_a_misspelt_key_is_refused_naming_the_model_and_key(tmp_path, target_dir):
    extra = ',\n  { key: "run_in_orchestrater" value: { string_value: "true" } }'
    with pytest.raises(ParameterError, match="target_verifier.*run_in_orchestrater"):
        read_target_config(write_repository(tmp_path, target_dir, extra=extra))


def test_an_unreadable_config_is_refused_naming_the_file(tmp_path):
    (tmp_path / "target_verifier").mkdir()
    (tmp_path / "target_verifier" / "config.pbtxt").write_text("parameters [ { key: ")
    with pytest.raises(ParameterError, match="target_verifier: cannot read .*config.pbtxt"):
        read_target_config(tmp_path)


def test_the_target_loads_here_only_when_asked(tmp_path, target_dir):
    assert load_target_here(write_repository(tmp_path, target_dir, here="false")) is None
    loaded = load_target_here(write_repository(tmp_path, target_dir))
    assert loaded.description.vocab_size == loaded.verifier.lm.vocab_size
    assert loaded.description.max_num_seqs == 3 and loaded.description.method == "target"


class Inner:
    """The stages for everything but the target: records what reaches it."""

    def __init__(self, fail_release: bool = False):
        self.released: list[dict] = []
        self.fail_release = fail_release

    async def propose(self, requests):
        return ["proposed", len(requests)]

    async def release(self, ended):
        self.released.append(dict(ended))
        if self.fail_release:
            raise RuntimeError("draft_proposer: release failed")


def verify_requests(n: int, sampling: SamplingParams | None = None) -> list[VerifyRequest]:
    return [VerifyRequest(f"s{i}", 0, [3 + i, 4, 5], 2, sampling or SamplingParams()) for i in range(n)]


def test_verify_runs_on_one_thread_and_equals_the_verifiers_own(target_model):
    threads = []

    def judge(requests, results):
        threads.append(threading.current_thread().name)
        return results

    stages = VerifyInProcess(Inner(), TargetVerifier(CachedCausalLM(target_model)), judge)
    expected = TargetVerifier(CachedCausalLM(target_model)).verify(verify_requests(2))
    got = asyncio.run(stages.verify(verify_requests(2)))
    assert [r.argmax.tolist() for r in got] == [r.argmax.tolist() for r in expected]
    asyncio.run(stages.verify([VerifyRequest("s0", 3, [6], 1, SamplingParams())]))
    assert len(threads) == 2 and len(set(threads)) == 1 and threads[0].startswith("specdec-target")
    assert asyncio.run(stages.propose([1, 2, 3])) == ["proposed", 3]  # the wrapped stages propose
    stages.close()


def test_sampled_sequences_get_the_judges_verdict(target_model):
    def judge(requests, results):
        return [replace(result, sampled="verdict") for result in results]

    stages = VerifyInProcess(Inner(), TargetVerifier(CachedCausalLM(target_model)), judge)
    got = asyncio.run(stages.verify(verify_requests(2, SamplingParams(temperature=0.7))))
    assert [r.sampled for r in got] == ["verdict", "verdict"]
    stages.close()


@pytest.mark.parametrize("fail_release", [False, True])
def test_release_frees_the_target_and_the_wrapped_stages(target_model, fail_release):
    inner = Inner(fail_release)
    verifier = TargetVerifier(CachedCausalLM(target_model))
    stages = VerifyInProcess(inner, verifier, lambda requests, results: results)
    asyncio.run(stages.verify(verify_requests(2)))
    assert verifier.lm.num_active_sequences == 2
    ended = {"s0": [1, 2], "s1": None}
    if fail_release:
        with pytest.raises(RuntimeError, match="draft_proposer"):
            asyncio.run(stages.release(ended))
    else:
        asyncio.run(stages.release(ended))
    assert verifier.lm.num_active_sequences == 0 and inner.released == [ended]
    stages.close()


class TargetAway:
    """``LocalStages`` for everything but the target: a verify reaching them fails, their releases leave it alone."""

    def __init__(self, local):
        self.local = local

    async def tokenize(self, text, stop_words):
        return await self.local.tokenize(text, stop_words)

    async def describe(self):
        return await self.local.describe()

    async def propose(self, requests):
        return await self.local.propose(requests)

    async def verify(self, requests):
        raise AssertionError("a verify reached the wrapped stages")

    async def release(self, ended):
        for seq_id, response in ended.items():
            self.local.proposer.release(seq_id, response)


@pytest.fixture(scope="module")
def sampler_model():
    """rejection_sampler's model.py, loaded here: sampled sequences are judged as the served hop judges them."""
    return load_model("rejection_sampler")


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


# a draft model's q is held by rejection_sampler when served, not by the local stages: greedy only
@pytest.mark.parametrize("method, sampling", [("draft_model", {}), ("suffix", {}), ("suffix", SAMPLED)])
def test_the_orchestrator_serves_the_same_text_with_the_target_here(codec, models, sampler_model, method, sampling):
    """Same prompts, same seeds: the text through a target held here equals the text through the verify stage."""
    judged = []

    def send(inputs):
        judged.append(len(inputs["seq_id"]))
        return sampler_model._sample({**inputs, **wire.secret_input(boot_secret())})

    through_stage, _ = make_orchestrator(codec, models, method)
    here, local = make_orchestrator(codec, models, method)
    target = local.verifier
    judge = functools.partial(sample_hop.sample_in_sampler, send=send)
    here.stages = VerifyInProcess(TargetAway(local), target, judge)
    for prompt in PROMPTS:
        expected = text_of(run(through_stage, request(prompt, **sampling)))
        assert text_of(run(here, request(prompt, **sampling))) == expected
    assert bool(judged) == bool(sampling)  # sampled steps went to the sampler; greedy ones never did
    assert target.lm.num_active_sequences == 0  # every sequence released, on the target's thread
    here.stages.close()


from test_triton_orchestrator import codec, models  # noqa: E402,F401  (module fixtures)


def test_without_the_setting_nothing_else_is_read(tmp_path):
    """target_verifier checks its own configuration: the orchestrator does not fail its load for it."""
    assert load_target_here(tmp_path) is None  # no target_verifier directory
    assert load_target_here(write_repository(tmp_path, tmp_path / "missing", here="false")) is None
