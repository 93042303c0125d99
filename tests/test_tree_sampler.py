"""Verifying a draft tree: the walk, its law (chi-square per tree shape) and the engine's output with trees."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.proposers.base import Proposer
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast import FastCausalLM
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import derive_seed
from specdec.tree import ROOT, chain, parse_token_tree
from specdec.tree_sampler import match_greedy_tree, sample_tree
from specdec.types import Proposal, SamplingParams, VerifyResult
from specdec.verifier import TargetVerifier
from test_fast_llama import random_ids, save_checkpoint

SHAPES = {
    "chain": chain(3),
    "wide": parse_token_tree("[(0,), (1,), (2,), (3,)]"),
    "deep": parse_token_tree("[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]"),
    "unbalanced": parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (1, 0)]"),
}
VOCAB = 8
NUM_SAMPLES = 4000


def test_greedy_follows_the_argmax_down_the_tree():
    parents = (ROOT, ROOT, 0, 1, 3)  # 0 and 1 under the root, 2 under 0, 3 under 1, 4 under 3
    drafts = [5, 6, 7, 2, 3]
    # root's argmax 6 -> node 1; node 1's argmax 2 -> node 3; node 3's argmax 3 -> node 4 (a leaf): bonus 9
    result = match_greedy_tree(drafts, parents, [6, 0, 2, 0, 3, 9])
    assert result.output_token_ids.tolist() == [6, 2, 3, 9] and result.accepted_nodes == (1, 3, 4)
    result = match_greedy_tree(drafts, parents, [5, 1, 0, 0, 0, 0])  # node 0, whose argmax 1 has no child
    assert result.output_token_ids.tolist() == [5, 1] and result.num_accepted == 1 and result.accepted_nodes == (0,)
    assert match_greedy_tree([], (), [4]).output_token_ids.tolist() == [4]


def _rows(num_rows: int, seed: int) -> torch.Tensor:  # [num_rows, VOCAB] p, far from uniform
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(num_rows, VOCAB, generator=g)).softmax(-1)


def _drafts_from(p: torch.Tensor, parents) -> list[int]:
    """Each node's token: its rank among its siblings' picks the parent row's next most probable token."""
    drafts, taken = [], {}
    for node, parent in enumerate(parents):
        order = p[parent + 1].argsort(descending=True).tolist()
        rank = taken.get(parent, 0)
        taken[parent] = rank + 1
        drafts.append(order[rank])
    return drafts


def _chi2(counts: Counter, probs: torch.Tensor) -> float:
    """The p-value of the counts against ``probs``; tokens expected fewer than 5 times share one cell."""
    n = sum(counts.values())
    probs = probs.double() / probs.double().sum()
    observed, expected, rest = [], [], [0, 0.0]
    for t in range(VOCAB):
        if n * float(probs[t]) < 5:
            rest[0] += counts.get(t, 0)
            rest[1] += n * float(probs[t])
        else:
            observed.append(counts.get(t, 0))
            expected.append(n * float(probs[t]))
    if rest[1] > 0:
        observed.append(rest[0])
        expected.append(rest[1])
    total = sum(expected)
    return chisquare(observed, [e * n / total for e in expected]).pvalue


@pytest.mark.parametrize("shape", SHAPES)
def test_each_emitted_token_follows_p_whatever_the_tree(shape):
    """The first token's law is the root's p; given it is node c's draft, the second's is node c's p."""
    tree = SHAPES[shape]
    p = _rows(tree.num_nodes + 1, seed=len(shape))
    drafts = _drafts_from(p, tree.parents)
    verify = VerifyResult(argmax=p.argmax(-1), probs=p)
    first, second = Counter(), Counter()
    child = tree.children()[-1][0]  # the root's rank-0 child: the node most often followed
    for seed in range(NUM_SAMPLES):
        out = sample_tree(drafts, tree.parents, verify, derive_seed(seed, 0, 7), None).output_token_ids.tolist()
        first[out[0]] += 1
        if out[0] == drafts[child]:
            second[out[1]] += 1
    assert _chi2(first, p[0]) > 1e-4  # eight such tests: a lossless rule fails one about once in 1,000 runs
    assert _chi2(second, p[child + 1]) > 1e-4


def test_the_statistic_sees_a_lossy_rule():
    """Accepting the rank-0 child at every node (what a tree without the rule would do) fails the same test."""
    tree = SHAPES["wide"]
    p = _rows(tree.num_nodes + 1, seed=4)
    drafts = _drafts_from(p, tree.parents)
    verify = VerifyResult(argmax=p.argmax(-1), probs=p)
    first = Counter()
    for seed in range(NUM_SAMPLES // 4):
        result = sample_tree(drafts, tree.parents, verify, seed, None, method="synthetic", synthetic_acceptance_rate=0.9)
        first[result.output_token_ids.tolist()[0]] += 1
    assert _chi2(first, p[0]) < 1e-6


class TreeOfGuesses(Proposer):
    """A proposer whose rank-0 path is the reference output (so paths are accepted) and other ranks are random."""

    def __init__(self, tree, reference: list[int], prompt_len: int, vocab: int):
        self.tree, self.reference, self.prompt_len, self.vocab = tree, reference, prompt_len, vocab
        self.length = 0

    def propose(self, requests):
        (r,) = requests
        self.length = r.position + len(r.token_ids)
        done = self.length - self.prompt_len
        tree = self.tree.first(r.num_tokens)
        drafts = []
        for path in tree.paths:
            i = done + len(path) - 1
            right = i < len(self.reference) and all(rank == 0 for rank in path)
            drafts.append(self.reference[i] if right else (7 * i + 3 * sum(path) + 1) % self.vocab)
        drafts = _distinct_siblings(drafts, tree.parents, self.vocab)
        return [Proposal(torch.tensor(drafts), parents=tree.parents)]

    def release(self, seq_id, response=None):
        pass


def _distinct_siblings(drafts, parents, vocab):
    seen = set()
    for i, parent in enumerate(parents):
        while (parent, drafts[i]) in seen:
            drafts[i] = (drafts[i] + 1) % vocab
        seen.add((parent, drafts[i]))
    return drafts


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp("target"), seed=33)[0]
    return TargetVerifier(FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=128))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=5)])
def test_generate_with_a_tree_emits_k0s_tokens(verifier, shape, sampling):
    """Greedy: the target's own output; seeded sampling: the same draws as k = 0, so the same tokens."""
    prompt = random_ids(10, 9)
    sampler = RejectionSampler()
    plain = GenerationParams(max_tokens=24, sampling=sampling)
    reference = [t for out in generate(None, verifier, sampler, prompt, plain) for t in out.new_token_ids]
    tree = SHAPES[shape]
    proposer = TreeOfGuesses(tree, reference[:18], len(prompt), verifier.vocab_size)  # the last steps miss
    params = GenerationParams(max_tokens=24, sampling=sampling, num_speculative_tokens=tree.num_nodes)
    steps = list(generate(proposer, verifier, sampler, prompt, params))
    assert [t for out in steps for t in out.new_token_ids] == reference
    assert steps[-1].stats.num_accepted_tokens > 0
