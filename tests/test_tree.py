"""Draft trees: the static shape's format and checks, the mask, and the fast engine's tree pass against chains."""
from __future__ import annotations

import pytest
import torch

from specdec.cached_lm import ForwardCall
from specdec.fast import FastCausalLM
from specdec.tree import ROOT, DraftTree, chain, node_depths, parse_token_tree, path_to, tree_visibility
from test_fast_llama import random_ids, save_checkpoint

WIDE_DEEP = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("target"), seed=21)[0]


def test_the_vllm_format_parses_breadth_first_with_parents_and_depths():
    tree = parse_token_tree("[(0, 0), (1,), (0,), (0, 1), (0, 0, 0)]")
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))  # vLLM's sort: by length, then lexicographic
    assert tree.parents == (ROOT, ROOT, 0, 0, 2)
    assert tree.depths == (1, 1, 2, 2, 3) and tree.max_depth == 3 and tree.max_rank == 2
    assert not tree.is_chain and chain(3).is_chain and chain(3).spec() == "[(0,), (0, 0), (0, 0, 0)]"
    assert tree.first(3).paths == ((0,), (0, 0), (0, 0, 0))  # cut to fewer nodes: the rank-0 chain first
    assert tree.first(4).paths == ((0,), (1,), (0, 0), (0, 0, 0)) and tree.first(5) is tree
    assert parse_token_tree([(0,), (0, 0)], num_speculative_tokens=2) == chain(2)


SHIPPED_SHAPE = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]"


@pytest.mark.parametrize("spec", [SHIPPED_SHAPE, "[(0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (0, 0, 0)]",
                                  "[(0,), (1,), (1, 0), (1, 1), (1, 0, 0)]"])  # fmt: skip
def test_a_tree_cut_to_fewer_nodes_stays_a_tree_and_keeps_the_likeliest_paths(spec):
    tree = parse_token_tree(spec)
    kept_before: set = set()
    for n in range(1, tree.num_nodes + 1):
        cut = tree.first(n)
        assert cut.num_nodes == n and set(cut.paths) <= set(tree.paths)
        assert parse_token_tree(cut.spec()) == cut  # closed under prefixes, breadth-first
        assert kept_before <= set(cut.paths)  # a larger budget only adds nodes
        kept_before = set(cut.paths)
        off_top = [sum(r > 0 for r in p) for p in cut.paths]
        left_out = [sum(r > 0 for r in p) for p in set(tree.paths) - set(cut.paths)]
        assert not left_out or max(off_top) <= min(left_out)  # no path kept that leaves rank 0 more often
    assert parse_token_tree(SHIPPED_SHAPE).first(4) == chain(4)


@pytest.mark.parametrize("value, named", [
    ("[(0,), (0, 0, 0)]", "not closed under prefixes"),
    ("[(0,), (0,)]", "more than once"),
    ("[(0,), (-1,)]", "ranks >= 0"),
    ("[]", "non-empty list"),
    ("[(0,), ()]", "non-empty tuple"),
    ("(0,", "Python literal"),
])  # fmt: skip
def test_a_bad_tree_is_refused_naming_the_key(value, named):
    with pytest.raises(ValueError, match="speculative_token_tree") as err:
        parse_token_tree(value)
    assert named in str(err.value)


def test_num_speculative_tokens_must_count_the_nodes():
    with pytest.raises(ValueError, match="has 2 nodes, but num_speculative_tokens is 3"):
        parse_token_tree("[(0,), (1,)]", num_speculative_tokens=3)


def test_visibility_is_ancestors_and_self():
    parents = DraftTree(parse_token_tree(WIDE_DEEP).paths).parents  # 0,1,2 under root; 3,4 under 0; 5 under 1; 6 under 3
    visible = tree_visibility(parents)
    assert visible.shape == (8, 8)
    for node in range(len(parents)):
        expected = {0} | {i + 1 for i in path_to(parents, node)}
        assert set(visible[node + 1].nonzero().flatten().tolist()) == expected
    assert node_depths(parents) == [1, 1, 1, 2, 2, 2, 3]


def _chain_logits(lm, prompt, tokens):
    """The last row's logits of feeding the prompt then ``tokens`` as a plain chain, on a fresh sequence."""
    lm.forward([ForwardCall("ref", 0, prompt, 1)])
    out = lm.forward([ForwardCall("ref", len(prompt), tokens, len(tokens))])[0]
    lm.release("ref")
    return out


def test_a_tree_pass_gives_each_node_its_own_paths_logits_and_moves_the_accepted_path_into_place(target):
    lm = FastCausalLM(target, dtype="float32", max_num_seqs=4, max_model_len=64)
    tree = parse_token_tree(WIDE_DEEP)
    prompt, root = random_ids(9, 3), 7
    drafts = random_ids(tree.num_nodes, 4)
    lm.forward([ForwardCall("s", 0, prompt, 1), ForwardCall("c", 0, prompt, 1)])
    p = len(prompt)
    rows = lm.forward([
        ForwardCall("s", p, [root, *drafts], tree.num_nodes + 1, tree.parents),
        ForwardCall("c", p, [root, drafts[0]], 2),  # a chain beside it in the same pass
    ])  # fmt: skip
    assert torch.allclose(rows[0][0], _chain_logits(lm, prompt, [root])[-1], atol=1e-5)
    for node in range(tree.num_nodes):
        path = [drafts[i] for i in path_to(tree.parents, node)]
        assert torch.allclose(rows[0][node + 1], _chain_logits(lm, prompt, [root, *path])[-1], atol=1e-5), node
    assert torch.allclose(rows[1], _chain_logits(lm, prompt, [root, drafts[0]]), atol=1e-5)
    # accept nodes 0 -> 3 -> 6 (depths 1, 2, 3): the next call continues from the path alone
    path, nxt = (0, 3, 6), 11
    moves = ((p + 1 + 3, p + 2), (p + 1 + 6, p + 3))
    after = lm.forward([ForwardCall("s", p + 4, [nxt], 1, moves=moves)])[0]
    expected = _chain_logits(lm, prompt, [root, *(drafts[i] for i in path), nxt])[-1]
    assert torch.allclose(after[0], expected, atol=1e-5)


def test_the_hf_engine_refuses_a_tree_by_name(target):
    from specdec.models import CachedCausalLM

    lm = CachedCausalLM.from_path(target, "float32", "cpu", 2, 64)
    lm.forward([ForwardCall("s", 0, [1, 2, 3], 1)])
    with pytest.raises(ValueError, match="fast engine"):
        lm.forward([ForwardCall("s", 3, [4, 5, 6], 3, (ROOT, ROOT))])
