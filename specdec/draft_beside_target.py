"""A draft model or head beside the target: one call drafts and verifies a step.

Served as two models, a step makes two calls, each to another process: propose, then
verify (its drafts are the verify's input); a head's features travel from the target to
the orchestrator and on to the head. When the proposer lives in the target's process
(draft_proposer's ``run_with_target``), :class:`DraftBesideTarget` does both halves of a
step in one call: the proposals, then one verify of every sequence with the drafts it
got. The caller builds each verify request for the drafts it asked for
(``ProposeVerify``), and :func:`fit_to_drafts` cuts it to the drafts made (a tree's with its
parents: the caller learns them from the proposal, and sends the accepted path next step).

A grammar request (structured output) is drafted under a copy of its grammar here
(:mod:`specdec.guided_drafts`, given ``grammar_compiler``). The caller's verify request then
carries the mask of row 0 alone, as it cannot know the drafts; the rows after them are the
copy's (``GrammarState.masks``). A sequence without a copy that follows it (none built, or
its row 0 differs from the caller's) has its drafts dropped, and is verified with row 0 alone.

A head's hidden states then never leave this process: :class:`HiddenRows` keeps each
sequence's rows by position, as a KV cache keeps its entries (a verify writes the rows of
the tokens it fed, cutting back to its position; a propose request takes the rows its
``hidden_position`` starts from, up to the last verified token). The caller counts the
rows it would have sent (``SequenceState(hidden_rows_stay=True)``), so ``hidden_position``
means what it means when the rows travel.

Sampled sequences keep the rejection sampler as the one owner of the sampling rule:
``judge`` has them judged there, each with its ``q`` and ``p``, in one request
(``specdec_triton.sample_hop``); two separate models need two, as the draft's ``q`` is
held in the sampler until the target's ``p`` arrives.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specdec.grammar import GrammarCompiler
from specdec.guided_drafts import GuidedDrafts
from specdec.types import Proposal, ProposeRequest, VerifyRequest, VerifyResult

# (requests of one verify call, the target's results, draft_probs=each one's q or None) -> the results
# with the sampled sequences (``sample_here``) judged
Judge = Callable[..., list[VerifyResult]]

NO_PROPOSAL = Proposal(token_ids=torch.empty(0, dtype=torch.long))


def free_every(frees: list[Callable[[], None]]) -> None:
    """Runs every release even if one fails, so no model keeps a sequence another let go; raises the first failure."""
    failures = []
    for free in frees:
        try:
            free()
        except Exception as err:  # noqa: PERF203
            failures.append(err)
    if failures:
        raise failures[0]


@dataclass(frozen=True)
class ProposeVerify:
    """One sequence's step: what to ask the proposer, and the verify request built for
    ``propose.num_tokens`` drafts (their ids are placeholders). Without a propose request the
    verify request is sent as it is: no drafts, or drafts from elsewhere (suffix decoding's)."""

    propose: ProposeRequest | None
    verify: VerifyRequest

    @property
    def seq_id(self) -> str:
        return self.verify.seq_id


def fit_to_drafts(request: VerifyRequest, proposal: Proposal) -> VerifyRequest:
    """``request``, built for the drafts asked, with the drafts the proposer made (there may be fewer)."""
    asked, made = request.num_logits - 1, len(proposal.token_ids)
    if made > asked:
        raise ValueError(f"seq {request.seq_id!r}: proposal has {made} tokens, more than the {asked} requested")
    fed = list(request.token_ids[: len(request.token_ids) - asked]) + proposal.token_ids.tolist()
    sample_here = request.sample_here
    if sample_here is not None:
        sample_here = replace(sample_here, draft_probs_held=proposal.probs_held)
    return replace(request, token_ids=fed, num_logits=made + 1, tree_parents=proposal.parents,
                   num_banned_rows=min(request.num_banned_rows, made + 1), sample_here=sample_here)  # fmt: skip


class HiddenRows:
    """Each sequence's target hidden states by position, kept for a head beside the target."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}  # seq_id -> (position of row 0, rows [n, features])

    def write(self, seq_id: str, position: int, rows: torch.Tensor) -> None:
        """The rows of tokens fed at ``position`` on; anything held from ``position`` on is replaced."""
        held = self._rows.get(seq_id)
        if held is not None and held[0] < position:
            start, kept = held
            if position > start + kept.shape[0]:
                raise ValueError(f"seq {seq_id!r}: hidden rows from position {position}, but rows are held only "
                                 f"up to {start + kept.shape[0]}")  # fmt: skip
            rows = torch.cat([kept[: position - start], rows])
            position = start
        self._rows[seq_id] = (position, rows)

    def take(self, seq_id: str, start: int, end: int) -> torch.Tensor | None:
        """Rows ``start .. end - 1`` ([end - start, features]; None when empty).

        Rows before ``start`` were read by earlier calls and are dropped; the rows returned
        stay until the next call moves ``start`` past them, so a call sent again gets them again.
        """
        held = self._rows.get(seq_id)
        if held is not None and held[0] < start <= held[0] + held[1].shape[0]:
            held = self._rows[seq_id] = (start, held[1][start - held[0]:])
        if end <= start:
            return None
        if held is None or held[0] > start or held[0] + held[1].shape[0] < end:
            have = ("none" if held is None or not held[1].shape[0]
                    else f"positions {held[0]} .. {held[0] + held[1].shape[0] - 1}")
            raise ValueError(f"seq {seq_id!r}: the head needs the target's hidden states at positions {start} .. "
                             f"{end - 1}, and this process holds {have}")  # fmt: skip
        first, rows = held
        return rows[start - first: end - first]

    def release(self, seq_id: str) -> None:
        self._rows.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._rows)


class DraftBesideTarget:
    """The target's verifier and a proposer in one process: ``step`` drafts and verifies in one call.

    Also the one holder of both models' sequences there: a release frees a sequence in both.
    """

    def __init__(self, verifier, proposer, hidden_layers: tuple[int, ...] = (), judge: Judge | None = None,
                 grammar_compiler: Callable[[], GrammarCompiler] | None = None,
                 log: Callable[[str], None] = print):  # fmt: skip
        """``hidden_layers``: the target hidden states the proposer reads (a head's); () for a draft model.
        ``judge``: None returns ``q`` and ``p`` to the caller, which samples. ``grammar_compiler``: makes the
        compiler of the target's guides; None: grammar requests draft nothing here."""
        self.verifier = verifier
        self.guides = None if grammar_compiler is None else GuidedDrafts(proposer, grammar_compiler, log)
        self.proposer = proposer if self.guides is None else self.guides
        self.hidden_layers = tuple(hidden_layers)
        self.judge = judge
        self.rows = HiddenRows()

    def step(self, steps: list[ProposeVerify]) -> list[tuple[Proposal, VerifyResult]]:
        """Every sequence's proposal (one propose call for those that draft), then one verify of all."""
        asked = [s.propose for s in steps if s.propose is not None]
        proposals = iter(self._propose(asked) if asked else [])
        made = [NO_PROPOSAL if s.propose is None else next(proposals) for s in steps]
        fitted = [self._fit(s, p) for s, p in zip(steps, made)]
        made, requests = [proposal for proposal, _ in fitted], [request for _, request in fitted]
        results = self.verifier.verify(requests)
        if self.judge is not None:  # q was used here: it does not travel back
            results = self.judge(requests, results, draft_probs=[p.probs for p in made])
            made = [replace(p, probs=None) if p.probs is not None else p for p in made]
        return list(zip(made, [self._keep_rows(r, result) for r, result in zip(requests, results)]))

    def _fit(self, step: ProposeVerify, proposal: Proposal) -> tuple[Proposal, VerifyRequest]:
        """The step's drafts and its verify request for them; under a grammar, its masks from the copy."""
        if step.propose is None:
            return proposal, step.verify
        masks = step.verify.allowed_tokens  # [1, words]: row 0's, the caller's
        if masks is None:
            return proposal, fit_to_drafts(step.verify, proposal)
        if masks.shape[0] != 1:
            raise ValueError(f"seq {step.seq_id!r}: a grammar request drafted beside the target carries row 0's mask "
                             f"alone, got {masks.shape[0]} rows")  # fmt: skip
        guide = None if self.guides is None else self.guides.guide_of(step.seq_id)
        if guide is None or not torch.equal(guide.masks([]), masks.to(torch.int32)):
            proposal = NO_PROPOSAL  # no copy that follows the sequence: nothing to mask its drafts' rows with
        else:
            masks = guide.masks(proposal.token_ids.tolist(), proposal.parents)  # [k' + 1, words]
        return proposal, replace(fit_to_drafts(step.verify, proposal), allowed_tokens=masks)

    def _propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        if self.hidden_layers:
            requests = [self._with_rows(r) for r in requests]
        return self.proposer.propose(requests)

    def _with_rows(self, request: ProposeRequest) -> ProposeRequest:
        """The request with the rows its proposer has not read: up to the last token the target verified."""
        if request.hidden_states is not None:
            raise ValueError(f"seq {request.seq_id!r}: hidden states sent with a propose request, but the target "
                             "beside the head keeps them")  # fmt: skip
        verified = request.position + len(request.token_ids) - 1  # the last token is not verified yet
        rows = self.rows.take(request.seq_id, request.hidden_position, verified)
        return replace(request, hidden_states=rows)

    def _keep_rows(self, request: VerifyRequest, result: VerifyResult) -> VerifyResult:
        """A result's hidden states stay here for the proposer; the caller gets the result without them."""
        if result.hidden_states is None:
            return result
        if request.hidden_layers:
            self.rows.write(request.seq_id, request.position, result.hidden_states)
        return replace(result, hidden_states=None)

    def release(self, seq_id: str, response: list[int] | None = None) -> None:
        """Frees the sequence in the proposer, the verifier and the rows."""
        free_every([lambda: self.proposer.release(seq_id, response), lambda: self.verifier.release(seq_id),
                    lambda: self.rows.release(seq_id)])  # fmt: skip

    @property
    def num_active_sequences(self) -> int:
        """Sequences held here: whichever of the two models (or the rows) holds the most, so a leak in any shows."""
        return max(self.verifier.num_active_sequences, self.proposer.num_active_sequences, len(self.rows))
