"""Lines up the decode steps of concurrent sequences, so their stage calls meet in one batch.

Each request decodes in its own coroutine. Left alone, the coroutines drift apart:
one drafts while another verifies and a third samples, so the target and the draft
model see one or two sequences per dynamic batch (with 8 streams on the shipped pair
at k = 4: 2.0 sequences per target forward, 3.2 with this barrier; docs/benchmarks.md)
and run many small forwards where one would do. vLLM avoids this with a scheduler that steps every running sequence at
once; this is the same idea for independent coroutines: a cyclic barrier whose
members are the sequences that are decoding. A member waits before each batched stage
of its step (propose, then verify), naming the stage; once every member waits at the
same stage, all go on together, and their calls reach the model at the same moment.
A lone sequence never waits.

A sequence that joins while the others wait at a later stage would stay one stage out
of step for good if everyone were let go at once. So when every member waits but at
different stages, only those at the latest stage go on; they come round to the first
stage of their next step, where the newcomer waits, and from then on all keep step.

Members join when they start decoding and leave when they stop, however they stop,
so a finished, failed or cancelled request never holds the others back.
"""
from __future__ import annotations

import asyncio


class StepBarrier:
    def __init__(self) -> None:
        self._members = 0
        self._waiting: list[tuple[int, asyncio.Future]] = []  # (stage, future)

    @property
    def num_members(self) -> int:
        return self._members

    def join(self) -> None:
        self._members += 1

    def leave(self) -> None:
        if self._members == 0:
            raise RuntimeError("StepBarrier.leave() without a matching join()")
        self._members -= 1
        self._open_if_all_wait()

    async def wait(self, stage: int = 0) -> None:
        """Return once every member waits (at once for a lone member); ``stage``: index of the stage in a step."""
        future = asyncio.get_running_loop().create_future()
        entry = (stage, future)
        self._waiting.append(entry)
        self._open_if_all_wait()
        try:
            await future
        except asyncio.CancelledError:
            if entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def _open_if_all_wait(self) -> None:
        if not self._waiting or len(self._waiting) < self._members:
            return
        latest = max(stage for stage, _ in self._waiting)  # all of it when every member waits at one stage
        going = [future for stage, future in self._waiting if stage == latest]
        self._waiting = [(stage, future) for stage, future in self._waiting if stage != latest]
        for future in going:
            if not future.done():
                future.set_result(None)
