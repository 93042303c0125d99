"""The tree planner: acceptance read off measured steps, a fitted step cost, and the fastest tree of each size."""
from __future__ import annotations

import itertools
import random

import pytest

from specdec.tree import DraftTree, chain, parse_token_tree
from specdec.tree_plan import PathAcceptance, StepCost, best_chain, best_trees, measurement_tree, plan


def test_a_measurement_tree_holds_every_path_within_its_bounds() -> None:
    tree = measurement_tree(max_depth=3, max_rank=3, max_off_top=1)
    expected = {p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d) if sum(r > 0 for r in p) <= 1}
    assert set(tree.paths) == expected
    assert parse_token_tree(tree.spec()) == tree  # closed under prefixes, breadth-first
    with pytest.raises(ValueError, match="depth and ranks"):
        measurement_tree(0, 2, 1)


def test_acceptance_counts_every_prefix_of_each_accepted_path() -> None:
    tree = parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0)]")
    # nodes: 0 (0,), 1 (1,), 2 (0, 0), 3 (0, 1), 4 (1, 0)
    acceptance = PathAcceptance.from_steps(tree, [(0, 2), (0,), (1, 4), (), (0, 3)])
    assert acceptance.steps == 5
    assert acceptance.counts == {(0,): 3, (1,): 1, (0, 0): 1, (0, 1): 1, (1, 0): 1}
    assert acceptance.tokens_per_step(tree) == pytest.approx(1 + 7 / 5)
    assert acceptance.tokens_per_step(chain(2)) == pytest.approx(1 + 4 / 5)
    with pytest.raises(ValueError, match="not in the measurement tree"):
        acceptance.tokens_per_step(chain(3))


def test_acceptance_refuses_a_child_accepted_more_often_than_its_parent() -> None:
    with pytest.raises(ValueError, match=r"path \(0, 0\) accepted 3 times, its parent 2"):
        PathAcceptance({(0,): 2, (0, 0): 3}, steps=4)
    with pytest.raises(ValueError, match="at least one step"):
        PathAcceptance({}, steps=0)


def test_the_fit_recovers_a_line_in_nodes_and_depth() -> None:
    truth = StepCost(fixed_s=5e-3, call_s=1e-3, depth_s=1.2e-3, node_s=0.2e-3)
    shapes = [(0, 0), (1, 1), (2, 2), (3, 3), (4, 1), (6, 2), (9, 3)]
    fitted = StepCost.fit([(n, d, truth.seconds(n, d)) for n, d in shapes])
    for got, want in zip((fitted.fixed_s, fitted.call_s, fitted.depth_s, fitted.node_s),
                         (truth.fixed_s, truth.call_s, truth.depth_s, truth.node_s)):  # fmt: skip
        assert got == pytest.approx(want, rel=1e-6)


def test_a_negative_slope_is_refit_at_zero() -> None:
    # a node that seems to save time (noise) would plan an infinite tree: it is held at zero instead
    observations = [(0, 0, 5.0), (1, 1, 7.0), (2, 2, 8.0), (3, 3, 9.0), (4, 1, 6.5), (9, 3, 8.0)]
    fitted = StepCost.fit(observations)
    assert min(fitted.call_s, fitted.depth_s, fitted.node_s) >= 0
    assert fitted.node_s == 0


def test_the_fit_refuses_shapes_that_cannot_tell_nodes_from_depth() -> None:
    with pytest.raises(ValueError, match="wider than it is deep"):
        StepCost.fit([(0, 0, 1.0), (1, 1, 2.0), (2, 2, 3.0), (3, 3, 4.0)])
    with pytest.raises(ValueError, match="k = 0"):
        StepCost.fit([(1, 1, 2.0), (2, 2, 3.0), (4, 1, 3.0)])


def _random_acceptance(tree: DraftTree, steps: int, seed: int) -> PathAcceptance:
    """Steps whose accepted path walks down ``tree``, each child taken with a rank- and depth-falling chance."""
    rng = random.Random(seed)
    children = tree.children()
    accepted = []
    for _ in range(steps):
        node, path = -1, []
        while True:
            kids = children[node]
            chosen = next((c for r, c in enumerate(kids) if rng.random() < 0.8 / (1 + 2 * r)), None)
            if chosen is None:
                break
            path.append(chosen)
            node = chosen
        accepted.append(tuple(path))
    return PathAcceptance.from_steps(tree, accepted)


def _prefix_closed_subtrees(tree: DraftTree, size: int):
    for nodes in itertools.combinations(tree.paths, size):
        chosen = set(nodes)
        if all(len(p) == 1 or p[:-1] in chosen for p in nodes):
            yield DraftTree(tuple(sorted(nodes, key=lambda p: (len(p), p))))


@pytest.mark.parametrize("cost", [
    StepCost(fixed_s=5e-3, call_s=1e-3, depth_s=1.5e-3, node_s=0.1e-3),  # levels dear, nodes cheap (a CPU head)
    StepCost(fixed_s=5e-3, call_s=1e-3, depth_s=0.1e-3, node_s=1.0e-3),  # nodes dear
])
def test_each_planned_tree_is_the_fastest_of_its_size(cost: StepCost) -> None:
    """Against every prefix-closed subtree of the measurement tree, by brute force."""
    measured = measurement_tree(max_depth=3, max_rank=3, max_off_top=2)
    acceptance = _random_acceptance(measured, steps=400, seed=3)
    plans = best_trees(acceptance, cost, max_nodes=6)
    assert [p.num_nodes for p in plans] == [1, 2, 3, 4, 5, 6]
    for p in plans:
        fastest = max(plan(t, acceptance, cost).tokens_per_s for t in _prefix_closed_subtrees(measured, p.num_nodes))
        assert p.tokens_per_s == pytest.approx(fastest)
        assert parse_token_tree(p.tree.spec()) == p.tree


def test_costly_levels_plan_wide_trees_and_costly_nodes_plan_chains() -> None:
    measured = measurement_tree(max_depth=4, max_rank=3, max_off_top=2)
    acceptance = _random_acceptance(measured, steps=400, seed=5)
    levels_dear = best_trees(acceptance, StepCost(5e-3, 1e-3, depth_s=3e-3, node_s=1e-5), max_nodes=8)[-1]
    assert levels_dear.tree.max_rank > 1 and levels_dear.tree.max_depth < 8
    nodes_dear = best_trees(acceptance, StepCost(5e-3, 1e-3, depth_s=1e-5, node_s=3e-3), max_nodes=3)
    assert nodes_dear[-1].tree == chain(3)


def test_the_best_chain_may_be_no_drafts_at_all() -> None:
    measured = measurement_tree(max_depth=3, max_rank=2, max_off_top=1)
    acceptance = PathAcceptance.from_steps(measured, [()] * 10)  # nothing ever accepted
    cost = StepCost(5e-3, 1e-3, 1e-3, 1e-4)
    assert best_chain(acceptance, cost, max_depth=3).tree is None
    assert best_chain(_random_acceptance(measured, 400, 1), StepCost(5e-3, 0, 1e-5, 1e-5), 3).tree == chain(3)
