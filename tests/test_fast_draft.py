"""DraftModelProposer on the fast engine: the hf engine's drafts and draw order, batched across sequences."""
from __future__ import annotations

import pytest
import torch

from specdec.models import CachedCausalLM
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast import FastCausalLM
from specdec.proposers.draft_model import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from test_fast_llama import random_ids, save_checkpoint
from test_fast_verifier import hf_greedy

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("draft"), seed=20, num_hidden_layers=1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("target"), seed=21)


def request(seq_id: str, token_ids: list[int], k: int, sampling=GREEDY, seed: int = 0, position=0) -> ProposeRequest:
    return ProposeRequest(seq_id, position, token_ids[position:], k, sampling, seed)


def test_greedy_proposals_equal_hf_greedy_continuation(draft):
    path, hf = draft
    proposer = DraftModelProposer(FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=64))
    seqs = {"a": random_ids(6, 21), "b": random_ids(3, 22), "c": random_ids(4, 23)}
    ks = {"a": 4, "b": 2, "c": 0}
    proposals = proposer.propose([request(s, ids, ks[s]) for s, ids in seqs.items()])
    for (s, ids), proposal in zip(seqs.items(), proposals):
        assert proposal.probs is None
        assert proposal.token_ids.tolist() == (hf_greedy(hf, ids, ks[s]) if ks[s] else []), s
    # Next round: a accepted 2 drafts then took another token (rollback), b accepted all, c joins.
    a_drafts, b_drafts = proposals[0].token_ids.tolist(), proposals[1].token_ids.tolist()
    sent = {s: len(ids) for s, ids in seqs.items()}
    seqs["a"] += a_drafts[:2] + [(a_drafts[2] + 1) % 128]
    seqs["b"] += b_drafts + [5]
    ks = {"a": 3, "b": 5, "c": 3}
    proposals = proposer.propose([request(s, ids, ks[s], position=sent[s]) for s, ids in seqs.items()])
    for (s, ids), proposal in zip(seqs.items(), proposals):
        assert proposal.token_ids.tolist() == hf_greedy(hf, ids, ks[s]), s
    assert proposer.num_active_sequences == 3


def test_sampled_proposals_are_deterministic_per_seed_and_match_generic(draft):
    path, hf = draft
    ids = {"a": random_ids(7, 24), "b": random_ids(2, 25)}

    def run(proposer, seeds):
        return proposer.propose([request(s, t, 5, SAMPLED, seeds[s]) for s, t in ids.items()])

    fast_1 = run(DraftModelProposer(FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=64)), {"a": 1, "b": 2})
    fast_2 = run(DraftModelProposer(FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=64)), {"a": 1, "b": 2})
    other = run(DraftModelProposer(FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=64)), {"a": 3, "b": 4})
    generic = run(DraftModelProposer(CachedCausalLM(hf, max_model_len=64)), {"a": 1, "b": 2})
    for p1, p2, g, o in zip(fast_1, fast_2, generic, other):
        assert torch.equal(p1.token_ids, p2.token_ids) and torch.equal(p1.probs, p2.probs)
        assert torch.equal(p1.token_ids, g.token_ids)  # same generator, same draw order
        torch.testing.assert_close(p1.probs, g.probs, atol=1e-5, rtol=0)
        assert not torch.equal(p1.token_ids, o.token_ids)
        assert p1.probs.shape == (5, 128)  # [k, vocab] q
        torch.testing.assert_close(p1.probs.sum(-1), torch.ones(5), atol=1e-5, rtol=0)
        assert (p1.probs.gather(1, p1.token_ids[:, None]) > 0).all()


def test_release_and_length_check(draft):
    path, _ = draft
    proposer = DraftModelProposer(FastCausalLM(path, dtype="float32", max_num_seqs=1, max_model_len=8))
    proposer.propose([request("s", [1, 2, 3], 2)])
    proposer.release("s")
    assert proposer.num_active_sequences == 0 and proposer.lm.num_active_sequences == 0
    proposer.propose([request("t", [1, 2, 3, 4, 5], 4)])  # 5 tokens + 3 fed drafts fill max_model_len
    with pytest.raises(ValueError, match="exceed max_model_len=8"):
        proposer.propose([request("t", [1, 2, 3, 4, 5], 5)])
    with pytest.raises(ValueError, match="token_ids is empty at position 0"):
        proposer.propose([request("u", [], 1)])
    with pytest.raises(ValueError, match="seq 't': position 6 is past the 5 tokens the proposer holds"):
        proposer.propose([request("t", [1, 2, 3, 4, 5, 6, 7], 1, position=6)])
    nothing = proposer.propose([request("t", [1, 2], 0)])  # no request drafts: no forward at all
    assert nothing[0].token_ids.shape == (0,) and nothing[0].probs is None


def test_engine_greedy_with_fast_pair_equals_hf_generate(draft, target):
    draft_path, _ = draft
    target_path, target_hf = target
    proposer = DraftModelProposer(FastCausalLM(draft_path, dtype="float32", max_num_seqs=1, max_model_len=64))
    verifier = TargetVerifier(FastCausalLM(target_path, dtype="float32", max_num_seqs=1, max_model_len=64))
    prompt = random_ids(6, 26)
    params = GenerationParams(max_tokens=16, num_speculative_tokens=3)
    out = [t for step in generate(proposer, verifier, RejectionSampler(), prompt, params) for t in step.new_token_ids]
    assert out == hf_greedy(target_hf, prompt, 16)
    assert proposer.num_active_sequences == 0 and verifier.num_active_sequences == 0


def test_engine_sampled_fast_pair_equals_generic_pair(draft, target):
    (draft_path, draft_hf), (target_path, target_hf) = draft, target
    params = GenerationParams(max_tokens=16, num_speculative_tokens=3, sampling=SamplingParams(0.9, 0, 1.0, seed=7))
    prompt = random_ids(5, 27)
    pairs = [
        (DraftModelProposer(FastCausalLM(draft_path, dtype="float32", max_num_seqs=1, max_model_len=64)),
         TargetVerifier(FastCausalLM(target_path, dtype="float32", max_num_seqs=1, max_model_len=64))),
        (DraftModelProposer(CachedCausalLM(draft_hf, max_model_len=64)), TargetVerifier(CachedCausalLM(target_hf, max_model_len=64))),
    ]
    fast, generic = (
        [t for step in generate(p, v, RejectionSampler(), prompt, params, seq_id="r") for t in step.new_token_ids]
        for p, v in pairs
    )
    assert fast == generic and len(fast) == 16


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_min_tokens_bans_reach_the_draft(draft, sampling):
    """The first num_banned_tokens drafts avoid the banned ids (q is 0 there); later ones may use them."""
    path, hf = draft
    ids = random_ids(6, 26)
    plain = DraftModelProposer(CachedCausalLM(hf, max_model_len=64)).propose([request("a", ids, 4, sampling, 3)])[0]
    banned = tuple(dict.fromkeys(plain.token_ids.tolist()[:2]))  # what the draft would propose first
    for proposer in (DraftModelProposer(FastCausalLM(path, dtype="float32", max_num_seqs=1, max_model_len=64)),
                     DraftModelProposer(CachedCausalLM(hf, max_model_len=64))):
        proposal = proposer.propose([ProposeRequest("a", 0, ids, 4, sampling, 3, num_banned_tokens=2,
                                                    banned_token_ids=banned)])[0]
        assert not set(proposal.token_ids.tolist()[:2]) & set(banned)
        if proposal.probs is not None:
            assert (proposal.probs[:2, list(banned)] == 0).all()
            assert (proposal.probs[2:].sum(-1) > 0.99).all()
