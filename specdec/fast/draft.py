"""Batched draft-model proposals on the fast engine (same contract as ``DraftModelProposer``).

The draft samples ``d_i ~ q(. | x, d_<i)`` (Leviathan et al. 2023) for every request at
once: one ragged pass feeds each sequence the tokens its cache lacks -- found as the
longest common prefix of the cached ids and ``request.token_ids``, so accepted drafts
are never recomputed and rejected ones are rolled back by position -- then ``k - 1``
batched single-token passes extend every sequence still drafting. Draws match the
generic proposer: one generator per request from ``make_generator(request.seed)``,
one multinomial over ``process_logits`` per drafted token.
"""
from __future__ import annotations

import os

import torch

from specdec.fast.runner import FastCausalLM, ForwardCall
from specdec.models import OwnsOneModel, common_prefix_length
from specdec.sampling import greedy_tokens, make_generator, process_logits, sample_from_probs
from specdec.types import Proposal, ProposeRequest


class FastDraftProposer(OwnsOneModel):
    def __init__(self, path: str | os.PathLike, *args, **kwargs):
        """Arguments: those of :class:`~specdec.fast.runner.FastCausalLM`, which owns the model and its cache."""
        self._lm = FastCausalLM(path, *args, **kwargs)
        self._token_ids: dict[str, list[int]] = {}  # the ids each slot holds, in order

    def release(self, seq_id: str) -> None:
        super().release(seq_id)
        self._token_ids.pop(seq_id, None)

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        drafting = [r for r in requests if r.num_tokens > 0]
        self._check(drafting)
        try:
            drafts, q_rows = self._draft(drafting)
        except BaseException:
            for r in drafting:  # a half-extended cache costs only a re-prefill, never a wrong token
                self.release(r.seq_id)
            raise
        by_seq = {r.seq_id: i for i, r in enumerate(drafting)}
        empty = torch.empty(0, dtype=torch.long, device=self._lm.device)
        proposals = []
        for r in requests:
            if r.num_tokens <= 0:
                proposals.append(Proposal(token_ids=empty))
                continue
            i = by_seq[r.seq_id]
            token_ids = torch.tensor(drafts[i], dtype=torch.long, device=self._lm.device)  # [k]
            probs = torch.cat(q_rows[i]) if q_rows[i] else None  # [k, vocab] q
            proposals.append(Proposal(token_ids=token_ids, probs=probs))
        return proposals

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        calls = []
        for r in requests:
            # Feed at least the last token: its logits give the first draft.
            start = min(common_prefix_length(self._token_ids.get(r.seq_id, []), r.token_ids), len(r.token_ids) - 1)
            calls.append(ForwardCall(r.seq_id, start, list(r.token_ids[start:]), num_logits=1))
        logits = self._lm.forward(calls)  # len(requests) x [1, vocab]
        for r in requests:
            self._token_ids[r.seq_id] = list(r.token_ids)
        generators = [None if r.sampling.greedy else make_generator(r.seed, self._lm.device) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]  # per request, k x [1, vocab]
        live = list(range(len(requests)))
        for step in range(max((r.num_tokens for r in requests), default=0)):
            if step:
                live = [i for i in live if requests[i].num_tokens > step]
                calls = [ForwardCall(requests[i].seq_id, len(self._token_ids[requests[i].seq_id]),
                                     [drafts[i][-1]], num_logits=1) for i in live]
                for i, row in zip(live, self._lm.forward(calls)):
                    logits[i] = row
                    self._token_ids[requests[i].seq_id].append(drafts[i][-1])
            tokens = []  # len(live) x [1]
            for i in live:
                banned = (int(step < requests[i].num_banned_tokens), requests[i].banned_token_ids)  # min_tokens
                if generators[i] is None:
                    tokens.append(greedy_tokens(logits[i], *banned))
                else:
                    q = process_logits(logits[i], requests[i].sampling, *banned)  # [1, vocab]
                    tokens.append(sample_from_probs(q, generators[i]))
                    q_rows[i].append(q)
            for i, token in zip(live, torch.cat(tokens).tolist()):  # one device sync per step
                drafts[i].append(token)
        return drafts, q_rows

    def _check(self, requests: list[ProposeRequest]) -> None:
        for r in requests:
            if not r.token_ids:
                raise ValueError(f"seq {r.seq_id!r}: token_ids must not be empty")
            if len(r.token_ids) + r.num_tokens - 1 > self._lm.max_model_len:
                raise ValueError(
                    f"seq {r.seq_id!r}: {len(r.token_ids)} tokens + {r.num_tokens} drafts exceed "
                    f"max_model_len={self._lm.max_model_len}"
                )
