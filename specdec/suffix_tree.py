"""A depth-limited suffix tree with occurrence counts, and speculation along it.

Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Arctic Inference, vLLM's
``suffix`` method) drafts by finding the recent tokens of a sequence in a tree of
earlier text and following the most frequent continuation. The tree here holds every
substring of length <= ``max_depth`` of the sequences added to it, as a trie whose
node for a string ``x`` counts the occurrences of ``x``. So the estimated probability
that ``t`` follows ``x`` is ``count(x + t) / count(x)``, and an occurrence of ``x`` at
the very end of a sequence (nothing followed it) lowers it, as it should.

A sequence grows by ``extend`` (one count per new substring: the ones ending at each
new token) and leaves by ``remove`` (the same counts, taken back; nodes that reach
zero are freed), so a tree of finished responses can evict the oldest ones and its
size stays the sum of what it holds. Plain Python: a node is a count and a child map.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


# Bytes a node takes (object, slots, the child dict of inner nodes): tracemalloc over 200
# random 64-token responses at depth 24 on CPython 3.11; the reported memory estimate uses it.
APPROX_NODE_BYTES = 264


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the string this node spells
        self.children: dict[int, _Node] | None = None  # next token -> node; None on a leaf

    def child(self, token: int) -> _Node | None:
        return None if self.children is None else self.children.get(token)

    def most_frequent_child(self) -> tuple[int, _Node] | None:
        """The continuation seen most often; among equals the one seen first."""
        if not self.children:
            return None
        return max(self.children.items(), key=lambda item: item[1].count)


@dataclass
class Draft:
    """Speculated tokens with their estimated probabilities (each the product along the path)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0  # how many recent tokens were found in the tree
    # a speculation tree (specdec.tree): each token's parent among them, -1 under the last token; None: a path
    parents: list[int] | None = None

    @property
    def score(self) -> float:
        """Expected number of the drafts that match, under the tree's estimates."""
        return sum(self.probs)


class SuffixTree:
    """Counts of every substring of length <= ``max_depth`` over a set of sequences, each under a key."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node()
        self._sequences: dict[Hashable, list[int]] = {}
        # per sequence: the nodes of its suffixes shorter than max_depth, which its next token extends
        self._open_suffixes: dict[Hashable, list[_Node]] = {}
        self.num_nodes = 0  # nodes besides the root

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._sequences.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sequences

    def extend(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Append tokens to the sequence ``key`` (a new one if unknown), counting its new substrings."""
        tokens = self._sequences.setdefault(key, [])
        open_suffixes = self._open_suffixes.setdefault(key, [])
        for token in token_ids:
            token = int(token)
            tokens.append(token)
            # Each suffix ending at the new token is one new occurrence: the empty suffix (root)
            # grows into the 1-token one, each open one grows by one.
            grown = []
            for node in [self._root, *open_suffixes]:
                child = self._child_or_new(node, token)
                child.count += 1
                grown.append(child)
            self._root.count += 1
            # a suffix of max_depth tokens is complete: no longer extended
            open_suffixes[:] = grown[: self.max_depth - 1]

    def remove(self, key: Hashable) -> None:
        """Forget the sequence ``key``: take back every count it added; a no-op for unknown keys."""
        tokens = self._sequences.pop(key, None)
        self._open_suffixes.pop(key, None)
        if tokens is None:
            return
        for start in range(len(tokens)):
            node = self._root
            node.count -= 1
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # its subtree counted only occurrences inside this one: all zero
                    self.num_nodes -= _size(child)
                    del node.children[token]
                    if not node.children:
                        node.children = None
                    break
                node = child

    def speculate(
        self,
        context: Sequence[int],  # the sequence's latest tokens, oldest first
        max_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
        tree: bool = False,
    ) -> Draft:
        """The best draft over every suffix of ``context`` found in the tree (the highest score).

        For each match length m (1 up to the longest suffix found), follow the most
        frequent continuation while the path's probability stays >= ``min_token_prob``,
        for at most ``min(max_tokens, floor(m * max_spec_factor))`` tokens: a short
        match earns a short draft. Among equal scores the longer match wins. ``tree``: a
        speculation tree of at most ``max_tokens`` nodes instead of one path (``_follow_tree``).
        """
        best = Draft()
        context = list(context)[-self.max_depth :]
        for match_len in range(1, len(context) + 1):
            node = self._find(context[len(context) - match_len :])
            if node is None:
                break  # a longer suffix contains this one: it cannot occur either
            limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6))
            if tree:
                draft = _follow_tree(node, _node_children, max_tokens, limit, min_token_prob)
            else:
                draft = _follow(node, limit, min_token_prob)
            draft.match_len = match_len
            if draft.score >= best.score:
                best = draft
        return best

    def _find(self, tokens: Sequence[int]) -> _Node | None:
        node = self._root
        for token in tokens:
            node = node.child(token)
            if node is None:
                return None
        return node

    def _child_or_new(self, node: _Node, token: int) -> _Node:
        if node.children is None:
            node.children = {}
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
            self.num_nodes += 1
        return child


def speculate_in_sequence(
    tokens: Sequence[int],  # [n]: one sequence, oldest first; its tail is the context
    max_depth: int,
    max_tokens: int,
    max_spec_factor: float,
    min_token_prob: float,
    tree: bool = False,
) -> Draft:
    """What ``SuffixTree(max_depth)`` holding only ``tokens`` drafts for their own tail, without a tree.

    A live request's local tree would gain ``max_depth`` nodes per token, a cost paid
    for every prompt token whether or not it is ever matched. Counting occurrences
    in the sequence itself gives the same counts at match time: the ends of the
    matched suffix's occurrences are found by comparing one more token to the left
    per match length, and the continuation is followed among them. It runs once per
    sequence and step in the orchestrator, on lists of a few occurrences: plain
    Python, since a numpy call on so few values costs more than the loop it replaces.
    """
    best, seq = Draft(), tokens if isinstance(tokens, list) else list(tokens)
    n = len(seq)
    if n == 0 or max_tokens <= 0:
        return best
    last = seq[-1]
    ends = [i for i, t in enumerate(seq) if t == last]  # where a match of length 1 ends
    for match_len in range(1, min(n, max_depth) + 1):
        if match_len > 1:  # the match grows one token to the left
            back, wanted = match_len - 1, seq[n - match_len]
            ends = [e for e in ends if e >= back and seq[e - back] == wanted]
        if not ends:
            break
        # the tree's paths stop at max_depth tokens
        limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6), max_depth - match_len)
        if tree:
            draft = _follow_tree(ends, lambda state: _occurrence_children(seq, state), max_tokens, limit, min_token_prob)
        else:
            draft = _follow_in_sequence(seq, ends, limit, min_token_prob)
        draft.match_len = match_len
        if draft.score >= best.score:
            best = draft
    return best


def _follow_in_sequence(seq: list[int], ends: list[int], limit: int, min_token_prob: float) -> Draft:
    """``_follow`` over occurrences: the next token most often seen after them, first seen first among equals."""
    draft, prob, n = Draft(), 1.0, len(seq)
    while len(draft.token_ids) < limit:
        counts: dict[int, int] = {}  # next token -> occurrences, in order of first occurrence
        for e in ends:
            if e + 1 < n:
                token = seq[e + 1]
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        pick = max(counts, key=counts.__getitem__)  # the first of the most frequent
        prob *= counts[pick] / len(ends)
        if prob < min_token_prob:
            break
        draft.token_ids.append(pick)
        draft.probs.append(prob)
        ends = [e + 1 for e in ends if e + 1 < n and seq[e + 1] == pick]
    return draft


def _follow(node: _Node, limit: int, min_token_prob: float) -> Draft:
    """Greedy walk down the most frequent children from ``node``."""
    draft, prob = Draft(), 1.0
    while len(draft.token_ids) < limit:
        step = node.most_frequent_child()
        if step is None:
            break
        token, child = step
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        draft.token_ids.append(token)
        draft.probs.append(prob)
        node = child
    return draft


def _follow_tree(start, children_of, max_nodes: int, max_depth: int, min_token_prob: float) -> Draft:
    """A speculation tree grown best first (Arctic Inference's tree speculation): of every continuation of the
    nodes taken so far, take the most probable path next, while it stays >= ``min_token_prob``, for at most
    ``max_nodes`` nodes of depth <= ``max_depth``.

    A path's probability only falls as it grows, so each node is taken after its parent, and the nodes
    taken are the ``max_nodes`` most probable paths: the most expected matches (``Draft.score``) a tree
    of that size can hold. ``children_of(state)`` lists ``(token, share, child state)`` in order of first
    occurrence; ties go to the continuation found first.
    """
    draft = Draft(parents=[])
    if max_depth <= 0:
        return draft
    order = itertools.count()
    frontier = [(-share, next(order), -1, 1, token, child) for token, share, child in children_of(start)]
    heapq.heapify(frontier)
    while frontier and len(draft.token_ids) < max_nodes:
        neg_prob, _, parent, depth, token, state = heapq.heappop(frontier)
        if -neg_prob < min_token_prob:
            break  # every other path is as improbable or more
        index = len(draft.token_ids)
        draft.token_ids.append(token)
        draft.probs.append(-neg_prob)
        draft.parents.append(parent)
        if depth < max_depth:
            for child_token, share, child in children_of(state):
                heapq.heappush(frontier, (neg_prob * share, next(order), index, depth + 1, child_token, child))
    return draft


def _node_children(node: _Node) -> list[tuple[int, float, _Node]]:
    """A tree node's continuations and each one's share of its count."""
    if not node.children:
        return []
    return [(token, child.count / node.count, child) for token, child in node.children.items()]


def _occurrence_children(seq: list[int], ends: list[int]) -> list[tuple[int, float, list[int]]]:
    """The continuations of the occurrences ending at ``ends``: each next token, its share, and where it ends."""
    after: dict[int, list[int]] = {}
    for e in ends:
        if e + 1 < len(seq):
            after.setdefault(seq[e + 1], []).append(e + 1)
    return [(token, len(found) / len(ends), found) for token, found in after.items()]


def _size(node: _Node) -> int:
    """Nodes in the subtree rooted at ``node``, itself included."""
    total, stack = 0, [node]
    while stack:
        current = stack.pop()
        total += 1
        if current.children:
            stack.extend(current.children.values())
    return total
