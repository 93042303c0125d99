"""Static trees drafted by the MLP speculator and the draft model (``specdec.proposers.static_tree``), shipped models.

Each tree shape must leave the output the target's own: greedy equal to HF ``generate``'s and k = 0's,
and a seeded sampled request k = 0's tokens exactly (the tree's verification draws as k = 0 does).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_llama import hf_generate_greedy

from specdec.build import build_lm
from specdec.engine import GenerationParams
from specdec.fast import FastCausalLM
from specdec.generate import generate
from specdec.heads import build_head_proposer
from specdec.models import load_causal_lm
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.tree import ROOT, parse_token_tree
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier

MODELS = Path(__file__).resolve().parents[1] / "models"
PROMPTS = [[5, 300, 41, 9, 77, 1200, 15], [88, 12, 2000, 4, 61, 63, 65, 67, 69]]
TREES = {  # wide, deep within the MLP speculator's 3 stages, unbalanced
    "wide": "[(0,), (1,), (2,), (0, 0), (1, 0), (2, 0)]",
    "deep": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]",
    "unbalanced": "[(0,), (1,), (1, 0), (1, 1), (1, 0, 0)]",
}


def _mlp(tree):
    return build_head_proposer("mlp_speculator", MODELS / "tiny-mlp-speculator", MODELS / "tiny-target", tree=tree)


def _draft(tree):
    return DraftModelProposer(build_lm(MODELS / "tiny-draft", "fast", "float32", "cpu", 2), tree=tree)


DRAFTERS = {"mlp_speculator": _mlp, "draft_model": _draft}


@pytest.fixture(scope="module")
def verifier():
    return TargetVerifier(FastCausalLM(MODELS / "tiny-target", max_num_seqs=2, max_model_len=256))


@pytest.fixture(scope="module")
def hf_target():
    return load_causal_lm(MODELS / "tiny-target", dtype="float32").eval()


@pytest.mark.parametrize("method", DRAFTERS)
@pytest.mark.parametrize("shape", TREES)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=11)])
def test_a_tree_emits_k0s_tokens(verifier, hf_target, method, shape, sampling):
    tree = parse_token_tree(TREES[shape])
    proposer, sampler, accepted = DRAFTERS[method](tree), RejectionSampler(), 0
    for prompt in PROMPTS:
        plain = GenerationParams(max_tokens=40, sampling=sampling)
        reference = [t for out in generate(None, verifier, sampler, prompt, plain) for t in out.new_token_ids]
        steps = list(generate(proposer, verifier, sampler, prompt,
                              GenerationParams(max_tokens=40, sampling=sampling, num_speculative_tokens=tree.num_nodes)))
        assert [t for out in steps for t in out.new_token_ids] == reference, (method, shape)
        if sampling.greedy:
            assert reference == hf_generate_greedy(hf_target, prompt, 40)
        accepted += steps[-1].stats.num_accepted_tokens
    assert accepted > 0
    assert proposer.num_active_sequences == 0


@pytest.mark.parametrize("method", DRAFTERS)
def test_a_node_takes_its_parents_rank_and_bans_hold_at_its_depth(method):
    """The node (0, 1) is the second likeliest token after the first: the same as a chain drafting after (0,) with
    that token's rank; an EOS banned for the first draft is never a depth-1 node."""
    tree = parse_token_tree(TREES["deep"])
    proposer = DRAFTERS[method](tree)
    prompt = PROMPTS[0]
    hidden = None
    if method == "mlp_speculator":
        import torch

        hidden = torch.randn(len(prompt) - 1, proposer.model.emb_dim)
    chain_first = DRAFTERS[method](None).propose([ProposeRequest("c", 0, prompt, 2, SamplingParams(), 0,
                                                                 hidden_states=hidden)])[0]  # fmt: skip
    (proposal,) = proposer.propose([ProposeRequest("a", 0, prompt, tree.num_nodes, SamplingParams(), 0,
                                                   hidden_states=hidden)])  # fmt: skip
    assert proposal.parents == tree.parents == (ROOT, ROOT, 0, 0, 1, 2, 2)
    ids = proposal.token_ids.tolist()
    assert ids[0] == chain_first.token_ids[0] and ids[2] == chain_first.token_ids[1]  # the rank-0 path is the chain
    assert len({ids[0], ids[1]}) == 2 and len({ids[2], ids[3]}) == 2  # siblings differ
    banned = ids[0]
    (kept_out,) = DRAFTERS[method](tree).propose([ProposeRequest("b", 0, prompt, tree.num_nodes, SamplingParams(), 0,
                                                                 hidden_states=hidden, num_banned_tokens=1,
                                                                 banned_token_ids=(banned,))])  # fmt: skip
    depth_one = [t for t, p in zip(kept_out.token_ids.tolist(), kept_out.parents) if p == ROOT]
    assert banned not in depth_one and banned in ids[:2]


def test_a_tree_deeper_than_the_mlp_speculators_stages_is_refused_naming_n_predict():
    with pytest.raises(ValueError, match="n_predict=3"):
        _mlp(parse_token_tree("[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]"))


def test_a_draft_models_length_check_counts_what_the_step_feeds_back():
    """A whole tree feeds all its nodes to the draft's cache; a greedy cut that is the chain feeds k - 1, as a
    chain does, so a sequence one short of ``max_model_len`` may still draft that chain."""
    tree = parse_token_tree(TREES["deep"])  # 7 nodes, depth 3: a cut to 3 nodes is the chain of 3
    proposer = DraftModelProposer(FastCausalLM(MODELS / "tiny-draft", max_num_seqs=2, max_model_len=32), tree=tree)
    prompt = list(range(5, 35))  # 30 tokens: 30 + 2 fed = 32
    chain = proposer.propose([ProposeRequest("a", 0, prompt, 3, SamplingParams(), 0)])
    assert len(chain[0].token_ids) == 3 and chain[0].parents is None
    with pytest.raises(ValueError, match=r"30 tokens \+ 3 drafts exceed max_model_len=32"):
        proposer.propose([ProposeRequest("b", 0, prompt, 3, SamplingParams(temperature=1.0), 0)])  # the tree's rule
