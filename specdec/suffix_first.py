"""Suffix decoding first, a model's drafts where it has no strong match (Arctic Inference's hybrid).

Suffix decoding drafts from the sequence's own text and past responses for the cost of a
lookup; a draft model or head drafts anywhere, for the cost of its passes (and, served
composing, a round trip to the draft_proposer model). Where the text repeats itself --
code, edits, the target's own loops -- suffix decoding's drafts are long and likely, and
elsewhere it has none. So for each sequence at each step, suffix decoding's draft is taken
when its score (the expected number of its tokens that match, ``Draft.score``) reaches
``min_score``, and the model drafts for the sequence otherwise.

The model is not called for a sequence whose draft suffix decoding gave: the tokens and
target hidden states of those steps wait here (``_ModelView``) and go with the
sequence's next model request, which the model catches up in one pass (a head's
ragged pass, a draft model's prefill of the new tokens). A step where suffix decoding
drafts for every sequence makes no model call at all. Either proposal is corrected by
rejection sampling as any other (suffix decoding's ``q`` is one-hot at its drafts), so
the output stays the target's. Each proposal names its source (``Proposal.source``), so the
steps it makes can be counted by source (the served metrics, the benchmarks).

:class:`SuffixFirst` decides and keeps the model's view of each sequence; it calls
nothing. :class:`SuffixFirstStages` wraps a step's stages (whose ``propose`` is the
model's, in this process or another) with it, as the orchestrator runs it;
:class:`SuffixFirstProposer` puts it in front of a proposer in this process.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from specdec.draft_beside_target import ProposeVerify, fit_to_drafts
from specdec.propose_in_process import ProposeInProcess
from specdec.proposers.base import Proposer
from specdec.proposers.model_free import MODEL_FREE_METHODS
from specdec.proposers.suffix import SuffixConfig, SuffixProposer
from specdec.scheduler import Stages, StepCapabilities
from specdec.types import ModelDescription, Proposal, ProposeRequest, VerifyResult

# A sequence's backlog goes to the model once it is this long, suffix decoding's draft or not: it bounds
# the catch-up pass (the model keeps the sequence meanwhile: the orchestrator renews every live one,
# specdec_triton.leases).
MAX_BACKLOG_TOKENS = 256
# of four drafts on held-out text the shipped head gets about 2.2 accepted, the draft model about 1.5: a
# suffix draft expected to match as many is taken, and saves the model's passes
DEFAULT_MIN_SCORE = 2.0
SUFFIX_SOURCE, MODEL_SOURCE = "suffix", "model"  # Proposal.source of each kind of draft


@dataclass(frozen=True)
class SuffixFirstConfig:
    """``enable_suffix_decoding`` beside a model method: suffix decoding's settings, when its draft is
    taken, and how far the model drafts when it is not."""

    suffix: SuffixConfig = SuffixConfig()
    min_score: float = DEFAULT_MIN_SCORE  # expected matching tokens at which suffix decoding's draft is taken
    # the model's drafts per step; 0: the step's k. Suffix decoding's long drafts are nearly free, a
    # model's each cost a pass, so a server may let suffix decoding draft 8 and the model 4.
    model_num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.min_score > 0:
            raise ValueError(f"suffix_decoding_min_score must be > 0, got {self.min_score}")
        if self.model_num_speculative_tokens < 0:
            raise ValueError(f"model_num_speculative_tokens must be >= 0 (0: the step's k), "
                             f"got {self.model_num_speculative_tokens}")  # fmt: skip

    def settings(self) -> tuple[tuple[str, int | float], ...]:
        """As a description carries them (``ModelDescription.settings``) to the orchestrator."""
        own = (("min_score", self.min_score), ("model_num_speculative_tokens", self.model_num_speculative_tokens))
        return (*asdict(self.suffix).items(), *own)

    @classmethod
    def from_settings(cls, settings: tuple[tuple[str, int | float], ...]) -> SuffixFirstConfig:
        """The config ``settings()`` described; ValueError naming what is missing or unknown."""
        given = dict(settings)
        names = {f.name for f in fields(SuffixConfig)} | {"min_score", "model_num_speculative_tokens"}
        if set(given) != names:
            raise ValueError(f"suffix decoding beside a model was described with settings {sorted(given)}, "
                             f"expected {sorted(names)}")  # fmt: skip
        own = {name: given.pop(name) for name in ("min_score", "model_num_speculative_tokens")}
        return cls(SuffixConfig(**given), float(own["min_score"]), int(own["model_num_speculative_tokens"]))


def suffix_first_for(description: ModelDescription, rows_stay: bool = False) -> SuffixFirst | None:
    """The router a model proposer's description asks for (its ``settings``); None when it asks for none.

    A model-free method's settings are its own (``specdec.proposers.model_free``): not these.
    ``rows_stay``: the model runs beside the target, which keeps a head's hidden states.
    """
    if description.method in MODEL_FREE_METHODS or not description.settings:
        return None
    return SuffixFirst(SuffixFirstConfig.from_settings(description.settings), rows_stay)


@dataclass
class _ModelView:
    """What the model proposer holds of one sequence, and the target features it has not been sent."""

    num_tokens: int = 0  # tokens of the sequence the model was sent (after any cut-back)
    num_features: int = 0  # target hidden-state rows the model was sent
    # [n_i, features] each, in order: rows num_features onwards, not sent (joined once, when they are)
    pending: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """One step's proposals: those suffix decoding gave, and the requests the model must answer."""

    from_suffix: dict[str, Proposal]  # seq_id -> suffix decoding's draft
    to_model: list[ProposeRequest]  # each sequence's whole backlog, in the order of the step's requests


class SuffixFirst:
    """Routes each sequence's step to suffix decoding or the model; owns the model's view of the sequences."""

    def __init__(self, config: SuffixFirstConfig, rows_stay: bool = False):
        """``rows_stay``: the model runs beside the target (``specdec.draft_beside_target``), which keeps a
        head's hidden states; requests then carry none, and the model reads every row up to the last
        token verified whenever it is called."""
        self.config = config
        self.rows_stay = rows_stay
        self.suffix = SuffixProposer(config.suffix)
        self._views: dict[str, _ModelView] = {}

    def plan(self, requests: list[ProposeRequest]) -> Plan:
        """Suffix decoding's draft where it scores ``min_score`` (and the model lacks under ``MAX_BACKLOG_TOKENS``
        of the sequence); the rest become model requests."""
        scored = self.suffix.propose_scored(requests)  # checks the requests and keeps every sequence's tokens
        from_suffix, to_model = {}, []
        for request, (proposal, score) in zip(requests, scored):
            view = self._views.setdefault(request.seq_id, _ModelView())
            self._keep(view, request)
            backlog = len(self.suffix.sequence(request.seq_id)) - view.num_tokens  # tokens the model lacks
            if len(proposal.token_ids) and score >= self.config.min_score and backlog < MAX_BACKLOG_TOKENS:
                from_suffix[request.seq_id] = replace(proposal, source=SUFFIX_SOURCE)
            else:
                to_model.append(self._backlog(view, request))
        return Plan(from_suffix, to_model)

    def answered(self, requests: list[ProposeRequest], plan: Plan, answers: list[Proposal]) -> list[Proposal]:
        """The step's proposals in the order of ``requests``, once the model has answered ``plan.to_model``
        (``answers``, in its order); the model now holds what those requests carried."""
        if len(answers) != len(plan.to_model):
            raise ValueError(f"the model answered {len(answers)} of {len(plan.to_model)} propose requests")
        for request in plan.to_model:
            view = self._views[request.seq_id]
            view.num_tokens = request.position + len(request.token_ids)
            if self.rows_stay:  # the last token is not verified yet
                view.num_features = view.num_tokens - 1
            elif request.hidden_states is not None:
                view.num_features = request.hidden_position + request.hidden_states.shape[0]
            view.pending = []
        from_model = {r.seq_id: replace(answer, source=MODEL_SOURCE) for r, answer in zip(plan.to_model, answers)}
        return [plan.from_suffix[r.seq_id] if r.seq_id in plan.from_suffix else from_model[r.seq_id] for r in requests]

    def release(self, seq_id: str, response: list[int] | None = None) -> None:
        self._views.pop(seq_id, None)
        self.suffix.release(seq_id, response)

    @property
    def num_active_sequences(self) -> int:
        return len(self._views)

    @staticmethod
    def _keep(view: _ModelView, request: ProposeRequest) -> None:
        """Move the view back where the request cuts the sequence, and queue its new target features."""
        view.num_tokens = min(view.num_tokens, request.position)
        if request.hidden_states is None:
            return
        start = request.hidden_position
        if start < view.num_features:  # the model will drop its rows past start when it is sent these
            view.num_features, view.pending = start, [request.hidden_states]
            return
        keep = start - view.num_features  # rows queued before the request's own
        if keep < sum(rows.shape[0] for rows in view.pending):  # the request resends some (a retried call)
            view.pending = [torch.cat(view.pending)[:keep]]
        view.pending.append(request.hidden_states)

    def _backlog(self, view: _ModelView, request: ProposeRequest) -> ProposeRequest:
        """The request as the model must see it: every token and feature row it was not sent, from where it stopped."""
        tokens = self.suffix.sequence(request.seq_id)
        cap = self.config.model_num_speculative_tokens
        pending = torch.cat(view.pending) if len(view.pending) > 1 else (view.pending[0] if view.pending else None)
        return replace(request, position=view.num_tokens, token_ids=tokens[view.num_tokens :],
                       num_tokens=min(request.num_tokens, cap) if cap else request.num_tokens,
                       hidden_states=pending, hidden_position=view.num_features)  # fmt: skip


class SuffixFirstProposer(Proposer):
    """:class:`SuffixFirst` in front of a proposer in this process; itself a ``Proposer``
    (for ``specdec.generate.generate``)."""

    def __init__(self, config: SuffixFirstConfig, model):
        self.router = SuffixFirst(config)
        self.model = model
        self.hidden_state_layers = model.hidden_state_layers  # the model's: a head reads them

    @property
    def num_active_sequences(self) -> int:
        return self.router.num_active_sequences

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        plan = self.router.plan(requests)
        return self.router.answered(requests, plan, self.model.propose(plan.to_model) if plan.to_model else [])

    def release(self, seq_id: str, response: list[int] | None = None) -> None:
        self.router.release(seq_id, response)
        self.model.release(seq_id, response)


class SuffixFirstStages(ProposeInProcess):
    """A step's stages with proposals from :class:`SuffixFirst` first and the wrapped stages' ``propose`` after.

    As :class:`~specdec.propose_in_process.ProposeInProcess`, with the router as the part in
    this process: verify, sample and release go on to the wrapped stages, the router hears
    every release, and ``on_release`` is called with it after each (the suffix trees' size).
    """

    def __init__(self, stages: Stages, router: SuffixFirst, on_release: Callable[[SuffixFirst], None] | None = None):
        super().__init__(stages, router, on_release)

    @property
    def router(self) -> SuffixFirst:
        return self.proposer

    @property
    def capabilities(self) -> StepCapabilities:
        """The wrapped stages': where their model runs beside the target, a step is one ``propose_and_verify`` call."""
        return self.stages.capabilities

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        plan = self.router.plan(requests)
        return self.router.answered(requests, plan, await self.stages.propose(plan.to_model) if plan.to_model else [])

    async def propose_and_verify(self, steps: list[ProposeVerify]) -> list[tuple[Proposal, VerifyResult]]:
        """The step in one call beside the target: a sequence suffix decoding drafts for is sent with its
        drafts in its verify request, the others with their model request (the backlog)."""
        asked = [s.propose for s in steps if s.propose is not None]
        plan = self.router.plan(asked) if asked else Plan({}, [])
        to_model = {request.seq_id: request for request in plan.to_model}
        sent = []
        for step in steps:
            if step.propose is None:  # drafts nothing this step
                sent.append(step)
            elif step.seq_id in plan.from_suffix:  # suffix decoding's drafts go in the verify request
                sent.append(ProposeVerify(None, fit_to_drafts(step.verify, plan.from_suffix[step.seq_id])))
            else:  # the model's request, with the sequence's backlog
                sent.append(ProposeVerify(to_model[step.seq_id], step.verify))
        results = await self.stages.propose_and_verify(sent)
        answers = [proposal for step, (proposal, _) in zip(sent, results) if step.propose is not None]
        proposals = iter(self.router.answered(asked, plan, answers))
        return [(next(proposals) if step.propose is not None else proposal, result)
                for step, (proposal, result) in zip(steps, results)]  # fmt: skip
