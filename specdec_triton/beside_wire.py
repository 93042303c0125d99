"""One call to target_verifier for a whole step, when the draft runs beside the target.

With draft_proposer's ``run_with_target``, target_verifier's process holds the draft
model or head too (:mod:`specdec.draft_beside_target`), and the orchestrator sends each
step as one call on target_verifier's socket: the verify request of every sequence,
built for the drafts it asks for, with the propose requests beside it under the
``propose_`` prefix (the two share names such as ``token_ids``). ``proposes`` marks the
sequences that draft. The answer is the verify call's outputs and every sequence's
proposal (none drafted for one that does not draft), under the same prefix. A head's hidden states stay in target_verifier's process, so only their
position travels (``propose_hidden_position``).

The draft's description comes from the same socket: a call with ``describe`` and
``describe_draft`` set gets the description draft_proposer would give.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from specdec.draft_beside_target import ProposeVerify
from specdec.types import Proposal, VerifyResult
from specdec_triton import hidden_wire, sample_hop, wire
from specdec_triton.packing import each, i64, one
from specdec_triton.plumbing import RequestError, scalar

PREFIX = "propose_"
PROPOSES_INPUT = "proposes"  # [S] bool: the sequence drafts this step (its propose request is among the propose_ inputs)
DESCRIBE_DRAFT_INPUT = "describe_draft"  # [1] bool, beside "describe": the draft's description, not the target's


def _prefixed(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {PREFIX + name: value for name, value in arrays.items()}


def _unprefixed(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name[len(PREFIX):]: value for name, value in arrays.items() if name.startswith(PREFIX)}


# --- orchestrator ------------------------------------------------------------------------------


def describe_draft_inputs() -> dict[str, np.ndarray]:
    return {**wire.describe_inputs(), DESCRIBE_DRAFT_INPUT: one(True, np.bool_)}


def step_inputs(steps: Sequence[ProposeVerify]) -> dict[str, np.ndarray]:
    verify = [s.verify for s in steps]
    propose = [s.propose for s in steps if s.propose is not None]
    inputs = {
        **wire.verify_inputs(verify), **hidden_wire.verify_hidden_inputs(verify),
        **sample_hop.verify_sample_inputs(verify),
        PROPOSES_INPUT: np.array([s.propose is not None for s in steps], np.bool_),
    }  # fmt: skip
    if propose:
        inputs.update(_prefixed({**wire.propose_inputs(propose), "hidden_position": i64([r.hidden_position for r in propose])}))
    return inputs


def step_output_names(steps: Sequence[ProposeVerify]) -> tuple[str, ...]:
    verify = [s.verify for s in steps]
    names = wire.GREEDY_VERIFY_OUTPUTS + (wire.LOG_PROB_OUTPUTS if any(r.log_probs for r in verify) else ())
    names += sample_hop.VERIFY_SAMPLE_OUTPUTS if any(r.sample_here for r in verify) else ()
    return names + tuple(PREFIX + n for n in wire.GREEDY_PROPOSE_OUTPUTS)  # q never comes back: it was used there


def step_results_of(steps: Sequence[ProposeVerify], outputs: Mapping[str, np.ndarray]) -> list[tuple[Proposal, VerifyResult]]:
    """Each sequence's proposal and verify result; the verify rows follow the drafts each one got."""
    proposals = wire.proposals_of(_unprefixed(outputs))
    if len(proposals) != len(steps):
        raise RuntimeError(f"target_verifier returned {len(proposals)} proposals for {len(steps)} sequences")
    for step, proposal in zip(steps, proposals):
        if len(proposal.token_ids) > (step.propose.num_tokens if step.propose else 0):
            raise RuntimeError(f"target_verifier returned {len(proposal.token_ids)} drafts for seq "
                               f"{step.verify.seq_id!r}, which asked for fewer")  # fmt: skip
    # a verify request sent without a propose request went as it was (its drafts, if any, from elsewhere)
    verify = [s.verify if s.propose is None else replace(s.verify, num_logits=len(p.token_ids) + 1)
              for s, p in zip(steps, proposals)]  # fmt: skip
    results = wire.verify_results_of(outputs, [r.num_logits for r in verify])
    return list(zip(proposals, sample_hop.attach_sampled(verify, results, outputs)))


# --- target_verifier ---------------------------------------------------------------------------


def is_step(inputs: Mapping[str, np.ndarray]) -> bool:
    return PROPOSES_INPUT in inputs


def is_describe_draft(inputs: Mapping[str, np.ndarray]) -> bool:
    return scalar(inputs, DESCRIBE_DRAFT_INPUT, bool, False)


def steps_of(inputs: Mapping[str, np.ndarray]) -> list[ProposeVerify]:
    verify = sample_hop.with_sample_here(hidden_wire.with_hidden_layers(wire.verify_requests_of(inputs), inputs), inputs)
    proposes = each(inputs, PROPOSES_INPUT, len(verify), bool, False)
    propose = []
    if any(proposes):
        asked = _unprefixed(inputs)
        propose = wire.propose_requests_of(asked)
        positions = each(asked, "hidden_position", len(propose), int, 0)
        propose = [replace(r, hidden_position=p) for r, p in zip(propose, positions)]
    if len(propose) != sum(proposes):
        raise RequestError(f"input '{PROPOSES_INPUT}' marks {sum(proposes)} sequences that draft, and "
                           f"{len(propose)} propose requests came with it")  # fmt: skip
    requests = iter(propose)
    steps = [ProposeVerify(next(requests) if p else None, v) for p, v in zip(proposes, verify)]
    for step in steps:
        if step.propose is not None and step.propose.seq_id != step.verify.seq_id:
            raise RequestError(f"propose request for seq {step.propose.seq_id!r} beside the verify request of "
                               f"{step.verify.seq_id!r}: the two lists must name the same sequences in order")  # fmt: skip
    return steps


def step_outputs(results: Sequence[tuple[Proposal, VerifyResult]]) -> dict[str, np.ndarray]:
    """Every sequence's proposal (no drafts for one that drafts nothing) and verify result."""
    proposals = [p for p, _ in results]
    verified = [r for _, r in results]
    return {**wire.verify_outputs(verified), **sample_hop.sampled_outputs(verified),
            **_prefixed(wire.proposal_outputs(proposals))}  # fmt: skip
