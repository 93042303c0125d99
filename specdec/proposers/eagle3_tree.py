"""EAGLE-3 drafting a static token tree (``specdec.tree``), one head pass per level of the tree.

After the head has caught up on a sequence's verified rows (``Eagle3Proposer._draft``), the
last row's logits rank the root's children: the node whose path ends in rank ``r`` takes
the ``r``-th most probable token (EAGLE-2's and vLLM's static-tree rule: the drafter's
top-k at every node). To rank a node's own children the head runs that node as a row, fed
its token and the pre-norm output of its parent's row, as a chain step feeds the token
drafted before; every node of one depth runs in one pass, for every sequence at once.

A level's rows are written to the head's cache at distinct positions, node ``j`` at
``base + 1 + j`` (``base``: the last verified row), and rotate at ``base + depth``; each
row attends to the verified rows and to its own ancestors' rows (``TreeAttention``), so it
sees what the same node would see as the last draft of a chain. The rows past ``base`` are
never kept: the next call cuts the cache back to the rows built from the target's features,
as after a chain. Leaves need no pass, so a tree of depth ``D`` costs ``D - 1`` passes.

Children are chosen, not sampled, for greedy and sampled requests alike: the tree's
verification (``specdec.tree_sampler``) is lossless for any choice, so no ``q`` is sent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.fast.llama import TreeAttention
from specdec.tree import DraftTree, DynamicTree, tree_visibility
from specdec.types import ProposeRequest


def draft_tree(proposer, requests: list[ProposeRequest], bases: list[int], logits: torch.Tensor,
               prenorm: torch.Tensor, bans, tree: DraftTree) -> list[list[int]]:  # fmt: skip
    """Each request's tree tokens, breadth-first: ``tree`` cut to its ``num_tokens`` nodes.

    ``proposer`` is the ``Eagle3Proposer`` (its head, cache and id maps); ``logits``
    ``[B, draft_vocab]`` and ``prenorm`` ``[B, h]`` are each sequence's last verified row's. Greedy
    requests that all draft the whole tree take one compiled call where the proposer has one
    (``specdec.heads.compiled_tree``); the others a pass a level from here.
    """
    if proposer.greedy_tree is not None and proposer.uniform_greedy(requests) and \
            requests[0].num_tokens >= tree.num_nodes:  # fmt: skip
        return _draft_tree_compiled(proposer, requests, bases, logits, prenorm, bans, tree)
    trees = [tree.first(r.num_tokens) for r in requests]
    ranks = max(t.max_rank for t in trees)
    b = len(requests)
    tokens: list[list[int]] = [[] for _ in requests]  # target ids, node order
    # per sequence, per node that has run: the target ids its children rank from, and its row's pre-norm
    node_logits: list[dict[int, torch.Tensor]] = [{} for _ in requests]
    node_prenorm: list[dict[int, torch.Tensor]] = [{} for _ in requests]
    root_top = _top_targets(proposer, logits, ranks, 0, bans).tolist()  # [B][ranks] target ids
    for depth in range(1, max(t.max_depth for t in trees) + 1):
        level = [[j for j, d in enumerate(t.depths) if d == depth] for t in trees]
        for i, t in enumerate(trees):  # this depth's tokens, ranked under each node's parent
            parents = t.parents
            for j in level[i]:
                parent = parents[j]
                top = root_top[i] if parent < 0 else node_logits[i][parent]
                tokens[i].append(int(top[t.paths[j][-1]]))
        running = [i for i in range(b) if any(_has_children(trees[i], j) for j in level[i])]
        if not running:
            continue
        out_logits, out_prenorm = _level_pass(proposer, requests, bases, trees, level, tokens, prenorm, node_prenorm,
                                              running, depth)  # fmt: skip
        width = out_logits.shape[1]
        top = _top_targets(proposer, out_logits.flatten(0, 1), ranks, depth, bans,
                           rows=[i for i in running for _ in range(width)])  # fmt: skip
        top = top.view(len(running), width, ranks).tolist()  # the level's one copy to the host
        for row, i in enumerate(running):
            for s, j in enumerate(level[i]):
                node_logits[i][j] = top[row][s]
                node_prenorm[i][j] = out_prenorm[row, s]
    return tokens


def _draft_tree_compiled(proposer, requests: list[ProposeRequest], bases: list[int], logits: torch.Tensor,
                         prenorm: torch.Tensor, bans, tree: DraftTree) -> list[list[int]]:  # fmt: skip
    """``draft_tree`` of greedy requests that all draft the whole ``tree``: its passes in one compiled call."""
    b = len(requests)
    host = torch.tensor(bases + [proposer.cache.slot(r.seq_id) for r in requests], dtype=torch.long)
    base, slots = host.to(proposer.device, non_blocking=True).view(2, b)  # [B] each
    banned, num_banned = bans if bans is not None else (torch.zeros_like(logits, dtype=torch.bool),
                                                        torch.zeros_like(base))  # fmt: skip
    kv_len = max(bases) + 1 + tree.num_nodes
    return proposer.greedy_tree.run(logits, prenorm, base, slots, proposer.cache.kv, kv_len, banned,
                                     num_banned).tolist()  # fmt: skip


def draft_dynamic_tree(proposer, requests: list[ProposeRequest], bases: list[int], logits: torch.Tensor,
                       prenorm: torch.Tensor, bans, shape: DynamicTree) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Each request's tree by EAGLE-2's rule (``specdec.tree.DynamicTree``), at most ``num_tokens`` nodes:
    its tokens and parents, parents first. ``shape.depth - 1`` head passes, ``topk`` rows a sequence each."""
    k = shape.topk
    # per sequence, the candidates: [target id, parent candidate (-1: root), cumulative log prob, depth]
    found: list[list[list]] = [[] for _ in requests]
    lp, ids = _top_log_probs(proposer, logits, k, 0, bans)  # [B, k] each
    level = [[len(found[i]) + c for c in range(k)] for i in range(len(requests))]
    for i in range(len(requests)):
        found[i] += [[ids[i][c], -1, lp[i][c], 1] for c in range(k)]
    slot: list[dict[int, int]] = [{} for _ in requests]  # candidate -> its tree slot, once fed
    node_prenorm: list[dict[int, torch.Tensor]] = [{} for _ in requests]
    running = list(range(len(requests)))
    for depth in range(1, shape.depth):
        rows = []
        for i in running:
            fed = sorted(level[i], key=lambda c: -found[i][c][2])[:k]  # the likeliest of the level
            first = len(slot[i])
            for c in fed:
                slot[i][c] = len(slot[i])
            span = first + len(fed)
            visible = torch.zeros(len(fed), span, dtype=torch.bool)
            for row, c in enumerate(fed):
                node = c
                while node >= 0:  # itself and its ancestors, all fed before it
                    visible[row, slot[i][node]] = True
                    node = found[i][node][1]
            parents = [found[i][c][1] for c in fed]
            hidden = [prenorm[i] if p < 0 else node_prenorm[i][p] for p in parents]
            rows.append(NodeRows([found[i][c][0] for c in fed], hidden, visible, first, first + k))
            level[i] = fed
        out_logits, out_prenorm = _run_nodes(proposer, requests, bases, running, rows, depth)
        width = out_logits.shape[1]
        lp, ids = _top_log_probs(proposer, out_logits.flatten(0, 1), k, depth, bans,
                                 rows=[i for i in running for _ in range(width)])  # fmt: skip
        for r, i in enumerate(running):
            children = []
            for s, c in enumerate(level[i]):
                node_prenorm[i][c] = out_prenorm[r, s]
                for j in range(k):
                    children.append(len(found[i]))
                    found[i].append([ids[r * width + s][j], c, found[i][c][2] + lp[r * width + s][j], depth + 1])
            level[i] = children
    tokens, parents = [], []
    for i, r in enumerate(requests):
        order = sorted(range(len(found[i])), key=lambda c: (-found[i][c][2], found[i][c][3], c))[: r.num_tokens]
        order.sort(key=lambda c: (found[i][c][3], -found[i][c][2]))  # by depth: parents first
        index = {c: n for n, c in enumerate(order)}
        tokens.append([found[i][c][0] for c in order])
        parents.append(tuple(-1 if found[i][c][1] < 0 else index[found[i][c][1]] for c in order))
    return tokens, parents


def _top_log_probs(proposer, logits: torch.Tensor, k: int, depth: int, bans, rows: list[int] | None = None):
    """The ``k`` likeliest target ids of each row and their draft log probabilities, as host lists ``[n][k]``."""
    if bans is not None:
        mask, num_banned = bans if rows is None else (bans[0][rows], bans[1][rows])
        logits = logits.masked_fill(mask & (depth < num_banned)[:, None], float("-inf"))
    values, indices = logits.float().log_softmax(-1).topk(k, dim=-1)
    return values.tolist(), proposer.draft_targets[indices].tolist()


def _has_children(tree: DraftTree, node: int) -> bool:
    return node in tree.parents


def _level_pass(proposer, requests, bases, trees, level, tokens, root_prenorm, node_prenorm, running, depth):
    """One head pass over the nodes of ``depth`` of each running sequence of a static tree: logits
    ``[R, S, draft_vocab]`` and pre-norm ``[R, S, h]``, row ``s`` of a sequence being its ``s``-th node of the level."""
    rows = []
    for i in running:
        t, nodes = trees[i], level[i]
        parents = t.parents
        hidden = [root_prenorm[i] if parents[j] < 0 else node_prenorm[i][parents[j]] for j in nodes]
        seen = tree_visibility(parents)[1:, 1:]  # [n, n]: node sees node (the root's row is verified, below base)
        rows.append(NodeRows([tokens[i][j] for j in nodes], hidden, seen[nodes[0] : nodes[-1] + 1], nodes[0], t.num_nodes))
    return _run_nodes(proposer, requests, bases, running, rows, depth)


@dataclass
class NodeRows:
    """One sequence's rows of a tree pass: nodes written from tree slot ``first_slot`` on."""

    tokens: list[int]  # [n] target ids
    hidden: list[torch.Tensor]  # n x [h]: each node's parent's pre-norm (the root's row for depth 1)
    visible: torch.Tensor  # [n, <= span] bool: node sees the tree slot
    first_slot: int
    span: int  # tree slots the sequence may use this call


def _run_nodes(proposer, requests, bases, running, rows: list[NodeRows], depth: int):
    """One head pass over ``rows`` (one entry per running sequence), each node rotating at ``base + depth``:
    logits ``[R, S, draft_vocab]`` and pre-norm ``[R, S, h]``."""
    device = proposer.device
    width = max(len(r.tokens) for r in rows)
    span = max(r.span for r in rows)  # tree positions a row may see
    ids = torch.zeros(len(running), width, dtype=torch.long)
    hidden = torch.zeros(len(running), width, rows[0].hidden[0].shape[-1], dtype=rows[0].hidden[0].dtype,
                         device=device)  # fmt: skip
    visible = torch.zeros(len(running), width, span, dtype=torch.bool)
    starts, num_new, slots, tree_base = [], [], [], []
    for row, (i, r) in enumerate(zip(running, rows)):
        n = len(r.tokens)
        ids[row, :n] = torch.tensor(r.tokens)
        hidden[row, :n] = torch.stack(r.hidden)
        visible[row, :n, : r.visible.shape[1]] = r.visible
        visible[row, n:, 0] = True  # padding rows see something: no empty softmax
        starts.append(bases[i] + 1 + r.first_slot)
        num_new.append(n)
        slots.append(proposer.cache.slot(requests[i].seq_id))
        tree_base.append(bases[i] + 1)
    host = torch.tensor([starts, num_new, slots, tree_base], dtype=torch.long)
    starts_t, num_new_t, slots_t, base_t = host.to(device, non_blocking=True)  # [R] each
    positions = (base_t + depth - 1)[:, None].expand(len(running), width)  # [R, S]: a depth-d node rotates at base + d
    tree = TreeAttention(base_t, positions.contiguous(), visible.to(device, non_blocking=True))
    kv_len = max(bases[i] + 1 + r.span for i, r in zip(running, rows))
    return proposer.head_forward(ids.to(device, non_blocking=True), hidden, starts_t, num_new_t, slots_t,
                                  proposer.cache.kv, kv_len, tree)  # fmt: skip


def _top_targets(proposer, logits: torch.Tensor, ranks: int, depth: int, bans, rows: list[int] | None = None):
    """The ``ranks`` most probable target ids of each row of ``logits`` ``[n, draft_vocab]``, banned ids masked
    where ``min_tokens`` binds the draft at this depth (output index ``depth`` past the step's first)."""
    if bans is not None:
        mask, num_banned = bans if rows is None else (bans[0][rows], bans[1][rows])
        logits = logits.masked_fill(mask & (depth < num_banned)[:, None], float("-inf"))
    return proposer.draft_targets[logits.topk(ranks, dim=-1).indices]  # [n, ranks]
