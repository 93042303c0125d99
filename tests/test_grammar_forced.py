"""Tokens the grammar forces are drafted (``GrammarState.forced_after``): always accepted, output unchanged.

Where the grammar allows a single next token, that token is drafted after the drafter's
allowed drafts with a one-hot ``q``, up to the step's k. Greedy output must equal k = 0's
with the same guide; a drafter that never drafts then still gets every forced token
accepted.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_grammar import (  # noqa: F401 (fixtures)
    EOS, ID, MAX_TOKENS, NUM_SAMPLES, PROMPTS, SCHEMAS, VOCAB, compiler, constrained_pvalue, decode, sampled_pair,
    small_compiler,
)

from specdec.proposers.base import Proposer
from specdec.engine import GenerationParams, SequenceState
from specdec.generate import generate
from specdec.grammar import GrammarState
from specdec.models import CachedCausalLM
from specdec.rejection_sampler import RejectionSampler
from specdec.types import Proposal, SamplingParams
from specdec.verifier import TargetVerifier

pytest.importorskip("xgrammar")


class NoDrafts(Proposer):
    """A drafter that never drafts: what a step verifies beyond its first token is what the grammar forced."""

    def propose(self, requests):
        return [Proposal(torch.empty(0, dtype=torch.long)) for _ in requests]

    def release(self, seq_id, response=None):
        pass


def test_the_forced_tokens_are_each_the_one_the_mask_allows_and_the_matcher_rolls_back(small_compiler):
    state = GrammarState(small_compiler.compile("regex", "x[ab]yc"), (EOS,))
    assert state.forced_after([], 4) == [ID["x"]]  # then a or b (or ab): a choice ends the run
    assert state.forced_after([ID["x"], ID["a"]], 4) == [ID["y"], ID["c"]]
    assert state.forced_after([ID["x"], ID["a"]], 1) == [ID["y"]]  # at most max_tokens
    assert state.forced_after([ID["x"], ID["z"]], 4) == []  # after a forbidden draft: nothing
    state.accept([ID["x"]])  # every call rolled the matcher back to the committed tokens
    assert state.allowed_drafts([ID["b"], ID["y"]]) == [0, 1]


def sequence(small_compiler, guide: str, sampling=SamplingParams()) -> SequenceState:
    params = GenerationParams(max_tokens=16, num_speculative_tokens=4, eos_token_ids=(EOS,), sampling=sampling,
                              grammar=small_compiler.compile("regex", guide))  # fmt: skip
    return SequenceState("s", [ID["z"]], params)


def test_a_chain_cut_at_a_forbidden_draft_goes_on_with_the_forced_tokens(small_compiler):
    state = sequence(small_compiler, "xay[ab]")
    proposal = state.constrain(Proposal(torch.tensor([ID["x"], ID["b"], ID["y"]])), 4)  # b is forbidden
    assert proposal.token_ids.tolist() == [ID["x"], ID["a"], ID["y"]]  # then a or b: a choice
    only_forced = state.constrain(None, 2)
    assert only_forced.token_ids.tolist() == [ID["x"], ID["a"]] and only_forced.probs is None
    assert state.constrain(None, 0) is None  # a step that drafts nothing verifies nothing more


def test_drafts_sampled_from_q_get_one_hot_rows_and_a_forbidden_one_stays_last(small_compiler):
    state = sequence(small_compiler, "xay[ab]", SamplingParams(temperature=1.0, seed=3))
    q = torch.full((1, len(VOCAB)), 1.0 / len(VOCAB))  # [1, vocab]
    extended = state.constrain(Proposal(torch.tensor([ID["x"]]), probs=q), 3)
    assert extended.token_ids.tolist() == [ID["x"], ID["a"], ID["y"]]
    assert torch.equal(extended.probs[0], q[0]) and extended.probs[1:].argmax(-1).tolist() == [ID["a"], ID["y"]]
    assert extended.probs[1:].sum(-1).tolist() == [1.0, 1.0]
    rejected = state.constrain(Proposal(torch.tensor([ID["b"]]), probs=q), 3)  # to be rejected: nothing after it
    assert rejected.token_ids.tolist() == [ID["b"]]


@pytest.mark.parametrize("name", ["nested", "enum"])
def test_greedy_output_with_forced_drafts_alone_equals_k0_and_each_is_accepted(name, shipped_pair, compiler):
    grammar = compiler.compile("json_schema", json.dumps(SCHEMAS[name]))
    tokenizer = shipped_pair.tokenizer
    for prompt in PROMPTS[:2]:
        plain, reason, _ = decode(shipped_pair, prompt, grammar, 0)
        params = GenerationParams(max_tokens=MAX_TOKENS, num_speculative_tokens=4, grammar=grammar,
                                  eos_token_ids=(tokenizer.eos_token_id,))  # fmt: skip
        out = []
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        verifier = TargetVerifier(CachedCausalLM(shipped_pair.target))
        for step in generate(NoDrafts(), verifier, RejectionSampler(), prompt_ids, params):
            out += step.new_token_ids
        assert out == plain and step.finish_reason == reason
        stats = step.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens, stats


@pytest.mark.slow
def test_sampled_output_with_forced_drafts_follows_the_masked_target(sampled_pair, small_compiler):
    """Sampled drafts from q, then the forced x with a one-hot row: the chi-square test of ``test_grammar``."""
    grammar = small_compiler.compile("regex", "[ab]x[0-3]y?")
    assert GrammarState(grammar, (EOS,)).forced_after([ID["a"]], 3) == [ID["x"]]
    assert constrained_pvalue(*sampled_pair, grammar, NUM_SAMPLES) > 1e-3
