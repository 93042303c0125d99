"""Coalesces the calls that concurrent sequences make to one stage into batched calls.

Each request decodes in its own coroutine and calls a stage (propose, verify, sample)
once per step. Sent one by one, those calls cost a BLS round trip each and reach the
model a little apart, so an idle model starts on the first alone and the rest wait
for the next forward: with 8 streams on the shipped pair, 2.0 sequences per target
forward (docs/benchmarks.md). Here a call joins a queue; calls queued in the same
turn of the event loop leave together as one batched call, and while a stage's call
is in flight the next arrivals wait and then leave together. So the sequences that
finish a stage together go on to the next one together: one BLS request and one
forward for all of them, and no call ever waits for a sequence that is not ready
(vLLM's scheduler steps every running sequence at once; this gets there without a
central loop). With one call in flight per stage, the sequences split into groups
that take turns, so the draft model works on one group while the target verifies
another.

When a call returns, the next one waits a few turns of the event loop
(``REJOIN_TURNS``) so that the returning callers whose next step is this same stage
(plain decoding: verify, then verify again) can queue and join it. Without that wait,
the calls queued meanwhile left at once, the returning ones waited for the call after,
and concurrent plain-decoding sequences settled into two groups that took turns at the
target, each forward carrying half of them: at 2 streams one sequence per forward.

A batched call that fails is retried one call per item, so one bad sequence gets its
own error and the others their results (as ``plumbing.answer_batch`` does on the
model side). A caller cancelled while its call is in flight still waits for that
call to end, so whatever it does next (release its sequence) comes after it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

# Turns of the event loop from a call's results to its callers queueing again: one for
# the shield around each caller's future, one to wake the caller's task, which then runs
# to its next stage call without awaiting; one more to spare.
REJOIN_TURNS = 3

Item = TypeVar("Item")
Result = TypeVar("Result")
BatchCall = Callable[[list[Item]], Awaitable[list[Result]]]


class StageBatcher(Generic[Item, Result]):
    def __init__(
        self,
        call: BatchCall,
        max_batch_size: int | None = None,
        # (items, seconds, succeeded) after every call, failed ones too
        on_call: Callable[[list[Item], float, bool], None] | None = None,
    ):
        self._call = call
        self.max_batch_size = max_batch_size  # None: every queued item goes in the next call
        self._on_call = on_call
        self._queue: list[tuple[Item, asyncio.Future]] = []
        self._in_flight: asyncio.Task | None = None
        self._flush_scheduled = False

    async def __call__(self, item: Item) -> Result:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._schedule()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                if any(f is future for _, f in self._queue):  # not sent yet: it never will be
                    self._queue = [(i, f) for i, f in self._queue if f is not future]
                    future.cancel()
                else:  # in flight: let the call finish before the caller goes on
                    await asyncio.gather(future, return_exceptions=True)
            raise

    def _schedule(self) -> None:
        if self._queue and self._in_flight is None and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)  # after every caller woken in this turn has queued

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._in_flight is not None or not self._queue:
            return
        size = self.max_batch_size or len(self._queue)
        batch, self._queue = self._queue[:size], self._queue[size:]
        self._in_flight = asyncio.ensure_future(self._run(batch))

    async def _run(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            items = [item for item, _ in batch]
            try:
                outcomes: list = await self._checked_call(items)
            except Exception as err:
                outcomes = [err] if len(items) == 1 else await self._one_by_one(items)
            for (_, future), outcome in zip(batch, outcomes):
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            for _ in range(REJOIN_TURNS):  # callers coming straight back join the next call
                await asyncio.sleep(0)
        except BaseException as err:  # cancelled (the loop is shutting down): no caller is left waiting
            for _, future in batch:
                if not future.done():
                    future.set_exception(err if isinstance(err, Exception) else RuntimeError("stage call cancelled"))
            raise
        finally:
            self._in_flight = None
            self._schedule()

    async def _checked_call(self, items: list[Item]) -> list[Result]:
        started, succeeded = time.monotonic(), False
        try:
            results = list(await self._call(items))
            if len(results) != len(items):
                raise RuntimeError(f"a batched call returned {len(results)} results for {len(items)} items")
            succeeded = True
            return results
        finally:
            if self._on_call is not None:
                self._on_call(items, time.monotonic() - started, succeeded)

    async def _one_by_one(self, items: list[Item]) -> list:
        outcomes = []
        for item in items:
            try:
                outcomes.extend(await self._checked_call([item]))
            except Exception as err:
                outcomes.append(err)
        return outcomes
