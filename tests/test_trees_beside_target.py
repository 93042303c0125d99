"""Draft trees with the drafter beside the target (``DraftBesideTarget``), the shipped models, through the scheduler.

One call a step drafts the tree and verifies it; the caller learns the parents from the proposal,
matches a greedy target down the tree, and sends the accepted path with the next verify request.
The output must be the target's: greedy HF ``generate``'s, sampled seed for seed the drafter's in
its own model (the tree rule judged by the local sampler, as rejection_sampler's model judges it served).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tiny_llama import hf_generate_greedy

from specdec.build import build_lm
from specdec.draft_beside_target import DraftBesideTarget
from specdec.engine import GenerationParams, SequenceState
from specdec.generate import generate
from specdec.heads import build_head_proposer, describe_head
from specdec.models import load_causal_lm
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.scheduler import StepCapabilities, StepScheduler
from specdec.speculation_length import SpeculationLength
from specdec.tree import DynamicTree, parse_token_tree
from specdec.types import SamplingParams
from specdec.verifier import TargetVerifier

MODELS = Path(__file__).resolve().parents[1] / "models"
PROMPTS = [[5, 300, 41, 9, 77, 1200, 15], [88, 12, 2000, 4, 61, 63, 65, 67, 69], [7, 7, 7, 900, 31]]
TREE = parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]")
NEW_TOKENS = 32


def build(method: str, tree):
    verifier = TargetVerifier(build_lm(MODELS / "tiny-target", "fast", "float32", "cpu", 4))
    if method == "draft_model":
        return DraftModelProposer(build_lm(MODELS / "tiny-draft", "fast", "float32", "cpu", 4), tree), verifier, ()
    head = MODELS / {"eagle3": "tiny-eagle3", "mlp_speculator": "tiny-mlp-speculator"}[method]
    proposer = build_head_proposer(method, head, MODELS / "tiny-target", max_num_seqs=4, tree=tree)
    return proposer, verifier, describe_head(proposer, str(head)).hidden_state_layers


class Stages:
    """Served target_verifier's calls in-process: one ``propose_and_verify`` a step; the sampler here."""

    def __init__(self, beside: DraftBesideTarget):
        self.beside, self.sampler, self.trees = beside, RejectionSampler(), 0
        self.capabilities = StepCapabilities(proposes_in_verify=True)

    async def propose_and_verify(self, steps):
        out = self.beside.step(steps)
        self.trees += sum(p.parents is not None for p, _ in out)
        return out

    async def sample(self, calls):
        return [self.sampler(c.draft_token_ids, c.draft_probs, c.verify, c.seed, c.method, c.position, c.parents)
                for c in calls]  # fmt: skip

    async def release(self, ended):
        for seq_id, response in ended.items():
            self.beside.release(seq_id, response)


def decode(method, tree, sampling, follows_acceptance=False) -> tuple[list[list[int]], Stages]:
    proposer, verifier, layers = build(method, tree)
    stages = Stages(DraftBesideTarget(verifier, proposer, layers))
    speculation = SpeculationLength(TREE.num_nodes, follows_acceptance=follows_acceptance)
    scheduler = StepScheduler(stages, speculation, max_num_seqs=None)
    states = [SequenceState(f"s{i}", p, GenerationParams(max_tokens=NEW_TOKENS, num_speculative_tokens=TREE.num_nodes,
                                                          sampling=sampling(i)), layers, hidden_rows_stay=True)
              for i, p in enumerate(PROMPTS)]  # fmt: skip

    async def main():
        async def collect(sequence):
            return [step async for step in sequence.steps()]

        await asyncio.gather(*(collect(scheduler.submit(state)) for state in states))

    asyncio.run(main())
    assert stages.beside.num_active_sequences == 0
    return [list(s.output_ids) for s in states], stages


@pytest.fixture(scope="module")
def hf_target():
    return load_causal_lm(MODELS / "tiny-target", dtype="float32").eval()


@pytest.mark.parametrize("method, tree", [("eagle3", TREE), ("eagle3", DynamicTree(topk=2, depth=4)),
                                          ("mlp_speculator", TREE), ("draft_model", TREE)])  # fmt: skip
def test_a_greedy_tree_beside_the_target_emits_the_targets_tokens(hf_target, method, tree):
    outputs, stages = decode(method, tree, lambda i: SamplingParams())
    assert stages.trees > 0  # the trees were drafted and verified as trees
    for prompt, output in zip(PROMPTS, outputs):
        assert output == hf_generate_greedy(hf_target, prompt, NEW_TOKENS), (method, prompt)


def test_a_tree_under_the_acceptance_rule_is_cut_per_sequence_and_keeps_the_targets_output(hf_target):
    """Each sequence's k from its acceptance cuts the tree to that many nodes (the chain below its depth)."""
    outputs, _ = decode("eagle3", TREE, lambda i: SamplingParams(), follows_acceptance=True)
    for prompt, output in zip(PROMPTS, outputs):
        assert output == hf_generate_greedy(hf_target, prompt, NEW_TOKENS), prompt


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_a_sampled_tree_beside_the_target_emits_k0s_tokens_seed_for_seed(method):
    def sampling(i):
        return SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i)

    with_tree, stages = decode(method, TREE, sampling)
    assert stages.trees > 0
    k0 = []
    for i, prompt in enumerate(PROMPTS):  # the target alone, k = 0, same seeds
        verifier = TargetVerifier(build_lm(MODELS / "tiny-target", "fast", "float32", "cpu", 1))
        params = GenerationParams(max_tokens=NEW_TOKENS, sampling=sampling(i))
        k0.append([t for out in generate(None, verifier, RejectionSampler(), prompt, params) for t in out.new_token_ids])
    assert with_tree == k0
