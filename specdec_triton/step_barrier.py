"""Lines up the decode steps of concurrent sequences, so their stage calls meet in one batch.

Each request decodes in its own coroutine. Left alone, the coroutines drift apart:
one drafts while another verifies and a third samples, so the target and the draft
model see one or two sequences per dynamic batch (measured with 8 streams on the
shipped pair: 1.7 sequences per target forward) and run many small forwards where
one would do. vLLM avoids this with a scheduler that steps every running sequence at
once; this is the same idea for independent coroutines: a cyclic barrier whose
members are the sequences that are decoding. A member waits before each step; once
every member waits, all start the step together, and their propose and verify calls
reach the models at the same moment. A lone sequence never waits.

Members join when they start decoding and leave when they stop, however they stop,
so a finished, failed or cancelled request never holds the others back.
"""
from __future__ import annotations

import asyncio


class StepBarrier:
    def __init__(self) -> None:
        self._members = 0
        self._waiting: list[asyncio.Future] = []

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

    async def wait(self) -> None:
        """Return once every member waits (at once for a lone member)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self._open_if_all_wait()
        try:
            await future
        except asyncio.CancelledError:
            if future in self._waiting:
                self._waiting.remove(future)
            raise

    def _open_if_all_wait(self) -> None:
        if self._waiting and len(self._waiting) >= self._members:
            waiting, self._waiting = self._waiting, []
            for future in waiting:
                if not future.done():
                    future.set_result(None)
