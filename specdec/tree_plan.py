"""The static tree that decodes fastest, from a drafter's measured acceptance and the step's measured cost.

A tree pays for every node (a verified position, a drafted row) and gains only where its
path is accepted. Which nodes are worth it depends on the machine as much as on the
drafter: on a GPU a verified position costs almost nothing until the batch fills the
device, on a CPU every one is paid in full. This module picks the shape the way Sequoia
does (Chen et al. 2024, "Sequoia", hardware-aware tree optimizer): the expected tokens a
tree accepts, over what its step is measured to cost.

Under greedy decoding a tree's yield is additive. A path of child ranks ``P`` is accepted
exactly when the target's own continuation, ranked at each depth by the drafter, starts
with ``P``; that depends on the drafter and the context, not on which other nodes the tree
holds (each node sees only its ancestors). So a step emits ``1 + sum(rate(P))`` tokens on
average over the nodes ``P`` of the tree, the rates read once off a large *measurement
tree* (:meth:`PathAcceptance.from_steps`). A child is never accepted without its parent,
so its rate is at most its parent's, and the ``N`` likeliest paths within a depth form a
tree (closed under prefixes): for a step cost that grows with the nodes and the depth,
the best tree of ``N`` nodes and depth at most ``D`` is those ``N`` paths.

Sampled requests accept a node with the target's probability of its token rather than
when it is the argmax; these rates are the greedy ones, which is what the benchmarks run.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdec.tree import DraftTree, chain


def measurement_tree(max_depth: int, max_rank: int, max_off_top: int) -> DraftTree:
    """Every path of at most ``max_depth`` ranks below ``max_rank`` that leaves the drafter's top
    choice at most ``max_off_top`` times: the candidates whose rates a measurement reads."""
    if min(max_depth, max_rank) < 1 or max_off_top < 0:
        raise ValueError(f"a measurement tree needs depth and ranks >= 1, got {max_depth}, {max_rank}, {max_off_top}")
    paths: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for _ in range(max_depth):
        level = [p + (r,) for p in level for r in range(max_rank) if sum(x > 0 for x in p + (r,)) <= max_off_top]
        paths += level
    return DraftTree(tuple(sorted(paths, key=lambda p: (len(p), p))))


@dataclass(frozen=True)
class PathAcceptance:
    """How often each path of a measurement tree was accepted, over ``steps`` verify steps."""

    counts: dict[tuple[int, ...], int]  # path of child ranks -> steps whose accepted path starts with it
    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"acceptance needs at least one step, got {self.steps}")
        for path, count in self.counts.items():
            parent = self.counts.get(path[:-1], self.steps) if len(path) > 1 else self.steps
            if not 0 <= count <= parent:
                raise ValueError(f"path {path} accepted {count} times, its parent {parent}: "
                                 "a child is never accepted more often than its parent")  # fmt: skip

    @classmethod
    def from_steps(cls, tree: DraftTree, accepted: Iterable[Sequence[int]]) -> PathAcceptance:
        """Each step's accepted nodes (indices into ``tree``, root's child first), over the measurement ``tree``."""
        counts = dict.fromkeys(tree.paths, 0)
        steps = 0
        for nodes in accepted:
            steps += 1
            for node in nodes:
                counts[tree.paths[node]] += 1
        return cls(counts, steps)

    def rate(self, path: tuple[int, ...]) -> float:
        """The fraction of steps that accepted ``path`` (and so all of its prefixes)."""
        return self.counts[path] / self.steps

    def tokens_per_step(self, tree: DraftTree) -> float:
        """Expected tokens a greedy step of ``tree`` emits: its accepted drafts and the target's own token."""
        missing = [p for p in tree.paths if p not in self.counts]
        if missing:
            raise ValueError(f"paths {missing[:4]} were not in the measurement tree; their rates are unknown")
        return 1.0 + sum(self.rate(p) for p in tree.paths)


@dataclass(frozen=True)
class StepCost:
    """A step's seconds as a line in the tree's size and depth, one sequence: the planner's cost model.

    ``depth_s`` is the drafter's sequential work (a head or draft pass per level), ``node_s``
    what each node adds to the drafted rows and the verified positions, ``call_s`` what a step
    that drafts at all pays once (the propose call), ``fixed_s`` the rest of a k = 0 step.
    """

    fixed_s: float
    call_s: float
    depth_s: float
    node_s: float

    def seconds(self, num_nodes: int, depth: int) -> float:
        if num_nodes == 0:
            return self.fixed_s
        return self.fixed_s + self.call_s + self.depth_s * depth + self.node_s * num_nodes

    @classmethod
    def fit(cls, observations: Sequence[tuple[int, int, float]]) -> StepCost:
        """Least squares over measured steps ``(num_nodes, depth, seconds)``; needs k = 0 and shapes that vary
        nodes and depth apart (chains alone tie them). A negative coefficient is refit at zero."""
        import numpy as np

        shapes = {(n, d) for n, d, _ in observations}
        if (0, 0) not in shapes or not any(n > d > 0 for n, d in shapes) or len({d for _, d in shapes}) < 3:
            raise ValueError(f"fitting a step's cost needs k = 0, a tree wider than it is deep and three depths; "
                             f"got shapes {sorted(shapes)}")  # fmt: skip
        x = np.array([[1.0, float(n > 0), d, n] for n, d, _ in observations])  # [obs, 4]
        y = np.array([s for _, _, s in observations])  # [obs]
        free = list(range(4))
        while True:
            coef = np.zeros(4)
            coef[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
            negative = [i for i in free if coef[i] < 0 and i > 0]
            if not negative:
                return cls(*(float(c) for c in coef))
            free.remove(min(negative, key=lambda i: coef[i]))


@dataclass(frozen=True)
class TreePlan:
    """A tree (None: no drafts), what a step of it emits and costs by the measurements."""

    tree: DraftTree | None
    tokens_per_step: float
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def num_nodes(self) -> int:
        return 0 if self.tree is None else self.tree.num_nodes


def plan(tree: DraftTree | None, acceptance: PathAcceptance, cost: StepCost) -> TreePlan:
    """What ``tree`` (None: k = 0) yields and costs by the measurements."""
    if tree is None:
        return TreePlan(None, 1.0, cost.seconds(0, 0))
    return TreePlan(tree, acceptance.tokens_per_step(tree), cost.seconds(tree.num_nodes, tree.max_depth))


def best_trees(acceptance: PathAcceptance, cost: StepCost, max_nodes: int) -> list[TreePlan]:
    """For each node count 1..``max_nodes``, the fastest tree of that many nodes the measurement tree holds.

    At each depth bound the likeliest paths go in first (ties: shallower, then lower ranks,
    so a parent always precedes its children); over the depth bounds the fastest is kept.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    ranked = sorted(acceptance.counts, key=lambda p: (-acceptance.counts[p], len(p), p))
    best: dict[int, TreePlan] = {}
    for depth_bound in range(1, max(map(len, ranked)) + 1):
        kept: list[tuple[int, ...]] = []
        for path in ranked:
            if len(path) > depth_bound or len(kept) == max_nodes:
                continue
            kept.append(path)
            candidate = plan(DraftTree(tuple(sorted(kept, key=lambda p: (len(p), p)))), acceptance, cost)
            known = best.get(len(kept))
            if known is None or candidate.tokens_per_s > known.tokens_per_s:
                best[len(kept)] = candidate
    return [best[n] for n in sorted(best)]


def best_chain(acceptance: PathAcceptance, cost: StepCost, max_depth: int) -> TreePlan:
    """The fastest chain of 1..``max_depth`` drafts (or k = 0, where no chain pays) by the same measurements."""
    plans = [plan(None, acceptance, cost)] + [plan(chain(k), acceptance, cost) for k in range(1, max_depth + 1)]
    return max(plans, key=lambda p: p.tokens_per_s)
