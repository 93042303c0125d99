"""The target and the draft loaded in the orchestrator's process: their settings read from their own
configs, their calls made on one thread, and the served text equal to the text through the stages."""
from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import replace

import pytest
import torch

from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer
from specdec.types import ProposeRequest, SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier
from specdec_triton import sample_hop, wire
from specdec_triton.internal import boot_secret
from specdec_triton.plumbing import ParameterError
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.models_here import (
    load_draft_here, load_target_here, read_draft_beside_target, read_draft_config, read_target_config,
)  # fmt: skip
from specdec_triton.in_process import StagesInProcess
from test_model_inputs import fake_pb_utils, load_model  # noqa: F401  (fake_pb_utils: the autouse fixture)
from local_orchestrator import PROMPTS, make_orchestrator, request, run, text_of

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

    stages = StagesInProcess(Inner(), TargetVerifier(CachedCausalLM(target_model)), judge)
    expected = TargetVerifier(CachedCausalLM(target_model)).verify(verify_requests(2))
    got = asyncio.run(stages.verify(verify_requests(2)))
    assert [r.argmax.tolist() for r in got] == [r.argmax.tolist() for r in expected]
    asyncio.run(stages.verify([VerifyRequest("s0", 3, [6], 1, SamplingParams())]))
    assert len(threads) == 2 and len(set(threads)) == 1 and threads[0].startswith("specdec-models")
    assert asyncio.run(stages.propose([1, 2, 3])) == ["proposed", 3]  # the wrapped stages propose
    stages.close()


def test_sampled_sequences_get_the_judges_verdict(target_model):
    def judge(requests, results):
        return [replace(result, sampled="verdict") for result in results]

    stages = StagesInProcess(Inner(), TargetVerifier(CachedCausalLM(target_model)), judge)
    got = asyncio.run(stages.verify(verify_requests(2, SamplingParams(temperature=0.7))))
    assert [r.sampled for r in got] == ["verdict", "verdict"]
    stages.close()


@pytest.mark.parametrize("fail_release", [False, True])
def test_release_frees_the_target_and_the_wrapped_stages(target_model, fail_release):
    inner = Inner(fail_release)
    verifier = TargetVerifier(CachedCausalLM(target_model))
    stages = StagesInProcess(inner, verifier, lambda requests, results: results)
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


class Away:
    """``LocalStages`` less the models held here: a call reaching one of those fails, their releases
    leave those alone."""

    def __init__(self, local, target_here: bool, draft_here: bool):
        self.local, self.target_here, self.draft_here = local, target_here, draft_here

    async def tokenize(self, text, stop_words):
        return await self.local.tokenize(text, stop_words)

    async def describe(self):
        return await self.local.describe()

    async def propose(self, requests):
        assert not self.draft_here, "a propose reached the wrapped stages"
        return await self.local.propose(requests)

    async def verify(self, requests):
        assert not self.target_here, "a verify reached the wrapped stages"
        return await self.local.verify(requests)

    async def release(self, ended):
        for seq_id, response in ended.items():
            if not self.draft_here:
                self.local.proposer.release(seq_id, response)
            if not self.target_here:
                self.local.verifier.release(seq_id)


@pytest.fixture(scope="module")
def sampler_model():
    """rejection_sampler's model.py, loaded here: sampled sequences are judged as the served hop judges them."""
    return load_model("rejection_sampler")


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


# sampled with the target away: LocalStages' verify does not judge (served, target_verifier does)
@pytest.mark.parametrize("method, sampling, here", [
    ("draft_model", {}, "target"), ("suffix", {}, "target"), ("suffix", SAMPLED, "target"),
    ("draft_model", {}, "draft"), ("draft_model", {}, "both"), ("draft_model", SAMPLED, "both"),
])  # fmt: skip
def test_the_orchestrator_serves_the_same_text_with_models_here(codec, models, sampler_model, method, sampling, here):
    """Same prompts, same seeds: the text through models held here equals the text through the stages."""
    sent = []

    def send(inputs):
        sent.append("hold" if sample_hop.is_hold(inputs) else "judge")
        return sampler_model._sample({**inputs, **wire.secret_input(boot_secret())})

    through_stages, _ = make_orchestrator(codec, models, method)
    orchestrator, local = make_orchestrator(codec, models, method)
    target_here, draft_here = here in ("target", "both"), here in ("draft", "both")
    judge, hold = (functools.partial(f, send=send) for f in (sample_hop.sample_in_sampler, sample_hop.hold_in_sampler))
    orchestrator.stages = StagesInProcess(Away(local, target_here, draft_here),
                                          *((local.verifier, judge) if target_here else (None, None)),
                                          *((local.proposer, hold) if draft_here else (None, None)))  # fmt: skip
    for prompt in PROMPTS:
        expected = text_of(run(through_stages, request(prompt, **sampling)))
        assert text_of(run(orchestrator, request(prompt, **sampling))) == expected
    # sampled steps went to the sampler (a draft model's q held there first); greedy ones never did
    assert set(sent) == (set() if not sampling else {"judge", "hold"} if method == "draft_model" else {"judge"})
    assert local.verifier.lm.num_active_sequences == 0  # every sequence released, here or through the stages
    assert local.proposer.num_active_sequences == 0
    orchestrator.stages.close()


from local_orchestrator import codec, models  # noqa: E402,F401  (module fixtures)


DRAFT_CONFIG = """
name: "draft_proposer"
backend: "python"
parameters [
  {{ key: "method" value: {{ string_value: "{method}" }} }},
  {{ key: "draft_model" value: {{ string_value: "{draft}" }} }},
  {{ key: "run_in_orchestrator" value: {{ string_value: "{here}" }} }},
  {{ key: "run_with_target" value: {{ string_value: "{beside}" }} }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def write_draft(tmp_path, draft, method="draft_model", here="true", beside="false"):
    model_dir = tmp_path / "draft_proposer"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(DRAFT_CONFIG.format(method=method, draft=draft, here=here, beside=beside))
    return tmp_path


def test_a_draft_with_the_target_goes_where_the_target_runs(tmp_path, target_dir):
    """run_with_target: target_verifier's process loads the draft, or the orchestrator's when the target runs there."""
    write_draft(tmp_path, target_dir, here="false", beside="true")
    write_repository(tmp_path, target_dir, here="false")
    assert read_draft_beside_target(tmp_path).draft_model == str(target_dir) and read_draft_config(tmp_path) is None
    write_repository(tmp_path, target_dir, here="true")
    assert read_draft_beside_target(tmp_path) is None and read_draft_config(tmp_path).config.beside_target
    write_draft(tmp_path, target_dir, method="ngram", here="false", beside="true")  # runs in the orchestrator anyway
    assert read_draft_beside_target(tmp_path) is None and read_draft_config(tmp_path) is None


def test_the_draft_loads_here_only_for_a_model_method_that_asks(tmp_path, target_dir):
    assert load_draft_here(write_draft(tmp_path, target_dir, here="false")) is None
    assert load_draft_here(tmp_path / "elsewhere") is None  # no draft_proposer directory
    for method in ("ngram", "suffix"):  # they run in the orchestrator's process anyway
        assert load_draft_here(write_draft(tmp_path, target_dir, method=method)) is None
        config = read_draft_config(write_draft(tmp_path, target_dir, method=method, here="false"))
        assert config is None
    assert "changes nothing for method 'suffix'" in DraftProposerConfig(
        "suffix", None, None, None, "auto", "fast", 8, run_in_orchestrator=True).unread_settings()[0]  # fmt: skip
    here = read_draft_config(write_draft(tmp_path, target_dir))
    assert here.config.method == "draft_model" and here.config.draft_model == str(target_dir) and here.device == "cpu"
    loaded = load_draft_here(write_draft(tmp_path, target_dir))
    assert isinstance(loaded.proposer, DraftModelProposer) and loaded.description.method == "draft_model"
    assert loaded.description.model == str(target_dir)


def test_propose_and_verify_share_one_thread_and_release_frees_both(target_model, draft_model):
    threads = []

    def on_thread(requests, results):
        threads.append(threading.current_thread().name)
        return results

    inner = Inner()
    proposer, verifier = DraftModelProposer(CachedCausalLM(draft_model)), TargetVerifier(CachedCausalLM(target_model))
    stages = StagesInProcess(inner, verifier, on_thread, proposer, on_thread)
    [proposal] = asyncio.run(stages.propose([ProposeRequest("s0", 0, [3, 4, 5], 2, SamplingParams(), 0)]))
    assert len(proposal.token_ids) == 2
    asyncio.run(stages.verify(verify_requests(1)))
    assert len(threads) == 2 and len(set(threads)) == 1
    asyncio.run(stages.release({"s0": [7]}))
    assert proposer.num_active_sequences == 0 and verifier.lm.num_active_sequences == 0
    assert inner.released == [{"s0": [7]}]  # the wrapped stages hear of it too (tokenizer-side state, metrics)
    with pytest.raises(ValueError, match="a verifier here needs its judge"):
        StagesInProcess(inner, verifier)
    stages.close()


def test_without_the_setting_nothing_else_is_read(tmp_path):
    """target_verifier checks its own configuration: the orchestrator does not fail its load for it."""
    assert load_target_here(tmp_path) is None  # no target_verifier directory
    assert load_target_here(write_repository(tmp_path, tmp_path / "missing", here="false")) is None


def test_a_draft_trained_for_fewer_positions_than_its_window_is_refused_with_the_fix():
    """The window often comes from target_verifier: the message says to lower that, not the draft's own."""
    import re
    from pathlib import Path

    from specdec_triton.models_here import build_proposer

    draft = str(Path(__file__).resolve().parents[1] / "models" / "tiny-draft")
    config = DraftProposerConfig(method="draft_model", draft_model=draft, prompt_lookup_min=None,
                                 prompt_lookup_max=None, dtype="float32", engine="fast", max_num_seqs=1,
                                 max_model_len=4096)  # fmt: skip
    with pytest.raises(ValueError, match=rf"draft model '{re.escape(draft)}' has max_position_embeddings 2048 but "
                                         r"would hold 4096 tokens .* lower target_verifier's max_model_len to at most "
                                         r"2048"):  # fmt: skip
        build_proposer(config, "cpu")
    assert build_proposer(replace(config, max_model_len=2048), "cpu").description.max_model_len == 2048
