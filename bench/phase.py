"""One measured phase against a running server: load, counter deltas, and the row of figures they make.

A *phase* is one configuration (a ``num_speculative_tokens`` per request, or none) at
one concurrency: the prompts sent closed loop, the server's Prometheus counters and
Triton's per-model statistics read before and after. Rounds of the same phase add up
(``PhaseMeasurement.__add__``) into one row: all requests, summed wall time, summed
counter deltas. Counters the server does not export are left out of the row, not
guessed (``spec_decode_num_steps`` falls back to Triton's statistics).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from bench.client import Job, JobResult, run_load
from bench.results import tokens_per_step
from bench.server import TritonServer
from bench.stats import (
    ModelCounters,
    Samples,
    acceptance_from_metrics,
    counters_delta,
    counters_sum,
    latency_summary,
    metric_by_label,
    metric_total,
    model_counters,
    parse_prometheus,
    samples_delta,
    samples_sum,
    source_figures,
    step_overhead_ms,
    with_socket_calls,
)

ORCHESTRATOR = "speculative_decoding"
TARGET_MODEL = "target_verifier"
PROPOSER_MODEL = "draft_proposer"
SAMPLER_MODEL = "rejection_sampler"
TOKENIZER_MODEL = "tokenizer"
DETOKENIZER_MODEL = "detokenizer"
COMPUTE_MODELS = (PROPOSER_MODEL, TARGET_MODEL, SAMPLER_MODEL)  # "model compute" of a step
ACTIVE_METRIC = "spec_decode_num_active_sequences"  # gauge: sequences each model holds
STEPS_METRIC = "spec_decode_num_steps"  # counter: target passes, prefills included
STAGE_CALLS_METRIC = "spec_decode_stage_calls"  # counter by stage; stage="verify": target_verifier calls
# counters by source under enable_suffix_decoding: steps drafted, draft tokens, accepted tokens
SOURCE_METRICS = ("spec_decode_suffix_first_proposals", "spec_decode_suffix_first_draft_tokens",
                  "spec_decode_suffix_first_accepted_tokens")

try:
    from tqdm import tqdm
except ImportError:  # a printed line per request instead
    tqdm = None


class Progress:
    """One progress bar over every request of a run (a printed line per request without tqdm)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.bar = tqdm(total=total, unit="req", dynamic_ncols=True) if tqdm is not None else None

    def phase(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)
        else:
            print(f"[bench] {name}", flush=True)

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(f"[bench] {self.done}/{self.total} requests", flush=True)

    def write(self, msg: str) -> None:
        (self.bar.write if self.bar is not None else print)(f"[bench] {msg}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class PhaseMeasurement:
    """What one phase (or several rounds of it, added) measured: requests, wall time, counter deltas."""

    results: list[JobResult]
    elapsed_s: float
    metrics: Samples  # the server's Prometheus counters, after - before
    stats: dict[str, ModelCounters]  # Triton's per-model statistics, after - before

    def __add__(self, other: PhaseMeasurement) -> PhaseMeasurement:
        return PhaseMeasurement(self.results + other.results, self.elapsed_s + other.elapsed_s,
                                samples_sum(self.metrics, other.metrics), counters_sum(self.stats, other.stats))

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(r.timing.num_tokens for r in self.results)
        return tokens / self.elapsed_s if self.elapsed_s > 0 else math.nan


def warm_up(server: TritonServer, jobs: list[Job], burst: int) -> None:
    """Unmeasured load before the first phase: each job alone at full length, then ``burst`` short ones at once.

    The first forwards of each batch shape pay one-off costs (oneDNN primitives, the
    allocator, lazy imports), which would otherwise land on whichever phase runs first:
    the one-stream baseline. ``jobs``: one per ``num_speculative_tokens`` to warm.
    """
    for job in jobs:
        run_load(server.grpc_url, ORCHESTRATOR, [job], 1)
        short = Job(job.prompt, min(16, job.max_tokens), job.num_speculative_tokens, job.ignore_eos)
        run_load(server.grpc_url, ORCHESTRATOR, [short] * burst, burst)


def wait_idle(server: TritonServer, timeout_s: float = 60.0) -> Samples:
    """Scrape the metrics once no model holds a sequence any more.

    A request's final response goes out before the orchestrator releases its
    sequences, so counters read right after the last response may miss those calls.
    A server without the gauge reads as idle at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        samples = parse_prometheus(server.metrics_text())
        if metric_total(samples, ACTIVE_METRIC) == 0:
            return samples
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server still holds sequences {timeout_s:.0f} s after the last response")
        time.sleep(0.05)


def measure_phase(
    server: TritonServer, jobs: list[Job], concurrency: int, on_done=lambda: None
) -> PhaseMeasurement:
    metrics_before = wait_idle(server)
    stats_before = model_counters(server.statistics())
    results, elapsed = run_load(server.grpc_url, ORCHESTRATOR, jobs, concurrency, on_done)
    metrics = samples_delta(wait_idle(server), metrics_before)
    stats = with_socket_calls(counters_delta(model_counters(server.statistics()), stats_before), metrics)
    return PhaseMeasurement(results, elapsed, metrics, stats)


def phase_row(measured: PhaseMeasurement) -> dict:
    """The figures of one configuration at one concurrency."""
    results, elapsed, metrics, stats = measured.results, measured.elapsed_s, measured.metrics, measured.stats
    summary = latency_summary([r.timing for r in results], elapsed)
    if STEPS_METRIC in {name for name, _ in metrics}:  # the orchestrator counts its steps, prefills included
        steps = round(metric_total(metrics, STEPS_METRIC))
    else:  # a repository without the counter: the target serves each prefill, decode step and one release
        steps = (stats[TARGET_MODEL].inference_count if TARGET_MODEL in stats else 0) - len(results)
    row = {**summary, **step_overhead_ms(elapsed, stats, steps, COMPUTE_MODELS), "decode_steps": steps - len(results),
           "tokens_per_step": tokens_per_step(summary["output_tokens"], len(results), steps - len(results))}
    # a step verifies in a verify call, or in a propose_verify call where the draft runs beside the target
    verify_calls = sum(metric_total(metrics, STAGE_CALLS_METRIC, stage=s) for s in ("verify", "propose_verify"))
    if verify_calls:  # one call in flight at a time, so one forward per call: the sequences each forward served
        row["target_sequences_per_execution"] = steps / verify_calls
    elif TARGET_MODEL in stats and stats[TARGET_MODEL].execution_count:  # a repository without the counter
        target = stats[TARGET_MODEL]
        row["target_sequences_per_execution"] = target.inference_count / target.execution_count
    by_source = [metric_by_label(metrics, name, "source") for name in SOURCE_METRICS]
    row.update(source_figures({s: tuple(counts.get(s, 0.0) for counts in by_source) for s in by_source[0]}))
    acceptance = acceptance_from_metrics(metrics)
    if acceptance is not None:
        row.update(acceptance.as_dict(), acceptance_source="prometheus")
    elif all(r.drafted is not None for r in results):  # totals only: no per-position figures this way
        drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
        row.update(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else math.nan, acceptance_source="request outputs")
    return row
