"""EAGLE-3 proposer: the head (``specdec.heads.eagle3``) drafts k tokens from the target's own features.

Each request brings the tokens and the target hidden states the proposer has not been sent
(``ProposeRequest.hidden_states``: one row per verified position, the accepted ones only).
With ``N`` tokens the target has verified positions ``0 .. N - 2`` (the last token, the recovered
or bonus one, has not been through the target yet), so the head runs its rows ``t <= N - 2``
(token ``x_{t+1}``, features at ``t``) that its cache lacks in one ragged forward, and the last
row's logits give the first draft. Each further draft is one row per sequence that feeds the
drafted token with the head's own pre-norm output of the row before. Those self-fed rows are never
kept: the next call brings the target's features there, and the cache is cut back (a length moves).

``q`` is the head's processed distribution over the target's vocabulary (the draft vocabulary
mapped through ``d2t``, every other id 0), so rejection sampling is unchanged and lossless.

The fused features live in one preallocated buffer, a row per cache slot and position,
as the KV cache does: a call writes every sequence's new features with one ``fc`` and
one indexed write, and a pass reads its rows as views of it. What a pass needs from the
host (ids, positions, slots) goes to the device as one tensor: on a GPU a copy or launch per
sequence would cost more than the head's pass once a batch holds a few sequences."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.nn.utils.rnn import pad_sequence

from specdec.compile_locks import compile_phase
from specdec.fast.cpu_compile import compile_forward
from specdec.fast.kv_cache import StaticKVCache
from specdec.fast.runner import padding_bounded_passes
from specdec.grammar import guided_row
from specdec.heads.compiled_steps import STEPS_PER_CALL, CompiledGreedySteps, warm_up
from specdec.heads.compiled_tree import CompiledGreedyTree
from specdec.heads.cuda_graphs import HeadGraphRunner, StaticHeadRunner
from specdec.heads.eagle3 import Eagle3Head
from specdec.proposers.base import Proposer, check_propose_requests, drafts_as_chain, proposals_in_order
from specdec.progress import Log
from specdec.proposers.eagle3_tree import draft_dynamic_tree, draft_tree
from specdec.sampling import apply_logit_bias, make_generator, process_logits, sample_from_probs
from specdec.tree import DraftTree, DynamicTree
from specdec.types import Proposal, ProposeRequest


@dataclass
class _Sequence:
    tokens: list[int]  # every token sent
    num_features: int = 0  # positions 0 .. num_features - 1 have fused target features in the buffer
    rows: int = 0  # head rows the KV cache holds that were built from the target's features


class Eagle3Proposer(Proposer):
    method = "eagle3"
    head_name = "EAGLE-3 head"  # in errors

    def __init__(self, head: Eagle3Head, max_num_seqs: int = 8, max_model_len: int | None = None,
                 cpu_compile: bool = False, cuda_graphs: bool | None = None,
                 tree: DraftTree | DynamicTree | None = None, log: Log | None = None):  # fmt: skip
        """``cpu_compile``: the head's forward compiled by ``torch.compile`` and warmed up here (CPU only; ``log``
        gets its progress, ``specdec.compile_locks.compile_phase``);
        ``cuda_graphs``: passes of up to ``DEFAULT_GRAPH_NUM_TOKENS`` tokens per row replay captured graphs
        (None: wherever the head is on CUDA); ``tree``: draft this static tree (``eagle3_tree``), cut to
        each request's ``num_tokens`` nodes, instead of a chain."""
        config = head.config
        self.head = head
        self.tree = None if tree is None or (isinstance(tree, DraftTree) and tree.is_chain) else tree
        ranks = 0 if self.tree is None else self.tree.max_rank if isinstance(self.tree, DraftTree) else self.tree.topk
        if ranks > config.draft_vocab_size:
            raise ValueError(f"the draft tree asks for {ranks} children of a node, but the EAGLE-3 head ranks "
                             f"{config.draft_vocab_size} draft tokens")  # fmt: skip
        self.device = head.device
        self.max_model_len = max_model_len or config.layer.max_position_embeddings
        self.max_num_seqs = max_num_seqs
        self.vocab_size = config.vocab_size
        self.hidden_state_layers = config.aux_layers
        layer = config.layer
        self.cache = StaticKVCache(
            layer.num_layers, layer.num_kv_heads, layer.head_dim, max_num_seqs, self.max_model_len, head.dtype, self.device
        )
        self._seqs: dict[str, _Sequence] = {}
        # [slots, max_model_len, h]: fc(target features) of each held sequence, by cache slot and position
        self._fused = torch.zeros(max_num_seqs, self.max_model_len, config.hidden_size, dtype=head.dtype,
                                  device=self.device)  # fmt: skip
        self.draft_targets = torch.arange(config.draft_vocab_size, device=self.device) + head.d2t  # [draft_vocab]
        self._draft_targets_host = self.draft_targets.cpu()  # for the ban masks, built on the host
        self.head_forward = head  # the module, or its compiled forward
        self._greedy_steps: CompiledGreedySteps | None = None  # on CPU with cpu_compile: drafting steps unrolled
        self.greedy_tree: CompiledGreedyTree | None = None  # on CPU with cpu_compile: a static tree in one call
        self.graphs: StaticHeadRunner | None = None
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {str(self.device)!r}")
        if on_cuda if cuda_graphs is None else cuda_graphs:
            self.graphs = HeadGraphRunner(head, self.cache)
        if cpu_compile:
            if self.device.type != "cpu":
                raise ValueError(f"cpu_compile is for CPU devices, got {str(self.device)!r}")
            # the cache's sizes never change: as symbols, one equal to a warm-up pass's row count (a head of
            # two layers, two sequences) would be taken for the same symbol and a third sequence recompile
            torch._dynamo.mark_static(self.cache.kv)
            with compile_phase(log, f"compiling the {self.head_name} for CPU") as progress:
                self.head_forward = compile_forward(head)
                self._greedy_steps = CompiledGreedySteps(head, self.draft_targets)
                static = isinstance(self.tree, DraftTree)
                self.greedy_tree = CompiledGreedyTree(head, self.draft_targets, self.tree) if static else None
                warm_up(self, progress)

    @property
    def num_active_sequences(self) -> int:
        return len(self._seqs)

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:  # a response teaches a head nothing
        self._seqs.pop(seq_id, None)
        self.cache.release(seq_id)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        check_propose_requests(requests, lambda s: len(self._seqs[s].tokens) if s in self._seqs else 0)
        self._check(requests)
        for r in requests:
            self._take(r)
        self._store_features(requests)
        drafting = [r for r in requests if r.num_tokens > 0]
        try:
            drafts, q_rows, parents = self._draft(drafting)
        except BaseException:
            for r in drafting:  # the next call rebuilds the rows from the features kept
                self._seqs[r.seq_id].rows = 0
            raise
        proposals = proposals_in_order(requests, drafting, drafts, q_rows)
        if parents is None:
            return proposals
        by_seq = dict(zip((r.seq_id for r in drafting), parents))
        return [replace(p, parents=by_seq[r.seq_id]) if len(p.token_ids) else p for r, p in zip(requests, proposals)]

    def _check(self, requests: list[ProposeRequest]) -> None:
        """Refuse, before any state moves, features that do not fit the head or leave a gap."""
        width = self.head.config.feature_size
        new = [r.seq_id for r in requests if r.seq_id not in self._seqs]
        if len(new) > self.cache.num_free:
            raise ValueError(f"{len(new)} new sequences, {self.cache.num_free} of max_num_seqs={self.max_num_seqs} "
                             f"slots free")  # fmt: skip
        for r in requests:
            held = self._seqs[r.seq_id].num_features if r.seq_id in self._seqs else 0
            hidden = r.hidden_states
            if hidden is not None and (hidden.dim() != 2 or hidden.shape[1] != width):
                raise ValueError(
                    f"seq {r.seq_id!r}: hidden_states of shape {tuple(hidden.shape)}; the {self.head_name} reads "
                    f"[n, {width}] (layers {self.hidden_state_layers} of a target with hidden size "
                    f"{self.head.config.target_hidden_size})"
                )
            if not 0 <= r.hidden_position <= held:
                raise ValueError(f"seq {r.seq_id!r}: hidden_position {r.hidden_position} is past the {held} "
                                 f"positions of hidden states the proposer holds")  # fmt: skip
            num_rows = held if hidden is None else r.hidden_position + hidden.shape[0]  # positions with features
            length = r.position + len(r.token_ids)
            if r.num_tokens > 0 and num_rows < length - 1:
                raise ValueError(f"seq {r.seq_id!r}: {length} tokens need the target's hidden states at "
                                 f"{length - 1} positions, the proposer has {num_rows}")  # fmt: skip
            if r.num_tokens > 0 and length + r.num_tokens - 2 > self.max_model_len:
                raise ValueError(f"seq {r.seq_id!r}: {length} tokens + {r.num_tokens} drafts exceed "
                                 f"max_model_len={self.max_model_len}")  # fmt: skip

    def _take(self, r: ProposeRequest) -> None:
        """The request's tokens, and how many positions have features once its own are stored."""
        seq = self._seqs.get(r.seq_id)
        if seq is None:
            seq = self._seqs[r.seq_id] = _Sequence([])
            self.cache.allocate(r.seq_id)
        del seq.tokens[r.position :]
        seq.tokens.extend(r.token_ids)
        seq.rows = min(seq.rows, max(r.position - 1, 0))  # row t reads token t + 1
        if r.hidden_states is not None:
            seq.num_features = r.hidden_position + r.hidden_states.shape[0]
            seq.rows = min(seq.rows, r.hidden_position)
        seq.num_features = min(seq.num_features, len(seq.tokens) - 1)  # features past the last token's predecessor are stale

    def _store_features(self, requests: list[ProposeRequest]) -> None:
        """Every request's new target features, fused by one ``fc`` and written into the buffer at once."""
        features, slots, positions = [], [], []
        for r in requests:
            if r.hidden_states is None:
                continue
            n = min(r.hidden_states.shape[0], self._seqs[r.seq_id].num_features - r.hidden_position)
            if n > 0:
                features.append(r.hidden_states[:n])
                slots += [self.cache.slot(r.seq_id)] * n
                positions += range(r.hidden_position, r.hidden_position + n)
        if not features:
            return
        fused = self.head.fuse(torch.cat(features).to(self.device, non_blocking=True))  # [N, h]
        index = torch.tensor([slots, positions], dtype=torch.long).to(self.device, non_blocking=True)  # [2, N]
        self._fused[index[0], index[1]] = fused

    @torch.inference_mode()  # the warm-up too: grad mode is part of a compiled graph's guards
    def _forward(self, seq_ids, starts, token_lists, hidden_lists, last: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One ragged pass: ids, starts as host lists, each row's hidden as a device tensor [n_i, h];
        each row's last logits [B, draft_vocab] and pre-norm [B, h] (``_pass``'s ``last`` rows)."""
        b, s = len(seq_ids), max(len(t) for t in token_lists)
        ids = [t + [0] * (s - len(t)) for t in token_lists]
        lengths = [len(t) for t in token_lists]
        slots = [self.cache.slot(x) for x in seq_ids]
        host = torch.tensor([x for row in ids for x in row] + list(starts) + lengths + slots, dtype=torch.long)
        meta = host.to(self.device, non_blocking=True)  # one copy: [B * S ids, B starts, B lengths, B slots]
        input_ids = meta[: b * s].view(b, s)  # [B, S]
        starts_t, num_new, slots_t = meta[b * s :].view(3, b)  # [B] each
        hidden = pad_sequence(list(hidden_lists), batch_first=True)  # [B, S, h], zeros past each row's length
        kv_len = max(start + n for start, n in zip(starts, lengths))
        return self._pass(input_ids, hidden, starts_t, num_new, slots_t, kv_len, last)

    def _catch_up(self, seq_ids, starts, token_lists, hidden_lists, last: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``_forward`` of each row's rows the cache lacks, in the passes the target's would take
        (``padding_bounded_passes``): a new prompt's rows beside decoding ones would pad them all to
        its length. Each row's last logits [B, draft_vocab] and pre-norm [B, h], in the rows' order."""
        groups = padding_bounded_passes([len(t) for t in token_lists])
        if len(groups) == 1:
            return self._forward(seq_ids, starts, token_lists, hidden_lists, last)
        columns = (seq_ids, starts, token_lists, hidden_lists)
        parts = [self._forward(*([column[i] for i in group] for column in columns), last) for group in groups]
        rows = torch.tensor([i for group in groups for i in group], device=self.device)  # [B]: each output's row
        logits, prenorm = (torch.cat(outputs) for outputs in zip(*parts))  # [B, draft_vocab], [B, h]: pass order
        return logits.index_copy(0, rows, logits), prenorm.index_copy(0, rows, prenorm)  # out[rows[j]] = in[j]

    def _draft(self, requests: list[ProposeRequest]) -> tuple[list[list[int]], list[list[torch.Tensor]], list | None]:
        """Each request's drafts, their q rows (sampled chains) and, for a tree, their parents."""
        if not requests:
            return [], [], None
        seqs = [self._seqs[r.seq_id] for r in requests]
        logits, prenorm = self._catch_up([r.seq_id for r in requests], *self._uncached_rows(requests, seqs))
        for seq in seqs:
            seq.rows = len(seq.tokens) - 1
        bans = self._ban_masks(requests)
        no_q = [[] for _ in requests]
        bases = [len(seq.tokens) - 2 for seq in seqs]
        if isinstance(self.tree, DynamicTree):
            tokens, parents = draft_dynamic_tree(self, requests, bases, logits, prenorm, bans, self.tree)
            return tokens, no_q, parents
        if not drafts_as_chain(self.tree, requests):
            tokens = draft_tree(self, requests, bases, logits, prenorm, bans, self.tree)
            return tokens, no_q, [self.tree.first(len(t)).parents for t in tokens]
        if self.uniform_greedy(requests):
            return self._draft_greedy_on_device(requests, seqs, logits, prenorm, bans), no_q, None
        generators = [None if r.sampling.greedy else make_generator(r.seed, self.device) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        live = list(range(len(requests)))
        for step in range(max(r.num_tokens for r in requests)):
            if step:
                live = [i for i in live if requests[i].num_tokens > step]
                rows = self._forward(
                    [requests[i].seq_id for i in live], [len(seqs[i].tokens) - 2 + step for i in live],
                    [[drafts[i][-1]] for i in live], [prenorm[i : i + 1] for i in live],
                )  # fmt: skip
                logits, prenorm = _scatter(logits, prenorm, live, rows)
            for i, token in zip(live, self._pick(requests, live, step, logits, generators, q_rows, bans, drafts)):
                drafts[i].append(token)
        return drafts, q_rows, None

    def _uncached_rows(self, requests, seqs) -> tuple[list[int], list[list[int]], list[torch.Tensor]]:
        """Each sequence's rows from the first its cache lacks to its last verified one: their first position,
        their tokens and their fused target features (a view of the buffer, [n, h])."""
        starts, tokens, hidden = [], [], []
        for r, seq in zip(requests, seqs):
            last_row = len(seq.tokens) - 2  # the last position the target has verified
            start = min(seq.rows, last_row)
            starts.append(start)
            tokens.append(seq.tokens[start + 1 : last_row + 2])
            hidden.append(self._fused[self.cache.slot(r.seq_id), start : last_row + 1])  # a view: [n, h]
        return starts, tokens, hidden

    @staticmethod
    def uniform_greedy(requests: list[ProposeRequest]) -> bool:
        """One k for every sequence, none sampled or under a grammar: the drafts stay on the device between steps."""
        return len({r.num_tokens for r in requests}) == 1 and all(r.sampling.greedy and r.guide is None for r in requests)

    def _draft_greedy_on_device(self, requests, seqs, logits, prenorm, bans) -> list[list[int]]:
        """Greedy drafts of one k for every sequence, each step fed by the last without the host.

        The per-step loop (sampled or mixed-k batches) reads every draft back before it can
        build the next pass, so a GPU idles between the head's small passes. Here each step's argmax
        (banned ids masked while ``min_tokens`` bans them) stays a device tensor that feeds
        the next pass, and the k drafts come back in one copy at the end: the passes queue
        back to back. On a CPU with ``cpu_compile`` the steps go ``STEPS_PER_CALL`` to one compiled
        call (``specdec.heads.compiled_steps``). The drafts are the per-step loop's, token for token.
        """
        b, k = len(requests), requests[0].num_tokens
        bases = [len(seq.tokens) - 2 for seq in seqs]  # the position of each row's step 1 is base + 1
        host = torch.tensor(bases + [self.cache.slot(r.seq_id) for r in requests] + [1] * b, dtype=torch.long)
        base, slots, ones = host.to(self.device, non_blocking=True).view(3, b)  # [B] each; ones: one token a row
        drafts = [self._greedy_ids(logits, 0, bans)]  # k x [B] target ids
        if self._greedy_steps is not None:
            banned, num_banned = bans if bans is not None else (torch.zeros_like(logits, dtype=torch.bool),
                                                                torch.zeros_like(base))  # fmt: skip
        step = 1
        while step < k:  # the last draft and the head's own pre-norm output of the row before
            if self._greedy_steps is not None and k - step >= STEPS_PER_CALL:  # several steps a compiled call
                ids, prenorm = self._greedy_steps.run(drafts[-1], prenorm, base + step, slots, self.cache.kv,
                                                      max(bases) + step + 1, banned, num_banned - step)  # fmt: skip
                # [B] each with a stride of 1, even for one row (a graph's guards check it; .contiguous() keeps 3)
                drafts += ids.t().clone(memory_format=torch.contiguous_format).unbind(0)
                step += STEPS_PER_CALL
                continue
            logits, prenorm = self._pass(drafts[-1][:, None], prenorm[:, None], base + step, ones, slots,
                                         max(bases) + step + 1)  # fmt: skip
            drafts.append(self._greedy_ids(logits, step, bans))  # [B]
            step += 1
        return torch.stack(drafts, 1).tolist()  # [B, k]: the one copy to the host

    def _pass(self, input_ids, hidden, starts, num_new, slots, kv_len: int,
              last: int = 1) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One pass of device tensors ([B, S] ids, [B, S, h] hidden, [B] each): the logits and pre-norm of each
        row's last token ([B, draft_vocab], [B, h]), or of its last ``last`` ([B, last, ...], clamped at its first).

        ``kv_len`` (positions attended, from the host's own counts) bounds an eager pass without
        reading the device; a captured one spans the whole cache."""
        b, s = input_ids.shape
        bucket = self.graphs.bucket(b, s) if self.graphs is not None else None
        if bucket is not None:  # [B', S', ...] for the bucket's (B', S'): rows past b and s are padding
            logits, prenorm = self.graphs.run_head(bucket, input_ids, hidden, starts, num_new, slots)
        else:
            logits, prenorm = self.head_forward(input_ids, hidden, starts, num_new, slots, self.cache.kv, kv_len)
        rows = torch.arange(b, device=self.device)
        if last == 1:
            return logits[rows, num_new - 1], prenorm[rows, num_new - 1]  # [B, draft_vocab], [B, h]
        at = (num_new[:, None] - last + torch.arange(last, device=self.device)).clamp(min=0)  # [B, last]: P-EAGLE's
        return logits[rows[:, None], at], prenorm[rows[:, None], at]  # [B, last, draft_vocab], [B, last, h]

    def _ban_masks(self, requests: list[ProposeRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each sequence's banned draft ids ([B, draft_vocab] bool: those whose target ids ``min_tokens``
        bans) and how many of its drafts they bind ([B]); None when no sequence bans any."""
        banning = [i for i, r in enumerate(requests) if r.banned_token_ids and r.num_banned_tokens]
        if not banning:
            return None
        mask = torch.zeros((len(requests), self.head.config.draft_vocab_size), dtype=torch.bool)  # on the host
        for i in banning:
            mask[i] = torch.isin(self._draft_targets_host, torch.tensor(requests[i].banned_token_ids))
        num_banned = torch.tensor([r.num_banned_tokens for r in requests])
        return mask.to(self.device, non_blocking=True), num_banned.to(self.device, non_blocking=True)

    def _greedy_ids(self, logits: torch.Tensor, step: int, bans, rows: list[int] | None = None) -> torch.Tensor:
        """The argmax over the draft vocabulary of ``logits`` [n, draft_vocab] (the requests' ``rows``, all
        if None), banned ids masked while they bind, mapped to target ids [n]; no target-vocabulary row."""
        if bans is not None:
            mask, num_banned = bans if rows is None else (bans[0][rows], bans[1][rows])
            logits = logits.masked_fill(mask & (step < num_banned)[:, None], float("-inf"))
        return self.draft_targets[logits.argmax(-1)]

    def _pick(self, requests, live, step, logits, generators, q_rows, bans, drafts) -> list[int]:
        """Each next draft: a free greedy row's is ``_greedy_ids``; the others' go on the target's vocabulary,
        where rejection sampling compares ``q`` and a grammar masks it."""
        picked = {}
        greedy = [i for i in live if generators[i] is None and requests[i].guide is None]
        if greedy:
            picked.update(zip(greedy, self._greedy_ids(logits[greedy], step, bans, greedy).tolist()))
        for i in (i for i in live if i not in picked):
            banned = (int(step < requests[i].num_banned_tokens), requests[i].banned_token_ids)
            row = apply_logit_bias(self.head.target_logits(logits[i : i + 1]), requests[i].sampling.logit_bias)
            row = guided_row(row, requests[i].guide, drafts[i])  # [1, vocab]: what the grammar allows
            if generators[i] is None:  # greedy under a grammar, which bans nothing (no min_tokens)
                picked[i] = int(row.argmax())
                continue
            q = process_logits(row, requests[i].sampling, *banned)  # [1, vocab]
            picked[i] = int(sample_from_probs(q, generators[i]))
            q_rows[i].append(q)
        return [picked[i] for i in live]

def _scatter(logits, prenorm, live, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the live sequences' new rows over their old ones (the others keep theirs, unread)."""
    logits, prenorm = logits.clone(), prenorm.clone()
    index = torch.tensor(live, dtype=torch.long, device=logits.device)
    logits[index], prenorm[index] = rows[0], rows[1]
    return logits, prenorm
