"""Draft-model proposer: a small causal LM drafts k tokens autoregressively.

Leviathan et al. 2023 and Chen et al. 2023: the draft samples ``d_i ~ q(. | x, d_<i)``
with the request's own temperature / top-k / top-p, and returns ``q`` so the
rejection sampler can accept ``d_i`` with probability ``min(1, p / q)``. The draft
keeps its own KV cache per sequence; each call reuses the longest common prefix of
what it cached and the request's tokens, so accepted drafts are never recomputed.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.models import CachedCausalLM, OwnsOneModel, common_prefix_length, model_vocab_size
from specdec.sampling import greedy_tokens, make_generator, process_logits, sample_from_probs
from specdec.types import Proposal, ProposeRequest


def check_vocab_compatible(draft_model: PreTrainedModel, target_model: PreTrainedModel) -> None:
    """Rejection sampling compares ``p`` and ``q`` token by token: both need the same vocabulary."""
    draft_vocab, target_vocab = model_vocab_size(draft_model), model_vocab_size(target_model)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"draft model vocab size {draft_vocab} != target model vocab size {target_vocab}; "
            f"the draft must share the target's tokenizer and output layer width"
        )


class DraftModelProposer(OwnsOneModel):
    def __init__(self, model: PreTrainedModel, device: str | torch.device = "cpu", max_model_len: int | None = None):
        self._lm = CachedCausalLM(model, device, max_model_len)

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return [self._propose_one(request) for request in requests]

    def _propose_one(self, request: ProposeRequest) -> Proposal:
        k, tokens, seq_id = request.num_tokens, request.token_ids, request.seq_id
        if k <= 0:
            return Proposal(token_ids=torch.empty(0, dtype=torch.long, device=self._lm.device))
        # Feed at least the last token: its logits give the first draft.
        start = min(common_prefix_length(self._lm.cached_token_ids(seq_id), tokens), len(tokens) - 1)
        logits = self._lm.forward(seq_id, start, tokens[start:], num_logits=1)  # [1, vocab]
        greedy = request.sampling.greedy
        generator = None if greedy else make_generator(request.seed, self._lm.device)
        drafts: list[torch.Tensor] = []  # k x [1]
        q_rows: list[torch.Tensor] = []  # k x [1, vocab]
        for i in range(k):
            if i:
                logits = self._lm.forward(seq_id, len(tokens) + i - 1, [int(drafts[-1])], num_logits=1)
            banned = (int(i < request.num_banned_tokens), request.banned_token_ids)  # min_tokens
            if greedy:
                drafts.append(greedy_tokens(logits, *banned))
            else:
                q = process_logits(logits, request.sampling, *banned)  # [1, vocab]
                drafts.append(sample_from_probs(q, generator))
                q_rows.append(q)
        token_ids = torch.cat(drafts)  # [k]
        return Proposal(token_ids=token_ids, probs=torch.cat(q_rows) if q_rows else None)  # probs: [k, vocab]
