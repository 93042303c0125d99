"""The step scheduler: one loop decides, for every step, which sequences run and how many tokens they draft.

In the spirit of vLLM v1's scheduler, requests do not drive their own decoding: each
submits a :class:`~specdec.engine.SequenceState` and reads its steps from a queue,
while one loop runs every step for all of them:

1. admit waiting sequences in arrival order while fewer than ``max_num_seqs`` run
   (the KV-cache slots the stages hold), and drop cancelled ones;
2. choose the step's ``k`` from the batch size (:class:`SpeculationLength`); a sequence
   drafts fewer if its own ``num_speculative_tokens`` or its tokens left say so, or, when
   the speculation follows acceptance, if its drafts have been failing
   (``specdec.follow_acceptance``: the goodput rule over each sequence's acceptance);
3. **one** propose call for every sequence that drafts, **one** verify call for all;
4. rejection sampling: against a greedy target the drafts are matched to the target's
   argmax here, without a call; the sampled sequences are sampled where ``p`` is made,
   inside the verify call, when the stages declare it (``samples_in_verify``: served, so
   ``p`` never travels back), else they go to the sampler in one call;
5. commit, hand each sequence its :class:`~specdec.engine.StepOutput`, and release the
   sequences that finished (in one call) before their slots are given to others.

So the batch shape of every step is a decision made in one place and reported
(:class:`StepReport`), not something that emerges from when coroutines wake up. A stage
call that fails fails the sequences it carried; the loop goes on with the others.
Nothing here imports Triton: :class:`Stages` is the seam, implemented with calls to the
composing models in ``specdec_triton.model_stages`` and with local objects in the tests.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specdec.draft_beside_target import NO_PROPOSAL, ProposeVerify
from specdec.engine import SequenceState, StepOutput
from specdec.follow_acceptance import DraftLengths
from specdec.tree_sampler import match_greedy_either
from specdec.speculation_length import SpeculationLength
from specdec.types import (
    Proposal, ProposeRequest, SampleCall, SampleHere, SampleResult, StepCapabilities, VerifyRequest, VerifyResult,
)  # fmt: skip


_log = logging.getLogger(__name__)  # DEBUG: one line per step with its shape


class Stages(Protocol):
    """The calls a step makes; each takes every sequence of the step at once.

    ``capabilities`` says which of them a step uses (:class:`StepCapabilities`).
    """

    capabilities: StepCapabilities

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]: ...
    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...
    async def sample(self, calls: list[SampleCall]) -> list[SampleResult]: ...  # the rejection sampler
    # frees each sequence's state in every stage; the value is its output if its request
    # completed (a proposer may learn from it: suffix decoding), None if cancelled or failed
    async def release(self, ended: dict[str, list[int] | None]) -> None: ...


class SequenceCancelled(Exception):
    """The sequence's client cancelled it; raised from :meth:`ScheduledSequence.steps`."""


@dataclass(frozen=True)
class SequenceStep:
    """What one sequence did in one step."""

    num_draft_tokens: int
    num_accepted: int
    num_new_tokens: int  # tokens emitted (fewer than accepted + 1 when a stop condition cut the step)
    source: str | None = None  # the proposal's (``Proposal.source``): who drafted, where a step may take either


@dataclass(frozen=True)
class StepReport:
    """One step of the loop: its shape, what each sequence did, and what each call took."""

    k: int  # the most drafts the step allowed a sequence
    sequences: tuple[SequenceStep, ...]  # one per sequence verified, in batch order
    # "propose" / "verify" / "sample" / "propose_verify" -> (sequences, wall seconds), calls made
    calls: dict[str, tuple[int, float]]

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)


@dataclass(frozen=True)
class ScheduledStep:
    """A step as its sequence's reader gets it: the output, and the request's counts as of this step."""

    output: StepOutput
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int


_RELEASED = object()  # queue marker: the stages hold nothing more for the sequence; no steps follow


class ScheduledSequence:
    """A submitted sequence: its state (owned by the loop once submitted) and its queue of steps."""

    def __init__(self, state: SequenceState, is_cancelled: Callable[[], bool]):
        self.state = state
        self._client_cancelled = is_cancelled
        self._abandoned = False
        self._queue: asyncio.Queue = asyncio.Queue()  # ScheduledStep | BaseException | _RELEASED

    def deliver(self, item) -> None:
        """From the scheduler: a ``ScheduledStep``, the exception that ended the sequence, or the end."""
        self._queue.put_nowait(item)

    def abandon(self) -> None:
        """The reader will read no more (its client went away, its send failed): stop at the next step."""
        self._abandoned = True

    def is_cancelled(self) -> bool:
        return self._abandoned or self._client_cancelled()

    async def steps(self) -> AsyncIterator[ScheduledStep]:
        """Every step's output in order; ends once the sequence is released, or raises why it failed.

        The iteration ends only after the stages released the sequence, so a final
        response sent after it tells the client the server holds nothing more for it.
        """
        while True:
            item = await self._queue.get()
            if item is _RELEASED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class StepScheduler:
    def __init__(
        self,
        stages: Stages,
        speculation: SpeculationLength,
        max_num_seqs: int | None,  # sequences the stages hold at once; None: no limit
        match_greedy_here: bool = True,  # False: every step goes to the sampler (e.g. its synthetic method)
        on_step: Callable[[StepReport], None] | None = None,
    ):
        self.stages = stages
        self.lengths = DraftLengths(speculation)  # each sequence's k in a step
        self.max_num_seqs = max_num_seqs
        self.match_greedy_here = match_greedy_here
        self.on_step = on_step
        self.samples_in_verify = stages.capabilities.samples_in_verify
        self.proposes_in_verify = stages.capabilities.proposes_in_verify
        self.drafts_under_grammar = stages.capabilities.drafts_under_grammar
        self._waiting: collections.deque[ScheduledSequence] = collections.deque()
        self._running: list[ScheduledSequence] = []
        self._ending: list[ScheduledSequence] = []  # out of the step, their release in flight
        self._loop_task: asyncio.Task | None = None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def held_seq_ids(self) -> list[str]:
        """The sequences the stages hold for requests still running (not those waiting, nor those ending)."""
        return [s.state.seq_id for s in self._running]

    def submit(self, state: SequenceState, is_cancelled: Callable[[], bool] = lambda: False) -> ScheduledSequence:
        """Queue a sequence (its prompt not yet in any cache); read its steps from the returned object."""
        sequence = ScheduledSequence(state, is_cancelled)
        self._waiting.append(sequence)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._run())
        return sequence

    def fail_all(self, error: Exception) -> list[str]:
        """Ends every sequence now with ``error``, without waiting for the call in flight; stops the loop.

        For a stage whose process died: a call to it may not answer for many seconds,
        and its readers must hear at once. Returns every seq_id the living stages may
        still hold, for the caller to release.
        """
        everyone = [*self._running, *self._waiting, *self._ending]
        self._running, self._waiting, self._ending = [], collections.deque(), []
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
        for sequence in everyone:
            sequence.deliver(error)
            sequence.deliver(_RELEASED)
        return [s.state.seq_id for s in everyone]

    async def _run(self) -> None:
        """Steps until no sequence runs or waits; a fault of the loop itself fails every sequence."""
        try:
            while self._waiting or self._running:
                await self._admit()
                if self._running:
                    await self._step()
        except BaseException as err:  # a bug here must not leave clients waiting forever
            everyone = [*self._running, *self._waiting]
            self._running, self._waiting = [], collections.deque()
            fault = RuntimeError(f"step scheduler failed: {err!r}")
            await self._end({sequence: fault for sequence in everyone})
            if not isinstance(err, Exception):
                raise

    async def _admit(self) -> None:
        """Cancelled sequences leave; waiting ones fill the free slots in arrival order."""
        cancelled = [s for s in [*self._running, *self._waiting] if s.is_cancelled()]
        if cancelled:
            self._running = [s for s in self._running if s not in cancelled]
            self._waiting = collections.deque(s for s in self._waiting if s not in cancelled)
            await self._end({s: SequenceCancelled(f"request cancelled after {len(s.state.output_ids)} output tokens")
                             for s in cancelled})  # fmt: skip
        while self._waiting and (self.max_num_seqs is None or len(self._running) < self.max_num_seqs):
            self._running.append(self._waiting.popleft())

    async def _step(self) -> None:
        batch, started = list(self._running), time.monotonic()
        lengths = self.lengths.choose([s.state for s in batch])
        k, ks = lengths.cap, dict(zip(batch, lengths.ks))  # the most drafts each sequence asks for
        calls: dict[str, tuple[int, float]] = {}  # what the report says of each call
        failed: dict[ScheduledSequence, Exception] = {}
        if self.proposes_in_verify:
            proposals, verified = await self._propose_and_verify(batch, ks, calls)
            alive = batch
        else:
            proposals = await self._propose(batch, ks, calls, failed)
            alive = [s for s in batch if s not in failed]
            verify_requests = [self._verify_request(s, proposals[s]) for s in alive]
            verified = dict(zip(alive, await self._call("verify", self.stages.verify, verify_requests, calls)))
        results = await self._sample(alive, proposals, verified, calls, failed)
        follows = self.lengths.speculation.follows_acceptance  # else the table alone: no step is measured
        fed = sum(s.state.num_fed(len(proposals[s].token_ids)) for s in alive) if follows else 0  # rows verified
        steps, finished = [], []
        for sequence in (s for s in batch if s not in failed):
            try:
                output = sequence.state.commit(proposals[sequence], results[sequence], verified[sequence])
            except ValueError as err:  # a result that does not fit the sequence's drafts
                failed[sequence] = err
                continue
            proposal = proposals[sequence]
            steps.append(SequenceStep(len(proposal.token_ids), results[sequence].num_accepted,
                                      len(output.new_token_ids), proposal.source))  # fmt: skip
            stats = sequence.state.stats
            sequence.deliver(ScheduledStep(
                output, len(sequence.state.output_ids), stats.num_draft_tokens, stats.num_accepted_tokens))
            if output.finished:
                finished.append(sequence)
        if fed:  # what the step's drafts did, and what it cost, for the next steps' k
            self.lengths.observe([(s.num_draft_tokens, s.num_accepted) for s in steps], fed, lengths,
                                 calls.get("propose", (0, 0.0))[1], time.monotonic() - started)  # fmt: skip
        report = StepReport(k, tuple(steps), calls)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("step: %d sequences (%d waiting), k=%d, drafted %d, accepted %d, emitted %d; calls %s",
                       report.num_sequences, len(self._waiting), k, sum(s.num_draft_tokens for s in steps),
                       sum(s.num_accepted for s in steps), sum(s.num_new_tokens for s in steps),
                       {stage: f"{n} seqs {1e3 * t:.2f} ms" for stage, (n, t) in calls.items()})  # fmt: skip
        if self.on_step is not None:
            self.on_step(report)
        if finished or failed:
            self._running = [s for s in self._running if s not in finished and s not in failed]
            await self._end({**{s: None for s in finished}, **failed})

    async def _propose(self, batch, ks: dict, calls: dict, failed: dict) -> dict[ScheduledSequence, Proposal]:
        """One propose call for the sequences that draft; an empty proposal for the others, but the tokens a
        grammar forces (``SequenceState.constrain``), whatever k: each costs a verify row and is always accepted."""
        proposals = {s: NO_PROPOSAL for s in batch}
        requests = {s: s.state.propose_request(ks[s], self.drafts_under_grammar) for s in batch if ks[s]}
        drafting = [s for s, request in requests.items() if request is not None]
        outcomes = await self._call("propose", self.stages.propose, [requests[s] for s in drafting], calls)
        for sequence, outcome in zip(drafting, outcomes):
            if isinstance(outcome, Exception):
                failed[sequence] = outcome
            else:
                proposals[sequence] = sequence.state.constrain(outcome, requests[sequence].num_tokens)
        for sequence in batch:
            if sequence not in requests and sequence.state.grammar is not None:
                proposals[sequence] = sequence.state.constrain(None, sequence.state.num_draft_tokens()) or NO_PROPOSAL
        return proposals

    async def _propose_and_verify(self, batch, ks: dict, calls: dict) -> tuple[dict, dict]:
        """The step as one call: each verify request is built for the drafts asked, and cut there to those made.

        A sequence whose call failed gets its error as its verify outcome, which ``_sample`` fails it with.
        """
        steps = []
        for sequence in batch:
            request = sequence.state.propose_request(ks[sequence]) if ks[sequence] else None
            asked = NO_PROPOSAL if request is None else Proposal(torch.zeros(request.num_tokens, dtype=torch.long))
            # a grammar's masks after the drafts are made where they are (specdec.draft_beside_target)
            verify = self._verify_request(sequence, asked, drafted_there=request is not None)
            steps.append(ProposeVerify(request, verify))
        outcomes = await self._call("propose_verify", self.stages.propose_and_verify, steps, calls)
        proposals, verified = {}, {}
        for sequence, outcome in zip(batch, outcomes):
            proposals[sequence], verified[sequence] = (NO_PROPOSAL, outcome) if isinstance(outcome, Exception) else outcome
        return proposals, verified

    def _needs_sampler(self, request: VerifyRequest) -> bool:
        return not (request.sampling.greedy and self.match_greedy_here)

    def _verify_request(self, sequence: ScheduledSequence, proposal: Proposal,
                        drafted_there: bool = False) -> VerifyRequest:  # fmt: skip
        """The sequence's verify request; one the sampler must judge is judged inside the call if the stages can."""
        request = sequence.state.verify_request(proposal, drafted_there)
        if self.samples_in_verify and self._needs_sampler(request):
            state = sequence.state
            here = SampleHere(state.sample_seed(), proposal.probs_held, state.sample_position())
            return replace(request, sample_here=here)
        return request

    async def _sample(self, alive, proposals, verified, calls: dict, failed: dict) -> dict:
        """Greedy targets are matched here; sampled where p is, or every other sequence to the sampler in one call."""
        results, to_sample = {}, []
        for sequence in alive:
            outcome, proposal = verified[sequence], proposals[sequence]
            if isinstance(outcome, Exception):
                failed[sequence] = outcome
            elif outcome.sampled is not None:
                results[sequence] = outcome.sampled
            elif outcome.probs is None and self.match_greedy_here:
                results[sequence] = match_greedy_either(proposal, outcome)
            elif self.samples_in_verify or proposal.probs_held:  # the sampler reads q where it was held
                failed[sequence] = RuntimeError(f"seq {sequence.state.seq_id!r}: the verify call returned no "
                                                "rejection-sampling verdict for a sequence it was asked to sample")
            else:
                to_sample.append(sequence)
        if not to_sample:  # stages that sample in verify have no sample call to name
            return results
        sample_calls = [SampleCall(proposals[s].token_ids, proposals[s].probs, verified[s], s.state.sample_seed(),
                                   position=s.state.sample_position(), parents=proposals[s].parents)
                        for s in to_sample]  # fmt: skip
        for sequence, outcome in zip(to_sample, await self._call("sample", self.stages.sample, sample_calls, calls)):
            if isinstance(outcome, Exception):
                failed[sequence] = outcome
            else:
                results[sequence] = outcome
        return results

    @staticmethod
    async def _call(stage: str, call: Callable, items: list, calls: dict) -> list:
        """One call for all ``items``: each one's result, or the exception that is its own.

        If the call fails, each item is sent again alone, so one sequence's bad input
        fails that sequence, not every sequence it shared a step with. Propose and
        verify calls are addressed by position, so sending one again is harmless.
        """
        if not items:
            return []
        started = time.monotonic()
        try:
            return _one_each(stage, items, await call(items))
        except Exception as err:
            if len(items) == 1:
                return [err]
        finally:
            calls[stage] = (len(items), time.monotonic() - started)
        outcomes = []
        for item in items:
            try:
                outcomes.append(_one_each(stage, [item], await call([item]))[0])
            except Exception as err:
                outcomes.append(err)
        return outcomes

    async def _end(self, ended: dict[ScheduledSequence, BaseException | None]) -> None:
        """Release the sequences in every stage (one call), then end each step queue, with its error if any."""
        if not ended:
            return
        release_error = None
        self._ending = list(ended)
        try:
            await self.stages.release({s.state.seq_id: None if error else list(s.state.output_ids)
                                       for s, error in ended.items()})  # fmt: skip
        except Exception as err:  # the client hears of it: the server may still hold the sequence
            release_error = RuntimeError(f"releasing the sequence failed: {err}")
        finally:
            self._ending = []
        for sequence, error in ended.items():
            if (error or release_error) is not None:
                sequence.deliver(error or release_error)
            sequence.deliver(_RELEASED)


def _one_each(stage: str, asked: list, answered: list) -> list:
    """A stage's results, one per item it was given; anything else is the stage's fault, not the sequences'."""
    if len(answered) != len(asked):
        raise RuntimeError(f"{stage} returned {len(answered)} results for {len(asked)} sequences")
    return answered
