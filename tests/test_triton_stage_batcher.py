"""specdec_triton.stage_batcher: calls queued together leave together, one call in flight per stage."""
from __future__ import annotations

import asyncio

import pytest

from specdec_triton import stage_batcher
from specdec_triton.stage_batcher import StageBatcher


class Stage:
    """Doubles its items; records each call's items; holds a call open until ``release`` is set."""

    def __init__(self, fail_on: int | None = None):
        self.calls: list[list[int]] = []
        self.fail_on = fail_on
        self.gate: asyncio.Event | None = None

    async def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.fail_on in items:
            raise ValueError(f"bad item {self.fail_on}")
        return [2 * item for item in items]


def test_calls_queued_in_one_turn_leave_as_one_batch_in_order():
    stage = Stage()

    async def main():
        batcher = StageBatcher(stage)
        return await asyncio.gather(*(batcher(i) for i in range(5)))

    results = asyncio.run(main())
    assert results == [0, 2, 4, 6, 8] and stage.calls == [[0, 1, 2, 3, 4]]


def test_arrivals_during_a_call_wait_and_leave_together():
    stage = Stage()

    async def main():
        batcher = StageBatcher(stage)
        stage.gate = asyncio.Event()
        first = asyncio.ensure_future(batcher(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first call is in flight, held at the gate
        later = [asyncio.ensure_future(batcher(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0)
        assert stage.calls == [[1]]  # nothing else leaves while a call is in flight
        stage.gate.set()
        return await first, await asyncio.gather(*later)

    first, later = asyncio.run(main())
    assert first == 2 and later == [4, 6, 8]
    assert stage.calls == [[1], [2, 3, 4]]


def test_max_batch_size_splits_the_queue():
    stage = Stage()

    async def main():
        batcher = StageBatcher(stage, max_batch_size=2)
        return await asyncio.gather(*(batcher(i) for i in range(5)))

    assert asyncio.run(main()) == [0, 2, 4, 6, 8]
    assert stage.calls == [[0, 1], [2, 3], [4]]


def test_a_failed_batch_is_retried_per_item_so_only_the_bad_item_fails():
    stage = Stage(fail_on=3)

    async def main():
        batcher = StageBatcher(stage)
        return await asyncio.gather(*(batcher(i) for i in (1, 3, 5)), return_exceptions=True)

    good, bad, other = asyncio.run(main())
    assert (good, other) == (2, 10) and isinstance(bad, ValueError) and "bad item 3" in str(bad)
    assert stage.calls == [[1, 3, 5], [1], [3], [5]]


def test_every_call_is_reported_with_its_size_time_and_outcome():
    stage, reports = Stage(fail_on=3), []

    async def main():
        batcher = StageBatcher(stage, on_call=lambda items, seconds, ok: reports.append((len(items), seconds, ok)))
        return await asyncio.gather(*(batcher(i) for i in (1, 2, 3)), return_exceptions=True)

    asyncio.run(main())
    assert [(n, ok) for n, _, ok in reports] == [(3, False), (1, True), (1, True), (1, False)]  # then one by one
    assert all(seconds >= 0 for _, seconds, _ in reports)


def test_a_wrong_number_of_results_is_an_error():
    async def short(items):
        return items[:-1]

    async def main():
        batcher = StageBatcher(short)
        return await asyncio.gather(batcher(1), batcher(2), return_exceptions=True)

    results = asyncio.run(main())  # the batch fails; alone, each item gets no result either
    assert all(isinstance(r, RuntimeError) and "returned 0 results for 1 items" in str(r) for r in results)


def test_a_caller_cancelled_before_its_call_leaves_is_not_sent():
    stage = Stage()

    async def main():
        batcher = StageBatcher(stage)
        stage.gate = asyncio.Event()
        first = asyncio.ensure_future(batcher(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(batcher(i)) for i in (2, 3)]
        await asyncio.sleep(0)
        queued[0].cancel()
        stage.gate.set()
        return await first, await asyncio.gather(*queued, return_exceptions=True)

    first, (cancelled, kept) = asyncio.run(main())
    assert first == 2 and isinstance(cancelled, asyncio.CancelledError) and kept == 6
    assert stage.calls == [[1], [3]]


def test_a_caller_cancelled_in_flight_returns_only_after_the_call():
    stage = Stage()
    order = []

    async def caller(batcher):
        try:
            await batcher(1)
        except asyncio.CancelledError:
            order.append("caller cancelled")
            raise

    async def main():
        batcher = StageBatcher(stage)
        stage.gate = asyncio.Event()
        task = asyncio.ensure_future(caller(batcher))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        order.append("call ends")
        stage.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert order == ["call ends", "caller cancelled"]


@pytest.mark.parametrize("rejoin_turns", [stage_batcher.REJOIN_TURNS, 0])
def test_callers_coming_straight_back_join_the_next_call(monkeypatch, rejoin_turns):
    """Sequences whose next step is the same stage (plain decoding) share every call, not alternate."""
    monkeypatch.setattr(stage_batcher, "REJOIN_TURNS", rejoin_turns)
    stage = Stage()

    async def sequence(batcher, start):
        for step in range(4):
            await batcher(start + step)

    async def main():
        batcher = StageBatcher(stage)
        first = asyncio.ensure_future(sequence(batcher, 0))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first sequence's call is in flight when the second arrives
        await asyncio.gather(first, sequence(batcher, 10))

    asyncio.run(main())
    sizes = [len(call) for call in stage.calls]
    if rejoin_turns:
        assert sizes == [1, 2, 2, 2, 1]  # from the second call on, both sequences in each
    else:
        assert sizes == [1] * 8  # without the wait they settle into taking turns
