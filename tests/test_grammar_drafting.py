"""Drafting under the grammar: a model drafter beside the grammar masks its ``q`` by it (``specdec.grammar``).

Each shipped drafter, greedy and sampled, under the shipped JSON schemas: every draft it makes
is one the grammar allows after the drafts before it (so none is cut before verification),
every ``q`` row puts no mass on a forbidden token, greedy output still equals k = 0's with the
same guide, and the drafts pass more often than when the same drafter drafts freely. The
chi-square tests of both ways are in ``test_grammar.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_grammar import PROMPTS, SCHEMAS, compiler, decode  # noqa: F401 (fixtures)

from specdec.proposers.base import Proposer
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.grammar import allowed_bool
from specdec.heads import build_head_proposer
from specdec.models import CachedCausalLM, load_causal_lm
from specdec.proposers import DraftModelProposer, ParallelDraftProposer, read_mask_token
from specdec.rejection_sampler import RejectionSampler
from specdec.types import SamplingParams
from specdec.verifier import TargetVerifier

pytest.importorskip("xgrammar")

MODELS = Path(__file__).resolve().parents[1] / "models"
DRAFTERS = ["draft_model", "draft_model+parallel", "eagle3", "eagle3+parallel", "mtp", "dflash", "medusa", "mlp_speculator"]
HEAD_DIRS = {"eagle3": "tiny-eagle3", "dflash": "tiny-dflash", "medusa": "tiny-medusa", "mlp_speculator": "tiny-mlp-speculator"}
K = 3  # within every shipped head's n_predict / num_heads
MAX_TOKENS = 40


def build(method: str, shipped_pair):
    if method == "draft_model":
        return DraftModelProposer(CachedCausalLM(shipped_pair.draft))
    if method == "draft_model+parallel":
        path = MODELS / "tiny-draft-pard"
        return ParallelDraftProposer(CachedCausalLM(load_causal_lm(path, dtype="float32")), read_mask_token(path))
    if method == "eagle3+parallel":  # P-EAGLE: a step's drafts from one head pass, picked one by one under the grammar
        return build_head_proposer("eagle3", MODELS / "tiny-peagle", MODELS / "tiny-target", max_num_seqs=1,
                                   parallel_drafting=True)  # fmt: skip
    path = MODELS / ("tiny-target" if method == "mtp" else HEAD_DIRS[method])
    return build_head_proposer(method, path, MODELS / "tiny-target", max_num_seqs=1)


class Checked(Proposer):
    """The drafter, with each proposal checked against the request's grammar as the drafter saw it."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.hidden_state_layers = proposer.hidden_state_layers
        self.drafted = 0

    def propose(self, requests):
        proposals = self.proposer.propose(requests)
        for request, proposal in zip(requests, proposals):
            drafts = proposal.token_ids.tolist()
            self.drafted += len(drafts)
            assert request.guide is not None
            stops = [j for j, token in enumerate(drafts) if token in request.guide.stop_token_ids]
            reached = stops[0] + 1 if stops else len(drafts)  # those after a stop token are cut: the output ends there
            assert request.guide.allowed_drafts(drafts) == list(range(reached)), drafts  # none cut before it
            for j in range(reached if proposal.probs is not None else 0):
                allowed = allowed_bool(request.guide.allowed_after(drafts[:j]), proposal.probs.shape[1])[0]  # [vocab]
                assert float(proposal.probs[j][~allowed].sum()) == 0.0, f"q row {j} has mass the grammar forbids"
        return proposals

    def release(self, seq_id, response=None):
        self.proposer.release(seq_id, response)


def run(proposer, pair, prompt, grammar, sampling, under_grammar=True):
    prompt_ids = pair.tokenizer(prompt, add_special_tokens=False).input_ids
    params = GenerationParams(max_tokens=MAX_TOKENS, num_speculative_tokens=K, sampling=sampling,
                              eos_token_ids=(pair.tokenizer.eos_token_id,), grammar=grammar)  # fmt: skip
    verifier = TargetVerifier(CachedCausalLM(pair.target))
    out = []
    for step in generate(proposer, verifier, RejectionSampler(), prompt_ids, params, drafts_under_grammar=under_grammar):
        out += step.new_token_ids
    return out, step.stats


@pytest.mark.parametrize("method", DRAFTERS)
def test_every_model_drafter_drafts_only_what_the_grammar_allows(method, shipped_pair, compiler):
    checked = Checked(build(method, shipped_pair))
    for name in ("nested", "enum", "pattern"):
        grammar = compiler.compile("json_schema", json.dumps(SCHEMAS[name]))
        plain, _, _ = decode(shipped_pair, PROMPTS[0], grammar, 0)
        greedy, _ = run(checked, shipped_pair, PROMPTS[0], grammar, SamplingParams())
        assert greedy == plain, name
        run(checked, shipped_pair, PROMPTS[0], grammar, SamplingParams(temperature=1.0, seed=7))
    assert checked.drafted > 0


def test_drafting_under_the_grammar_accepts_more_tokens_per_step_than_drafting_freely(shipped_pair, compiler):
    """The draft model, greedy, over every schema and prompt. Per step, not per draft: a free draft the
    grammar forbids is cut before verification and never counted, while a guided drafter drafts its best
    allowed token in its place, which passes less often than the drafts it would have kept anyway."""
    proposer = DraftModelProposer(CachedCausalLM(shipped_pair.draft))
    per_step = {}
    for under_grammar in (True, False):
        steps = accepted = 0
        for name in sorted(SCHEMAS):
            grammar = compiler.compile("json_schema", json.dumps(SCHEMAS[name]))
            for prompt in PROMPTS:
                _, stats = run(proposer, shipped_pair, prompt, grammar, SamplingParams(), under_grammar)
                steps, accepted = steps + stats.num_steps, accepted + stats.num_accepted_tokens
        per_step[under_grammar] = accepted / steps
    assert per_step[True] > per_step[False], per_step
