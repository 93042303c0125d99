"""P-EAGLE proposer: a P-EAGLE head (``specdec.heads.peagle``) drafts all k tokens of a step in one forward.

P-EAGLE (AWS 2026, speculators' ``peagle``; vLLM's ``PtdEagleProposer``, ``parallel_drafting`` for
``eagle3``) trains an EAGLE-3 head to read, after the rows EAGLE-3 reads, ``k - 1`` mask positions
(the mask token beside ``fc(mask_hidden)``) and predict at mask ``j`` the token ``j`` places past
the first draft. A step is then one forward over each sequence's rows its cache lacks, up to its
last verified position (token ``x_{t+1}`` beside the target's features at ``t``, as
:class:`Eagle3Proposer` feeds them; the newly sampled token is the last row's) followed by the
masks: the logits at the last real row give draft 1, those at mask ``j`` draft ``j + 1``. A chain
EAGLE-3 head pays ``k`` sequential head passes for the same ``k`` drafts.

Everything else is :class:`Eagle3Proposer`'s: sequences, the fused-feature buffer, the cut-back of
rolled-back rows, the ragged passes split as the target's are, CUDA graphs and the CPU compile. The
cache keeps real rows only, as PARD's (``specdec.proposers.pard``) keeps real tokens: the masks'
keys and values are written past the rows the cache counts (``_Sequence.rows``) and the next call
starts at or before them, writing over them before any query can see them.

Losslessness is untouched: draft ``j`` is the argmax of its own row (greedy) or drawn from that
row's ``q_j`` (the target vocabulary's processed distribution, sent with it), and ``q_j`` not
depending on drafts ``1 .. j - 1`` changes nothing in the rejection sampler's argument. ``min_tokens``
bans, grammars and sampling go column by column through the chain's own picking (``_pick``), so each
request's generator draws in the order a chain's would. Trees are refused (a chain in one forward).
"""
from __future__ import annotations

import torch

from specdec.heads.peagle import PEagleHead
from specdec.proposers.eagle3 import Eagle3Proposer
from specdec.sampling import make_generator
from specdec.types import ProposeRequest


class PEagleProposer(Eagle3Proposer):
    head_name = "P-EAGLE head"

    def __init__(self, head: PEagleHead, max_num_seqs: int = 8, max_model_len: int | None = None,
                 cpu_compile: bool = False, cuda_graphs: bool | None = None, log=None):  # fmt: skip
        self.mask_token_id = head.mask_token_id
        with torch.inference_mode():
            self._mask_row = head.mask_features()  # [1, h]: what every mask position reads
        super().__init__(head, max_num_seqs, max_model_len, cpu_compile, cuda_graphs, tree=None, log=log)

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]], None]:
        """Each request's drafts and, sampled, their q rows: one head pass for every sequence."""
        if not requests:
            return [], [], None
        seqs = [self._seqs[r.seq_id] for r in requests]
        starts, tokens, hidden = self._uncached_rows(requests, seqs)
        for r, row_tokens, i in zip(requests, tokens, range(len(hidden))):
            row_tokens += [self.mask_token_id] * (r.num_tokens - 1)
            hidden[i] = torch.cat([hidden[i], self._mask_row.expand(r.num_tokens - 1, -1)])  # [n + k - 1, h]
        k = max(r.num_tokens for r in requests)
        logits, _ = self._catch_up([r.seq_id for r in requests], starts, tokens, hidden, last=k)
        if k == 1:
            logits = logits[:, None]  # [B, 1, draft_vocab]
        for seq in seqs:
            seq.rows = len(seq.tokens) - 1  # real rows only: the masks lie past them, written over by the next call
        # [B, k, draft_vocab]: column j is draft j + 1 of every request (a request of fewer drafts ends at k)
        shift = torch.tensor([k - r.num_tokens for r in requests], device=self.device)
        at = (shift[:, None] + torch.arange(k, device=self.device)).clamp(max=k - 1)  # [B, k]
        logits = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))
        bans = self._ban_masks(requests)
        if all(r.sampling.greedy and r.guide is None for r in requests):
            return self._greedy_columns(requests, logits, bans), [[] for _ in requests], None
        generators = [None if r.sampling.greedy else make_generator(r.seed, self.device) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(k):
            live = [i for i, r in enumerate(requests) if r.num_tokens > step]
            for i, token in zip(live, self._pick(requests, live, step, logits[:, step], generators, q_rows, bans,
                                                 drafts)):  # fmt: skip
                drafts[i].append(token)
        return drafts, q_rows, None

    def _greedy_columns(self, requests, logits, bans) -> list[list[int]]:
        """Greedy drafts of every column at once (``logits`` [B, k, draft_vocab]): the argmax over the draft
        vocabulary, ids ``min_tokens`` bans masked in the columns they bind, read back in one copy."""
        if bans is not None:
            banned, num_banned = bans  # [B, draft_vocab], [B]
            binding = torch.arange(logits.shape[1], device=self.device)[None, :] < num_banned[:, None]  # [B, k]
            logits = logits.masked_fill(banned[:, None, :] & binding[..., None], float("-inf"))
        ids = self.draft_targets[logits.argmax(-1)].tolist()  # [B, k] target ids
        return [row[: r.num_tokens] for row, r in zip(ids, requests)]
