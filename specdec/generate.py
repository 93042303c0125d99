"""Decode one request in this process: ``SequenceState`` driven by local proposer, verifier and sampler calls.

The reference loop the tests and the evaluation scripts run, one request at a time;
served requests run the same state machine in the step scheduler (``specdec.scheduler``).
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from specdec.engine import GenerationParams, SequenceState, StepOutput
from specdec.proposers.base import Proposer
from specdec.types import Proposal, SampleResult, VerifyRequest, VerifyResult

# (draft_token_ids [k], draft_probs [k, vocab] | None, verify result, seed; position=, parents=) -> accepted +
# recovered/bonus
Sampler = Callable[[torch.Tensor, torch.Tensor | None, VerifyResult, int], SampleResult]


class Verifier(Protocol):
    """What the loop needs of a target verifier (``TargetVerifier`` or a batched engine)."""

    vocab_size: int
    max_model_len: int | None

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...

    def release(self, seq_id: str) -> None: ...


def check_token_ids(prompt_ids: list[int], params: GenerationParams, vocab_size: int) -> None:
    """Token ids must index the target's vocabulary; fails before any model call."""
    named = {"prompt_ids": list(prompt_ids), "eos_token_ids": list(params.eos_token_ids)}
    named["stop_token_sequences"] = [t for stop in params.stop_token_sequences for t in stop]
    named["bad_words"] = [t for word in params.penalties.bad_words for t in word]
    named["logit_bias"] = [t for t, _ in params.sampling.logit_bias]
    for name, ids in named.items():
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} must lie in [0, {vocab_size}), got {bad[:8]}")


def generate(
    proposer: Proposer | None,
    verifier: Verifier,
    sampler: Sampler,
    prompt_ids: list[int],
    params: GenerationParams,
    seq_id: str | None = None,
    drafts_under_grammar: bool = True,
) -> Iterator[StepOutput]:
    """Decode one request in-process, yielding the tokens each step emits.

    ``proposer`` may be None when ``params.num_speculative_tokens == 0``. Proposer and
    verifier state for the sequence is released however the loop ends: finished,
    raised, or closed early by the caller. ``drafts_under_grammar`` False: the drafter
    drafts freely and the grammar cuts what it forbids, as for a drafter in another process.
    """
    seq_id = seq_id if seq_id is not None else uuid.uuid4().hex
    params.validate(verifier.max_model_len, len(prompt_ids))
    check_token_ids(prompt_ids, params, verifier.vocab_size)
    if proposer is None and params.num_speculative_tokens > 0:
        raise ValueError("proposer is required when num_speculative_tokens > 0")
    state = SequenceState(seq_id, prompt_ids, params, () if proposer is None else proposer.hidden_state_layers)
    completed = False  # a response that ran to its end may teach the proposer (suffix decoding)
    try:
        while not state.finished:
            propose_request = state.propose_request(guided=drafts_under_grammar)
            proposal = proposer.propose([propose_request])[0] if propose_request is not None else None
            proposal = state.constrain(proposal, 0 if propose_request is None else propose_request.num_tokens)
            verify_result = verifier.verify([state.verify_request(proposal)])[0]
            if proposal is None:
                proposal = Proposal(token_ids=torch.empty(0, dtype=torch.long, device=verify_result.argmax.device))
            tree = {} if proposal.parents is None else {"parents": proposal.parents}  # a chain's sampler needs no more
            result = sampler(proposal.token_ids, proposal.probs, verify_result, state.sample_seed(),
                             position=state.sample_position(), **tree)  # fmt: skip
            output = state.commit(proposal, result, verify_result)
            completed = state.finished
            yield output
    finally:
        try:
            if proposer is not None:
                proposer.release(seq_id, state.output_ids if completed else None)
        finally:
            verifier.release(seq_id)
