"""Suffix decoding in front of a model (``specdec.suffix_first``): routing, the model's backlog, losslessness."""
from __future__ import annotations

import asyncio
import collections

import pytest
import torch

from tiny_llama import build_tiny_llama, hf_generate_greedy
from specdec.proposers.base import Proposer
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast.runner import FastCausalLM
from specdec.heads import build_head_proposer
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, SuffixConfig
from specdec.rejection_sampler import RejectionSampler
from specdec.suffix_first import (
    MAX_BACKLOG_TOKENS, MODEL_SOURCE, SUFFIX_SOURCE, SuffixFirst, SuffixFirstConfig, SuffixFirstProposer, SuffixFirstStages, suffix_first_for,
)  # fmt: skip
from specdec.types import ModelDescription, Proposal, ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from eagle3_heads import VOCAB, pair  # noqa: F401  (pair: a 6-layer target and a random EAGLE-3 head)
from test_sampled_losslessness import NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens

LOOP = [5, 6, 7, 8, 9]  # a prompt that repeats itself: suffix decoding drafts its continuation with certainty


def request(seq_id, position, tokens, k=4, hidden=None, hidden_position=0) -> ProposeRequest:
    return ProposeRequest(seq_id, position, tokens, k, SamplingParams(), 0, hidden_states=hidden,
                          hidden_position=hidden_position)  # fmt: skip


class RecordingModel(Proposer):
    """A model proposer that drafts token 1 and records every request it is sent."""

    def __init__(self):
        self.calls: list[list[ProposeRequest]] = []

    def propose(self, requests):
        self.calls.append(requests)
        return [Proposal(torch.ones(r.num_tokens, dtype=torch.long)) for r in requests]

    def release(self, seq_id, response=None):
        pass


def counting_sources(proposer: SuffixFirstProposer) -> collections.Counter:
    """The sources of every proposal ``proposer`` makes from now on, tallied as they are made."""
    sources, propose = collections.Counter(), proposer.propose

    def counted(requests):
        proposals = propose(requests)
        sources.update(p.source for p in proposals)
        return proposals

    proposer.propose = counted
    return sources


def test_a_strong_suffix_match_is_taken_and_the_model_is_not_called():
    model = RecordingModel()
    proposer = SuffixFirstProposer(SuffixFirstConfig(min_score=2.0), model)
    [proposal] = proposer.propose([request("a", 0, LOOP * 4)])
    assert proposal.token_ids.tolist() == [5, 6, 7, 8] and proposal.probs is None
    assert proposal.source == SUFFIX_SOURCE  # what the served metrics count it under
    assert model.calls == []


def test_a_weak_match_goes_to_the_model_with_everything_it_was_not_sent():
    model = RecordingModel()
    proposer = SuffixFirstProposer(SuffixFirstConfig(min_score=2.0), model)
    features = torch.arange(30.0).view(15, 2)  # [positions, features]
    proposer.propose([request("a", 0, LOOP * 3, hidden=features[:14])])  # suffix decoding drafts: the model waits
    assert model.calls == []
    # the sequence leaves the loop: no match, so the model drafts, sent both steps' tokens and features
    [proposal] = proposer.propose([request("a", 15, [1, 2], hidden=features[14:], hidden_position=14)])
    assert proposal.token_ids.tolist() == [1, 1, 1, 1] and proposal.source == MODEL_SOURCE
    [[sent]] = model.calls
    assert (sent.position, sent.token_ids, sent.hidden_position) == (0, LOOP * 3 + [1, 2], 0)
    assert torch.equal(sent.hidden_states, features)
    # the next model request starts where this one ended
    proposer.propose([request("a", 17, [3], hidden=torch.zeros(2, 2), hidden_position=15)])
    assert (model.calls[1][0].position, model.calls[1][0].token_ids, model.calls[1][0].hidden_position) == (17, [3], 15)


def test_a_long_backlog_goes_to_the_model_even_under_a_strong_match():
    model = RecordingModel()
    proposer = SuffixFirstProposer(SuffixFirstConfig(), model)
    tokens = LOOP * (MAX_BACKLOG_TOKENS // len(LOOP) + 1)  # the bound falls within its last five
    proposer.propose([request("a", 0, tokens[:-5])])
    assert model.calls == []  # short of the bound: suffix decoding's draft
    [proposal] = proposer.propose([request("a", len(tokens) - 5, tokens[-5:])])
    assert [len(call[0].token_ids) for call in model.calls] == [len(tokens)] and proposal.token_ids.tolist() == [1] * 4


def test_a_cut_back_moves_the_models_backlog_back_with_it():
    model = RecordingModel()
    proposer = SuffixFirstProposer(SuffixFirstConfig(min_score=2.0), model)
    proposer.propose([request("a", 0, [1, 2, 3], hidden=torch.zeros(2, 2))])  # no match: the model holds 3 tokens
    proposer.propose([request("a", 1, [4, 4], hidden=torch.ones(2, 2), hidden_position=1)])  # sent again from 1
    sent = model.calls[1][0]
    assert (sent.position, sent.token_ids, sent.hidden_position) == (1, [4, 4], 1)
    assert torch.equal(sent.hidden_states, torch.ones(2, 2))


def test_a_request_planned_again_after_a_failed_call_carries_the_same_backlog():
    """The scheduler sends each request of a failed call again alone: nothing may be queued twice."""
    router = SuffixFirst(SuffixFirstConfig(min_score=2.0))
    router.plan([request("a", 0, [1, 2, 3], hidden=torch.zeros(2, 2))])
    first = router.plan([request("a", 3, [4], hidden=torch.ones(1, 2), hidden_position=2)]).to_model[0]
    again = router.plan([request("a", 3, [4], hidden=torch.ones(1, 2), hidden_position=2)]).to_model[0]
    assert (again.position, again.token_ids, again.hidden_position) == (first.position, first.token_ids, 0)
    assert torch.equal(again.hidden_states, first.hidden_states) and again.hidden_states.shape == (3, 2)


def test_the_model_drafts_at_most_its_own_number_of_tokens():
    model = RecordingModel()
    proposer = SuffixFirstProposer(SuffixFirstConfig(model_num_speculative_tokens=2), model)
    [suffix_draft] = proposer.propose([request("a", 0, LOOP * 4, k=8)])
    [model_draft] = proposer.propose([request("b", 0, [1, 2, 3], k=8)])
    assert len(suffix_draft.token_ids) == 8 and len(model_draft.token_ids) == 2


def test_the_stages_call_the_model_once_for_the_sequences_suffix_decoding_left():
    class Stages:
        def __init__(self):
            self.model, self.released = RecordingModel(), []

        async def propose(self, requests):
            return self.model.propose(requests)

        async def release(self, ended):
            self.released.append(ended)

    inner = Stages()
    stages = SuffixFirstStages(inner, SuffixFirst(SuffixFirstConfig()))
    got = asyncio.run(stages.propose([request("a", 0, LOOP * 4), request("b", 0, [1, 2, 3]), request("c", 0, [2, 2])]))
    assert [p.token_ids.tolist() for p in got] == [[5, 6, 7, 8], [1] * 4, [1] * 4]
    assert [[r.seq_id for r in call] for call in inner.model.calls] == [["b", "c"]]
    asyncio.run(stages.release({"a": None, "b": [1]}))
    assert inner.released == [{"a": None, "b": [1]}] and stages.router.num_active_sequences == 1


def test_the_description_carries_the_settings_and_builds_the_same_router():
    config = SuffixFirstConfig(SuffixConfig(max_tree_depth=12), min_score=1.5, model_num_speculative_tokens=3)
    head = ModelDescription("/m/head", 32, 64, 4, "eagle3", (1, 2, 3), config.settings())
    assert suffix_first_for(head).config == config
    assert suffix_first_for(ModelDescription("/m/head", 32, 64, 4, "eagle3", (1, 2, 3))) is None
    with pytest.raises(ValueError, match="min_score"):
        suffix_first_for(ModelDescription("/m/d", 32, 64, 4, "draft_model", settings=(("max_tree_depth", 3),)))
    with pytest.raises(ValueError, match="suffix_decoding_min_score must be > 0"):
        SuffixFirstConfig(min_score=0)


PROMPTS = [[3, 7, 1, 12, 30], LOOP * 3 + [2], [9, 9, 9, 2, 2, 2, 9, 9], list(range(1, 21)) * 2]


@pytest.mark.parametrize("model", ["eagle3", "draft_model"])
def test_greedy_output_equals_hf_generate_with_both_kinds_of_draft(pair, model):
    target, target_dir, head_dir = pair
    verifier = TargetVerifier(FastCausalLM(target_dir, max_num_seqs=2))
    inner = (build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=2) if model == "eagle3"
             else DraftModelProposer(CachedCausalLM(build_tiny_llama(seed=3, vocab_size=VOCAB, hidden_size=32))))
    proposer = SuffixFirstProposer(SuffixFirstConfig(min_score=1.0, model_num_speculative_tokens=3), inner)
    sources = counting_sources(proposer)
    for k in (2, 5):
        for prompt in PROMPTS:
            params = GenerationParams(max_tokens=24, num_speculative_tokens=k)
            out = [t for step in generate(proposer, verifier, RejectionSampler(), prompt, params) for t in step.new_token_ids]
            assert out == hf_generate_greedy(target, prompt, 24), (k, prompt)
    assert sources[SUFFIX_SOURCE] > 0 and sources[MODEL_SOURCE] > 0, "both kinds of draft must run"
    assert proposer.num_active_sequences == 0 and inner.num_active_sequences == 0 and verifier.num_active_sequences == 0


@pytest.mark.slow
def test_speculative_sampling_with_both_kinds_of_draft_matches_the_target_distribution(tiny_llama):
    """The chi-square test of ``test_sampled_losslessness``: suffix decoding's one-hot q from the
    responses before, the draft model's q where suffix decoding's draft scores low."""
    target = tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    draft = tiny_llama(seed=4, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    # suffix decoding's drafts here score about 0.3 or 0.5: 0.45 sends about a quarter of them to the model
    config = SuffixFirstConfig(SuffixConfig(max_spec_factor=4.0, min_token_prob=0.0), min_score=0.45)
    proposer = SuffixFirstProposer(config, DraftModelProposer(CachedCausalLM(draft)))
    sources = counting_sources(proposer)
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer, max_tokens=3)
    assert sources[SUFFIX_SOURCE] > 300 and sources[MODEL_SOURCE] > 300, sources
    assert 0.05 < sampler.accepted / sampler.drafted < 0.95
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_an_mlp_speculator_behind_suffix_decoding_drafts_its_n_predict_while_suffix_decoding_drafts_more(tmp_path):
    """k 5 for suffix decoding beside a speculator of 3 stages (model_num_speculative_tokens 3): exact."""
    from test_mlp_speculator import HIDDEN, N_PREDICT, PROMPTS as MLP_PROMPTS, VOCAB as MLP_VOCAB, write_speculator

    target = build_tiny_llama(seed=0, vocab_size=MLP_VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                              initializer_range=0.3)  # fmt: skip
    target.save_pretrained(tmp_path / "target")
    write_speculator(tmp_path / "head", MLP_VOCAB, HIDDEN, N_PREDICT, tie=False)
    inner = build_head_proposer("mlp_speculator", tmp_path / "head", tmp_path / "target")
    # long suffix drafts from short matches, so that some run past the speculator's stages
    suffix = SuffixConfig(max_spec_factor=4.0, min_token_prob=0.0)
    config = SuffixFirstConfig(suffix, min_score=1.0, model_num_speculative_tokens=N_PREDICT)
    proposer, verifier = SuffixFirstProposer(config, inner), TargetVerifier(CachedCausalLM(target))
    sources = counting_sources(proposer)
    planned, plan = [], proposer.router.plan
    proposer.router.plan = lambda requests: planned.append(plan(requests)) or planned[-1]
    for prompt in [*MLP_PROMPTS, [1, 2, 3, 4] * 5]:
        params = GenerationParams(max_tokens=20, num_speculative_tokens=5)
        out = [t for step in generate(proposer, verifier, RejectionSampler(), prompt, params) for t in step.new_token_ids]
        assert out == hf_generate_greedy(target, prompt, 20), prompt
    assert max(len(p.token_ids) for step in planned for p in step.from_suffix.values()) > N_PREDICT
    assert all(r.num_tokens <= N_PREDICT for step in planned for r in step.to_model) and sources[MODEL_SOURCE]
