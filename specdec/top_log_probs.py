"""The likeliest tokens at each output position and their log probabilities (OpenAI's ``top_logprobs``).

They come from the distribution the chosen token's own log probability is read from
(:func:`specdec.penalties.log_kept_mass`): the target's logits with the penalties, the
logit bias, ``min_tokens`` bans and a grammar's mask applied, divided by the temperature
(1 for a greedy request), before top-k, top-p and min-p. So the alternatives are those of
the distribution the request decodes from, whatever was drafted: the verifier computes
them for every row it scores, and the state machine keeps the rows of the tokens that stay
(a chain's first ``accepted + 1``, a tree's root and accepted path).
"""
from __future__ import annotations

import torch

from specdec.types import VerifyResult

MAX_TOP_LOG_PROBS = 20  # OpenAI's bound on top_logprobs; each costs a few bytes per row on the wire

Alternatives = tuple[tuple[int, float], ...]  # (token id, log probability), likeliest first


def top_alternatives(
    logits: torch.Tensor,  # [m, vocab]: the processed logits log_kept_mass reads
    divisor: float,  # the temperature, or 1 for a greedy request
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [m, n] int64, log probabilities [m, n] float32
    """The ``n`` likeliest tokens of each row under ``softmax(logits / divisor)``, likeliest first."""
    if not 0 < n <= MAX_TOP_LOG_PROBS:
        raise ValueError(f"num_top_log_probs must be in [1, {MAX_TOP_LOG_PROBS}], got {n}")
    values, ids = torch.log_softmax(logits.float() / divisor, dim=-1).topk(min(n, logits.shape[-1]), dim=-1)
    return ids, values


def emitted_alternatives(verified: VerifyResult | None, num_tokens: int, rows: list[int] | None = None,
                         ) -> list[Alternatives]:  # fmt: skip
    """Each emitted token's alternatives: from rows ``0 .. num_tokens - 1``, or a tree's ``rows``."""
    if verified is None or verified.top_token_ids is None or verified.top_log_probs is None:
        raise ValueError("num_top_log_probs needs the verifier's top alternatives, got none")
    rows = list(range(num_tokens)) if rows is None else rows[:num_tokens]
    pick = torch.tensor(rows, dtype=torch.long, device=verified.top_token_ids.device)
    ids, values = verified.top_token_ids[pick].tolist(), verified.top_log_probs[pick].tolist()
    return [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]
