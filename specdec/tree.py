"""Draft token trees: several candidates per position, verified by the target in one forward.

A tree's nodes are draft tokens; node ``i``'s parent is another node or the *root*, the
sequence's last token (the one the step feeds first). Nodes come in breadth-first order,
so a parent always precedes its children, and are addressed by ``parents``: the index of
each node's parent among the nodes, ``ROOT`` (-1) for a child of the root. A chain of k
drafts is the tree whose node ``i`` has parent ``i - 1``.

The static shape is vLLM's ``speculative_token_tree``: a Python-literal list of tuples,
each the path of child *ranks* from the root (rank 0 is the drafter's most probable child,
rank 1 the next), for example ``"[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"``. As in vLLM the
paths are sorted breadth-first (by length, then lexicographically), and
``num_speculative_tokens`` is the number of nodes; without a tree the chain is the default.

The target attends over a tree with a mask (:func:`tree_visibility`): each node sees the
sequence before the root, the root and its own ancestors, at the rotary position of its
depth, while its keys and values are written at distinct cache positions in node order.
After the step the accepted path's entries move down to the positions of their depths
(``specdec.fast.kv_cache.StaticKVCache.move``).
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

ROOT = -1  # parent index of a child of the root (the sequence's last token)
TREE_KEY = "speculative_token_tree"


@dataclass(frozen=True)
class DraftTree:
    """A static tree shape: each node's path of child ranks from the root, breadth-first."""

    paths: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    # derived once per shape: a shape (and each of its cuts, memoized by ``first``) serves every step
    @cached_property
    def parents(self) -> tuple[int, ...]:  # [num_nodes]: index of each node's parent, ROOT for depth 1
        index = {path: i for i, path in enumerate(self.paths)}
        return tuple(index[path[:-1]] if len(path) > 1 else ROOT for path in self.paths)

    @cached_property
    def depths(self) -> tuple[int, ...]:  # [num_nodes]: 1 for a child of the root
        return tuple(len(path) for path in self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def max_rank(self) -> int:
        """The most candidates any node needs from the drafter: its highest child rank + 1."""
        return max((path[-1] for path in self.paths), default=-1) + 1

    @property
    def is_chain(self) -> bool:
        return all(path == (0,) * len(path) for path in self.paths) and self.depths == tuple(range(1, self.num_nodes + 1))

    def first(self, num_nodes: int) -> DraftTree:
        """The tree cut to the ``num_nodes`` nodes likeliest to be accepted, breadth-first again.

        A step drafts fewer nodes than the tree has when the batch-size table (or the
        request) asks fewer. A drafter's rank-0 child passes far more often than its
        siblings (the shipped EAGLE-3 head: 0.82 at depth 1, and a chain keeps 0.38 of its
        fourth draft), so the nodes kept are those whose paths leave the rank-0 child the
        fewest times, then by rank sum, then by depth: EAGLE-2's and Sequoia's premise that
        a path's chance falls faster across ranks than down a path. A tree cut below its
        depth becomes the chain, which is what a loaded step should draft. The order is
        closed under prefixes: a parent's key never exceeds its child's, and it is shallower.
        """
        if num_nodes >= self.num_nodes:
            return self
        if num_nodes not in self._cuts:
            kept = self._likeliest_first[:num_nodes]
            self._cuts[num_nodes] = DraftTree(tuple(sorted(kept, key=lambda p: (len(p), p))))
        return self._cuts[num_nodes]

    @cached_property
    def _likeliest_first(self) -> tuple[tuple[int, ...], ...]:
        return tuple(sorted(self.paths, key=lambda p: (sum(r > 0 for r in p), sum(p), len(p), p)))

    @cached_property
    def _cuts(self) -> dict[int, DraftTree]:  # num_nodes -> the cut, made once
        return {}

    def children(self) -> list[list[int]]:
        """Each node's children (node indices) in rank order; index ``num_nodes`` holds the root's."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, parent in enumerate(self.parents):
            out[parent].append(i)  # ROOT (-1) lands in the last list
        return out

    def spec(self) -> str:
        """The ``speculative_token_tree`` string of this tree, as vLLM writes it after sorting."""
        return str(list(self.paths))


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's context-aware tree (Li et al. 2024, "EAGLE-2"), grown anew for each sequence and step.

    Each level expands the ``topk`` nodes of the level before with the highest cumulative
    draft probability, ``topk`` children each, for ``depth`` levels; then every candidate is
    reranked by cumulative probability and the step's ``num_speculative_tokens`` best are
    kept (closed under ancestry, a child being no likelier than its parent). The keys are
    SGLang's (``speculative_eagle_topk``, ``speculative_num_steps``); vLLM has no dynamic tree.
    """

    topk: int
    depth: int

    def __post_init__(self) -> None:
        if self.topk < 1 or self.depth < 1:
            raise ValueError(f"a dynamic tree needs speculative_eagle_topk >= 1 and speculative_num_steps >= 1, "
                             f"got {self.topk} and {self.depth}")  # fmt: skip


def chain(num_nodes: int) -> DraftTree:
    """vLLM's default tree: ``[(0,), (0, 0), ...]``."""
    return DraftTree(tuple((0,) * (i + 1) for i in range(num_nodes)))


def parse_token_tree(value: str | Sequence, num_speculative_tokens: int | None = None, key: str = TREE_KEY) -> DraftTree:
    """A tree from ``speculative_token_tree`` (a string literal or a list of tuples), checked, errors naming ``key``.

    Refused: anything that is not a non-empty list of non-empty tuples of non-negative ints,
    a repeated path, a path whose parent is missing (not closed under prefixes), and a
    ``num_speculative_tokens`` other than the number of nodes (vLLM counts the nodes).
    """
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"{key} must be a Python literal list of tuples such as "
                             f"'[(0,), (1,), (0, 0)]', got {value!r}: {err}") from None  # fmt: skip
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key} must be a non-empty list of paths (tuples of child ranks), got {value!r}")
    paths = []
    for path in value:
        if not isinstance(path, (list, tuple)) or not path or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path
        ):
            raise ValueError(f"{key}: each path must be a non-empty tuple of ranks >= 0, got {path!r}")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        repeated = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"{key}: paths {repeated} appear more than once")
    known = set(paths)
    missing = sorted({p[:-1] for p in paths if len(p) > 1 and p[:-1] not in known})
    if missing:
        raise ValueError(f"{key} is not closed under prefixes: the parents {missing} of some paths are missing")
    tree = DraftTree(tuple(sorted(paths, key=lambda p: (len(p), p))))
    if num_speculative_tokens is not None and num_speculative_tokens != tree.num_nodes:
        raise ValueError(f"{key} has {tree.num_nodes} nodes, but num_speculative_tokens is "
                         f"{num_speculative_tokens}; as in vLLM, it must equal the number of nodes")  # fmt: skip
    return tree


def check_parents(parents: Sequence[int], num_nodes: int, name: str = "parents") -> None:
    """A node's parent precedes it (breadth-first order), or is the root."""
    if len(parents) != num_nodes:
        raise ValueError(f"{name} must hold one parent for each of the {num_nodes} drafts, got {len(parents)}")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(f"{name}[{i}] = {parent}: a draft's parent must be an earlier draft or {ROOT} (the root)")


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node, 1 for the root's children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the root, ``node == ROOT``)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_visibility(parents: Sequence[int], width: int | None = None) -> torch.Tensor:
    """``[n + 1, width]`` bool: row ``i`` (0 the root, ``j + 1`` node ``j``) sees column ``c`` iff ``c`` is itself
    or an ancestor, the root included. ``width`` (default ``n + 1``) pads with unseen columns."""
    n = len(parents)
    width = n + 1 if width is None else width
    visible = torch.zeros(n + 1, width, dtype=torch.bool)
    visible[0, 0] = True
    for j, parent in enumerate(parents):
        visible[j + 1, : n + 1] = visible[parent + 1, : n + 1]  # ROOT + 1 = row 0
        visible[j + 1, j + 1] = True
    return visible
