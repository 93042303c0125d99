"""Sampled steps with no distribution through the orchestrator: ``q`` and ``p`` cross one process boundary each.

Sent back to the orchestrator and on to rejection_sampler, a sampled step would move
``q`` ``[k, vocab]`` and ``p`` ``[k + 1, vocab]`` twice each per sequence, through host
memory (at a 128k vocabulary and k = 4, about 4.6 MB per sequence and step). Instead:

1. the orchestrator's propose request sets ``hold_draft_probs``; draft_proposer sends
   every ``q`` it drew to rejection_sampler in one request (``hold_inputs``), which keeps
   it (:class:`specdec.held_draft_probs.HeldDraftProbs`), and answers with the drafts and
   ``draft_probs_held``;
2. the verify request marks the sequences to sample (``sample_here``, each one's seed and
   whether its ``q`` is held); target_verifier, after its forward, sends their ``p``,
   argmax and drafts to rejection_sampler in one request naming the sequences, and
   answers with the verdicts (``num_accepted``, ``output_token_ids``, and the emitted
   tokens' log probabilities when asked) in place of ``p``.

The rejection sampler stays the one owner of the acceptance rule and its random numbers.
A request to it that names sequences must carry the server's secret, as requests to the
stateful models do. The names and layouts live here, beside ``wire`` (same conventions:
no batch dimension, one or more sequences per request).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.held_draft_probs import HeldDraftProbs
from specdec.penalties import emitted_log_probs
from specdec.types import Proposal, ProposeRequest, SampleCall, SampleHere, SampleResult, VerifyRequest, VerifyResult
from specdec_triton import wire
from specdec_triton.tree_wire import SAMPLE_TREE_OUTPUTS, lists_of, lists_out
from specdec_triton.internal import SECRET_INPUT, is_authorized
from specdec_triton.packing import cut, each, each_optional_position, flat, i32, one, optional_positions, split
from specdec_triton.bls import bls_blocking
from specdec_triton.plumbing import RequestError, bytes_array, scalar, text, texts

PROPOSE_HOLD_INPUTS = ("hold_draft_probs",)  # [1] bool: send q to rejection_sampler, not back
PROPOSE_HOLD_OUTPUTS = ("draft_probs_held",)  # [S] bool: this sequence's q waits in rejection_sampler
VERIFY_SAMPLE_INPUTS = ("sample_here", "sample_seed", "sample_position", "draft_probs_held")  # [S] each
VERIFY_SAMPLE_OUTPUTS = ("num_accepted", "output_token_ids", "output_log_probs", *SAMPLE_TREE_OUTPUTS)
SAMPLER_SEQUENCE_INPUTS = ("seq_id", "hold_draft_probs", "draft_probs_held", SECRET_INPUT)

Send = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]  # one request to rejection_sampler


# --- orchestrator: what it asks for, and what it reads back ------------------------------------


def propose_hold_inputs(requests: Sequence[ProposeRequest]) -> dict[str, np.ndarray]:
    """Greedy drafts draw no q; a request with a sampled sequence asks for its q to go to the sampler."""
    return {} if all(r.sampling.greedy for r in requests) else {"hold_draft_probs": one(True, np.bool_)}


def mark_held(proposals: list[Proposal], outputs: Mapping[str, np.ndarray]) -> list[Proposal]:
    if "draft_probs_held" not in outputs:
        return proposals
    held = each(outputs, "draft_probs_held", len(proposals), bool, False)
    return [replace(p, probs_held=True) if h else p for p, h in zip(proposals, held)]


def verify_sample_inputs(requests: Sequence[VerifyRequest]) -> dict[str, np.ndarray]:
    here = [r.sample_here for r in requests]
    if not any(here):
        return {}
    return {
        "sample_here": np.array([h is not None for h in here], np.bool_),  # [S]
        "sample_seed": np.array([h.seed if h else 0 for h in here], np.uint64),  # [S]
        "sample_position": optional_positions(h.position if h else None for h in here),  # [S]
        "draft_probs_held": np.array([bool(h and h.draft_probs_held) for h in here], np.bool_),  # [S]
    }


def attach_sampled(
    requests: Sequence[VerifyRequest], results: list[VerifyResult], outputs: Mapping[str, np.ndarray]
) -> list[VerifyResult]:
    """The results with each sampled-here sequence's verdict; a missing one is the verifier's fault."""
    if not any(r.sample_here for r in requests):
        return results
    accepted = i32(outputs["num_accepted"]).tolist()
    if len(accepted) != len(requests):
        raise RuntimeError(f"target_verifier returned {len(accepted)} verdicts for {len(requests)} sequences")
    sampled = [n >= 0 for n in accepted]
    if sampled != [r.sample_here is not None for r in requests]:
        raise RuntimeError(f"target_verifier sampled sequences {sampled}, asked for "
                           f"{[r.sample_here is not None for r in requests]}")  # fmt: skip
    lengths = [n + 1 if s else 0 for n, s in zip(accepted, sampled)]
    tokens = split(outputs, "output_token_ids", lengths, len(requests))
    with_log_probs = [n if s and r.log_probs else 0 for n, s, r in zip(lengths, sampled, requests)]
    log_probs = _split_floats(outputs, "output_log_probs", with_log_probs)
    paths = lists_of(outputs, "accepted_nodes", len(requests))
    return [
        replace(result, sampled=SampleResult(torch.tensor(ids, dtype=torch.long), n, lp if r.log_probs else None, path))
        if s else result
        for result, r, s, n, ids, lp, path in zip(results, requests, sampled, accepted, tokens, log_probs, paths)
    ]  # fmt: skip


def _split_floats(outputs: Mapping[str, np.ndarray], name: str, lengths: list[int]) -> list[list[float]]:
    values = np.asarray(outputs.get(name, np.zeros(0, np.float32)), np.float32).reshape(-1).tolist()
    if len(values) != sum(lengths):
        raise RuntimeError(f"target_verifier returned {len(values)} values of '{name}' for {sum(lengths)} tokens")
    return cut(values, lengths)


# --- draft_proposer: q goes to the sampler -----------------------------------------------------


def asks_to_hold(batch: Sequence[Mapping[str, np.ndarray]]) -> bool:
    """A dynamic batch holds q if any of its requests asks (they all come from the one orchestrator)."""
    return any(scalar(inputs, "hold_draft_probs", bool, False) for inputs in batch)


def hold_in_sampler(requests: Sequence[ProposeRequest], proposals: list[Proposal], send: Send) -> list[Proposal]:
    """Every q drawn goes to rejection_sampler in one request; the proposals come back without it, flagged held."""
    drawn = [(r.seq_id, p) for r, p in zip(requests, proposals) if p.probs is not None]
    if not drawn:
        return proposals
    send({
        **wire.proposal_outputs([p for _, p in drawn]),  # draft ids, their counts, q rows
        "seq_id": bytes_array([seq_id for seq_id, _ in drawn]),
        "hold_draft_probs": one(True, np.bool_),
    })  # fmt: skip
    return [replace(p, probs=None, probs_held=True) if p.probs is not None else p for p in proposals]


def held_outputs(proposals: Sequence[Proposal]) -> dict[str, np.ndarray]:
    return {"draft_probs_held": np.array([p.probs_held for p in proposals], np.bool_)}  # [S]


# --- target_verifier: p goes to the sampler ----------------------------------------------------


def with_sample_here(requests: list[VerifyRequest], inputs: Mapping[str, np.ndarray]) -> list[VerifyRequest]:
    if "sample_here" not in inputs:
        return requests
    count = len(requests)
    here = each(inputs, "sample_here", count, bool, False)
    seeds = each(inputs, "sample_seed", count, int, 0)
    positions = each_optional_position(inputs, "sample_position", count)
    held = each(inputs, "draft_probs_held", count, bool, False)
    return [replace(r, sample_here=SampleHere(seed, h, position)) if s else r
            for r, s, seed, h, position in zip(requests, here, seeds, held, positions)]  # fmt: skip


def sample_in_sampler(requests: Sequence[VerifyRequest], results: list[VerifyResult], send: Send,
                      draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[VerifyResult]:  # fmt: skip
    """The sampled-here sequences judged by rejection_sampler in one request; their p does not travel further.

    ``draft_probs``: each sequence's ``q``, where the draft ran in this process (it then goes in the
    same request, instead of being held in the sampler first); None: held, or one-hot.
    """
    chosen = [i for i, r in enumerate(requests) if r.sample_here is not None]
    if not chosen:
        return results
    calls = [_sample_call(requests[i], results[i], draft_probs[i] if draft_probs else None) for i in chosen]
    outputs = send({
        **wire.sample_inputs(calls),
        "seq_id": bytes_array([requests[i].seq_id for i in chosen]),
        "draft_probs_held": np.array([requests[i].sample_here.draft_probs_held for i in chosen], np.bool_),
    })  # fmt: skip
    verdicts = wire.sample_results_of(outputs)
    if len(verdicts) != len(chosen):
        raise RuntimeError(f"rejection_sampler returned {len(verdicts)} verdicts for {len(chosen)} sequences")
    out = list(results)
    for i, verdict in zip(chosen, verdicts):
        request, result = requests[i], results[i]
        tokens = verdict.output_token_ids.tolist()
        log_probs = _log_probs(tokens, result, verdict) if request.log_probs else None
        out[i] = replace(result, probs=None, sampled=replace(verdict, log_probs=log_probs))
    return out


def _sample_call(request: VerifyRequest, result: VerifyResult, draft_probs: torch.Tensor | None = None) -> SampleCall:
    num_drafts = request.num_logits - 1
    if num_drafts < 0 or num_drafts > len(request.token_ids):
        raise RequestError(f"seq {request.seq_id!r}: input 'num_logits' ({request.num_logits}) leaves no drafts "
                           f"among its {len(request.token_ids)} token_ids to sample")  # fmt: skip
    drafts = request.token_ids[len(request.token_ids) - num_drafts :]
    return SampleCall(torch.tensor(drafts, dtype=torch.long), draft_probs, VerifyResult(result.argmax, result.probs),
                      request.sample_here.seed, position=request.sample_here.position,
                      parents=request.tree_parents)  # fmt: skip


def _log_probs(tokens: list[int], result: VerifyResult, verdict: SampleResult) -> list[float]:
    """The emitted tokens' log probs, from the rows they were drawn at: a tree's root and accepted path."""
    rows = None if verdict.accepted_nodes is None else [0, *(node + 1 for node in verdict.accepted_nodes)]
    if rows is None:
        return emitted_log_probs(tokens, result.log_mass, result.probs, result.argmax)
    pick = torch.tensor(rows, device=result.argmax.device)
    return emitted_log_probs(tokens, result.log_mass[pick], None if result.probs is None else result.probs[pick],
                             result.argmax[pick])  # fmt: skip


def sampled_outputs(results: Sequence[VerifyResult]) -> dict[str, np.ndarray]:
    """``num_accepted`` -1 for a sequence not sampled here; log probs only for those that asked."""
    sampled = [r.sampled for r in results]
    return {
        "num_accepted": i32([s.num_accepted if s else -1 for s in sampled]),  # [S]
        "output_token_ids": flat([s.output_token_ids.tolist() if s else () for s in sampled]),
        "output_log_probs": np.array([v for s in sampled if s and s.log_probs for v in s.log_probs], np.float32),
        **lists_out("accepted_nodes", [s.accepted_nodes if s else None for s in sampled]),  # tree_wire
    }


# --- rejection_sampler: keeps q, pairs it with p -----------------------------------------------


def names_sequences(inputs: Mapping[str, np.ndarray]) -> bool:
    return "seq_id" in inputs


def check_sequence_caller(inputs: Mapping[str, np.ndarray], secret: str) -> None:
    if not is_authorized(text(inputs, SECRET_INPUT), secret):
        raise RequestError(
            "rejection_sampler: a request naming sequences (input 'seq_id': their q held here) is internal to "
            f"speculative_decoding and needs input '{SECRET_INPUT}'; without 'seq_id' the sampler takes q and p "
            "as inputs and is callable on its own"
        )


def is_hold(inputs: Mapping[str, np.ndarray]) -> bool:
    return scalar(inputs, "hold_draft_probs", bool, False)


def hold(inputs: Mapping[str, np.ndarray], held: HeldDraftProbs) -> None:
    seq_ids = texts(inputs, "seq_id") or []
    proposals = wire.proposals_of(inputs)
    if len(proposals) != len(seq_ids):
        raise RequestError(f"input 'seq_id' names {len(seq_ids)} sequences, 'num_draft_tokens' {len(proposals)}")
    for seq_id, proposal in zip(seq_ids, proposals):
        if proposal.probs is None:
            raise RequestError(f"seq {seq_id!r}: a hold_draft_probs request needs input 'draft_probs' for it")
        try:
            held.hold(seq_id, proposal.token_ids.tolist(), proposal.probs.clone())  # its buffer is the request's
        except ValueError as err:
            raise RequestError(f"input 'draft_probs': {err}") from None


def with_held_probs(
    calls: list[SampleCall], inputs: Mapping[str, np.ndarray], held: HeldDraftProbs
) -> tuple[list[SampleCall], list[str]]:
    """The calls with the q held for the flagged sequences, and those sequences (to discard once sampled)."""
    seq_ids = texts(inputs, "seq_id") or []
    if len(seq_ids) != len(calls):
        raise RequestError(f"input 'seq_id' names {len(seq_ids)} sequences, the request samples {len(calls)}")
    flags = each(inputs, "draft_probs_held", len(calls), bool, False)
    out, taken = [], []
    for call, seq_id, flag in zip(calls, seq_ids, flags):
        if not flag:
            out.append(call)
            continue
        try:
            out.append(replace(call, draft_probs=held.take(seq_id, call.draft_token_ids.tolist())))
        except ValueError as err:
            raise RequestError(str(err)) from None
        taken.append(seq_id)
    return out, taken


# --- the request itself, from a model's execute ------------------------------------------------


def sampler_sender(secret: str) -> Send:
    """A blocking BLS request to rejection_sampler carrying the server's secret (from a model's ``execute``)."""

    def send(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return bls_blocking(wire.REJECTION_SAMPLER, {**inputs, **wire.secret_input(secret)}, wire.SAMPLE_OUTPUTS)

    return send
