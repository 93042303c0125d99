"""Admission and streaming of generate requests; the steps themselves run in :mod:`specdec.scheduler`.

A request is tokenized and checked here (errors name the input), handed to the
:class:`~specdec.scheduler.StepScheduler` as a :class:`~specdec.engine.SequenceState`,
and its steps are turned into responses as they come: with ``stream`` one response per
step with only the new text (detokenized incrementally, in this process, from the new
tokens alone), otherwise one response at the end. The final response goes out only
after the scheduler has released the sequence in every stage.

Before the first request the stages describe themselves once (:class:`Descriptions`):
the target's vocabulary and limits, the draft's vocabulary, the sampler's method, the
tokenizer's directory. A draft whose vocabulary differs from the target's is refused
there, naming both models. When a composing model's process dies,
:meth:`Orchestrator.stage_failed` ends every request at once and refuses new ones
until :meth:`Orchestrator.recovered` (:mod:`specdec_triton.recovery` decides which).
While requests run, the sequences they hold are renewed in the stateful stages every
``RENEW_INTERVAL_S`` (:mod:`specdec_triton.leases`), so a slow step never costs a live
request its state.
Like tensorrtllm_backend's ``decode.py`` this file has no Triton import:
:class:`Stages` is the seam, implemented with calls to the composing models in
:mod:`specdec_triton.model_stages` and with local objects in the tests.
"""
from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from specdec.detokenize import IncrementalDetokenizer
from specdec.engine import SequenceState
from specdec.generate import check_token_ids
from specdec.grammar import Grammar, GrammarCompiler, GrammarError
from specdec.propose_in_process import ProposeInProcess
from specdec.proposers import Proposer, SuffixProposer, check_draft_compatible, model_free_proposer
from specdec.scheduler import ScheduledStep, StepReport, StepScheduler
from specdec.scheduler import Stages as StepStages
from specdec.suffix_first import SuffixFirst, SuffixFirstStages, suffix_first_for
from specdec.types import ModelDescription, RequestStats
from specdec_triton.configs import OrchestratorConfig
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters, SuffixCacheGauges
from specdec_triton.plumbing import RequestError, ServingError
from specdec_triton.request import GenerateRequest, generate_outputs
from specdec_triton.leases import RENEW_INTERVAL_S
from specdec_triton.text import TextCodec


@dataclass(frozen=True)
class Tokenized:
    prompt_ids: list[int]
    stop_token_sequences: tuple[tuple[int, ...], ...]
    eos_token_ids: tuple[int, ...]  # the tokenizer's defaults; a request's end_id replaces them


@dataclass(frozen=True)
class Descriptions:
    """What each composing model states about itself, asked once before the first request."""

    tokenizer: ModelDescription  # model: the tokenizer directory
    draft: ModelDescription
    target: ModelDescription  # vocab_size, max_model_len, max_num_seqs
    sampler: ModelDescription  # method: the configured rejection-sampling method

    @property
    def max_num_seqs(self) -> int | None:
        """Sequences the stateful stages can hold at once: the smaller of their slots."""
        return min((n for n in (self.draft.max_num_seqs, self.target.max_num_seqs) if n), default=None)


class Stages(StepStages, Protocol):
    async def tokenize(self, text: str, stop_words: tuple[str, ...]) -> Tokenized: ...
    async def describe(self) -> Descriptions: ...
    async def renew(self, seq_ids: list[str]) -> None: ...  # live requests still hold these sequences


# (outputs of one public response, final) -> None
Send = Callable[[dict, bool], None]


class Orchestrator:
    def __init__(
        self,
        stages: Stages,
        config: OrchestratorConfig,
        counters: SpecDecodeCounters | None = None,
        active: ActiveSequences | None = None,
        log: Callable[[str], None] | None = None,
        suffix_gauges: SuffixCacheGauges | None = None,  # what a suffix proposer run here keeps
    ):
        self.stages = stages
        self.config = config
        self.counters = counters
        self.active = active
        self.log = log
        self.suffix_gauges = suffix_gauges
        # what proposes in this process: a model-free method's proposer, or suffix decoding in front of a model
        self._proposer_here: Proposer | SuffixFirst | None = None
        self._proposer_described: ModelDescription | None = None  # the description it was built from
        self.num_active_requests = 0  # tokenized and not yet answered: running or waiting for a slot
        self.descriptions: Descriptions | None = None
        self.scheduler: StepScheduler | None = None
        self._codec: TextCodec | None = None
        self._grammars: GrammarCompiler | None = None  # built at the first request with a guide
        self._describing: asyncio.Future | None = None  # the one describe in flight
        self.unavailable: str | None = None  # why requests are refused now: a composing model stopped
        self._background: set[asyncio.Task] = set()  # releases after a fault and the renewals, kept until done
        self._per_client: collections.Counter = collections.Counter()  # client id -> its requests in flight

    def drop_metrics(self) -> None:
        """Apply the pending counts, then let go of every metric family: Triton 2.51's Python backend
        destroys a family still referenced at exit inside the stub's destructor, whose write to shared
        memory then segfaults (triton-inference-server/python_backend#429, fixed after 2.51); a request
        still pending at exit holds the orchestrator. Called from ``finalize``'s thread, as the event loop
        may no longer run then: each use reads a metric attribute once, so a step on the loop either counts
        or sees None. Steps after this are not counted, as with no metrics at all."""
        counters, self.counters, self.active, self.suffix_gauges = self.counters, None, None, None
        if counters is not None:
            counters.flush()  # also cancels the scheduled flush, which holds the counters

    def stage_failed(self, models: list[str]) -> None:
        """Composing models stopped: every request fails now, and new ones are refused until :meth:`recovered`."""
        self.stop_serving(f"composing model(s) {', '.join(models)} stopped (the process died); "
                          f"the server is recovering or shutting down")  # fmt: skip

    def stop_serving(self, why: str) -> None:
        """Every request in flight ends now with UNAVAILABLE and ``why``; new ones are refused with it.

        The scheduler is rebuilt after recovery (the stages describe themselves again);
        what the living stateful stages hold of the failed sequences is released in the
        background, so the answer does not wait for a stage that may not answer.
        """
        self.unavailable = why
        if self.scheduler is not None:
            seq_ids = self.scheduler.fail_all(ServingError(f"{why}; the request was not finished"))
            if seq_ids:
                self._keep_in_background(self._release_quietly(self.scheduler.stages, seq_ids))
        self.scheduler, self.descriptions, self._describing = None, None, None
        self._show_running()

    def recovered(self) -> None:
        self.unavailable = None

    def _keep_in_background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _renew_while_serving(self, scheduler: StepScheduler) -> None:
        """Every ``RENEW_INTERVAL_S`` while ``scheduler`` serves: renew the sequences its requests hold.

        A renewal that fails is logged and tried again next time: a stage that died is
        recovered as a whole (its sequences with it), and one that is slow answers later.
        """
        while self.scheduler is scheduler:
            await asyncio.sleep(RENEW_INTERVAL_S)
            seq_ids = scheduler.held_seq_ids()
            if not seq_ids or self.scheduler is not scheduler:
                continue
            try:
                await self.stages.renew(seq_ids)
            except Exception as err:  # noqa: BLE001 (logged; the next renewal tries again)
                if self.log is not None:
                    self.log(f"renewing {len(seq_ids)} sequence(s) failed, tried again in {RENEW_INTERVAL_S:g} s: {err}")

    @staticmethod
    async def _release_quietly(stages: StepStages, seq_ids: list[str]) -> None:
        try:
            await stages.release(dict.fromkeys(seq_ids))  # failed requests: no responses to keep
        except Exception:  # a stopped stage holds nothing; the stage itself logged what failed
            pass

    async def _ensure_ready(self) -> None:
        """Describe the stages and build the scheduler, once; a failed attempt is retried by the next request."""
        if self.unavailable is not None:
            raise ServingError(self.unavailable)
        if self.scheduler is not None:
            return
        if self._describing is None or self._describing.done():
            self._describing = asyncio.ensure_future(self.stages.describe())
        descriptions = await asyncio.shield(self._describing)
        if self.scheduler is not None:
            return
        try:
            check_draft_compatible(descriptions.draft, descriptions.target)
        except ValueError as err:
            raise ServingError(f"draft_proposer does not fit target_verifier: {err}") from None
        try:
            self._proposer_here = self._proposer_for(descriptions.draft)
        except ValueError as err:
            raise ServingError(f"draft_proposer: {err}") from None
        tokenizer, target = descriptions.tokenizer, descriptions.target
        if tokenizer.vocab_size is not None and tokenizer.vocab_size > target.vocab_size:
            raise ServingError(
                f"tokenizer {tokenizer.model!r} has {tokenizer.vocab_size} tokens but target model {target.model!r} "
                f"has logits for {target.vocab_size}: point tokenizer_dir at the target's tokenizer"
            )
        self._codec = TextCodec(descriptions.tokenizer.model)
        self._grammars = None  # compiled for the tokenizer just loaded
        self.descriptions = descriptions
        self.scheduler = StepScheduler(
            self._step_stages(),
            self.config.speculation,
            descriptions.max_num_seqs,
            match_greedy_here=descriptions.sampler.method != "synthetic",
            on_step=self._record_step,
        )
        self._keep_in_background(self._renew_while_serving(self.scheduler))
        if self.log is not None:
            where = descriptions.draft.model
            if isinstance(self._proposer_here, SuffixFirst):
                where = f"suffix decoding first, in this process; then {where}"
            elif self._proposer_here is not None:
                where = "run in this process"
            self.log(f"serving {descriptions.target.model} with {descriptions.draft.method} "
                     f"({where}), {descriptions.max_num_seqs} sequences at once")

    def _proposer_for(self, draft: ModelDescription) -> Proposer | SuffixFirst | None:
        """What proposes in this process for ``draft``: its model-free proposer, or suffix decoding in front
        of the draft_proposer model's drafts (``enable_suffix_decoding``); None when that model alone proposes.

        The one built before is kept while the description is the same, so suffix
        decoding's global tree outlives the recovery of another composing model.
        """
        if self._proposer_here is not None and self._proposer_described == draft:
            return self._proposer_here
        # beside the target, a head's hidden states stay there (specdec.draft_beside_target)
        rows_stay = self.stages.capabilities.proposes_in_verify
        proposer = model_free_proposer(draft) or suffix_first_for(draft, rows_stay=rows_stay)
        self._proposer_described = draft
        return proposer

    def _step_stages(self) -> StepStages:
        if self._proposer_here is None:
            return self.stages
        if isinstance(self._proposer_here, SuffixFirst):
            return SuffixFirstStages(self.stages, self._proposer_here, on_release=self._show_proposer_memory)
        return ProposeInProcess(self.stages, self._proposer_here, on_release=self._show_proposer_memory)

    def _show_proposer_memory(self, proposer) -> None:
        gauges = self.suffix_gauges  # read once: drop_metrics may run on another thread
        if gauges is None:
            return
        if isinstance(proposer, SuffixFirst):
            proposer = proposer.suffix
        if isinstance(proposer, SuffixProposer):
            stats = proposer.stats()
            gauges.set(stats.cached_responses, stats.tree_nodes, stats.approx_bytes)

    async def prepare(self, request: GenerateRequest) -> SequenceState:
        """Tokenize and validate; raises RequestError naming the bad input."""
        await self._ensure_ready()
        if request.return_log_probs and self.descriptions.sampler.method == "synthetic":
            raise RequestError("input 'return_log_probs' needs a lossless rejection_sample_method; this server's "
                               "rejection_sampler is configured 'synthetic' (benchmarking only)")  # fmt: skip
        # bad words are tokenized as stop words are, each on its own: one call, split after
        words = await self.stages.tokenize(request.text_input, request.stop_words + request.bad_words)
        num_stop_words = len(request.stop_words)
        tokenized = replace(words, stop_token_sequences=words.stop_token_sequences[:num_stop_words])
        target = self.descriptions.target
        params = request.generation_params(
            self.config.default_max_tokens,
            self.config.num_speculative_tokens,
            tokenized.eos_token_ids,
            tokenized.stop_token_sequences,
            target.vocab_size,
            words.stop_token_sequences[num_stop_words:],
        )
        if request.guide_type is not None:
            params = replace(params, grammar=self._grammar(request))
        try:
            params.validate(target.max_model_len, len(tokenized.prompt_ids))
            check_token_ids(tokenized.prompt_ids, params, target.vocab_size)
        except ValueError as err:
            message = str(err)
            if request.max_tokens is None and "max_tokens" in message:
                message += f" (the request sent no max_tokens: the model's default_max_tokens, {params.max_tokens})"
            raise RequestError(message) from None
        hidden_layers = self.descriptions.draft.hidden_state_layers  # a draft head's: the verifier returns them
        # a head beside the target reads them there (specdec.draft_beside_target): they do not come back
        return SequenceState(uuid.uuid4().hex, tokenized.prompt_ids, params, hidden_layers,
                             hidden_rows_stay=self.scheduler.proposes_in_verify)

    def _grammar(self, request: GenerateRequest) -> Grammar:
        """The request's guide, compiled for the tokenizer (xgrammar keeps what it compiled for the next request)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self._codec.tokenizer, self.descriptions.target.vocab_size)
        try:
            return self._grammars.compile(request.guide_type, request.guide)
        except GrammarError as err:
            raise RequestError(f"input 'guided_decoding_guide': {err}") from None

    async def generate(self, request: GenerateRequest, send: Send, is_cancelled: Callable[[], bool],
                       client: str | None = None) -> None:  # fmt: skip
        """Decode ``request`` to the end: one response per step when streaming, else one in all.

        ``client``: who sent it, when the deployment names clients (``client_id_parameter``);
        each may have at most ``max_sequences_per_client`` requests in flight.
        """
        self._admit_client(client)
        try:
            state = await self.prepare(request)
            self._count_request(+1)
            try:
                final_outputs = await self._decode(request, state, send, is_cancelled)
            finally:
                self._count_request(-1)
                counters = self.counters
                if counters is not None:  # a client that hears of the end sees the request's steps counted
                    counters.flush()
        finally:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
        send(final_outputs, True)

    def _admit_client(self, client: str | None) -> None:
        """Counts the request against its client; refuses it when the client has its most in flight already."""
        limit = self.config.max_sequences_per_client
        if limit and self._per_client[client] >= limit:
            who = "requests without a client id" if client is None else f"client {client!r}"
            raise ServingError(f"{who}: {limit} requests already in flight, the most max_sequences_per_client "
                               f"allows; retry when one has ended")  # fmt: skip
        self._per_client[client] += 1

    async def _decode(self, request: GenerateRequest, state: SequenceState, send: Send, is_cancelled) -> dict:
        """Streams each step's new text while the scheduler runs the sequence; returns the final outputs."""
        if self.unavailable is not None or self.scheduler is None:  # a stage stopped while this one was tokenized
            raise ServingError(self.unavailable or "the server is recovering a composing model")
        detokenizer = IncrementalDetokenizer(self._codec.tokenizer.backend_tokenizer) if request.stream else None
        sequence = self.scheduler.submit(state, is_cancelled)
        num_sent = 0  # output tokens whose ids and log probs went out in streamed responses
        try:
            async for step in sequence.steps():
                if detokenizer is None or step.output.finished:  # the last step's text goes in the final response
                    continue
                piece = detokenizer.push(step.output.new_token_ids)
                if piece:
                    send(self._outputs(state, step, piece, num_sent), False)
                    num_sent = step.num_output_tokens
        except BaseException:
            sequence.abandon()  # a failed send or decode: the scheduler frees the slot at its next step
            raise
        text = self._codec.decode(state.output_ids)
        if request.stream:
            return self._final_outputs(state, detokenizer.finish(text), num_sent)
        prefix = "" if request.exclude_input_in_output else request.text_input
        return self._final_outputs(state, prefix + text)

    def _record_step(self, report: StepReport) -> None:
        self._show_running()
        counters = self.counters
        if counters is None:
            return
        counters.record_step_shape(report.num_sequences, report.k)
        for sequence in report.sequences:
            counters.record_step(sequence.num_draft_tokens, sequence.num_accepted, sequence.num_new_tokens,
                                 sequence.source)  # fmt: skip
        for stage, (num_sequences, seconds) in report.calls.items():
            counters.record_stage_call(stage, num_sequences, seconds)

    def _count_request(self, change: int) -> None:
        self.num_active_requests += change
        self._show_running()

    def _show_running(self) -> None:
        """The gauge shows the sequences that hold a slot, as on the stateful models; waiting ones do not."""
        gauge = self.active
        if gauge is not None:
            gauge.set(self.scheduler.num_running if self.scheduler is not None else 0)

    @staticmethod
    def _outputs(state: SequenceState, step: ScheduledStep, text: str, num_sent: int) -> dict:
        """A streamed response: the counts are those of the step that produced ``text``.

        Its log probs are those of the tokens since the last response, which may span
        steps: a step whose tokens end inside a character sends nothing. The state's
        list only grows, so slicing it at this step's count is safe while the
        scheduler runs ahead.
        """
        stats = RequestStats(num_draft_tokens=step.num_draft_tokens, num_accepted_tokens=step.num_accepted_tokens)
        log_probs = state.output_log_probs[:step.num_output_tokens]
        return generate_outputs(text, None, len(state.prompt_ids), step.num_output_tokens, stats,
                                log_probs[num_sent:], sum(log_probs), state.output_ids[num_sent:step.num_output_tokens],
                                state.output_top_log_probs[num_sent:step.num_output_tokens])  # fmt: skip

    @staticmethod
    def _final_outputs(state: SequenceState, text: str, num_sent: int = 0) -> dict:
        log_probs = state.output_log_probs
        return generate_outputs(text, state.finish_reason, len(state.prompt_ids), len(state.output_ids), state.stats,
                                log_probs[num_sent:], sum(log_probs), state.output_ids[num_sent:],
                                state.output_top_log_probs[num_sent:])  # fmt: skip
