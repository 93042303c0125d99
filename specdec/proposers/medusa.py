"""Medusa proposer: every draft of a step from one pass of the heads over the target's last hidden state.

The state of a sequence is its tokens and the target's final hidden state at the last
verified position (``N - 2`` for ``N`` tokens: the one the target's prediction of the last
token ``N - 1`` came from, as for the MLP speculator); head ``i`` drafts token ``N + i``,
the ``i + 1``-th draft. The heads read no drafted token, so the drafts of one step are
independent of each other and cost one pass whatever their number.

* A chain of ``k`` drafts: head ``i``'s argmax (greedy), or a draw from its processed
  distribution ``q`` (sampled, ``q`` sent with the drafts; a head's ``q`` is a valid proposal
  for its position whatever the drafts before it, so the rejection sampler stays lossless).
* A static tree (``specdec.tree``, Medusa's Cartesian tree): the node whose path of ranks
  ends in ``r`` at depth ``d`` takes head ``d - 1``'s ``r``-th most probable token, whatever
  its parent's token; chosen, not sampled, for greedy and sampled requests alike, as the
  tree's verification (``specdec.tree_sampler``) is lossless for any choice.

A request for more drafts (or a tree deeper) than the heads is refused, naming ``num_heads``.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.grammar import guided_picks
from specdec.heads.medusa import Medusa
from specdec.proposers.base import DraftLimit, check_draft_limit, drafts_as_chain, proposals_in_order
from specdec.proposers.last_hidden import DraftsFromLastHidden, LastHiddenSequences
from specdec.sampling import apply_logit_bias, make_generator, process_logits, sample_from_probs
from specdec.tree import DraftTree
from specdec.types import Proposal, ProposeRequest




class MedusaProposer(DraftsFromLastHidden):
    method = "medusa"
    max_num_seqs = None  # no cache: any number of sequences
    max_model_len = None

    def __init__(self, model: Medusa, target_num_layers: int, tree: DraftTree | None = None):
        """``tree``: draft this static tree, cut to each request's ``num_tokens`` nodes (None or a chain: a chain)."""
        if tree is not None and tree.max_depth > model.num_heads:
            raise ValueError(f"speculative_token_tree is {tree.max_depth} deep, but the Medusa head has "
                             f"num_heads={model.num_heads}: a tree may be at most num_heads deep")  # fmt: skip
        self.model = model
        self.tree = tree if tree is not None and not tree.is_chain else None
        self.device = model.lm_heads[0].weight.device
        self.vocab_size = model.vocab_size
        self.hidden_state_layers = (target_num_layers,)  # the target's final normed hidden state
        self.draft_limit = DraftLimit(model.num_heads, "a Medusa head", f"num_heads={model.num_heads}", "heads",
                                      "num_heads")  # fmt: skip
        self._seqs = LastHiddenSequences(self.device)

    @property
    def num_heads(self) -> int:
        return self.model.num_heads

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        self._seqs.check(requests)
        width = self.model.config.hidden_size
        if self.tree is None:  # a tree's nodes may outnumber the heads; its depth may not (checked at build)
            check_draft_limit(requests, self.draft_limit)
        for r in requests:
            if r.hidden_states is not None and r.hidden_states.shape[-1] != width:
                raise ValueError(f"seq {r.seq_id!r}: hidden_states of width {r.hidden_states.shape[-1]}; the Medusa "
                                 f"head reads the target's last hidden state, hidden_size={width}")  # fmt: skip
        drafting = self._seqs.take(requests)
        if not drafting:
            return proposals_in_order(requests, [], [], [])
        as_tree = not drafts_as_chain(self.tree, drafting)
        if as_tree:
            drafts, q_rows = self._draft_tree(drafting), [[] for _ in drafting]
        else:
            drafts, q_rows = self._draft_chain(drafting)
        proposals = proposals_in_order(requests, drafting, drafts, q_rows)
        if not as_tree:
            return proposals
        return [replace(p, parents=self.tree.first(len(p.token_ids)).parents) if len(p.token_ids) else p
                for p in proposals]  # fmt: skip

    def _logits(self, requests: list[ProposeRequest], depth: int) -> torch.Tensor:
        """``[depth, B, vocab]``: the first ``depth`` heads' logits for each request, with its logit bias, each
        head's banned ids at -inf where ``min_tokens`` binds its draft (head ``i`` drafts output index ``i``
        past the step's first)."""
        hidden = torch.stack([self._seqs[r.seq_id].hidden for r in requests])  # [B, h]
        logits = self.model(hidden, depth)  # [depth, B, vocab] float32
        for i, r in enumerate(requests):
            if r.sampling.logit_bias:  # as the target's distribution has it
                logits[:, i] = apply_logit_bias(logits[:, i], r.sampling.logit_bias)
            if r.banned_token_ids and r.num_banned_tokens:
                banned = torch.tensor(r.banned_token_ids, device=logits.device)
                logits[: r.num_banned_tokens, i].index_fill_(-1, banned, float("-inf"))
        return logits

    def _draft_chain(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        logits = self._logits(requests, max(r.num_tokens for r in requests))  # [k, B, vocab]
        picks = logits.argmax(-1)  # [k, B]: greedy requests' drafts; sampled ones' columns are drawn below
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        for i, r in enumerate(requests):
            generator = None if r.sampling.greedy else make_generator(r.seed, self.device)
            if r.guide is not None:  # structured output: picked one by one under the grammar
                guided, q = guided_picks(logits[: r.num_tokens, i], r, generator)
                picks[: r.num_tokens, i] = torch.tensor(guided, dtype=torch.long, device=picks.device)
                q_rows[i] = [] if q is None else list(q.split(1))
                continue
            if generator is None:
                continue
            q = process_logits(logits[: r.num_tokens, i], r.sampling)  # [k_i, vocab]: head j's q for draft j
            picks[: r.num_tokens, i] = torch.cat([sample_from_probs(q[j : j + 1], generator)
                                                  for j in range(r.num_tokens)])  # fmt: skip
            q_rows[i] = list(q.split(1))
        rows = picks.T.tolist()  # [B, k]: the one copy to the host
        return [row[: r.num_tokens] for row, r in zip(rows, requests)], q_rows

    def _draft_tree(self, requests: list[ProposeRequest]) -> list[list[int]]:
        trees = [self.tree.first(r.num_tokens) for r in requests]
        depth = max(t.max_depth for t in trees)
        ranks = max(t.max_rank for t in trees)
        top = self._logits(requests, depth).topk(ranks, dim=-1).indices.tolist()  # [depth][B][ranks]
        return [[top[len(path) - 1][i][path[-1]] for path in t.paths] for i, t in enumerate(trees)]
