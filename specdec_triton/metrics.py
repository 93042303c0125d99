"""Speculative-decoding metrics as Triton custom metrics (``pb_utils.MetricFamily``).

The counters follow vLLM's ``spec_decode_*`` metrics, so the usual derived figures
apply: acceptance rate = accepted / draft tokens, mean accepted length =
1 + accepted / drafts, and ``num_accepted_tokens_per_pos{position=i}`` / drafts is
the chance that draft position ``i`` survives (non-increasing in ``i``, since a
draft is only accepted after every earlier one was).

Families are declared here once: Triton merges families of the same name, kind and
description across models, each model adding its own ``model`` label.
"""
from __future__ import annotations

import asyncio
import time

from specdec_triton.plumbing import triton_utils

_COUNTERS = {
    "spec_decode_num_steps": "Target passes of all requests (steps), each request's prefill pass included",
    "spec_decode_num_drafts": "Speculative steps that proposed at least one draft token",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the rejection sampler",
    "spec_decode_num_output_tokens": "Tokens emitted to clients",
}
STAGES = ("propose", "verify", "sample", "propose_verify")  # the calls a step makes, each for all its sequences
# (propose_verify: both in one, where the draft runs beside the target)
_STAGE_COUNTERS = {
    "spec_decode_stage_calls": "Calls the orchestrator made to a composing model, by stage",
    "spec_decode_stage_sequences": "Sequences those calls carried, by stage",
    "spec_decode_stage_seconds": "Wall time of those calls as the orchestrator waited for them "
    "(round trip, queueing and compute), by stage",
}
# The shape of every step, as counts by value: a Prometheus histogram's observe() is a round trip to
# the server per observation, while these sum between flushes like the other counters.
_STEP_SHAPE = {
    "spec_decode_steps_by_batch_size": ("sequences", "Scheduler steps, by the number of sequences the step verified"),
    "spec_decode_steps_by_k": ("k", "Scheduler steps, by the most draft tokens the step allowed a sequence"),
}
_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position (0-based)")
# How stale the counters on the metrics port may be under load; Prometheus scrapes every 10-60 s.
FLUSH_INTERVAL_S = 0.5
_ACTIVE = ("spec_decode_num_active_sequences", "Sequences whose state this model holds")
_SOCKET_CALLS = {
    "spec_decode_socket_calls": "Calls the orchestrator made on this model's socket (stage_calls socket)",
    "spec_decode_socket_call_seconds": "Time this model spent answering them, from a call's arrival to its answer "
    "(its Python and compute; Triton's statistics do not see these calls)",
}
_EXPIRED = ("spec_decode_num_expired_sequences",
            "Sequences this model released because no request used them for sequence_idle_timeout_s")


def _family(name: str, description: str, kind: str, family_type=None):
    """A ``pb_utils.MetricFamily``, or one of ``family_type`` (a stand-in, in tests)."""
    family_type = family_type or triton_utils().MetricFamily
    return family_type(name=name, description=description, kind=getattr(family_type, kind))


class ActiveSequences:
    """Gauge of live sequences held by one model; set after every request, so it returns to 0 when idle.

    An update is a round trip to the server process, so only changes are sent.
    """

    def __init__(self, model_name: str, family_type=None):
        self._family = _family(*_ACTIVE, "GAUGE", family_type)  # must outlive its metrics
        self._gauge = self._family.Metric(labels={"model": model_name})
        self._count: int | None = None  # the value last sent
        self.set(0)  # a reloaded model starts empty: the gauge must not keep the value of the stub before it

    def set(self, count: int) -> None:
        if count != self._count:
            self._gauge.set(count)
            self._count = count


_SUFFIX_GAUGES = {
    "spec_decode_suffix_cached_responses": "Completed responses the suffix-decoding global tree holds",
    "spec_decode_suffix_tree_nodes": "Nodes of the suffix-decoding trees (the live sequences' and the global one)",
    "spec_decode_suffix_tree_bytes": "Estimated memory of those trees, in bytes",
}


# Under enable_suffix_decoding (specdec.suffix_first), by the source of each proposal (Proposal.source)
_BY_SOURCE = {
    "spec_decode_suffix_first_proposals": "Sequences' steps drafted by each source under enable_suffix_decoding: "
    "suffix decoding's draft taken, or the model's",
    "spec_decode_suffix_first_draft_tokens": "Draft tokens each source proposed under enable_suffix_decoding",
    "spec_decode_suffix_first_accepted_tokens": "Draft tokens of each source the rejection sampler accepted "
    "under enable_suffix_decoding",
}


class SuffixCacheGauges:
    """What suffix decoding keeps in memory, so its bound can be watched; only changes are sent.

    The families are made on first use: a server that runs another method shows none.
    """

    def __init__(self, model_name: str, family_type=None):
        self._model_name, self._family_type = model_name, family_type
        self._families: list = []  # must outlive their metrics
        self._gauges: list = []
        self._values: tuple[int, ...] | None = None

    def set(self, cached_responses: int, tree_nodes: int, tree_bytes: int) -> None:
        values = (cached_responses, tree_nodes, tree_bytes)
        if not self._gauges:
            self._families = [_family(name, text, "GAUGE", self._family_type) for name, text in _SUFFIX_GAUGES.items()]
            self._gauges = [family.Metric(labels={"model": self._model_name}) for family in self._families]
        if values != self._values:
            for gauge, value in zip(self._gauges, values):
                gauge.set(value)
            self._values = values


class ExpiredSequences:
    """Counter of sequences a stateful model reclaimed after their idle timeout (``specdec_triton.leases``)."""

    def __init__(self, model_name: str, family_type=None):
        self._family = _family(*_EXPIRED, "COUNTER", family_type)
        self._counter = self._family.Metric(labels={"model": model_name})

    def add(self, count: int) -> None:
        if count:
            self._counter.increment(count)


class SocketCallTime:
    """What a stateful model's socket calls cost it, summed and sent at most every ``flush_interval_s``
    and at every release (the end of a request), since each update is a round trip to the server."""

    def __init__(self, model_name: str, family_type=None, flush_interval_s: float = FLUSH_INTERVAL_S,
                 clock=time.monotonic):  # fmt: skip
        self._families = [_family(name, text, "COUNTER", family_type) for name, text in _SOCKET_CALLS.items()]
        self._calls, self._seconds = (family.Metric(labels={"model": model_name}) for family in self._families)
        self._pending_calls, self._pending_seconds = 0, 0.0
        self._flush_interval_s, self._clock = flush_interval_s, clock
        self._last_flush = clock()

    def add(self, seconds: float, flush: bool = False) -> None:
        self._pending_calls += 1
        self._pending_seconds += seconds
        if flush or self._clock() - self._last_flush >= self._flush_interval_s:
            self._calls.increment(self._pending_calls)
            self._seconds.increment(self._pending_seconds)
            self._pending_calls, self._pending_seconds, self._last_flush = 0, 0.0, self._clock()


class SpecDecodeCounters:
    """The orchestrator's per-step counters.

    Every ``pb_utils`` metric update is a synchronous round trip to the server process
    that blocks the event loop (and so every stage dispatch behind it), and a step
    touches up to ``k + 5`` counters. So updates are summed and applied at most every
    ``flush_interval_s`` (``FLUSH_INTERVAL_S``), one update per counter whatever the
    number of steps, and at once by :meth:`flush` (the orchestrator calls it whenever a
    request ends, before its final response or error, so a client that has heard of the
    end sees the request's steps counted).
    Outside an event loop, updates apply at once.
    """

    def __init__(self, model_name: str, max_positions: int, family_type=None,
                 flush_interval_s: float = FLUSH_INTERVAL_S):
        labels = {"model": model_name}
        # Families must outlive their metrics, so both are kept.
        self._families = {name: _family(name, text, "COUNTER", family_type) for name, text in _COUNTERS.items()}
        self._counters = {name: family.Metric(labels=labels) for name, family in self._families.items()}
        self._per_position_family = _family(*_PER_POSITION, "COUNTER", family_type)
        self._per_position = [
            self._per_position_family.Metric(labels={**labels, "position": str(i)}) for i in range(max_positions)
        ]
        self._stage_families = {name: _family(name, text, "COUNTER", family_type)
                                for name, text in _STAGE_COUNTERS.items()}  # fmt: skip
        self._stage = {
            (name, stage): family.Metric(labels={**labels, "stage": stage})
            for name, family in self._stage_families.items()
            for stage in STAGES
        }
        self._shape_families = {name: _family(name, text, "COUNTER", family_type)
                                for name, (_, text) in _STEP_SHAPE.items()}  # fmt: skip
        self._shape: dict[tuple[str, int], object] = {}  # (family, value) -> its metric, made on first use
        self._family_type = family_type
        self._source_families: dict[str, object] = {}  # _BY_SOURCE's, made on the first step with a source
        self._by_source: dict[tuple[str, str], object] = {}  # (family, source) -> its metric
        self._labels = labels
        self._pending: dict[object, float] = {}  # metric -> increment not applied yet
        self._flush_interval_s = flush_interval_s
        self._scheduled_flush: asyncio.TimerHandle | None = None
        self._scheduled_on: asyncio.AbstractEventLoop | None = None  # the loop that will run it

    def record_stage_call(self, stage: str, num_sequences: int, seconds: float) -> None:
        """One batched call to a stage: seconds / calls is its mean latency, sequences / calls its batch."""
        self._add(self._stage[("spec_decode_stage_calls", stage)], 1)
        self._add(self._stage[("spec_decode_stage_sequences", stage)], num_sequences)
        self._add(self._stage[("spec_decode_stage_seconds", stage)], seconds)

    def record_step_shape(self, num_sequences: int, k: int) -> None:
        """One scheduler step: how many sequences it verified, and the most drafts it allowed each."""
        for name, value in (("spec_decode_steps_by_batch_size", num_sequences), ("spec_decode_steps_by_k", k)):
            metric = self._shape.get((name, value))
            if metric is None:
                label = _STEP_SHAPE[name][0]
                metric = self._shape_families[name].Metric(labels={**self._labels, label: str(value)})
                self._shape[(name, value)] = metric
            self._add(metric, 1)

    def record_step(self, num_draft_tokens: int, num_accepted: int, num_output_tokens: int,
                    source: str | None = None) -> None:  # fmt: skip
        """One sequence's part of a step (``spec_decode_num_steps`` counts target passes per sequence);
        ``source``: which proposer drafted it, where a step may take either (``_BY_SOURCE``)."""
        if source is not None and num_draft_tokens:  # as spec_decode_num_drafts counts
            for name, value in zip(_BY_SOURCE, (1, num_draft_tokens, num_accepted)):
                self._add(self._source_metric(name, source), value)
        self._add(self._counters["spec_decode_num_steps"], 1)
        if num_draft_tokens:
            self._add(self._counters["spec_decode_num_drafts"], 1)
            self._add(self._counters["spec_decode_num_draft_tokens"], num_draft_tokens)
            self._add(self._counters["spec_decode_num_accepted_tokens"], num_accepted)
        for position in range(num_accepted):
            self._add(self._per_position[position], 1)
        self._add(self._counters["spec_decode_num_output_tokens"], num_output_tokens)

    def _source_metric(self, name: str, source: str):
        metric = self._by_source.get((name, source))
        if metric is None:
            if not self._source_families:
                self._source_families = {n: _family(n, text, "COUNTER", self._family_type) for n, text in _BY_SOURCE.items()}
            metric = self._by_source[(name, source)] = self._source_families[name].Metric(
                labels={**self._labels, "source": source})
        return metric

    def flush(self) -> None:
        """Apply every pending update now."""
        if self._scheduled_flush is not None:
            self._scheduled_flush.cancel()
            self._scheduled_flush = None
        pending, self._pending = self._pending, {}
        for metric, amount in pending.items():
            metric.increment(amount)

    def _add(self, metric, amount: float) -> None:
        if not amount:
            return
        self._pending[metric] = self._pending.get(metric, 0) + amount
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop: nothing would run a deferred flush
            self.flush()
            return
        if self._scheduled_flush is not None and self._scheduled_on is loop:
            return
        self._scheduled_flush, self._scheduled_on = loop.call_later(self._flush_interval_s, self.flush), loop
