"""Target-model verification: one forward pass scores the last token and k drafts.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023) runs the target once over
``[last, d_1 .. d_k]`` and reads ``k + 1`` next-token distributions ``p`` from it:
one per draft to accept or reject, plus the bonus position. The KV cache written
for rejected drafts is discarded by the next call, whose ``position`` cuts it back.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.cached_lm import CachedLM, ForwardCall, OwnsOneModel
from specdec.sampling import greedy_tokens, process_logits
from specdec.types import VerifyRequest, VerifyResult


def verify_result(logits: torch.Tensor, request: VerifyRequest) -> VerifyResult:  # logits: [num_logits, vocab]
    """``argmax`` always; ``p`` only for sampled requests; min_tokens bans applied to both."""
    banned = (request.num_banned_rows, request.banned_token_ids)
    argmax = greedy_tokens(logits, *banned)  # [num_logits]
    if request.sampling.greedy:
        return VerifyResult(argmax=argmax, probs=None)
    return VerifyResult(argmax=argmax, probs=process_logits(logits, request.sampling, *banned))


class TargetVerifier(OwnsOneModel):
    """Verifies the drafts of every request of a call in one forward of the target ``CachedLM``.

    The fast engine runs the calls as one ragged batch (a CUDA graph where it fits);
    the ``hf`` engine runs them one after another. Either way the verifier owns no
    cache of its own: ``position`` addresses the LM's.
    """

    def __init__(self, lm: CachedLM):
        self.lm = lm

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        calls = [ForwardCall(r.seq_id, r.position, list(r.token_ids), r.num_logits) for r in requests]
        layers = {r.hidden_layers for r in requests}
        if len(layers) > 1:
            raise ValueError(f"the requests of one verify call must ask for the same hidden_layers, got {layers}")
        hidden_layers = layers.pop() if layers else ()
        if not hidden_layers:
            return [verify_result(logits, r) for logits, r in zip(self.lm.forward(calls), requests)]
        logits, hidden = self.lm.forward_with_hidden(calls, hidden_layers)
        return [replace(verify_result(row, r), hidden_states=h) for row, h, r in zip(logits, hidden, requests)]
