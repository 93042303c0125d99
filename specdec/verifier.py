"""Target-model verification: one forward pass scores the last token and k drafts.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023) runs the target once over
``[last, d_1 .. d_k]`` and reads ``k + 1`` next-token distributions ``p`` from it:
one per draft to accept or reject, plus the bonus position. The KV cache written
for rejected drafts is discarded by the next call, whose ``position`` cuts it back.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.models import CachedCausalLM, OwnsOneModel
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
    """Verifies drafts with any Hugging Face ``AutoModelForCausalLM``.

    Requests in a batch run one after another over per-sequence ``DynamicCache``s;
    this generic path defines the contract a batched static-cache engine keeps.
    """

    def __init__(self, model: PreTrainedModel, device: str | torch.device = "cpu", max_model_len: int | None = None):
        self._lm = CachedCausalLM(model, device, max_model_len)

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return [
            verify_result(self._lm.forward(r.seq_id, r.position, r.token_ids, r.num_logits), r) for r in requests
        ]
