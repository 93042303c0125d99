"""Target-model verification: one forward pass scores the last token and k drafts.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023) runs the target once over
``[last, d_1 .. d_k]`` and reads ``k + 1`` next-token distributions ``p`` from it:
one per draft to accept or reject, plus the bonus position. The KV cache written
for rejected drafts is discarded by the next call, whose ``position`` cuts it back.

Penalties and bad words (:mod:`specdec.penalties`) and a logit bias change ``p`` itself, so they
are applied here, to every row with the tokens before it, drafts included: the verifier
keeps the tokens of each sequence that asks for penalties, addressed by ``position``
like the cache.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from specdec.cached_lm import CachedLM, ForwardCall, OwnsOneModel
from specdec.grammar import apply_allowed
from specdec.penalties import NO_PENALTIES, apply_penalties, log_kept_mass
from specdec.sampling import apply_logit_bias, check_banned, greedy_tokens, process_logits
from specdec.top_log_probs import top_alternatives
from specdec.tree import node_depths, path_to
from specdec.types import GREEDY_TEMPERATURE_BELOW, VerifyRequest, VerifyResult, check_logit_bias


def verify_result(
    logits: torch.Tensor,  # [num_logits, vocab]
    request: VerifyRequest,
    tokens: list[int] | None = None,  # the whole sequence through the last row's token; needed for penalties
) -> VerifyResult:
    """``argmax`` always; ``p`` only for sampled requests; penalties, the logit bias, min_tokens bans and a
    grammar's ``allowed_tokens`` applied to both."""
    if request.tree_parents is not None:
        logits, request = _tree_rows(logits, request, tokens)
    if request.penalties.active:
        logits = apply_penalties(logits, tokens, request.num_prompt_tokens, request.penalties)
    logits = apply_logit_bias(logits, request.sampling.logit_bias)  # the same in every row, a tree's too
    logits = apply_allowed(logits, request.allowed_tokens)  # [num_logits, vocab]
    banned = (request.num_banned_rows, request.banned_token_ids)
    argmax = greedy_tokens(logits, *banned)  # [num_logits]
    probs = None if request.sampling.greedy else process_logits(logits, request.sampling, *banned)
    log_mass = None
    if request.log_probs:
        banned_logits = logits if not request.num_banned_rows else _with_bans(logits, *banned)
        temperature = request.sampling.temperature
        divisor = temperature if temperature >= GREEDY_TEMPERATURE_BELOW else 1.0  # greedy: the logits' own
        log_mass = log_kept_mass(banned_logits, probs, argmax, divisor)
        if request.num_top_log_probs:
            top_ids, top_values = top_alternatives(banned_logits, divisor, request.num_top_log_probs)  # [m, n] each
            return VerifyResult(argmax, probs, log_mass, top_token_ids=top_ids, top_log_probs=top_values)
    return VerifyResult(argmax=argmax, probs=probs, log_mass=log_mass)


def _tree_rows(
    logits: torch.Tensor,  # [n + 1, vocab]: the root's row, then each node's
    request: VerifyRequest,
    tokens: list[int] | None,  # the sequence through the root, then the tree's nodes in order
) -> tuple[torch.Tensor, VerifyRequest]:
    """A tree's rows with penalties (each row's context is its own path) and min_tokens bans (by depth)
    applied, and the request without them, for ``verify_result`` to finish as for a chain."""
    parents = request.tree_parents
    depths = [0, *node_depths(parents)]  # row j emits output index (row 0's) + depths[j]
    if request.penalties.active:
        before = tokens[: len(tokens) - len(parents)]  # through the root
        drafts = tokens[len(before) :]
        rows = [apply_penalties(logits[:1], before, request.num_prompt_tokens, request.penalties)]
        for node in range(len(parents)):
            context = before + [drafts[i] for i in path_to(parents, node)]
            rows.append(apply_penalties(logits[node + 1 : node + 2], context, request.num_prompt_tokens,
                                        request.penalties))  # fmt: skip
        logits = torch.cat(rows)
    banned = [j for j, depth in enumerate(depths) if depth < request.num_banned_rows]
    if banned and request.banned_token_ids:
        logits = logits.float().clone()
        logits[torch.tensor(banned)[:, None], torch.tensor(request.banned_token_ids)[None, :]] = float("-inf")
    return logits, replace(request, penalties=NO_PENALTIES, num_banned_rows=0, banned_token_ids=())


def asked_hidden_layers(requests: Sequence[VerifyRequest]) -> tuple[int, ...]:
    """The hidden layers the requests of one verify call ask for: those of any that asks.

    A sequence that drafts nothing asks for none (``SequenceState``), so one call may mix
    it with sequences that ask for the head's layers: the pass returns them for every row,
    and a sequence that asked for none leaves its rows unread. Two different non-empty
    sets cannot come from one proposer and are refused.
    """
    asked = {r.hidden_layers for r in requests if r.hidden_layers}
    if len(asked) > 1:
        raise ValueError(f"the requests of one verify call must ask for the same hidden_layers, got {asked}")
    return asked.pop() if asked else ()


def path_moves(request: VerifyRequest) -> tuple[tuple[int, int], ...]:
    """Cache moves that put the previous step's accepted tree path at the positions of its depths.

    That step fed its root at ``P = position - len(path) - 1`` and node ``j`` at ``P + 1 + j``;
    the path's i-th node (depth ``i``) belongs at ``P + i``.
    """
    path = request.accepted_path
    root = request.position - len(path) - 1
    return tuple((root + 1 + node, root + depth) for depth, node in enumerate(path, 1) if node + 1 != depth)


def kept_path_tokens(held: list[int], request: VerifyRequest) -> list[int]:
    """``held`` with the previous step's accepted tree path moved as ``path_moves`` moves the cache."""
    moves = path_moves(request)
    if not moves:
        return held
    held = list(held)
    for source, target in moves:  # ascending: a source always lies at or past every earlier target
        held[target] = held[source]
    return held


def _with_bans(logits: torch.Tensor, num_banned_rows: int, banned_token_ids: tuple[int, ...]) -> torch.Tensor:
    logits = logits.float().clone()
    logits[: min(num_banned_rows, logits.shape[0]), list(banned_token_ids)] = float("-inf")
    return logits


class TargetVerifier(OwnsOneModel):
    """Verifies the drafts of every request of a call in one forward of the target ``CachedLM``.

    The fast engine runs the calls as one ragged batch (a CUDA graph where it fits);
    the ``hf`` engine runs them one after another. Either way the verifier owns no
    cache of its own: ``position`` addresses the LM's.
    """

    def __init__(self, lm: CachedLM):
        self.lm = lm
        self._tokens: dict[str, list[int]] = {}  # seq_id -> its tokens, for sequences with penalties

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        for r in requests:
            check_banned(r.banned_token_ids, self.lm.vocab_size)
            check_logit_bias(r.sampling.logit_bias, self.lm.vocab_size)
        tokens = [self._sequence_tokens(r) for r in requests]
        calls = [ForwardCall(r.seq_id, r.position, list(r.token_ids), r.num_logits, r.tree_parents, path_moves(r))
                 for r in requests]  # fmt: skip
        hidden_layers = asked_hidden_layers(requests)
        if not hidden_layers:
            return [verify_result(logits, r, t) for logits, r, t in zip(self.lm.forward(calls), requests, tokens)]
        logits, hidden = self.lm.forward_with_hidden(calls, hidden_layers)
        return [replace(verify_result(row, r, t), hidden_states=h) for row, h, r, t in zip(logits, hidden, requests, tokens)]

    def _sequence_tokens(self, request: VerifyRequest) -> list[int] | None:
        """The sequence through this request's tokens, kept for a request with penalties (checked first)."""
        if not request.penalties.active:
            return None
        held = self._tokens.get(request.seq_id, [])
        if request.position > len(held):
            raise ValueError(
                f"seq {request.seq_id!r}: penalties need every token of the sequence, but position "
                f"{request.position} lies past the {len(held)} tokens sent with penalties"
            )
        request.penalties.validate()
        held = kept_path_tokens(held, request)
        sequence = held[: request.position] + list(request.token_ids)
        self._tokens[request.seq_id] = sequence
        return sequence

    def release(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)
        self.lm.release(seq_id)
