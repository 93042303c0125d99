"""Draft-model proposer: greedy and sampled drafts, position-based requests, release, the draft check."""
from __future__ import annotations

import pytest
import torch

from specdec.engine import GenerationParams, SequenceState
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, check_draft_compatible, make_proposer
from specdec.proposers.base import Proposer
from specdec.sampling import process_logits
from specdec.types import ModelDescription, ProposeRequest, SampleResult, SamplingParams

PROMPT = [(5 * i + 11) % 256 for i in range(12)]  # [12]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)


def propose(proposer, token_ids, k, sampling=SamplingParams(), seed=0, seq_id="s", position=0):
    (proposal,) = proposer.propose([ProposeRequest(seq_id, position, list(token_ids), k, sampling, seed)])
    return proposal


def greedy_continuation(model, token_ids: list[int], k: int) -> list[int]:
    tokens = list(token_ids)
    with torch.inference_mode():
        for _ in range(k):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(token_ids) :]


def test_is_a_proposer(draft_model):
    assert isinstance(DraftModelProposer(CachedCausalLM(draft_model)), Proposer)
    assert isinstance(make_proposer("draft_model", lm=CachedCausalLM(draft_model)), DraftModelProposer)


def test_greedy_drafts_are_the_draft_models_greedy_continuation(draft_model):
    proposal = propose(DraftModelProposer(CachedCausalLM(draft_model)), PROMPT, 5)
    assert proposal.probs is None and proposal.token_ids.dtype == torch.long
    assert proposal.token_ids.tolist() == greedy_continuation(draft_model, PROMPT, 5)


def test_sampled_drafts_return_q_and_are_seeded(draft_model):
    proposal = propose(DraftModelProposer(CachedCausalLM(draft_model)), PROMPT, 4, SAMPLED, seed=123)
    drafts = proposal.token_ids.tolist()
    assert proposal.probs.shape == (4, draft_model.config.vocab_size)
    # q row i is the processed draft distribution after the prompt and drafts before i.
    with torch.inference_mode():
        logits = draft_model(torch.tensor([PROMPT + drafts[:-1]])).logits[0, -4:]  # [4, vocab]
    torch.testing.assert_close(proposal.probs, process_logits(logits, SAMPLED), atol=1e-5, rtol=0)
    assert bool((proposal.probs[torch.arange(4), proposal.token_ids] > 0).all())
    again = propose(DraftModelProposer(CachedCausalLM(draft_model)), PROMPT, 4, SAMPLED, seed=123)
    assert again.token_ids.tolist() == drafts
    others = {
        tuple(propose(DraftModelProposer(CachedCausalLM(draft_model)), PROMPT, 4, SAMPLED, seed=s).token_ids.tolist())
        for s in range(8)
    }
    assert len(others) > 1, "different seeds must give different drafts"


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_position_based_requests_draft_what_a_fresh_proposer_drafts(draft_model, sampling):
    """Driven by SequenceState (only new tokens, k = 0 steps between), every proposal equals a
    fresh proposer's given the whole sequence: accepted drafts reused, rejected ones cut back."""
    proposer = DraftModelProposer(CachedCausalLM(draft_model))
    state = SequenceState("s", PROMPT, GenerationParams(max_tokens=40, num_speculative_tokens=4, sampling=sampling))
    state.commit(None, SampleResult(torch.tensor([7]), 0))  # the prefill
    accepted_counts = iter([4, 0, 2, None, None, 1, 3, None, 2, 0, 1])  # None: a step that drafts nothing
    positions = []
    for num_accepted in accepted_counts:
        request = state.propose_request(max_drafts=0 if num_accepted is None else None)
        if request is None:
            state.commit(None, SampleResult(torch.tensor([(len(state.token_ids) * 7) % 256]), 0))
            continue
        positions.append(request.position)
        drafts = proposer.propose([request])[0]
        whole = state.token_ids
        fresh = propose(DraftModelProposer(CachedCausalLM(draft_model)), whole, request.num_tokens, sampling,
                        request.seed)  # fmt: skip
        assert drafts.token_ids.tolist() == fresh.token_ids.tolist()
        if sampling.greedy:
            assert drafts.probs is None and fresh.probs is None
        else:
            torch.testing.assert_close(drafts.probs, fresh.probs, atol=1e-5, rtol=0)
        ids = drafts.token_ids.tolist()
        own = (ids[num_accepted] + 1) % 256 if num_accepted < len(ids) else 5  # recovered, or the bonus token
        state.commit(drafts, SampleResult(torch.tensor(ids[:num_accepted] + [own]), num_accepted))
    assert positions == sorted(positions) and positions[0] == 0 and len(set(positions)) == len(positions)


def test_a_new_prompt_under_the_same_id_cuts_back_to_its_position(draft_model):
    proposer = DraftModelProposer(CachedCausalLM(draft_model))
    propose(proposer, PROMPT, 3)
    other = [1, 2, 3]
    assert propose(proposer, other, 3).token_ids.tolist() == greedy_continuation(draft_model, other, 3)
    assert propose(proposer, [], 3, position=3).token_ids.tolist() == greedy_continuation(draft_model, other, 3)


def test_a_gap_or_an_empty_sequence_is_refused_by_name(draft_model):
    proposer = DraftModelProposer(CachedCausalLM(draft_model))
    with pytest.raises(ValueError, match=r"seq 'g': position 3 is past the 0 tokens the proposer holds"):
        propose(proposer, [1, 2], 2, seq_id="g", position=3)
    with pytest.raises(ValueError, match=r"seq 'e': token_ids is empty at position 0"):
        propose(proposer, [], 2, seq_id="e")
    propose(proposer, PROMPT, 2, seq_id="g")
    with pytest.raises(ValueError, match=rf"seq 'g': position {len(PROMPT) + 1} is past the {len(PROMPT)} tokens"):
        propose(proposer, [1], 2, seq_id="g", position=len(PROMPT) + 1)
    assert propose(proposer, [9], 2, seq_id="g", position=len(PROMPT)).token_ids.numel() == 2  # refused, not lost


def test_zero_tokens_proposes_nothing_but_keeps_the_tokens(draft_model):
    proposer = DraftModelProposer(CachedCausalLM(draft_model))
    proposal = propose(proposer, PROMPT, 0)
    assert proposal.token_ids.numel() == 0 and proposer.lm.num_active_sequences == 0  # no forward ran
    assert propose(proposer, [], 3, position=len(PROMPT)).token_ids.tolist() == greedy_continuation(
        draft_model, PROMPT, 3
    )


def test_release_frees_each_sequence(draft_model):
    proposer = DraftModelProposer(CachedCausalLM(draft_model))
    propose(proposer, PROMPT, 2, seq_id="a")
    propose(proposer, PROMPT, 2, seq_id="b")
    assert proposer.num_active_sequences == 2
    proposer.release("a")
    proposer.release("b")
    proposer.release("b")
    assert proposer.num_active_sequences == 0 and proposer.lm.num_active_sequences == 0


def test_draft_vocab_mismatch_is_refused_naming_both():
    target = ModelDescription("/models/target", 256, 2048, 8, "target")
    check_draft_compatible(ModelDescription("/models/draft", 256, 2048, 8, "draft_model"), target)
    check_draft_compatible(ModelDescription("ngram", None, None, None, "ngram"), target)  # no vocabulary
    other = ModelDescription("/models/other", 128, 2048, 8, "draft_model")
    with pytest.raises(ValueError, match=r"draft model '/models/other' has vocab size 128 but target model "
                                         r"'/models/target' has vocab size 256"):  # fmt: skip
        check_draft_compatible(other, target)


def test_a_draft_holding_less_of_a_sequence_than_the_target_serves_is_refused_naming_both():
    target = ModelDescription("/models/target", 256, 4096, 8, "target")
    check_draft_compatible(ModelDescription("/models/draft", 256, 8192, 8, "draft_model"), target)
    check_draft_compatible(ModelDescription("/models/head", 256, None, 8, "mlp_speculator"), target)  # no cache
    short = ModelDescription("/models/draft", 256, 2048, 8, "draft_model")
    with pytest.raises(ValueError, match=r"draft model '/models/draft' holds 2048 tokens of a sequence but target "
                                         r"model '/models/target' serves 4096; raise draft_proposer's max_model_len"):
        check_draft_compatible(short, target)
