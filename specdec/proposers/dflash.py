"""DFlash proposer: every draft of a step from one forward of the block drafter (``specdec.heads.dflash``).

Each request brings the tokens and the target hidden states the proposer has not been sent
(``ProposeRequest.hidden_states``: one row per verified position, the accepted ones only).
With ``N`` tokens the target has verified positions ``0 .. N - 2``; the proposer turns each new
row into the drafter's *context*: ``hidden_norm(fc(features))`` projected by every layer's
``k_proj`` / ``v_proj`` (normed, rotated at its position) and written into a slot cache
(``StaticKVCache``: one slot per sequence, a length per slot). Those keys and values depend on
the target's features alone, never on a draft, so each position is computed once; a request
that cuts the sequence back (rejected drafts, a new ``hidden_position``) lowers the length, and
the rows past it are forgotten and overwritten by the next write. The block's own keys and
values live only inside its forward.

A step is one forward over every drafting sequence: the block ``[x_{N-1}, mask x (block_size - 1)]``
at positions ``N - 1 ..``, attending to the sequence's context and the whole block. The block
is always the checkpoint's ``block_size`` long, the length it was trained at (with
non-causal attention a shorter block changes every position's output; vLLM runs ``k + 1``
queries); position ``j``'s logits give draft ``j`` for ``j <= k``:

* greedy: the argmax of each position;
* sampled: a draw from each position's processed distribution ``q_j``, sent with the drafts.
  The positions are drawn independently, so ``q_j`` is draft ``j``'s distribution whatever the
  drafts before it, which is what the rejection sampler needs to stay lossless (as for Medusa).

``min_tokens``' banned ids are at ``-inf`` in the first ``num_banned_tokens`` positions. A request for
more drafts than ``block_size - 1`` is refused naming ``block_size``; trees are not drafted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.fast.kv_cache import StaticKVCache
from specdec.grammar import guided_picks
from specdec.heads.dflash import DFlashDrafter
from specdec.proposers.base import DraftLimit, Proposer, check_draft_limit, check_propose_requests, proposals_in_order
from specdec.sampling import make_generator, process_logits, sample_from_probs
from specdec.types import Proposal, ProposeRequest


@dataclass
class _Sequence:
    tokens: list[int]  # every token sent
    num_context: int = 0  # positions 0 .. num_context - 1 hold context keys and values in the cache


class DFlashProposer(Proposer):
    method = "dflash"

    def __init__(self, model: DFlashDrafter, max_num_seqs: int = 8, max_model_len: int | None = None):
        """``max_model_len``: the positions a sequence's context may hold (None: the drafter config's
        ``max_position_embeddings``)."""
        config = model.config
        self.model = model
        self.device = model.device
        self.block_size = config.block_size
        self.vocab_size = config.layer.vocab_size
        self.hidden_state_layers = config.hidden_state_layers
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or config.layer.max_position_embeddings
        layer = config.layer
        self.cache = StaticKVCache(layer.num_layers, layer.num_kv_heads, layer.head_dim, max_num_seqs,
                                   self.max_model_len, model.dtype, self.device)  # fmt: skip
        self._seqs: dict[str, _Sequence] = {}
        self._feature_width = len(config.target_layer_ids) * layer.hidden_size
        self.draft_limit = DraftLimit(self.max_drafts, "a DFlash drafter", f"block_size={self.block_size}",
                                      f"(the last token and {self.max_drafts} masks)",
                                      f"block_size - 1 = {self.max_drafts}")  # fmt: skip

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    @property
    def num_active_sequences(self) -> int:
        return len(self._seqs)

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:  # a response teaches it nothing
        self._seqs.pop(seq_id, None)
        self.cache.release(seq_id)

    def context_length(self, seq_id: str) -> int:
        """Positions whose context keys and values the cache holds for ``seq_id`` (0 when unknown)."""
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.num_context

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        check_propose_requests(requests, lambda s: len(self._seqs[s].tokens) if s in self._seqs else 0)
        self._check(requests)
        new_rows = [self._take(r) for r in requests]
        self._store_context(requests, new_rows)
        drafting = [r for r in requests if r.num_tokens > 0]
        drafts, q_rows = self._draft(drafting) if drafting else ([], [])
        return proposals_in_order(requests, drafting, drafts, q_rows)

    def _check(self, requests: list[ProposeRequest]) -> None:
        """Refuse, before any state moves, what the drafter cannot do."""
        new = [r.seq_id for r in requests if r.seq_id not in self._seqs]
        if len(new) > self.cache.num_free:
            raise ValueError(f"{len(new)} new sequences, {self.cache.num_free} of max_num_seqs={self.max_num_seqs} "
                             f"slots free")  # fmt: skip
        check_draft_limit(requests, self.draft_limit)
        for r in requests:
            hidden = r.hidden_states
            if hidden is not None and (hidden.dim() != 2 or hidden.shape[1] != self._feature_width):
                raise ValueError(f"seq {r.seq_id!r}: hidden_states of shape {tuple(hidden.shape)}; the DFlash "
                                 f"drafter reads [n, {self._feature_width}] (layers {self.hidden_state_layers})")  # fmt: skip
            held = self.context_length(r.seq_id)
            if not 0 <= r.hidden_position <= held:
                raise ValueError(f"seq {r.seq_id!r}: hidden_position {r.hidden_position} is past the {held} "
                                 f"positions of hidden states the proposer holds")  # fmt: skip
            rows = held if hidden is None else r.hidden_position + hidden.shape[0]
            length = r.position + len(r.token_ids)
            if r.num_tokens > 0 and rows < length - 1:
                raise ValueError(f"seq {r.seq_id!r}: {length} tokens need the target's hidden states at "
                                 f"{length - 1} positions, the proposer has {rows}")  # fmt: skip
            if length - 1 > self.max_model_len:
                raise ValueError(f"seq {r.seq_id!r}: {length} tokens exceed max_model_len={self.max_model_len}")

    def _take(self, r: ProposeRequest) -> tuple[int, int]:
        """The request's tokens; the context cut back to what stays valid. Returns the rows of its
        ``hidden_states`` to store: (first position, count)."""
        seq = self._seqs.get(r.seq_id)
        if seq is None:
            seq = self._seqs[r.seq_id] = _Sequence([])
            self.cache.allocate(r.seq_id)
        del seq.tokens[r.position :]
        seq.tokens.extend(r.token_ids)
        verified = len(seq.tokens) - 1  # positions the target has verified
        if r.hidden_states is None:
            seq.num_context = min(seq.num_context, verified)
            return r.hidden_position, 0
        # the rows from hidden_position on replace what was held there; rows past the last verified are stale
        end = min(r.hidden_position + r.hidden_states.shape[0], verified)
        seq.num_context = min(max(r.hidden_position, end), verified)
        return r.hidden_position, max(end - r.hidden_position, 0)

    def _store_context(self, requests: list[ProposeRequest], new_rows: list[tuple[int, int]]) -> None:
        """Every request's new context rows: one ``fc`` and one projection per layer for all of them,
        written into the cache with one indexed write per layer."""
        features, slots, positions = [], [], []
        for r, (start, n) in zip(requests, new_rows):
            if n > 0:
                features.append(r.hidden_states[:n])
                slots += [self.cache.slot(r.seq_id)] * n
                positions += range(start, start + n)
        if not features:
            return
        index = torch.tensor([slots, positions], dtype=torch.long).to(self.device, non_blocking=True)  # [2, N]
        context = self.model.context(torch.cat(features).to(self.device, non_blocking=True))  # [N, h]
        for i, (keys, values) in enumerate(self.model.context_keys_values(context, index[1])):  # [N, kv_heads, D]
            self.cache.kv[i, 0][index[0], :, index[1]] = keys
            self.cache.kv[i, 1][index[0], :, index[1]] = values

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """One forward of every request's block; each request's drafts and, sampled, its q rows."""
        b, s = len(requests), self.block_size
        seqs = [self._seqs[r.seq_id] for r in requests]
        lengths = [len(seq.tokens) - 1 for seq in seqs]  # context rows of each: positions 0 .. N - 2
        mask_id = self.model.config.mask_token_id
        ids = [t for seq in seqs for t in [seq.tokens[-1]] + [mask_id] * (s - 1)]
        host = torch.tensor(ids + lengths + [self.cache.slot(r.seq_id) for r in requests], dtype=torch.long)
        meta = host.to(self.device, non_blocking=True)  # one copy: [B * S ids, B lengths, B slots]
        block_ids = meta[: b * s].view(b, s)  # [B, S]
        context_len, slots = meta[b * s :].view(2, b)  # [B] each
        positions = context_len[:, None] + torch.arange(s, device=self.device)  # [B, S]: N - 1 ..
        span = max(lengths)  # keys read from the cache: the longest context
        kv = self.cache.kv[:, :, slots, :, :span]  # [layers, 2, B, kv_heads, span, D]
        visible = torch.arange(span, device=self.device)[None, :] < context_len[:, None]  # [B, span]
        mask = torch.cat([visible, visible.new_ones(b, s)], 1)[:, None, None, :].expand(b, 1, s, span + s)
        hidden = self.model(block_ids, positions, [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])], mask)
        k = max(r.num_tokens for r in requests)
        logits = self.model.logits(hidden[:, 1 : 1 + k])  # [B, k, vocab] float32: block position j drafts j
        for i, r in enumerate(requests):
            if r.banned_token_ids and r.num_banned_tokens:
                banned = torch.tensor(r.banned_token_ids, device=logits.device)
                logits[i, : r.num_banned_tokens].index_fill_(-1, banned, float("-inf"))
        picks = logits.argmax(-1)  # [B, k]: greedy requests' drafts; sampled ones' rows are drawn below
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        for i, r in enumerate(requests):
            generator = None if r.sampling.greedy else make_generator(r.seed, self.device)
            if r.guide is not None:  # structured output: picked one by one under the grammar
                guided, q = guided_picks(logits[i, : r.num_tokens], r, generator)
                picks[i, : r.num_tokens] = torch.tensor(guided, dtype=torch.long, device=picks.device)
                q_rows[i] = [] if q is None else list(q.split(1))
                continue
            if generator is None:
                continue
            q = process_logits(logits[i, : r.num_tokens], r.sampling)  # [k_i, vocab]: position j's q for draft j
            picks[i, : r.num_tokens] = torch.cat([sample_from_probs(q[j : j + 1], generator)
                                                  for j in range(r.num_tokens)])  # fmt: skip
            q_rows[i] = list(q.split(1))
        rows = picks.tolist()  # [B, k]: the one copy to the host
        return [row[: r.num_tokens] for row, r in zip(rows, requests)], q_rows
