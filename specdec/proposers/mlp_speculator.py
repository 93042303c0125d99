"""MLP-speculator proposer: ``n_predict`` stages draft from the target's last hidden state.

The state of a sequence is its tokens and the target's final hidden state at the last
verified position (``N - 2`` for ``N`` tokens: the one the target's own prediction of
token ``N - 1`` came from); stage ``i`` reads the state and the last token and drafts
token ``i + 1``. ``q`` is the stage's processed distribution over the target's vocabulary.
A request for more drafts than the model has stages is refused, naming ``n_predict``.

A static tree (``specdec.proposers.static_tree``): stage ``d`` runs a row per node of depth
``d`` that has children, fed the node's token and the state its parent's row left, and the
row's candidates are the node's children; a tree may be at most ``n_predict`` deep.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.grammar import guided_row
from specdec.heads.mlp_speculator import MLPSpeculator
from specdec.proposers.base import DraftLimit, check_draft_limit, drafts_as_chain, proposals_in_order
from specdec.proposers.last_hidden import DraftsFromLastHidden, LastHiddenSequences
from specdec.proposers.static_tree import Row, grow_tree, ranked_candidates
from specdec.sampling import apply_logit_bias, greedy_tokens, make_generator, process_logits, sample_from_probs
from specdec.tree import DraftTree
from specdec.types import Proposal, ProposeRequest


class MLPSpeculatorProposer(DraftsFromLastHidden):
    method = "mlp_speculator"
    max_num_seqs = None  # no cache: any number of sequences
    max_model_len = None

    def __init__(self, model: MLPSpeculator, target_num_layers: int, tree: DraftTree | None = None):
        """``tree``: draft this static tree, cut to each request's ``num_tokens`` nodes (None or a chain: a chain)."""
        if tree is not None and tree.max_depth > model.n_predict:
            raise ValueError(f"speculative_token_tree is {tree.max_depth} deep, but the MLP speculator has "
                             f"n_predict={model.n_predict} stages: a tree may be at most n_predict deep")  # fmt: skip
        self.model = model
        self.tree = tree if tree is not None and not tree.is_chain else None
        self.device = model.head[0].weight.device
        self.vocab_size = model.vocab_size
        self.hidden_state_layers = (target_num_layers,)  # the target's final normed hidden state
        self.draft_limit = DraftLimit(model.n_predict, "an MLP speculator", f"n_predict={model.n_predict}", "stages",
                                      "n_predict")  # fmt: skip
        self._seqs = LastHiddenSequences(self.device)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        self._seqs.check(requests)
        if self.tree is None:  # a tree's nodes may outnumber the stages; its depth may not (checked at build)
            check_draft_limit(requests, self.draft_limit)
        for r in requests:
            if r.hidden_states is not None and r.hidden_states.shape[-1] != self.model.emb_dim:
                raise ValueError(
                    f"seq {r.seq_id!r}: hidden_states of width {r.hidden_states.shape[-1]}; the MLP speculator "
                    f"reads the target's last hidden state, emb_dim={self.model.emb_dim}"
                )
        drafting = self._seqs.take(requests)
        if not drafting or drafts_as_chain(self.tree, drafting):
            drafts, q_rows = self._draft(drafting) if drafting else ([], [])
            return proposals_in_order(requests, drafting, drafts, q_rows)
        trees = [self.tree.first(r.num_tokens) for r in drafting]
        proposals = proposals_in_order(requests, drafting, self._draft_tree(drafting, trees), [[] for _ in drafting])
        parents = {r.seq_id: t.parents for r, t in zip(drafting, trees)}
        return [replace(p, parents=parents[r.seq_id]) if len(p.token_ids) else p for r, p in zip(requests, proposals)]

    def _draft_tree(self, requests: list[ProposeRequest], trees: list[DraftTree]) -> list[list[int]]:
        """Each request's tree tokens, node order: stage ``d`` over the rows of depth ``d`` (``grow_tree``)."""
        seqs = [self._seqs[r.seq_id] for r in requests]
        ranks = max(t.max_rank for t in trees)
        states = {}  # (request, node) -> the state its row left, which its children's rows read

        def rank(depth: int, rows: list[Row], tokens: list[list[int]]) -> list[list[int]]:
            if depth == 0:  # the sequence's last token, from the target's hidden state
                state = self.model.first_state(torch.stack([seqs[i].hidden for i, _ in rows]))  # [R, emb_dim]
                fed = [seqs[i].tokens[-1] for i, _ in rows]
            else:
                state = torch.stack([states[i, trees[i].parents[node]] for i, node in rows])  # [R, inner]
                fed = [tokens[i][node] for i, node in rows]
            logits, out = self.model.stage(depth, state, torch.tensor(fed, dtype=torch.long, device=self.device))
            states.update({row: out[n] for n, row in enumerate(rows)})  # out: [R, inner]
            return ranked_candidates(logits, [requests[i] for i, _ in rows], depth, ranks)

        return grow_tree(trees, rank)

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        seqs = [self._seqs[r.seq_id] for r in requests]
        state = self.model.first_state(torch.stack([s.hidden for s in seqs]))  # [B, emb_dim]
        tokens = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.long, device=self.device)  # [B]
        generators = [None if r.sampling.greedy else make_generator(r.seed, self.device) for r in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        picks: list[torch.Tensor] = []  # one [B] per stage, on the device: read back once, after the last stage
        for step in range(max(r.num_tokens for r in requests)):
            logits, state = self.model.stage(step, state, tokens)  # [B, vocab], [B, inner]
            logits = logits.float()
            picked = []
            for i, r in enumerate(requests):
                banned = (int(step < r.num_banned_tokens), r.banned_token_ids)
                row = apply_logit_bias(logits[i : i + 1], r.sampling.logit_bias)  # [1, vocab]: as the target's
                if r.guide is not None:  # structured output: what the grammar allows after this row's drafts
                    row = guided_row(row, r.guide, [int(p[i]) for p in picks])
                if generators[i] is None:
                    picked.append(greedy_tokens(row, *banned))
                else:
                    q = process_logits(row, r.sampling, *banned)  # [1, vocab]
                    picked.append(sample_from_probs(q, generators[i]))
                    if r.num_tokens > step:
                        q_rows[i].append(q)
            tokens = torch.cat(picked)  # [B]
            picks.append(tokens)
        rows = torch.stack(picks, 1).tolist()  # [B, max k]
        return [row[: r.num_tokens] for row, r in zip(rows, requests)], q_rows
