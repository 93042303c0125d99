"""EAGLE-3 drafting trees (static and EAGLE-2's dynamic) with the shipped head: the target's own output."""
from __future__ import annotations

from pathlib import Path

import pytest
from eagle3_heads import greedy_drafts

from specdec.cached_lm import ForwardCall
from specdec.engine import GenerationParams
from specdec.fast import FastCausalLM
from specdec.generate import generate
from specdec.heads.compiled_tree import CompiledGreedyTree
from specdec.heads import build_head_proposer
from specdec.rejection_sampler import RejectionSampler
from specdec.tree import DynamicTree, parse_token_tree
from specdec.types import SamplingParams
from specdec.verifier import TargetVerifier

MODELS = Path(__file__).resolve().parents[1] / "models"
PROMPTS = [[5, 300, 41, 9, 77, 1200, 15], [88, 12, 2000, 4, 61, 63, 65, 67, 69]]
SHAPES = {
    "static": (parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"), 6),
    "dynamic": (DynamicTree(topk=2, depth=4), 6),
}


@pytest.fixture(scope="module")
def verifier():
    return TargetVerifier(FastCausalLM(MODELS / "tiny-target", max_num_seqs=2, max_model_len=256))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=11)])
def test_a_tree_of_the_head_emits_k0s_tokens(verifier, shape, sampling):
    tree, k = SHAPES[shape]
    proposer = build_head_proposer("eagle3", MODELS / "tiny-eagle3", MODELS / "tiny-target", max_num_seqs=2, tree=tree)
    sampler, accepted = RejectionSampler(), 0
    for prompt in PROMPTS:
        plain = GenerationParams(max_tokens=40, sampling=sampling)
        reference = [t for out in generate(None, verifier, sampler, prompt, plain) for t in out.new_token_ids]
        steps = list(generate(proposer, verifier, sampler, prompt,
                              GenerationParams(max_tokens=40, sampling=sampling, num_speculative_tokens=k)))
        assert [t for out in steps for t in out.new_token_ids] == reference
        accepted += steps[-1].stats.num_accepted_tokens
    assert accepted > 0


def test_a_dynamic_tree_is_at_most_k_nodes_parents_first_and_varies_by_step(verifier):
    proposer = build_head_proposer("eagle3", MODELS / "tiny-eagle3", MODELS / "tiny-target", max_num_seqs=2,
                                   tree=DynamicTree(topk=3, depth=3))  # fmt: skip
    proposals, propose = [], proposer.propose
    proposer.propose = lambda requests: proposals.extend(propose(requests)) or proposals[-len(requests):]
    list(generate(proposer, verifier, RejectionSampler(), PROMPTS[0], GenerationParams(max_tokens=30,
                                                                                       num_speculative_tokens=7)))
    assert proposals
    for proposal in proposals:
        parents = proposal.parents
        assert len(parents) == len(proposal.token_ids) <= 7
        assert all(-1 <= p < i for i, p in enumerate(parents))
        assert len(set(zip(parents, proposal.token_ids.tolist()))) == len(parents)  # siblings distinct
    assert len({p.parents for p in proposals}) > 1  # the shape follows the head's confidence


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_a_tree_cut_to_a_chain_drafts_the_chain_when_greedy(verifier, sampling):
    """A loaded step asks 3 of the tree's 6 nodes: greedy, that is the chain's drafts on the chain's path (no
    parents); sampled, the tree's rule keeps them (parents), so the seeded text stays k = 0's."""
    tree = SHAPES["static"][0]
    proposer = build_head_proposer("eagle3", MODELS / "tiny-eagle3", MODELS / "tiny-target", max_num_seqs=2, tree=tree)
    chain = build_head_proposer("eagle3", MODELS / "tiny-eagle3", MODELS / "tiny-target", max_num_seqs=2)
    seen = {}
    for name, drafter in (("tree", proposer), ("chain", chain)):
        calls, propose = [], drafter.propose
        drafter.propose = lambda requests, propose=propose, calls=calls: calls.extend(propose(requests)) or calls[-1:]
        list(generate(drafter, verifier, RejectionSampler(), PROMPTS[1],
                      GenerationParams(max_tokens=20, sampling=sampling, num_speculative_tokens=3)))
        seen[name] = calls
    assert all(p.parents is None for p in seen["tree"]) == sampling.greedy
    if sampling.greedy:  # the same drafts as the chain's, step for step
        assert [p.token_ids.tolist() for p in seen["tree"]] == [p.token_ids.tolist() for p in seen["chain"]]
    else:
        assert all(p.parents == tree.first(len(p.token_ids)).parents for p in seen["tree"] if len(p.token_ids))


def test_a_compiled_tree_drafts_the_per_level_passes_tokens(verifier):
    """A greedy step that drafts the whole static tree runs its level passes as one compiled call
    (``specdec.heads.compiled_tree``): the tokens are the per-level passes', which keep the target's
    output (above), for several rows, with bans binding the first two depths of one; a cut of the tree takes
    the per-level passes. The compiled tree alone, on an eager proposer, for one batch size: each graph of
    it takes most of a minute to compile on a cold cache, and a proposer built with ``cpu_compile`` compiles
    every chain graph too (``tests/test_eagle3.py`` covers those)."""
    tree = SHAPES["static"][0]
    proposer = build_head_proposer("eagle3", MODELS / "tiny-eagle3", MODELS / "tiny-target", max_num_seqs=3, tree=tree)
    compiled, calls = CompiledGreedyTree(proposer.head, proposer.draft_targets, tree), []
    run = compiled.run
    compiled.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    layers, lm = proposer.hidden_state_layers, verifier.lm
    prompts = {s: PROMPTS[i % 2][i:] for i, s in enumerate("abc")}
    features = {}
    for s, t in prompts.items():
        features[s] = lm.forward_with_hidden([ForwardCall(s, 0, t[:-1], 1)], layers)[1][0]
        lm.release(s)

    def drafts(on_device: bool, seq_ids: str, banned: tuple[int, ...], k: int = tree.num_nodes) -> list[list[int]]:
        proposer.greedy_tree = compiled if on_device else None
        return greedy_drafts(proposer, prompts, features, seq_ids, k, banned, 2)

    free = drafts(False, "b", ())
    banned = (free[0][0], free[0][2])  # b's root children: one at depth 1, one at depth 2
    assert drafts(False, "b", banned) != free
    for bans in ((), banned):
        calls.clear()
        assert drafts(True, "abc", bans) == drafts(False, "abc", bans), bans
        assert calls == [3]
    calls.clear()
    drafts(True, "ab", (), k=5)  # a cut that is no chain: the per-level passes
    assert calls == []
