"""When each sequence a stateful model holds was last used, so slots a caller lost are reclaimed.

The orchestrator steps every live sequence every scheduler step and releases it when
it ends, so a sequence left untouched for ``idle_timeout_s`` has lost its owner: a
release that failed (a stage that died mid-call, a bug). Without expiry its KV slot
would stay taken until the server restarts, and enough of them would refuse every
request with "KV cache is full". :meth:`SequenceLeases.expire` runs before each batch,
the moment a slot is needed; the model logs how many it reclaimed (never the ids,
which name live requests) and counts them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class SequenceLeases:
    def __init__(self, idle_timeout_s: float, release: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.idle_timeout_s = idle_timeout_s  # 0: never expire
        self._release = release
        self._clock = clock
        self._last_used: dict[str, float] = {}  # seq_id -> when a request last named it

    def __len__(self) -> int:
        return len(self._last_used)

    def touch(self, seq_ids: Iterable[str]) -> None:
        now = self._clock()
        for seq_id in seq_ids:
            self._last_used[seq_id] = now

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._last_used.pop(seq_id, None)

    def expire(self) -> int:
        """Release every sequence idle longer than the timeout; how many were."""
        if not self.idle_timeout_s:
            return 0
        cutoff = self._clock() - self.idle_timeout_s
        idle = [seq_id for seq_id, used in self._last_used.items() if used < cutoff]
        for seq_id in idle:
            self._release(seq_id)
            del self._last_used[seq_id]
        return len(idle)
