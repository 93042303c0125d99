"""One OpenAI request's choices, each a streamed Triton request, turned into one response or one event stream.

A :class:`ChoiceStream` reads one Triton stream: it cuts the text at the first stop
string (:mod:`specdec_openai.stops`) and hands out each token's log probability with
the text it begins in (:mod:`specdec_openai.logprobs`). Once a stop string is seen it
stops reading and closes the stream, which cancels the Triton request: through
``speculative_decoding`` the sequence ends within a step and its state is released in
every stage, as for a client that goes away. :class:`Generation` runs the choices of
a request concurrently and merges them: whole, into one body (``best_of`` keeps the
choices with the highest cumulative log probability, as vLLM did); streamed, into one
event stream whose chunks carry each choice's index.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specdec_openai.logprobs import TokenLog, TokenLogprob, Vocabulary, chat_logprobs, completion_logprobs
from specdec_openai.metrics import RequestTimer
from specdec_openai.protocol import GenerateParams, Plan, RequestError
from specdec_openai.responses import Envelope, acceptance, error_body, sse, usage
from specdec_openai.stops import StopMatcher
from specdec_openai.tools import ToolCallParser, message_of
from specdec_openai.tools import finish_reason as tool_finish_reason
from specdec_openai.triton import Step, TritonUnavailable


@dataclass
class Delta:
    """What one Triton response adds to a choice, once stop strings are cut."""

    text: str
    tokens: list[TokenLogprob]
    finish_reason: str | None  # on the choice's last delta
    step: Step  # the Triton response: the request's counts so far


class ChoiceStream:
    """One Triton stream as one choice; ``first`` was awaited already (a refusal is a status code, not an event)."""

    def __init__(self, params: GenerateParams, first: Step, rest: AsyncIterator[Step], timer: RequestTimer,
                 vocabulary: Vocabulary | None):  # fmt: skip
        self.params, self.first, self.rest, self.timer = params, first, rest, timer
        self.stops = StopMatcher(params.stop_words)
        self.tokens = TokenLog(vocabulary) if vocabulary is not None else None

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            step = self.first
            while True:
                self.timer.on_response(step.num_output_tokens)
                text = self.stops.push(step.text, active=step.num_output_tokens > (self.params.min_tokens or 0))
                if self.tokens is not None:
                    self.tokens.add(step.text, step.token_ids, step.log_probs, step.top)
                if self.stops.stopped:  # the tokens of the stop string and after it are dropped with their text
                    yield Delta(text, self._tokens(everything=False), "stop", step)
                    self.timer.finish("stop")
                    return
                if step.finish_reason is not None:
                    yield Delta(text + self.stops.finish(), self._tokens(everything=True), step.finish_reason, step)
                    self.timer.finish(step.finish_reason)
                    return
                yield Delta(text, self._tokens(everything=False), None, step)
                step = await anext(self.rest, None)
                if step is None:
                    raise TritonUnavailable("the Triton stream ended without a final response")
        finally:
            await self.rest.aclose()  # a stop string, a disconnect or an error: cancels the Triton request

    def _tokens(self, everything: bool) -> list[TokenLogprob]:
        """The tokens not handed out yet that begin in the text released so far; ``everything``: all of them."""
        if self.tokens is None:
            return []
        return self.tokens.release(None if everything else self.stops.released)


@dataclass
class ChoiceResult:
    """A choice read to its end."""

    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    last: Step | None = None

    @property
    def cum_logprob(self) -> float:
        return sum(token.logprob for token in self.tokens)


class Generation:
    """A request's choices (:class:`~specdec_openai.protocol.Plan`), run together."""

    def __init__(self, envelope: Envelope, plan: Plan, choices: list[ChoiceStream], vocabulary: Vocabulary | None,
                 k: int | None):  # fmt: skip
        self.envelope, self.plan, self.choices, self.vocabulary, self.k = envelope, plan, choices, vocabulary, k

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice, delta) in the order they come; leaving early, or one choice failing, ends every choice."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, choice: ChoiceStream) -> None:
            try:
                async for delta in choice.deltas():
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as err:
                queue.put_nowait((index, err))

        tasks = [asyncio.ensure_future(pump(i, choice)) for i, choice in enumerate(self.choices)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each closes its Triton stream

    def _logprobs(self, tokens: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if self.plan.logprobs is None:
            return None
        if self.envelope.kind == "chat":
            return chat_logprobs(tokens, self.vocabulary)
        return completion_logprobs(tokens, self.vocabulary, offset)

    def _echo(self, index: int) -> str:
        return self.plan.echo[index // self.plan.best_of] if self.plan.echo else ""

    def _totals(self, lasts: list[Step]) -> tuple[dict[str, int], dict[str, Any]]:
        """Usage and acceptance over every choice generated; a prompt's tokens count once per prompt."""
        prompt_tokens = sum(last.num_input_tokens for last in lasts[:: self.plan.best_of])
        completion_tokens = sum(last.num_output_tokens for last in lasts)
        drafted = sum(last.total_draft_tokens for last in lasts)
        accepted = sum(last.total_accepted_draft_tokens for last in lasts)
        return usage(prompt_tokens, completion_tokens), acceptance(drafted, accepted, self.k)

    async def _close(self) -> None:
        """Close every choice's Triton stream (those closed already: no-ops); after :meth:`_merged` has ended."""
        await asyncio.gather(*(choice.rest.aclose() for choice in self.choices), return_exceptions=True)

    async def whole(self) -> dict[str, Any]:
        results = [ChoiceResult() for _ in self.choices]
        try:
            async with contextlib.aclosing(self._merged()) as merged:
                async for index, delta in merged:
                    result = results[index]
                    result.text += delta.text
                    result.tokens += delta.tokens
                    result.finish_reason, result.last = delta.finish_reason or "", delta.step
        finally:
            await self._close()
        choices = []
        n, best_of = self.plan.n, self.plan.best_of
        for prompt in range(len(results) // best_of):
            group = list(range(prompt * best_of, (prompt + 1) * best_of))
            if best_of > n:  # the n with the highest cumulative log probability, best first
                group = sorted(group, key=lambda i: results[i].cum_logprob, reverse=True)[:n]
            for rank, i in enumerate(group):
                echo, result = self._echo(i), results[i]
                message, finish = self._tool_message(result)
                choices.append(self.envelope.whole_choice(prompt * n + rank, echo + result.text, finish,
                                                          self._logprobs(result.tokens, len(echo)), message))  # fmt: skip
        return self.envelope.response(choices, *self._totals([result.last for result in results]))

    def _tool_message(self, result: ChoiceResult) -> tuple[dict[str, Any] | None, str]:
        """Chat with tools: the message with the calls read from the text, and the finish reason they give."""
        if self.plan.tools is None:
            return None, result.finish_reason
        parser = ToolCallParser()
        message = message_of(parser.push(result.text) + parser.finish())
        return message, tool_finish_reason(result.finish_reason, self.plan.tools, parser.num_calls)

    def _tool_chunks(self, index: int, delta: Delta, parser: ToolCallParser, logprobs: dict | None) -> list[dict]:
        """A delta of chat with tools as chunks: content and tool-call deltas, logprobs on the first."""
        final = delta.finish_reason is not None
        pieces = parser.push(delta.text) + (parser.finish() if final else [])
        chunks = [self.envelope.chunk(index, "", None, logprobs if i == 0 else None, delta=piece)
                  for i, piece in enumerate(pieces)]  # fmt: skip
        if not pieces and logprobs is not None:
            chunks.append(self.envelope.chunk(index, "", None, logprobs, delta={}))
        if final:
            step = delta.step
            reason = tool_finish_reason(delta.finish_reason, self.plan.tools, parser.num_calls)
            metrics = acceptance(step.total_draft_tokens, step.total_accepted_draft_tokens, self.k)
            chunks.append(self.envelope.chunk(index, "", reason, None, metrics, delta={}))
        return chunks

    async def events(self, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: streamed requests have ``best_of`` = ``n``, so every choice is sent."""
        lasts: list[Step | None] = [None] * len(self.choices)
        parsers = [ToolCallParser() if self.plan.tools is not None else None for _ in self.choices]
        try:
            for index in range(len(self.choices)):
                opening = self.envelope.first_chunk(index)
                if opening is not None:
                    yield sse(opening)
                if self._echo(index):
                    yield sse(self.envelope.chunk(index, self._echo(index)))
            async with contextlib.aclosing(self._merged()) as merged:
                async for index, delta in merged:
                    logprobs = self._logprobs(delta.tokens, len(self._echo(index)))
                    if parsers[index] is not None:
                        if delta.finish_reason is not None:
                            lasts[index] = delta.step
                        for chunk in self._tool_chunks(index, delta, parsers[index], logprobs):
                            yield sse(chunk)
                    elif delta.finish_reason is not None:
                        lasts[index] = delta.step
                        step = delta.step
                        metrics = acceptance(step.total_draft_tokens, step.total_accepted_draft_tokens, self.k)
                        yield sse(self.envelope.chunk(index, delta.text, delta.finish_reason, logprobs, metrics))
                    elif delta.text or delta.tokens:
                        yield sse(self.envelope.chunk(index, delta.text, None, logprobs))
            if include_usage:
                yield sse(self.envelope.usage_chunk(self._totals(lasts)[0]))
        except (RequestError, TritonUnavailable) as err:  # after the stream started: the error is an event
            yield sse(error_of(err)[1])
        finally:
            await self._close()  # a client that went away before a choice was read: its Triton request too
        yield sse("[DONE]")


def error_of(err: Exception) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a refused request or an unreachable Triton."""
    if isinstance(err, RequestError):
        return err.status, error_body(err.message, param=err.param, code=err.code)
    return 503, error_body(str(err), "server_error", code="triton_unavailable")
