"""When each sequence a stateful model holds was last used, so slots a caller lost are reclaimed.

The orchestrator steps every live sequence and releases it when it ends, so a sequence
left untouched for ``idle_timeout_s`` has lost its owner: a release that failed (a
stage that died mid-call, a bug). Without expiry its KV slot would stay taken until the
server restarts, and enough of them would refuse every request with "KV cache is full".

A live request's sequence must never be taken, however slow its steps. So:

* the orchestrator renews every sequence its requests hold every ``RENEW_INTERVAL_S``
  (:class:`specdec_triton.orchestrator.Orchestrator`), whether or not a step names it
  (a sequence that drafts nothing is in no propose call; a step that waits on another
  model's compile names it in no call for minutes);
* a request names its sequences before the expiry runs, so a batch never reclaims what
  it is about to use;
* the time this model spends inside a long call of its own (a cold compile, a long
  prefill on a loaded machine: over ``LONG_CALL_S``) does not count as idle: the calls
  queued behind it, renewals among them, could not be answered. Short calls count, so a
  busy server still reclaims a lost slot on time.

:meth:`SequenceLeases.expire` runs before each batch, the moment a slot is needed; the
model logs how many it reclaimed (never the ids, which name live requests) and counts them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

RENEW_INTERVAL_S = 5.0  # how often the orchestrator renews the sequences of live requests
MIN_IDLE_TIMEOUT_S = 3 * RENEW_INTERVAL_S  # a shorter timeout could fall between two renewals
LONG_CALL_S = 1.0  # a call this long held renewals back: its time is not idleness (a step takes milliseconds)


class SequenceLeases:
    def __init__(self, idle_timeout_s: float, release: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.idle_timeout_s = idle_timeout_s  # 0: never expire
        self._release = release
        self.clock = clock  # the model times its calls with it too
        self._busy_s = 0.0  # time spent inside this model's long calls, which is nobody's idleness
        self._last_used: dict[str, float] = {}  # seq_id -> when a request last named it, on the idle clock

    def __len__(self) -> int:
        return len(self._last_used)

    def _now(self) -> float:
        return self.clock() - self._busy_s

    def call_took(self, seconds: float) -> None:
        """One of this model's calls took ``seconds``: the idle clock skips a long one."""
        if seconds > LONG_CALL_S:
            self._busy_s += seconds

    def touch(self, seq_ids: Iterable[str]) -> None:
        now = self._now()
        for seq_id in seq_ids:
            self._last_used[seq_id] = now

    def renew(self, seq_ids: Iterable[str]) -> None:
        """The orchestrator still holds these: touch the ones held here (a renewal never adds a sequence)."""
        self.touch(s for s in seq_ids if s in self._last_used)

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._last_used.pop(seq_id, None)

    def expire(self) -> int:
        """Release every sequence idle longer than the timeout; how many were."""
        if not self.idle_timeout_s:
            return 0
        cutoff = self._now() - self.idle_timeout_s
        idle = [seq_id for seq_id, used in self._last_used.items() if used < cutoff]
        for seq_id in idle:
            self._release(seq_id)
            del self._last_used[seq_id]
        return len(idle)
