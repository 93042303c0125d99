"""Parallel drafting (PARD): a draft model that drafts all k tokens in one forward.

PARD (An et al. 2025, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft
Model Adaptation", arXiv 2504.18583) trains a causal LM to read ``k - 1`` copies of a mask
token after a sequence and predict, at each, the token that many places further on. One
forward over ``[tokens the cache lacks, m, m, ..., m]`` then gives every draft at once: the
logits at the last real token give draft 1, those at mask ``j`` draft ``j + 1``. A chain
drafter (:class:`DraftModelProposer`) pays ``k`` sequential forwards for the same ``k``
drafts; what a step saves is ``k - 1`` of those, and what it costs is acceptance, since draft
``j`` is not conditioned on drafts ``1 .. j - 1``.

Losslessness is untouched: draft ``j`` is drawn from its own row's ``q_j`` (argmax when
greedy) and ``q_j`` is returned, so the rejection sampler accepts it with ``min(1, p / q_j)``
as it does any draft. That ``q_j`` does not depend on the earlier drafts changes nothing in
Leviathan et al.'s argument, which needs only that the draft was drawn from the ``q`` given.

The cache holds real tokens only. The masks' keys and values are written past the
sequence's cached length (``_Sequence.cached`` counts real tokens) and the next call starts
at or before that length, which cuts them off (``CachedLM``: a call at ``position`` discards
what the cache held past it). The drafts are not fed back either: the accepted ones come back
with the next request as new tokens, fed with the next step's masks.

The mask token is the checkpoint's ``pard_token`` (config.json), the key vLLM reads for a
``draft_model`` with ``parallel_drafting`` and that AMD's PARD checkpoints carry. vLLM also
takes ``ptd_token_id`` and ``dflash_config.mask_token_id``; those belong to other drafters
(P-EAGLE heads, served as ``eagle3`` with ``parallel_drafting``: ``specdec.proposers.peagle``;
DFlash), so they are not read here: a draft model with only those is refused rather than served
as a plain causal LM.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.cached_lm import CachedLM, ForwardCall
from specdec.grammar import guided_picks
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling import greedy_tokens, make_generator, process_logits, sample_from_probs
from specdec.types import ProposeRequest

MASK_TOKEN_KEY = "pard_token"  # vLLM's key (and PARD's) in the draft checkpoint's config.json


def read_mask_token(path: str | os.PathLike) -> int:
    """The mask token id the draft checkpoint at ``path`` names; refused by name where it names none."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"parallel_drafting: cannot read the draft checkpoint's {config_path}: {err}") from None
    token = config.get(MASK_TOKEN_KEY)
    if token is None:
        raise ValueError(
            f"parallel_drafting needs a draft trained for it (PARD): draft model {os.fspath(path)!r} names no mask "
            f"token ('{MASK_TOKEN_KEY}' in its config.json); serve a PARD checkpoint (models/tiny-draft-pard, "
            f"scripts/train_pard_draft.py) or set parallel_drafting false"
        )
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"draft model {os.fspath(path)!r}: '{MASK_TOKEN_KEY}' must be a token id, got {token!r}")
    return token


class ParallelDraftProposer(DraftModelProposer):
    """A PARD draft model behind the ``Proposer`` protocol: one draft forward per step, whatever k is.

    The sequence bookkeeping (``_take``, the position checks, ``release``) is the chain
    drafter's; only the drafting differs. Every request of a call drafts in the same forward.
    """

    def __init__(self, lm: CachedLM, mask_token_id: int):
        super().__init__(lm)
        if not 0 <= mask_token_id < lm.vocab_size:
            raise ValueError(f"{MASK_TOKEN_KEY} {mask_token_id} is outside the draft's vocabulary [0, {lm.vocab_size})")
        self.mask_token_id = mask_token_id

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        seqs = [self._seqs[r.seq_id] for r in requests]
        calls = []
        for r, seq in zip(requests, seqs):
            # Feed at least the last real token: its logits give draft 1, mask j's draft j + 1.
            start = min(seq.cached, self.lm.cached_length(r.seq_id), len(seq.tokens) - 1)
            masks = [self.mask_token_id] * (r.num_tokens - 1)
            calls.append(ForwardCall(r.seq_id, start, seq.tokens[start:] + masks, num_logits=r.num_tokens))
        logits = self.lm.forward(calls)  # len(requests) x [k, vocab]
        for seq in seqs:
            seq.cached = len(seq.tokens)  # real tokens only: the masks lie past it, cut by the next call
        tokens, q_rows = [], []  # per request: [k] ids, and [[k, vocab] q] when sampled
        for r, rows in zip(requests, logits):
            banned = (r.num_banned_tokens, r.banned_token_ids)  # min_tokens: rows (drafts) before it ban EOS
            if r.guide is not None:  # structured output: picked one by one under the grammar
                generator = None if r.sampling.greedy else make_generator(r.seed, self.lm.device)
                picks, q = guided_picks(rows, r, generator)
                tokens.append(torch.tensor(picks, dtype=torch.long, device=rows.device))  # [k]
                q_rows.append([] if q is None else [q])
            elif r.sampling.greedy:
                tokens.append(greedy_tokens(rows, *banned))  # [k]
                q_rows.append([])
            else:
                q = process_logits(rows, r.sampling, *banned)  # [k, vocab]: each position's own q
                tokens.append(sample_from_probs(q, make_generator(r.seed, self.lm.device)))  # [k]
                q_rows.append([q])
        ids = torch.cat(tokens).tolist() if tokens else []  # one device sync for the whole call
        drafts, at = [], 0
        for r in requests:
            drafts.append(ids[at : at + r.num_tokens])
            at += r.num_tokens
        return drafts, q_rows
