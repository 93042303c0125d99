"""The serving loop of one generate request, over async stage calls.

It drives :class:`specdec.engine.SequenceState`, the same state machine as the
in-process :func:`specdec.engine.generate`, so the two decode identically; only
the calls differ. Like tensorrtllm_backend's ``decode.py`` this file has no
Triton import: :class:`Stages` is the seam, implemented with BLS requests in
:mod:`specdec_triton.bls_stages` and with local objects in the tests.

Many requests progress at once: each decodes in its own coroutine, and its propose,
verify, sample and detokenize calls go through a
:class:`~specdec_triton.stage_batcher.StageBatcher` per stage, so the calls of the
sequences that are ready together leave as one request (one BLS round trip, one
forward) while another group of sequences is at another stage; ``micro_batches``
can keep those groups of equal size. No more sequences run than the stages can hold
(``max_num_seqs``); later requests wait for a free slot. With
``speculative_length_policy: adaptive`` each step asks
:mod:`specdec_triton.speculation_length` how many drafts pay at the current load, and
tells it what the step and its stage calls cost and earned.
Cancellation is checked between steps (a step is the unit of work; Triton does not
cancel BLS children), and every stage's state for the sequence is released however
the request ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.call_costs import CallCosts
from specdec.detokenize import TextStream
from specdec.engine import SequenceState, check_token_ids
from specdec.rejection_sampler import match_greedy
from specdec.types import Proposal, ProposeRequest, SampleCall, SampleResult, VerifyRequest, VerifyResult
from specdec_triton.configs import OrchestratorConfig
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters
from specdec_triton.plumbing import RequestCancelled, RequestError
from specdec_triton.request import GenerateRequest, generate_outputs
from specdec_triton.speculation_length import AdaptiveSpeculationLength
from specdec_triton.stage_batcher import StageBatcher


@dataclass(frozen=True)
class Tokenized:
    prompt_ids: list[int]
    stop_token_sequences: tuple[tuple[int, ...], ...]
    eos_token_ids: tuple[int, ...]  # the tokenizer's defaults; a request's end_id replaces them


@dataclass(frozen=True)
class Limits:
    """What the stages accept and how they sample; asked once, before the first request."""

    max_model_len: int | None  # prompt + output tokens the target accepts
    vocab_size: int  # width of the target's logits
    max_num_seqs: int | None = None  # sequences the stages can hold at once; None: no limit
    rejection_sample_method: str = "probabilistic"  # the rejection sampler's configured method
    verify_costs: CallCosts | None = None  # measured by the verifier; asked for by the adaptive length policy
    propose_costs: CallCosts | None = None  # measured by the proposer; likewise
    call_overhead_s: float = 0.0  # what a stage call costs beyond its model's work (BLS round trip); likewise


class Stages(Protocol):
    """The composing models, one awaitable call each; all but tokenize, limits and release take a batch."""

    async def tokenize(self, text: str, stop_words: tuple[str, ...]) -> Tokenized: ...
    async def detokenize(self, token_id_lists: list[list[int]]) -> list[str]: ...
    async def limits(self, call_costs: bool = False) -> Limits: ...  # call_costs: fill in the *_costs
    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]: ...
    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...
    async def sample(self, calls: list[SampleCall]) -> list[SampleResult]: ...  # the rejection sampler
    async def release(self, seq_id: str) -> None: ...


# (outputs of one public response, final) -> None
Send = Callable[[dict, bool], None]


class Orchestrator:
    def __init__(
        self,
        stages: Stages,
        config: OrchestratorConfig,
        counters: SpecDecodeCounters | None = None,
        active: ActiveSequences | None = None,
        log: Callable[[str], None] | None = None,  # the adaptive length policy's changes of mind
    ):
        self.stages = stages
        self.log = log
        self.config = config
        self.counters = counters
        self.active = active
        self.num_active_sequences = 0
        # one per batched stage: the calls of sequences that are ready together leave as one
        self.proposals: StageBatcher[ProposeRequest, Proposal] = StageBatcher(
            stages.propose, on_call=self._timed("propose", lambda r: r.num_tokens))
        self.verifications: StageBatcher[VerifyRequest, VerifyResult] = StageBatcher(
            stages.verify, on_call=self._timed("verify", lambda r: len(r.token_ids)))
        self.samples: StageBatcher[SampleCall, SampleResult] = StageBatcher(
            stages.sample, on_call=self._timed("sample"))
        self.texts: StageBatcher[list[int], str] = StageBatcher(
            stages.detokenize, on_call=self._timed("detokenize"))
        self._limits: Limits | None = None
        self._slots: asyncio.Semaphore | None = None  # admits at most limits.max_num_seqs sequences
        self.length_policy: AdaptiveSpeculationLength | None = None  # with speculative_length_policy adaptive
        self._catching_up: set[str] = set()  # sequences whose propose call also feeds the draft missed tokens

    async def prepare(self, request: GenerateRequest) -> SequenceState:
        """Tokenize and validate; raises RequestError / ValueError naming the bad input."""
        tokenized = await self.stages.tokenize(request.text_input, request.stop_words)
        if self._limits is None:
            adaptive = self.config.length_policy == "adaptive"
            limits = await self.stages.limits(call_costs=adaptive)
            if self._limits is None:  # another request may have fetched them meanwhile
                self._limits = limits
                self._slots = asyncio.Semaphore(limits.max_num_seqs) if limits.max_num_seqs else None
                if adaptive:
                    self.length_policy = AdaptiveSpeculationLength(
                        limits.verify_costs, limits.propose_costs, limits.call_overhead_s, self.log
                    )
        params = request.generation_params(
            self.config.default_max_tokens,
            self.config.num_speculative_tokens,
            tokenized.eos_token_ids,
            tokenized.stop_token_sequences,
            self._limits.vocab_size,
        )
        try:
            params.validate(self._limits.max_model_len, len(tokenized.prompt_ids))
            check_token_ids(tokenized.prompt_ids, params, self._limits.vocab_size)
        except ValueError as err:
            message = str(err)
            if request.max_tokens is None and "max_tokens" in message:
                message += f" (the request sent no max_tokens: the model's default_max_tokens, {params.max_tokens})"
            raise RequestError(message) from None
        return SequenceState(uuid.uuid4().hex, tokenized.prompt_ids, params)

    async def generate(self, request: GenerateRequest, send: Send, is_cancelled: Callable[[], bool]) -> None:
        """Decode ``request`` to the end, sending one response per step when streaming, else one in all.

        The final response goes out only after every stage has released the sequence,
        so a client that has it knows the server holds nothing more for the request.
        """
        state = await self.prepare(request)
        async with self._slots or contextlib.nullcontext():  # waits while max_num_seqs sequences run
            self._set_active(+1)
            try:
                final_outputs = await self._decode(request, state, send, is_cancelled)
            finally:
                try:
                    await self.stages.release(state.seq_id)
                finally:
                    self._set_active(-1)
                    if self.counters is not None:  # however it ended, a client that hears of it sees its steps counted
                        self.counters.flush()
        send(final_outputs, True)

    async def _decode(self, request: GenerateRequest, state: SequenceState, send: Send, is_cancelled) -> dict:
        """Steps until the sequence finishes; returns the final response's outputs."""
        stream = TextStream()
        streaming: asyncio.Future | None = None  # the last step's detokenize-and-send, running beside the next step
        previous_step_ended = time.monotonic()
        try:
            while True:
                if is_cancelled():
                    raise RequestCancelled(f"request cancelled after {len(state.output_ids)} output tokens")
                if streaming is not None and streaming.done():
                    streaming.result()  # a failed detokenize fails the request now, not at the end
                await self._step(state, previous_step_ended)
                previous_step_ended = time.monotonic()
                if state.finished:
                    break
                if request.stream:  # the piece is cut from this step's state, before the next step changes it
                    piece = self._stream_text(stream, state.snapshot(), send, streaming)
                    streaming = asyncio.ensure_future(piece)
            if streaming is not None:
                await streaming  # every streamed piece goes out before the final response
        finally:
            if streaming is not None and not streaming.done():
                streaming.cancel()  # also cancels the earlier pieces it waits on
                await asyncio.gather(streaming, return_exceptions=True)
        text = await self.texts(state.output_ids)
        if request.stream:
            return self._outputs(state, stream.push(text, final=True))
        prefix = "" if request.exclude_input_in_output else request.text_input
        return self._outputs(state, prefix + text)

    async def _stream_text(self, stream: TextStream, state: SequenceState, send: Send, previous) -> None:
        """Detokenize the output of ``state`` (a snapshot) and send what is new, while the next step runs.

        The detokenizer round trip leaves the decode loop's critical path. The counts in
        the response are those of the step that produced the text; ``previous`` (the last
        step's piece) goes out first, so pieces keep their order.
        """
        try:
            text = await self.texts(state.output_ids)
        finally:
            if previous is not None:
                await previous  # in order; a failure there is raised (and so retrieved) first
        new_text = stream.push(text)
        if new_text:
            send(self._outputs(state, new_text), False)

    def _timed(self, stage: str, tokens_of: Callable | None = None) -> Callable[[list, float, bool], None]:
        """What a stage's batcher reports after each call: into the stage counters and the length policy.

        ``tokens_of(item)``: the tokens one sequence asks of a propose or verify call (its
        drafts, its rows), which with the call's size gives the shape the policy looks up.
        A failed call counts as a call, but tells the policy nothing of what a call costs.
        """

        def record(items: list, seconds: float, succeeded: bool) -> None:
            if self.counters is not None:
                self.counters.record_stage_call(stage, len(items), seconds)
            if self.length_policy is None or tokens_of is None or not items or not succeeded:
                return
            if stage == "propose" and any(r.seq_id in self._catching_up for r in items):
                return  # a prefill of the draft, not what a step of k drafts costs
            tokens = max(map(tokens_of, items))
            self.length_policy.record_call(stage, len(items), tokens, seconds, self._policy_load())

        return record

    def _set_active(self, change: int) -> None:
        self.num_active_sequences += change
        self._size_micro_batches()
        if self.active is not None:
            self.active.set(self.num_active_sequences)

    def _size_micro_batches(self) -> None:
        """Cap draft and verify calls at a ``1 / micro_batches`` share of the live sequences.

        Left to themselves the groups drift apart in size: sequences that meet at a busy
        stage merge, and at 8 streams the pairs were mostly 7 + 1 (per-call timestamps), so
        the target waited for the big group's draft. Equal halves (``micro_batches: 2``) gave
        +7-11% tokens/s at 8 streams, `draft_model` k = 4, on a 2-core CPU until calls waited
        for their callers to rejoin (``stage_batcher.REJOIN_TURNS``); since then no difference,
        while halves cut every plain-decoding forward in two, so the default is 1
        (docs/benchmarks.md).
        """
        size = max(1, math.ceil(self.num_active_sequences / self.config.micro_batches))
        self.proposals.max_batch_size = self.verifications.max_batch_size = size

    async def _step(self, state: SequenceState, previous_step_ended: float) -> None:
        """One propose / verify / sample round, each call batched with those of other ready sequences.

        The time since the sequence's previous step ended, less what this step awaited in
        its stage calls, is the length policy's per-step overhead ``O``: the
        orchestrator's own work for the step and between steps (streaming included).
        """
        awaited = 0.0

        async def timed(call):
            nonlocal awaited
            call_started = time.monotonic()
            try:
                return await call
            finally:
                awaited += time.monotonic() - call_started

        propose_request = state.propose_request(self._max_drafts(state))
        proposal = None
        if propose_request is not None:
            if not state.drafted_last_step and self.length_policy is not None:
                self._catching_up.add(state.seq_id)
            try:
                proposal = await timed(self.proposals(propose_request))
            finally:
                self._catching_up.discard(state.seq_id)
        verify_result = await timed(self.verifications(state.verify_request(proposal)))
        if proposal is None:
            proposal = Proposal(token_ids=torch.empty(0, dtype=torch.long))
        if self._matches_here(verify_result):
            result = match_greedy(proposal.token_ids.tolist(), verify_result.argmax.tolist())
        else:
            call = SampleCall(proposal.token_ids, proposal.probs, verify_result, state.sample_seed())
            result = await timed(self.samples(call))
        step = state.commit(proposal, result)
        if self.counters is not None:
            self.counters.record_step(len(proposal.token_ids), result.num_accepted, len(step.new_token_ids))
        if self.length_policy is not None:
            self.length_policy.record_step(len(proposal.token_ids), result.num_accepted)
            cycle = time.monotonic() - previous_step_ended
            self.length_policy.record_step_overhead(cycle - awaited, self._policy_load())

    def _max_drafts(self, state: SequenceState) -> int | None:
        """The most drafts this step may ask for: 0 under ``disable_by_batch_size``, the length policy's choice."""
        if not self._speculating():
            return 0
        if self.length_policy is None or state.num_draft_tokens() == 0:
            return None
        return self.length_policy.choose(self._policy_load(), state.num_draft_tokens())

    def _policy_load(self) -> int:
        """The load the length policy chooses at and learns at: the live sequences, at most one call's share."""
        per_call = self.verifications.max_batch_size or self.num_active_sequences
        return min(self.num_active_sequences, per_call)

    def _speculating(self) -> bool:
        """Whether steps draft now: not while more sequences are live than ``disable_by_batch_size``.

        Under enough load the target's forward is compute-bound, and verifying ``k + 1``
        tokens per sequence costs more than the drafts save (vLLM's
        ``speculative_disable_by_batch_size``). A step without drafts is a plain decoding
        step, so output does not change; the draft model re-reads what it missed in its
        next call, and speculation resumes as soon as the load falls back.
        """
        limit = self.config.disable_by_batch_size
        return not limit or self.num_active_sequences <= limit

    def _matches_here(self, verify_result: VerifyResult) -> bool:
        """Whether this step's rejection sampling is a comparison of ids, done here without a round trip.

        Against a greedy target (no ``p``) every lossless method keeps the drafts that equal
        the target's argmax and draws nothing (``match_greedy``), so the rejection_sampler
        call would only carry ``k + 1`` ids there and back: 2-4 ms per step on a loaded
        2-core CPU, on the path between verify and the next draft. The synthetic
        benchmarking method accepts at random whatever the tokens are, so it always goes
        to the sampler.
        """
        return verify_result.probs is None and self._limits.rejection_sample_method != "synthetic"

    @staticmethod
    def _outputs(state: SequenceState, text: str) -> dict:
        return generate_outputs(text, state.finish_reason, len(state.prompt_ids), len(state.output_ids), state.stats)
