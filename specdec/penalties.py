"""Repetition, presence and frequency penalties and bad words, applied to the target's logits.

Penalties change the distribution a request samples from, so for decoding to stay
lossless they belong to the *target's* distribution ``p``: the verifier penalises every
row it scores, each with the penalty state of the tokens before that row's position,
drafts included. Row ``j`` of a verify call over ``[last, d_1 .. d_k]`` predicts the token
after ``d_j``, so its context holds ``d_1 .. d_j``; were a draft rejected there, the
recovered token is drawn from a row whose context is exactly the tokens already
emitted. Greedy output is then the penalised target's own greedy output, and sampled
output follows the penalised target's distribution, whatever the draft proposes.

Definitions (applied in this order, before temperature, top-k and top-p, as vLLM does):

* ``repetition_penalty`` (Keskar et al. 2019, CTRL; Hugging Face's
  ``RepetitionPenaltyLogitsProcessor``): the logit of every token in the context, prompt
  included, is divided by the penalty if positive and multiplied by it if negative.
* ``frequency_penalty`` and ``presence_penalty`` (OpenAI's definition, as vLLM applies
  it): ``logit -= frequency * count + presence * (count > 0)``, ``count`` being how often
  the token occurs in the *output* so far (prompt tokens are not counted).
* ``bad_words``: token sequences that may not be produced: the last token of a sequence
  gets probability 0 wherever the context ends with the rest of it (a single-token bad
  word is never produced), as in Hugging Face's ``NoBadWordsLogitsProcessor``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """A request's penalties; the defaults leave the logits unchanged."""

    repetition_penalty: float = 1.0  # > 0; 1: off; > 1 discourages repeating any context token
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output may not contain

    @property
    def active(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.bad_words))  # fmt: skip

    def validate(self) -> None:
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number (0: off), got {getattr(self, name)}")
        if any(len(word) == 0 or min(word) < 0 for word in self.bad_words):
            raise ValueError(f"bad_words must be non-empty sequences of non-negative ids, got {self.bad_words}")


NO_PENALTIES = Penalties()


def apply_penalties(
    logits: torch.Tensor,  # [m, vocab]: row j predicts the token after tokens[: len(tokens) - m + 1 + j]
    tokens: Sequence[int],  # the whole sequence through the token of the last row: prompt, output, drafts
    num_prompt_tokens: int,
    penalties: Penalties,
) -> torch.Tensor:  # [m, vocab] float32
    """The penalised logits of ``m`` consecutive positions, each with the context before it."""
    logits = logits.float()
    if not penalties.active:
        return logits
    m, vocab = logits.shape
    first = len(tokens) - m + 1  # context length of row 0
    if first < 1 or num_prompt_tokens > first:
        raise ValueError(f"{len(tokens)} tokens cannot hold {m} rows after a {num_prompt_tokens}-token prompt")
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=logits.device)  # [len(tokens)]
    later = ids[first:]  # [m - 1]: the token each later row adds to the context of the row before
    logits = logits.clone()
    if penalties.repetition_penalty != 1.0:
        seen = _cumulative(torch.zeros(vocab, device=logits.device).index_fill_(0, ids[:first], 1.0), later, m)
        penalised = torch.where(logits > 0, logits / penalties.repetition_penalty,
                                logits * penalties.repetition_penalty)  # fmt: skip
        logits = torch.where(seen > 0, penalised, logits)
    if penalties.frequency_penalty != 0.0 or penalties.presence_penalty != 0.0:
        counts = _cumulative(torch.bincount(ids[num_prompt_tokens:first], minlength=vocab).float(), later, m)
        logits -= penalties.frequency_penalty * counts + penalties.presence_penalty * (counts > 0).float()
    for j in range(m):
        banned = _banned_by_bad_words(tokens[: first + j], penalties.bad_words)
        if banned:
            logits[j, banned] = float("-inf")
    return logits


def _cumulative(base: torch.Tensor, later: torch.Tensor, m: int) -> torch.Tensor:  # base: [vocab] -> [m, vocab]
    """Per-row token counts: row 0 holds ``base``, each later row adds one more token."""
    rows = base.expand(m, -1).clone()
    for j, token in enumerate(later.tolist(), start=1):
        rows[j:, token] += 1
    return rows


def _banned_by_bad_words(context: Sequence[int], bad_words: tuple[tuple[int, ...], ...]) -> list[int]:
    """The tokens that would complete a bad word after ``context``."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(context) >= len(prefix) and tuple(context[len(context) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def log_kept_mass(
    logits: torch.Tensor,  # [m, vocab] penalised (and banned) logits
    probs: torch.Tensor | None,  # [m, vocab] p, or None: greedy (p one-hot at the argmax)
    argmax: torch.Tensor,  # [m] int64
    temperature: float,  # the divisor: the request's, or 1 where it decodes greedily at temperature 0
) -> torch.Tensor:  # [m] float32
    """log of the mass that ``p``'s support holds under ``softmax(logits / T)``, per row.

    A token emitted from row j has log probability ``log p[j, t] + log_kept_mass[j]`` in
    the penalised, temperature-scaled distribution before top-k / top-p: top-k and top-p
    only renormalise ``p`` over the tokens they keep, and every emitted token is one of
    those. One float per row travels back from the verifier instead of a second
    vocabulary-wide row; for a greedy row (``log p = 0`` at the argmax) it is the
    argmax's own log probability.
    """
    full = torch.log_softmax(logits.float() / temperature, dim=-1)  # [m, vocab]
    if probs is None:  # top_k 1 too: p is one-hot at the argmax
        return full.gather(-1, argmax.view(-1, 1)).squeeze(-1)
    return torch.logsumexp(full.masked_fill(probs <= 0, float("-inf")), dim=-1)


def emitted_log_probs(
    tokens: Sequence[int],  # the tokens a step emitted, row by row from row 0
    log_mass: torch.Tensor,  # [m] from log_kept_mass
    probs: torch.Tensor | None,  # [m, vocab] p, or None: greedy
    argmax: torch.Tensor,  # [m] int64
) -> list[float]:
    """The target's log probability of each emitted token (see :func:`log_kept_mass`)."""
    mass = log_mass.tolist()
    if probs is None:
        greedy = argmax.tolist()
        if list(tokens) != greedy[: len(tokens)]:
            raise ValueError(f"a greedy target emits its argmax {greedy}, got {list(tokens)}: no log probabilities")
        return [mass[j] for j in range(len(tokens))]
    rows = probs[torch.arange(len(tokens)), torch.as_tensor(list(tokens), dtype=torch.long)]  # [len(tokens)]
    return [math.log(p) + mass[j] if p > 0 else float("-inf") for j, p in enumerate(rows.tolist())]
