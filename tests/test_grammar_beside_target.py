"""Structured output beside the target: the drafter follows a copy of the grammar, which masks the rows after it.

The scheduler sends a grammar request's verify call row 0's mask alone; ``DraftBesideTarget``
drafts under its copy (``specdec.guided_drafts``) and masks the rows after the drafts with
it. Greedy output must equal k = 0's under the same grammar, with drafts accepted; without a
compiler (or a copy whose row 0 is not the caller's) the drafts are dropped, and the output is
still k = 0's.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_draft_beside_target import (  # noqa: F401 (models: a fixture)
    NUM_NEW_TOKENS, VOCAB, BesideStages, SeparateStages, build, decode, models,
)

from specdec.draft_beside_target import DraftBesideTarget
from specdec.engine import GenerationParams
from specdec.grammar import GrammarCompiler

xgrammar = pytest.importorskip("xgrammar")

K = 4
TOKENS = [chr(ord("a") + i) for i in range(26)] + ["0", "1", "2", "3", "4", "<eos>"]  # one per id of VOCAB
EOS = len(TOKENS) - 1
GUIDE = "[a-h]{2,6}(0|1)[a-d]{1,8}"


@pytest.fixture(scope="module")
def compiler():
    assert len(TOKENS) == VOCAB
    return GrammarCompiler(xgrammar.TokenizerInfo(TOKENS, vocab_size=VOCAB, stop_token_ids=[EOS]), VOCAB)


def params_under(compiler, k, guide=GUIDE):
    grammar = compiler.compile("regex", guide)
    return lambda i: GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=k, eos_token_ids=(EOS,),
                                      grammar=grammar)  # fmt: skip


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "dflash"])
def test_greedy_output_under_a_grammar_beside_the_target_equals_k0s(models, compiler, method):
    proposer, verifier, layers = build(models, method)
    plain = decode(SeparateStages(proposer, verifier), layers, params_under(compiler, 0), rows_stay=False)
    proposer, verifier, layers = build(models, method)
    beside = DraftBesideTarget(verifier, proposer, layers, grammar_compiler=lambda: compiler)
    guided = decode(BesideStages(beside), layers, params_under(compiler, K), rows_stay=True)
    assert [out for out, _ in guided] == [out for out, _ in plain], method
    assert sum(accepted for _, accepted in guided) > 0
    proposer, verifier, layers = build(models, method)
    unguided = decode(BesideStages(DraftBesideTarget(verifier, proposer, layers)), layers, params_under(compiler, K),
                      rows_stay=True)  # fmt: skip
    assert unguided == [(out, 0) for out, _ in plain]  # no copy here: the drafts were dropped


class WrongRow0(BesideStages):
    """Row 0's mask as the caller sends it without "a", which ``[a-h]+`` allows everywhere: no longer the copy's."""

    async def propose_and_verify(self, steps):
        self.asked = getattr(self, "asked", 0) + sum(s.propose is not None for s in steps)
        flipped = []
        for s in steps:
            masks = s.verify.allowed_tokens.clone()
            masks[0, 0] &= ~1  # the target then emits what the grammar allows still
            flipped.append(replace(s, verify=replace(s.verify, allowed_tokens=masks)))
        return await super().propose_and_verify(flipped)


def test_a_copy_whose_row_0_is_not_the_callers_has_its_drafts_dropped(models, compiler):
    proposer, verifier, layers = build(models, "draft_model")
    stages = WrongRow0(DraftBesideTarget(verifier, proposer, layers, grammar_compiler=lambda: compiler))
    outputs = decode(stages, layers, params_under(compiler, K, "[a-h]+"), rows_stay=True)
    assert stages.asked > 0 and all(accepted == 0 for _, accepted in outputs)
