"""Draft-model proposer: greedy and sampled drafts, common-prefix cache reuse, release, vocab check."""
from __future__ import annotations

import pytest
import torch

from specdec.proposers import DraftModelProposer, check_vocab_compatible, make_proposer
from specdec.proposers.base import Proposer
from specdec.sampling import process_logits
from specdec.types import ProposeRequest, SamplingParams

PROMPT = [(5 * i + 11) % 256 for i in range(12)]  # [12]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)


def propose(proposer, token_ids, k, sampling=SamplingParams(), seed=0, seq_id="s"):
    (proposal,) = proposer.propose([ProposeRequest(seq_id, list(token_ids), k, sampling, seed)])
    return proposal


def greedy_continuation(model, token_ids: list[int], k: int) -> list[int]:
    tokens = list(token_ids)
    with torch.inference_mode():
        for _ in range(k):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(token_ids) :]


def test_is_a_proposer(draft_model):
    assert isinstance(DraftModelProposer(draft_model), Proposer)
    assert isinstance(make_proposer("draft_model", model=draft_model), DraftModelProposer)


def test_greedy_drafts_are_the_draft_models_greedy_continuation(draft_model):
    proposal = propose(DraftModelProposer(draft_model), PROMPT, 5)
    assert proposal.probs is None and proposal.token_ids.dtype == torch.long
    assert proposal.token_ids.tolist() == greedy_continuation(draft_model, PROMPT, 5)


def test_sampled_drafts_return_q_and_are_seeded(draft_model):
    proposer = DraftModelProposer(draft_model)
    proposal = propose(proposer, PROMPT, 4, SAMPLED, seed=123)
    drafts = proposal.token_ids.tolist()
    assert proposal.probs.shape == (4, draft_model.config.vocab_size)
    # q row i is the processed draft distribution after the prompt and drafts before i.
    with torch.inference_mode():
        logits = draft_model(torch.tensor([PROMPT + drafts[:-1]])).logits[0, -4:]  # [4, vocab]
    torch.testing.assert_close(proposal.probs, process_logits(logits, SAMPLED), atol=1e-5, rtol=0)
    assert bool((proposal.probs[torch.arange(4), proposal.token_ids] > 0).all())
    assert propose(DraftModelProposer(draft_model), PROMPT, 4, SAMPLED, seed=123).token_ids.tolist() == drafts
    others = {tuple(propose(proposer, PROMPT, 4, SAMPLED, seed=s).token_ids.tolist()) for s in range(8)}
    assert len(others) > 1, "different seeds must give different drafts"


def test_cache_rolls_back_to_the_common_prefix(draft_model):
    proposer = DraftModelProposer(draft_model)
    first = propose(proposer, PROMPT, 4).token_ids.tolist()
    # The target accepted two drafts and then emitted a token of its own.
    recovered = (first[2] + 1) % 256
    sequence = PROMPT + first[:2] + [recovered]
    reused = propose(proposer, sequence, 4, SAMPLED, seed=7)
    fresh = propose(DraftModelProposer(draft_model), sequence, 4, SAMPLED, seed=7)
    assert reused.token_ids.tolist() == fresh.token_ids.tolist()
    torch.testing.assert_close(reused.probs, fresh.probs, atol=1e-5, rtol=0)
    # A shorter, diverging sequence (a new prompt under the same id) also rolls back.
    other = [1, 2, 3]
    assert propose(proposer, other, 3).token_ids.tolist() == greedy_continuation(draft_model, other, 3)
    # The same sequence again: everything but the last token is cached, nothing breaks.
    assert propose(proposer, other, 3).token_ids.tolist() == greedy_continuation(draft_model, other, 3)


def test_zero_tokens_proposes_nothing(draft_model):
    proposer = DraftModelProposer(draft_model)
    proposal = propose(proposer, PROMPT, 0)
    assert proposal.token_ids.numel() == 0 and proposer.num_active_sequences == 0


def test_release_frees_each_sequence(draft_model):
    proposer = DraftModelProposer(draft_model)
    propose(proposer, PROMPT, 2, seq_id="a")
    propose(proposer, PROMPT, 2, seq_id="b")
    assert proposer.num_active_sequences == 2
    proposer.release("a")
    proposer.release("b")
    proposer.release("b")
    assert proposer.num_active_sequences == 0


def test_vocab_mismatch_is_reported(target_model, draft_model, tiny_llama):
    check_vocab_compatible(draft_model, target_model)
    other = tiny_llama(seed=2, vocab_size=128, hidden_size=16, num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft model vocab size 128 != target model vocab size 256"):
        check_vocab_compatible(other, target_model)
