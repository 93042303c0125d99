"""A static draft tree's greedy level passes as one compiled call (CPU, ``cpu_compile``).

``specdec.proposers.eagle3_tree.draft_tree`` runs one head pass per level of a tree and
builds each pass on the host: which nodes, whose pre-norm each is fed, who sees whom, and
the level's ranked tokens read back before the next level can be fed. On a CPU each of
those passes also pays a compiled call's fixed entry, so a tree of depth ``D`` would pay
``D - 1`` entries and round trips where a chain's greedy steps pay one per
``STEPS_PER_CALL`` (``compiled_steps``). For a greedy step every one of those host decisions follows from the
tree's shape alone: the nodes of a level, their parents, their ranks and the visibility
mask are constants of the shape, and the tokens are the ranked ids of the parents' rows.
Here the whole tree is traced as one graph per shape, the constants baked in, and its
tokens come back in one copy.

The passes are the eager path's, row for row: each level's nodes (all of them, so that
they are written at the same cache positions, ``base + 1 + j`` for node ``j``) rotate at
``base + depth`` and see the verified rows and their own ancestors. The tokens equal the
eager path's up to the order of float sums in the compiled graph; either way the tree's
verification keeps the target's output.
"""
from __future__ import annotations

import torch

from specdec.fast.cpu_compile import compile_dynamic
from specdec.fast.llama import TreeAttention
from specdec.heads.eagle3 import Eagle3Head
from specdec.tree import DraftTree, tree_visibility


class CompiledGreedyTree:
    """The greedy tokens of one static tree shape (a ``DraftTree`` with more than a chain), one call a step."""

    def __init__(self, head: Eagle3Head, draft_targets: torch.Tensor, tree: DraftTree):
        """``draft_targets``: [draft_vocab] the target id of each draft id."""
        self.head = head
        self.draft_targets = draft_targets
        # the shape as plain constants for the trace (Dynamo does not trace the tree's derived properties)
        depths = self._depths = tree.depths
        self._parents, self._ranks = tree.parents, tuple(path[-1] for path in tree.paths)
        self._max_rank, self._num_nodes = tree.max_rank, tree.num_nodes
        # per level with children: the first and last node index (a level is contiguous: nodes are breadth-first)
        self._levels = [(depths.index(d), len(depths) - depths[::-1].index(d) - 1) for d in range(1, tree.max_depth)]
        visible = tree_visibility(tree.parents)[1:, 1:]  # [n, n]: node sees node (the root is below base)
        self._visible = [visible[first : last + 1].to(head.device) for first, last in self._levels]  # [m, n] each
        self._compiled = compile_dynamic(self._tree)

    @torch.inference_mode()  # at warm-up too: grad mode is part of a compiled graph's guards
    def run(
        self,
        root_logits: torch.Tensor,  # [B, draft_vocab]: each row's last verified row's logits
        root_prenorm: torch.Tensor,  # [B, h]: that row's pre-norm
        base: torch.Tensor,  # [B] int64: the last verified position of each row; node j is written at base + 1 + j
        slots: torch.Tensor,  # [B] int64
        kv: torch.Tensor,  # the head's cache
        kv_len: int,  # positions a pass attends: max(base) + 1 + num_nodes (the host's count)
        banned: torch.Tensor,  # [B, draft_vocab] bool: ids masked while a row's bans bind
        bans_left: torch.Tensor,  # [B] int64: how many more depths of each row the bans bind
    ) -> torch.Tensor:  # [B, num_nodes] target ids, node order
        return self._compiled(root_logits, root_prenorm, base, slots, kv, kv_len, banned, bans_left)

    def _ranked(self, logits: torch.Tensor, depth: int, banned, bans_left) -> torch.Tensor:
        """``[..., max_rank]`` target ids of ``logits`` ``[B, ..., draft_vocab]``, most probable first."""
        bind = (bans_left > depth).view(-1, *([1] * (logits.dim() - 1)))  # [B, 1, ...]
        masked = logits.masked_fill(banned.view(banned.shape[0], *([1] * (logits.dim() - 2)), -1) & bind, float("-inf"))
        return self.draft_targets[masked.topk(self._max_rank, dim=-1).indices]

    def _tree(self, root_logits, root_prenorm, base, slots, kv, kv_len: int, banned, bans_left):
        parents, ranks, depths, n = self._parents, self._ranks, self._depths, self._num_nodes
        b = root_logits.shape[0]
        ranked = {-1: self._ranked(root_logits, 0, banned, bans_left)}  # node (-1: root) -> [B, max_rank]
        prenorm = {-1: root_prenorm}  # node -> [B, h]
        tokens = [ranked[-1][:, ranks[j]] if parents[j] < 0 else None for j in range(n)]  # n x [B]
        for depth, ((first, last), visible) in enumerate(zip(self._levels, self._visible), 1):
            m = last - first + 1
            ids = torch.stack(tokens[first : last + 1], 1)  # [B, m]
            hidden = torch.stack([prenorm[parents[j]] for j in range(first, last + 1)], 1)  # [B, m, h]
            positions = (base + depth)[:, None].expand(b, m).contiguous()  # [B, m]: a depth-d node rotates at base + d
            attention = TreeAttention(base + 1, positions, visible[None].expand(b, m, n))
            num_new = torch.full_like(base, m)  # [B]
            logits, out = self.head(ids, hidden, base + 1 + first, num_new, slots, kv, kv_len, attention)
            level_ranked = self._ranked(logits, depth, banned, bans_left)  # [B, m, max_rank]
            for s, j in enumerate(range(first, last + 1)):
                ranked[j], prenorm[j] = level_ranked[:, s], out[:, s]
            for j in range(last + 1, n):
                if depths[j] == depth + 1:
                    tokens[j] = ranked[parents[j]][:, ranks[j]]
        return torch.stack(tokens, 1)  # [B, n]
