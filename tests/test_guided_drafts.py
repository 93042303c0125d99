"""A drafter in its own process follows a copy of each request's grammar (``specdec.guided_drafts``).

Served, draft_proposer gets a sequence's guide as text with its first propose request
(``guide_spec``, over the wire) and drafts under its own matcher. Here the requests cross
the same wire functions as served: the drafts it makes are all allowed by the scheduler's
grammar (none cut), greedy output equals k = 0's, and a copy that cannot follow its
sequence, or a guide that does not compile there, leaves the drafter drafting freely.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_grammar import PROMPTS, SCHEMAS, compiler, decode  # noqa: F401 (fixtures)

from specdec.proposers.base import Proposer
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.grammar import GrammarState
from specdec.guided_drafts import GuidedDrafts
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.types import GuideSpec, Proposal, ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from specdec_triton import wire

pytest.importorskip("xgrammar")


class OverTheWire(Proposer):
    """The scheduler's side of draft_proposer: each request encoded and decoded as served (no live guide crosses)."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.drafted = self.guided = 0

    def propose(self, requests):
        assert all(r.guide is None for r in requests)  # the scheduler's grammar stays in its process
        received = wire.propose_requests_of(wire.propose_inputs(requests))
        proposals = self.proposer.propose(received)
        self.drafted += sum(len(p.token_ids) for p in proposals)
        return proposals

    def release(self, seq_id, response=None):
        self.proposer.release(seq_id, response)


class Recorded(Proposer):
    """The drafter behind ``GuidedDrafts``: counts the requests that reached it with a guide."""

    def __init__(self, proposer, wired):
        self.proposer, self.wired = proposer, wired
        self.num_active_sequences = 0
        self.guides: list[object] = []

    def propose(self, requests):
        self.guides += [r.guide for r in requests]
        self.wired.guided += sum(r.guide is not None for r in requests)
        return self.proposer.propose(requests)

    def release(self, seq_id, response=None):
        self.proposer.release(seq_id, response)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_drafts_made_under_the_copy_are_never_cut_and_greedy_output_is_k0s(shipped_pair, compiler, sampling, monkeypatch):
    cuts = []  # (drafts, kept) of each cut the scheduler's grammar made
    allowed_drafts = GrammarState.allowed_drafts

    def recorded(self, drafts, parents=None, keep_first_forbidden=False):
        kept = allowed_drafts(self, drafts, parents, keep_first_forbidden)
        cuts.append((list(drafts), kept, self.stop_token_ids))
        return kept

    monkeypatch.setattr(GrammarState, "allowed_drafts", recorded)
    for name in ("nested", "enum", "pattern"):
        grammar = compiler.compile("json_schema", json.dumps(SCHEMAS[name]))
        wired = OverTheWire(None)
        wired.proposer = GuidedDrafts(Recorded(DraftModelProposer(CachedCausalLM(shipped_pair.draft)), wired), lambda: compiler)
        prompt_ids = shipped_pair.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
        params = GenerationParams(max_tokens=40, num_speculative_tokens=3, sampling=sampling, grammar=grammar,
                                  eos_token_ids=(shipped_pair.tokenizer.eos_token_id,))  # fmt: skip
        out, drafted = [], 0
        for step in generate(wired, TargetVerifier(CachedCausalLM(shipped_pair.target)), RejectionSampler(), prompt_ids,
                             params, drafts_under_grammar=False):  # fmt: skip
            out += step.new_token_ids
            drafted = step.stats.num_draft_tokens if step.stats else drafted
        assert wired.guided > 0 and drafted > 0
        if sampling.greedy:
            assert out == decode(shipped_pair, PROMPTS[0], grammar, 0)[0], name
    assert len(cuts) > 10
    for drafts, kept, stops in cuts:  # every draft reaches verification, but those after a stop token
        reached = next((j + 1 for j, token in enumerate(drafts) if token in stops), len(drafts))
        assert kept == list(range(reached)), drafts


class Fake(Proposer):
    num_active_sequences = 0

    def __init__(self):
        self.guides = []

    def propose(self, requests):
        self.guides += [r.guide for r in requests]
        return [Proposal(torch.empty(0, dtype=torch.long)) for _ in requests]

    def release(self, seq_id, response=None):
        pass


def ask(seq_id, position, token_ids, spec=None):
    return ProposeRequest(seq_id, position, token_ids, 2, SamplingParams(), 0, guide_spec=spec)


def test_a_copy_that_cannot_follow_its_sequence_or_a_guide_that_does_not_compile_drafts_freely(compiler):
    fake, logged = Fake(), []
    drafts = GuidedDrafts(fake, lambda: compiler, log=logged.append)
    spec = GuideSpec("regex", "[ab]+", 2, ())
    drafts.propose([ask("s", 0, [5, 6], spec)])  # the prompt: two tokens, no output yet
    a, b = compiler.tokenizer_info.decoded_vocab.index(b"a"), compiler.tokenizer_info.decoded_vocab.index(b"b")
    drafts.propose([ask("s", 2, [a, b])])  # the output goes on: the copy takes it
    assert fake.guides[0] is not None and fake.guides[1] is fake.guides[0]
    drafts.propose([ask("s", 3, [a])])  # cut back below what the copy took: it is dropped
    drafts.propose([ask("s", 4, [a])])
    assert fake.guides[2:] == [None, None]
    drafts.propose([ask("s", 0, [5, 6, a], spec)])  # started again at position 0: a new copy
    assert fake.guides[-1] is not None
    drafts.release("s")
    drafts.propose([ask("t", 0, [5], GuideSpec("regex", "[a-", 1, ()))])
    assert fake.guides[-1] is None and "seq 't' drafts without its grammar: regex guide does not compile" in logged[0]
