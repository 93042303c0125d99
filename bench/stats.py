"""Figures from one benchmark phase: streaming latencies, acceptance, server counters.

Latency vocabulary (after vLLM's ``benchmark_serving``):

* *TTFT* -- time from sending a request to the first response carrying a token;
* *chunk gap* -- time between two consecutive streamed responses of one request; a
  speculative step delivers its accepted tokens plus one in a single response;
* *ITL* (inter-token latency) -- each chunk gap split evenly over the tokens that
  chunk delivers, so its mean is the time per output token after the first and a
  step of 3 tokens counts as 3 short intervals, not 1 long one.

Acceptance vocabulary (vLLM ``spec_decode`` metrics): a *draft* is one step that
proposed tokens; ``acceptance_rate = accepted / draft tokens``;
``mean_accepted_length = 1 + accepted / drafts`` (tokens per target pass that drafted);
per-position acceptance is ``accepted at position i / drafts``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


@dataclass
class RequestTiming:
    """Client-side clock readings (seconds, one monotonic clock) of one streamed request."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # when each response carrying tokens arrived
    tokens: list[int] = field(default_factory=list)  # how many tokens each of those responses carried

    def record(self, when: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.arrivals.append(when)
            self.tokens.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def latency(self) -> float:
        return self.arrivals[-1] - self.sent if self.arrivals else math.nan

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent if self.arrivals else math.nan

    def chunk_gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def inter_token_latencies(self) -> list[float]:
        itl: list[float] = []
        for gap, n in zip(self.chunk_gaps(), self.tokens[1:]):
            itl.extend([gap / n] * n)
        return itl


def latency_summary(timings: list[RequestTiming], elapsed_s: float) -> dict[str, float]:
    """Throughput and latency percentiles of one phase; times in milliseconds."""
    done = [t for t in timings if t.arrivals]
    tokens = sum(t.num_tokens for t in done)
    itl = [x for t in done for x in t.inter_token_latencies()]
    gaps = [x for t in done for x in t.chunk_gaps()]
    ttft = [t.ttft for t in done]
    per_stream = [t.num_tokens / t.latency for t in done if t.latency > 0]
    return {
        "requests": len(done),
        "output_tokens": tokens,
        "elapsed_s": elapsed_s,
        "tokens_per_s_aggregate": tokens / elapsed_s if elapsed_s > 0 else math.nan,
        "tokens_per_s_per_stream": float(np.mean(per_stream)) if per_stream else math.nan,
        "ttft_ms_p50": 1e3 * percentile(ttft, 50),
        "ttft_ms_p99": 1e3 * percentile(ttft, 99),
        "itl_ms_p50": 1e3 * percentile(itl, 50),
        "itl_ms_p99": 1e3 * percentile(itl, 99),
        "chunk_gap_ms_p50": 1e3 * percentile(gaps, 50),
        "chunk_gap_ms_p99": 1e3 * percentile(gaps, 99),
        "tokens_per_chunk": tokens / sum(len(t.tokens) for t in done) if done else math.nan,
    }


@dataclass(frozen=True)
class Acceptance:
    num_drafts: int  # steps that proposed at least one token
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # [k] accepted count at draft position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def per_position_rate(self) -> list[float]:
        """Empty when nothing was drafted."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_rate,
        }


# --- Prometheus text exposition format -------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) -> value


def parse_prometheus(text: str) -> Samples:
    """Samples of a ``/metrics`` page; comments and malformed lines are skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, _, labels, value = match.group(1), match.group(2), match.group(3), match.group(4)
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        samples[(name, pairs)] = number
    return samples


def samples_delta(after: Samples, before: Samples) -> Samples:
    """Counter increments between two scrapes (a series absent before counts from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def samples_sum(a: Samples, b: Samples) -> Samples:
    """Two counter deltas added series by series (a series absent on one side counts as 0)."""
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in {**a, **b}}


def metric_total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and want <= set(pairs))


def metric_by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``{label value: summed value}`` of ``name`` split by one label."""
    out: dict[str, float] = {}
    for (n, pairs), v in samples.items():
        if n == name:
            for key, value in pairs:
                if key == label:
                    out[value] = out.get(value, 0.0) + v
    return out


def acceptance_from_metrics(delta: Samples, prefix: str = "spec_decode_") -> Acceptance | None:
    """Acceptance over a phase from vLLM-named counters; None when the server exports none."""
    names = {n for n, _ in delta}
    if f"{prefix}num_drafts" not in names:
        return None
    per_pos = {int(p): v for p, v in metric_by_label(delta, f"{prefix}num_accepted_tokens_per_pos", "position").items()}
    counts = [0] * (max(per_pos) + 1 if per_pos else 0)  # a position no step reached counts 0
    for position, value in per_pos.items():
        counts[position] = round(value)
    return Acceptance(
        num_drafts=round(metric_total(delta, f"{prefix}num_drafts")),
        num_draft_tokens=round(metric_total(delta, f"{prefix}num_draft_tokens")),
        num_accepted_tokens=round(metric_total(delta, f"{prefix}num_accepted_tokens")),
        accepted_per_position=tuple(counts),
    )


PROPOSAL_SOURCES = ("suffix", "model")  # the metrics' source labels (specdec.suffix_first's Proposal.source)


def source_figures(by_source: dict[str, tuple[float, float, float]]) -> dict:
    """With suffix decoding in front of a model: ``{source: (steps drafted, draft tokens, accepted tokens)}``
    as a row's figures -- the steps each source drafted, suffix decoding's share of them (how often a
    model pass was saved), and the accepted tokens per step each source drafted; empty without sources."""
    if not by_source:
        return {}
    steps = {s: round(by_source.get(s, (0, 0, 0))[0]) for s in PROPOSAL_SOURCES}
    total = sum(steps.values())
    row: dict = {f"proposals_from_{s}": n for s, n in steps.items()}
    row["suffix_share"] = steps["suffix"] / total if total else math.nan
    for source, n in steps.items():
        row[f"accepted_per_step_{source}"] = by_source[source][2] / n if n else math.nan
    return row


# --- Triton statistics extension --------------------------------------------------------


@dataclass(frozen=True)
class ModelCounters:
    """Cumulative counters of one model from Triton's statistics extension."""

    inference_count: int  # requests executed (before batching)
    execution_count: int  # model executions (after batching)
    compute_infer_ns: int  # time inside the model's execute, summed over requests
    queue_ns: int = 0  # time requests waited in the model's scheduler queue, summed over requests


def model_counters(statistics: dict) -> dict[str, ModelCounters]:
    """``{model name: counters}`` from ``get_inference_statistics(as_json=True)``.

    Versions of one model are summed. Protobuf JSON writes 64-bit integers as strings
    and omits zero fields, hence the ``int(... or 0)``.
    """
    out: dict[str, ModelCounters] = {}
    for stat in statistics.get("model_stats", []):
        inference = stat.get("inference_stats", {})
        counters = ModelCounters(
            inference_count=int(stat.get("inference_count") or 0),
            execution_count=int(stat.get("execution_count") or 0),
            compute_infer_ns=int(inference.get("compute_infer", {}).get("ns") or 0),
            queue_ns=int(inference.get("queue", {}).get("ns") or 0),
        )
        prev = out.get(stat["name"])
        if prev is not None:
            counters = ModelCounters(*(a + b for a, b in zip(_fields(prev), _fields(counters))))
        out[stat["name"]] = counters
    return out


def counters_delta(after: dict[str, ModelCounters], before: dict[str, ModelCounters]) -> dict[str, ModelCounters]:
    zero = ModelCounters(0, 0, 0, 0)
    return {
        name: ModelCounters(*(a - b for a, b in zip(_fields(c), _fields(before.get(name, zero)))))
        for name, c in after.items()
    }


def counters_sum(a: dict[str, ModelCounters], b: dict[str, ModelCounters]) -> dict[str, ModelCounters]:
    zero = ModelCounters(0, 0, 0, 0)
    return {
        name: ModelCounters(*(x + y for x, y in zip(_fields(a.get(name, zero)), _fields(b.get(name, zero)))))
        for name in {**a, **b}
    }


def _fields(c: ModelCounters) -> tuple[int, int, int, int]:
    return c.inference_count, c.execution_count, c.compute_infer_ns, c.queue_ns


SOCKET_CALLS_METRIC = "spec_decode_socket_calls"  # counter by model: calls answered on its socket
SOCKET_SECONDS_METRIC = "spec_decode_socket_call_seconds"  # the time the model spent on them


def with_socket_calls(delta: dict[str, ModelCounters], metrics: Samples) -> dict[str, ModelCounters]:
    """``delta`` (Triton's statistics) with each model's socket calls counted as executions.

    With ``stage_calls: socket`` a step's calls reach draft_proposer and target_verifier
    on their sockets, which Triton's statistics never see; the models count those calls
    and the time they spent on them themselves (``spec_decode_socket_call*``). Each call
    is one execution of one request, with no queue time.
    """
    out = dict(delta)
    for model, calls in metric_by_label(metrics, SOCKET_CALLS_METRIC, "model").items():
        seconds = metric_total(metrics, SOCKET_SECONDS_METRIC, model=model)
        before = out.get(model, ModelCounters(0, 0, 0))
        out[model] = ModelCounters(before.inference_count + round(calls), before.execution_count + round(calls),
                                   before.compute_infer_ns + round(1e9 * seconds), before.queue_ns)  # fmt: skip
    return out


def step_overhead_ms(
    elapsed_s: float, delta: dict[str, ModelCounters], steps: int, compute_models: tuple[str, ...]
) -> dict:
    """Per-step time not spent computing in ``compute_models`` (the proposer, target and sampler).

    ``steps`` counts every target pass, prefills included. Everything else the
    orchestrator does per step -- BLS round trips, detokenizing, queueing, sending
    the response -- is the overhead. Exact when one request runs at a time; when
    component models execute concurrently, their summed compute overlaps in wall
    time and the overhead is underestimated.
    """
    if steps <= 0:
        return {"steps": 0, "step_wall_ms": math.nan, "step_compute_ms": math.nan, "step_overhead_ms": math.nan}
    compute_ns = sum(delta[m].compute_infer_ns for m in compute_models if m in delta)
    wall_ms = 1e3 * elapsed_s / steps
    compute_ms = 1e-6 * compute_ns / steps
    return {
        "steps": steps,
        "step_wall_ms": wall_ms,
        "step_compute_ms": compute_ms,
        "step_overhead_ms": wall_ms - compute_ms,
        "compute_ms_per_step_by_model": {name: 1e-6 * c.compute_infer_ns / steps for name, c in sorted(delta.items())},
    }


@dataclass(frozen=True)
class StageTimes:
    """One orchestrator stage over a run, as the orchestrator waited on it and as its model saw it.

    The orchestrator's side comes from ``spec_decode_stage_*``; the model's from Triton's
    statistics of the model that serves the stage, whose requests include the stage's
    calls and also releases and the limits probe (a small share). Per call, what is
    neither queueing nor execution is the BLS round trip and the orchestrator's own
    turnaround.
    """

    calls: float
    sequences: float
    wait_s: float  # the orchestrator's wait, summed over calls
    queue_s: float  # in the model's scheduler queue, summed over its requests
    execute_s: float  # in the model's execute, summed over its requests

    @classmethod
    def of(cls, samples: Samples, stage: str, model: ModelCounters | None) -> StageTimes | None:
        """``samples``: a delta of the orchestrator's metrics; ``model``: that run's counters of the stage's model."""
        calls = metric_total(samples, "spec_decode_stage_calls", stage=stage)
        if not calls:
            return None
        return cls(
            calls=calls,
            sequences=metric_total(samples, "spec_decode_stage_sequences", stage=stage),
            wait_s=metric_total(samples, "spec_decode_stage_seconds", stage=stage),
            queue_s=1e-9 * model.queue_ns if model is not None else math.nan,
            execute_s=1e-9 * model.compute_infer_ns if model is not None else math.nan,
        )

    @property
    def ms_per_call(self) -> float:
        return 1e3 * self.wait_s / self.calls

    @property
    def queue_ms_per_call(self) -> float:
        return 1e3 * self.queue_s / self.calls

    @property
    def execute_ms_per_call(self) -> float:
        return 1e3 * self.execute_s / self.calls

    @property
    def round_trip_ms_per_call(self) -> float:
        return self.ms_per_call - self.queue_ms_per_call - self.execute_ms_per_call
