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

from specdec_triton.plumbing import triton_utils

_COUNTERS = {
    "spec_decode_num_steps": "Target passes of all requests (steps), each request's prefill pass included",
    "spec_decode_num_verify_calls": "Calls to the target verifier; each carries the steps of one or more sequences",
    "spec_decode_num_drafts": "Speculative steps that proposed at least one draft token",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the rejection sampler",
    "spec_decode_num_output_tokens": "Tokens emitted to clients",
}
_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position (0-based)")
_ACTIVE = ("spec_decode_num_active_sequences", "Sequences whose state this model holds")


def _family(name: str, description: str, kind: str, family_type=None):
    """A ``pb_utils.MetricFamily``, or one of ``family_type`` (a stand-in, in tests)."""
    family_type = family_type or triton_utils().MetricFamily
    return family_type(name=name, description=description, kind=getattr(family_type, kind))


class ActiveSequences:
    """Gauge of live sequences held by one model; set after every request, so it returns to 0 when idle."""

    def __init__(self, model_name: str, family_type=None):
        self._family = _family(*_ACTIVE, "GAUGE", family_type)  # must outlive its metrics
        self._gauge = self._family.Metric(labels={"model": model_name})

    def set(self, count: int) -> None:
        self._gauge.set(count)


class SpecDecodeCounters:
    """The orchestrator's per-step counters."""

    def __init__(self, model_name: str, max_positions: int, family_type=None):
        labels = {"model": model_name}
        # Families must outlive their metrics, so both are kept.
        self._families = {name: _family(name, text, "COUNTER", family_type) for name, text in _COUNTERS.items()}
        self._counters = {name: family.Metric(labels=labels) for name, family in self._families.items()}
        self._per_position_family = _family(*_PER_POSITION, "COUNTER", family_type)
        self._per_position = [
            self._per_position_family.Metric(labels={**labels, "position": str(i)}) for i in range(max_positions)
        ]

    def record_verify_call(self) -> None:
        self._counters["spec_decode_num_verify_calls"].increment(1)

    def record_step(self, num_draft_tokens: int, num_accepted: int, num_output_tokens: int) -> None:
        self._counters["spec_decode_num_steps"].increment(1)
        if num_draft_tokens:
            self._counters["spec_decode_num_drafts"].increment(1)
            self._counters["spec_decode_num_draft_tokens"].increment(num_draft_tokens)
            self._counters["spec_decode_num_accepted_tokens"].increment(num_accepted)
        for position in range(num_accepted):
            self._per_position[position].increment(1)
        if num_output_tokens:
            self._counters["spec_decode_num_output_tokens"].increment(num_output_tokens)
