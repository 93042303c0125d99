"""The step barrier: concurrent sequences start each step together, and nobody is held by a leaver."""
from __future__ import annotations

import asyncio

import pytest

from specdec_triton.step_barrier import StepBarrier


def test_lone_member_never_waits():
    async def main():
        barrier = StepBarrier()
        barrier.join()
        for _ in range(3):
            await asyncio.wait_for(barrier.wait(), timeout=1)
        barrier.leave()
        return barrier.num_members

    assert asyncio.run(main()) == 0


def test_members_start_each_step_together():
    """Members with different step costs still begin step n only when all finished step n - 1."""
    starts: list[tuple[int, int]] = []  # (step, member)

    async def member(barrier, index, steps, cost):
        try:
            for step in range(steps):
                await barrier.wait()
                starts.append((step, index))
                for _ in range(cost):  # a step that yields to the loop `cost` times
                    await asyncio.sleep(0)
        finally:
            barrier.leave()

    async def main():
        barrier = StepBarrier()
        for _ in range(3):
            barrier.join()  # all are decoding before the first step
        await asyncio.gather(*(member(barrier, i, 4, cost) for i, cost in enumerate([1, 5, 2])))

    asyncio.run(main())
    assert [step for step, _ in starts] == sorted(step for step, _ in starts)
    assert sorted(starts) == [(s, m) for s in range(4) for m in range(3)]


def test_a_member_that_leaves_early_releases_the_others():
    """A request that finishes (or fails) after fewer steps must not leave the rest waiting."""
    done: list[int] = []

    async def member(barrier, index, steps, fail=False):
        barrier.join()
        try:
            for _ in range(steps):
                await barrier.wait()
                await asyncio.sleep(0)
                if fail:
                    raise RuntimeError("stage failed")
            done.append(index)
        finally:
            barrier.leave()

    async def main():
        barrier = StepBarrier()
        results = await asyncio.wait_for(
            asyncio.gather(member(barrier, 0, 6), member(barrier, 1, 2), member(barrier, 2, 3, fail=True),
                           return_exceptions=True),
            timeout=2,
        )
        return barrier, results

    barrier, results = asyncio.run(main())
    assert sorted(done) == [0, 1] and isinstance(results[2], RuntimeError)
    assert barrier.num_members == 0


def test_a_cancelled_waiter_is_forgotten():
    async def main():
        barrier = StepBarrier()
        barrier.join(), barrier.join()
        waiter = asyncio.ensure_future(barrier.wait())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        barrier.leave()  # the cancelled member leaves; the other now waits alone and passes
        await asyncio.wait_for(barrier.wait(), timeout=1)

    asyncio.run(main())


def test_leave_without_join_is_an_error():
    with pytest.raises(RuntimeError, match="without a matching join"):
        StepBarrier().leave()


def test_a_member_a_stage_out_of_step_is_brought_back_in_step():
    """A newcomer waiting at stage 0 while the others wait at stage 1: stage 1 goes first, then all together."""
    log: list[tuple[str, int, int]] = []  # (member, step, stage)

    async def member(barrier, name, steps, first_stage):
        try:
            for step in range(steps):
                for stage in (0, 1):
                    if step == 0 and stage < first_stage:
                        continue
                    await barrier.wait(stage)
                    log.append((name, step, stage))
                    await asyncio.sleep(0)
        finally:
            barrier.leave()

    async def main():
        barrier = StepBarrier()
        for _ in range(3):
            barrier.join()
        # a and b are mid-step (next: stage 1); c has just joined (next: stage 0)
        await asyncio.gather(member(barrier, "a", 4, 1), member(barrier, "b", 4, 1), member(barrier, "c", 3, 0))

    asyncio.run(main())
    groups: list[tuple[int, set]] = []  # (stage, members) of each release, in order
    for name, _, stage in log:
        if not groups or groups[-1][0] != stage:
            groups.append((stage, set()))
        groups[-1][1].add(name)
    assert groups[0] == (1, {"a", "b"})  # the later stage first, without c
    assert all(members == {"a", "b", "c"} for _, members in groups[1:])  # then all three keep step
    assert [stage for stage, _ in groups[1:]] == [0, 1] * 3
