"""The suffix tree counts substrings exactly, forgets what it removes, and drafts as the paper says."""
from __future__ import annotations

import random
from collections import Counter

import pytest


from specdec.suffix_tree import SuffixTree, speculate_in_sequence


def substring_counts(sequences: list[list[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for tokens in sequences:
        for start in range(len(tokens)):
            for end in range(start + 1, min(len(tokens), start + max_depth) + 1):
                counts[tuple(tokens[start:end])] += 1
    return counts


def tree_counts(tree: SuffixTree) -> Counter:
    counts: Counter = Counter()
    stack = [((), tree._root)]
    while stack:
        prefix, node = stack.pop()
        for token, child in (node.children or {}).items():
            counts[prefix + (token,)] = child.count
            stack.append((prefix + (token,), child))
    return counts


def test_counts_match_brute_force_through_extends_and_removes():
    rng = random.Random(0)
    tree, held = SuffixTree(max_depth=4), {}
    for key in range(30):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
        # appended in pieces, as a sequence grows step by step
        cut = rng.randrange(len(tokens) + 1)
        tree.extend(key, tokens[:cut])
        tree.extend(key, tokens[cut:])
        held[key] = tokens
        if key % 3 == 2:
            gone = rng.choice(sorted(held))
            tree.remove(gone)
            del held[gone]
        expected = substring_counts(list(held.values()), 4)
        assert tree_counts(tree) == expected
        assert tree.num_nodes == len(expected)
        assert tree.num_tokens == sum(map(len, held.values()))
    for key in list(held):
        tree.remove(key)
    assert tree.num_nodes == 0 and tree_counts(tree) == Counter() and tree._root.count == 0


def test_remove_of_an_unknown_key_changes_nothing():
    tree = SuffixTree(3)
    tree.extend("a", [1, 2, 3])
    tree.remove("b")
    assert tree_counts(tree) == substring_counts([[1, 2, 3]], 3)


def test_speculate_follows_the_most_frequent_continuation():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3, 4, 5])
    tree.extend(1, [1, 2, 3, 4, 5])
    tree.extend(2, [1, 2, 3, 9])
    draft = tree.speculate([7, 1, 2, 3], max_tokens=5, max_spec_factor=1.0, min_token_prob=0.1)
    # "1 2 3" matched (3 tokens: at most 3 drafts); then 4 in 2 of 3 occurrences, 5 always after 4
    assert draft.match_len == 3
    assert draft.token_ids == [4, 5]
    assert draft.probs == pytest.approx([2 / 3, 2 / 3])


def test_speculate_stops_under_min_token_prob_and_limits_by_match_length():
    tree = SuffixTree(8)
    for key, tail in enumerate([[4], [5], [6], [7]]):
        tree.extend(key, [1, 2, *tail, 8])
    # after "1 2" each continuation has probability 1/4
    assert tree.speculate([1, 2], 4, 1.0, min_token_prob=0.3).token_ids == []
    assert len(tree.speculate([1, 2], 4, 1.0, min_token_prob=0.2).token_ids) == 2
    # a one-token match drafts at most one token with factor 1, two with factor 2
    tree.extend(9, [3, 4, 5, 6])
    assert tree.speculate([0, 3], 4, 1.0, 0.0).token_ids == [4]
    assert tree.speculate([0, 3], 4, 2.0, 0.0).token_ids == [4, 5]


def test_speculate_with_no_match_drafts_nothing():
    tree = SuffixTree(4)
    tree.extend(0, [1, 2, 3])
    draft = tree.speculate([7, 8], 4, 1.0, 0.1)
    assert draft.token_ids == [] and draft.score == 0


def test_max_depth_must_be_positive():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)


@pytest.mark.parametrize("seed", range(40))
def test_matching_in_the_sequence_drafts_what_its_tree_would(seed):
    """The local "tree" of a live sequence is the sequence itself: same counts, same drafts, same tie-breaks."""
    rng = random.Random(seed)
    tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 60))]
    depth, max_tokens = rng.choice([3, 6, 24]), rng.choice([1, 4, 8])
    factor, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4])
    tree = SuffixTree(depth)
    tree.extend(0, tokens)
    expected = tree.speculate(tokens, max_tokens, factor, min_prob)
    got = speculate_in_sequence(tokens, depth, max_tokens, factor, min_prob)
    assert (got.token_ids, got.match_len) == (expected.token_ids, expected.match_len)
    assert got.probs == pytest.approx(expected.probs)


def test_a_speculation_tree_holds_the_most_probable_continuations_branches_included():
    """After 'a b' came 'c' twice and 'd' once: a path takes c alone, a tree takes d beside it."""
    a, b, c, d, x = 1, 2, 3, 4, 5
    seq = [a, b, c, a, b, d, a, b, c, x, a, b]  # 'x a b' is found nowhere else: the match is 'a b'
    path = speculate_in_sequence(seq, 8, 4, 2.0, 0.1)
    assert path.parents is None and path.token_ids[0] == c
    tree = speculate_in_sequence(seq, 8, 4, 2.0, 0.1, tree=True)
    assert tree.parents is not None and len(tree.token_ids) <= 4
    nodes = list(zip(tree.token_ids, tree.parents))
    assert (c, -1) in nodes and (d, -1) in nodes  # both continuations of 'a b', under the last token
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first
    assert tree.probs == sorted(tree.probs, reverse=True)  # taken most probable first
    assert tree.score >= path.score


def test_the_global_tree_speculates_a_tree_too():
    tree = SuffixTree(8)
    tree.extend("x", [1, 2, 3, 4])
    tree.extend("y", [1, 2, 5, 6])
    draft = tree.speculate([9, 1, 2], 4, 2.0, 0.1, tree=True)
    assert sorted(t for t, p in zip(draft.token_ids, draft.parents) if p == -1) == [3, 5]
    assert len(draft.token_ids) == 4 and all(p < i for i, p in enumerate(draft.parents))
