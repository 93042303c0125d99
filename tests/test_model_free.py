"""Model-free proposers described by their settings and rebuilt from them (specdec.proposers.model_free),
and the stages that run such a proposer in the caller's process (specdec.propose_in_process)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from specdec.propose_in_process import ProposeInProcess
from specdec.scheduler import StepCapabilities
from specdec.proposers import (
    NgramProposer, SuffixConfig, SuffixProposer, describe_model_free, model_free_proposer,
)  # fmt: skip
from specdec.types import ModelDescription, ProposeRequest, SamplingParams


@pytest.mark.parametrize("proposer", [NgramProposer(2, 4), SuffixProposer(SuffixConfig(max_tree_depth=9, min_token_prob=0.25))])
def test_a_description_rebuilds_the_same_proposer(proposer):
    description = describe_model_free(proposer)
    assert description.method in ("ngram", "suffix") and description.vocab_size is None
    rebuilt = model_free_proposer(description)
    assert type(rebuilt) is type(proposer) and rebuilt.config == proposer.config and rebuilt is not proposer


def test_a_method_that_runs_a_model_is_not_rebuilt():
    assert model_free_proposer(ModelDescription("/models/draft", 4096, 2048, 8, "draft_model")) is None


@pytest.mark.parametrize("settings, shown", [((), r"\[\]"), ((("prompt_lookup_min", 2),), r"\['prompt_lookup_min'\]"),
                                              ((("prompt_lookup_min", 2), ("prompt_lookup_max", 3), ("n", 1)), "'n'")])
def test_settings_that_are_not_the_methods_are_refused_naming_it(settings, shown):
    description = replace(describe_model_free(NgramProposer()), settings=settings)
    with pytest.raises(ValueError, match=rf"method 'ngram' was described with settings .*{shown}"):
        model_free_proposer(description)


def test_invalid_values_are_refused_as_the_config_refuses_them():
    description = replace(describe_model_free(NgramProposer()), settings=(("prompt_lookup_min", 4), ("prompt_lookup_max", 2)))
    with pytest.raises(ValueError, match="prompt_lookup_min .4. must be <= prompt_lookup_max .2."):
        model_free_proposer(description)


class RecordingStages:
    capabilities = StepCapabilities()

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    async def propose(self, requests):
        raise AssertionError("a proposal must not leave the process")

    async def verify(self, requests):
        self.calls.append(("verify", len(requests)))
        return ["verified"] * len(requests)

    async def sample(self, calls):
        self.calls.append(("sample", len(calls)))
        return ["sampled"] * len(calls)

    async def release(self, ended):
        self.calls.append(("release", dict(ended)))


def test_stages_propose_here_and_pass_the_rest_on_with_every_release():
    stages, seen = RecordingStages(), []
    here = ProposeInProcess(stages, SuffixProposer(), on_release=lambda p: seen.append(p.stats().cached_responses))
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    request = ProposeRequest("a", 0, tokens, 3, SamplingParams(), seed=0)
    (proposal,) = asyncio.run(here.propose([request]))
    assert proposal.token_ids.tolist() == [3, 1, 2] and proposal.probs is None
    assert asyncio.run(here.verify([object()])) == ["verified"]
    assert asyncio.run(here.sample([object(), object()])) == ["sampled", "sampled"]
    asyncio.run(here.release({"a": [7, 8, 9], "b": None}))
    assert here.proposer.num_active_sequences == 0
    assert seen == [1]  # the completed response joined the global tree; the cancelled one did not
    assert stages.calls == [("verify", 1), ("sample", 2), ("release", {"a": [7, 8, 9], "b": None})]
