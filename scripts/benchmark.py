#!/usr/bin/env python3
"""Benchmark speculative decoding served by Triton against plain decoding and Hugging Face.

Compared in one run, on the same checkpoints and held-out prompts:

* the server with ``num_speculative_tokens = 0`` (the baseline, per-request override);
* the server with each proposer method (draft model, n-gram) at each k; with
  ``--length-policies fixed,adaptive`` also a server per method whose steps draft
  0 .. k, chosen by ``speculative_length_policy: adaptive`` (rows ``<method> adaptive k<=k``);
* in-process ``generate``: plain, with ``assistant_model`` (same draft, same k) and with
  ``prompt_lookup_num_tokens = k``, one request at a time.

For each server configuration it starts ``scripts/serve.sh`` on a copy of the model
repository whose parameters select the method, and stops it afterwards. Figures per
configuration and concurrency: tokens/s per stream and in total, TTFT, ITL p50/p99,
acceptance (overall and per draft position), tokens per target pass, per-step
orchestration overhead, the analytic speedup bound and the efficiency against it
(see ``bench``). In this process it also times the target's steps against their
memory-bandwidth floor (weight bytes / measured copy bandwidth) and, on CUDA, the
captured CUDA graphs against eager. Writes JSON (and a PNG when matplotlib is installed) to
--out-dir and appends a markdown table to docs/benchmarks.md.

With ``--rounds N`` the server phases run N times in turn (every concurrency and k, then
again), and each figure pools all N: on a machine whose speed drifts, a configuration's
one-stream and 8-stream phases are then measured across the same stretch of time.

    python scripts/benchmark.py --concurrency 1 --num-prompts 4 --max-tokens 64 --ks 2,4
    python scripts/benchmark.py --target models/random-1b --draft models/random-125m --synthetic-acceptance-rate 0.8
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tritonclient.grpc import InferenceServerClient

from bench import report
from bench.bound import forward_ms
from bench.client import Job, JobResult, run_load
from bench.hf import generation_config, run_hf
from bench.repository import get_parameters, make_variant
from bench.results import (
    annotate,
    match_reference,
    step_time_keys,
    tokens_per_step,
)
from bench.roofline import memory_bandwidth_gbps, target_over_floor, weight_bytes_per_step
from bench.server import TritonServer
from bench.stats import (
    ModelCounters,
    Samples,
    acceptance_from_metrics,
    counters_delta,
    counters_sum,
    latency_summary,
    metric_total,
    model_counters,
    parse_prometheus,
    samples_delta,
    samples_sum,
    step_overhead_ms,
)
from bench.workload import held_out_texts, select_prompts
from specdec.fast import FastCausalLM
from specdec.models import load_causal_lm, load_tokenizer
from specdec.proposers import PROPOSERS
from specdec_triton.configs import LENGTH_POLICIES

REPO_ROOT = Path(__file__).resolve().parent.parent
ORCHESTRATOR = "speculative_decoding"
TARGET_MODEL = "target_verifier"
PROPOSER_MODEL = "draft_proposer"
SAMPLER_MODEL = "rejection_sampler"
TOKENIZER_MODEL = "tokenizer"
DETOKENIZER_MODEL = "detokenizer"
Outputs = dict[tuple[str, int], list[str]]  # (config, concurrency) -> output texts in prompt order
ACTIVE_METRIC = "spec_decode_num_active_sequences"  # gauge: sequences each model holds
STEPS_METRIC = "spec_decode_num_steps"  # counter: target passes, prefills included
STAGE_CALLS_METRIC = "spec_decode_stage_calls"  # counter by stage; stage="verify": target_verifier calls
COMPUTE_MODELS = (PROPOSER_MODEL, TARGET_MODEL, SAMPLER_MODEL)  # "model compute" of a step

try:
    from tqdm import tqdm
except ImportError:  # a printed line per request instead
    tqdm = None


class Progress:
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


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    p.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    p.add_argument("--methods", default="draft_model,ngram", help="draft_proposer methods, comma-separated")
    p.add_argument("--ks", type=int_list, default=[1, 2, 4], help="num_speculative_tokens values")
    p.add_argument("--length-policies", default="fixed",
                   help="speculative_length_policy values, comma-separated: fixed, adaptive (one server each)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16])
    p.add_argument("--num-prompts", type=int, default=16, help="requests per configuration and concurrency")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the server phases this many times in turn and pool them (against drift)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (whole lines, at least this)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="min_tokens = max_tokens, so every configuration emits the same number of tokens")
    p.add_argument("--synthetic-acceptance-rate", type=float, default=None,
                   help="use the synthetic rejection sampler (for random-weight models)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="in-process HF baselines")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads here and OMP_NUM_THREADS of every server model process (serve.sh's default)")
    p.add_argument("--timing-repeats", type=int, default=20, help="forwards per step-time median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None, help="default runs/benchmark-<timestamp>/")
    p.add_argument("--docs", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown to append to")
    p.add_argument("--no-docs", action="store_true", help="do not append to --docs")
    p.add_argument("--note", action="append", default=[], help="a line of context for the report (repeatable)")
    args = p.parse_args()
    if any(k < 1 for k in args.ks) or any(c < 1 for c in args.concurrency) or min(args.threads, args.rounds) < 1:
        p.error("--ks, --concurrency, --threads and --rounds values must be >= 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in PROPOSERS]
    if unknown or not args.methods:
        p.error(f"--methods must name some of {sorted(PROPOSERS)}, got {args.methods}")
    args.length_policies = [x.strip() for x in args.length_policies.split(",") if x.strip()]
    if not args.length_policies or not set(args.length_policies) <= set(LENGTH_POLICIES):
        p.error(f"--length-policies must name some of {list(LENGTH_POLICIES)}, got {args.length_policies}")
    return args


def server_parameter(repository: Path, model: str, key: str, default: str) -> str:
    config = repository / model / "config.pbtxt"
    return get_parameters(config.read_text()).get(key, default) if config.is_file() else default


def measure_step_times(args, target, draft, dtype: str, device: str, cuda_graphs: bool | None = None) -> dict:
    """Median forward times (ms) on a cache of prompt + max_tokens / 2 tokens, in this process.

    Timed on the engine each server model runs (``engine`` in its config.pbtxt), so the
    analytic bound is that of the serving path; the ``hf`` engine reuses the loaded models.
    ``cuda_graphs``: that of the fast engine (None: on where CUDA is, as in the server).
    """
    context = args.prompt_tokens + args.max_tokens // 2
    models = {}
    for role, model_name, hf_model, path in (("target", TARGET_MODEL, target, args.target),
                                              ("draft", PROPOSER_MODEL, draft, args.draft)):
        engine = server_parameter(args.repository, model_name, "engine", "fast")
        models[role] = (FastCausalLM(path, dtype, device, max_num_seqs=len(args.ks) + 1, max_model_len=context + 16,
                                     cuda_graphs=cuda_graphs)
                        if engine == "fast" else hf_model)
    shapes = {name: (models["draft" if name.startswith("draft") else "target"], n)
              for name, n in step_time_keys(args.ks)}  # fmt: skip
    return forward_ms(shapes, context, repeats=args.timing_repeats, seed=args.seed)


def in_process_timings(args, target, draft, dtype: str, device: str) -> tuple[dict, dict, dict | None, list[str]]:
    """Step times, the target's memory-bandwidth floor and, on CUDA, eager step times; and a line on each."""
    step_times = measure_step_times(args, target, draft, dtype, device)
    roofline = target_over_floor(weight_bytes_per_step(target), memory_bandwidth_gbps(device), step_times)
    eager = None
    if device == "cuda" and server_parameter(args.repository, TARGET_MODEL, "engine", "fast") == "fast":
        eager = measure_step_times(args, target, draft, dtype, device, cuda_graphs=False)
    notes = [
        "Step times (ms, median, in-process): " + ", ".join(f"{k} {v:.2f}" for k, v in step_times.items()),
        f"Memory-bandwidth floor of a target step: {roofline['target_weight_bytes'] / 1e6:.1f} MB of weights / "
        f"{roofline['bandwidth_gbps']:.1f} GB/s measured copy bandwidth = {roofline['floor_ms']:.2f} ms; "
        + ", ".join(f"{name} {ratio:.2f}x the floor" for name, ratio in roofline["over_floor"].items()),
        "CUDA graphs against eager, step times (ms, median): "
        + ", ".join(f"{k} {step_times[k]:.2f} vs {ms:.2f} (graphs {ms / step_times[k]:.2f}x faster)"
                    for k, ms in eager.items())
        if eager is not None else "CUDA graphs against eager: not measured (no CUDA device, or the hf engine)",
    ]
    return step_times, roofline, eager, notes


def hf_rows(args, prompts, target, draft, tokenizer, outputs: Outputs, progress: Progress) -> list[dict]:
    config = generation_config(args.max_tokens, tokenizer.eos_token_id, args.ignore_eos)
    runs = [("hf plain", "plain", 0, None)]
    if args.synthetic_acceptance_rate is None:  # random weights accept nothing: assisted figures would mislead
        for k in args.ks:
            runs += [(f"hf assisted k={k}", "assisted", k, "draft_model"),
                     (f"hf prompt_lookup k={k}", "prompt_lookup", k, "ngram")]
    rows = []
    list(run_hf(target, prompts[:1], config, "plain"))  # warm-up
    for name, mode, k, proposer in runs:
        progress.phase(name)
        started = time.perf_counter()
        timings, texts = [], []
        for timing, output_ids in run_hf(target, prompts, config, mode, k, draft):
            timings.append(timing)
            # decoded as the server's detokenizer does (specdec_triton/text.py)
            texts.append(tokenizer.decode(output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
            progress.step()
        summary = latency_summary(timings, time.perf_counter() - started)
        outputs[(name, 1)] = texts
        # generate() streams one target pass per chunk; assisted passes start at the prompt
        per_pass = summary["tokens_per_chunk"] if k else math.nan
        rows.append({"config": name, "concurrency": 1, "k": k, "proposer": proposer, "baseline": "hf plain",
                     "tokens_per_step": per_pass, "mean_accepted_length": per_pass, **summary})
    return rows


def server_edits(args, method: str, policy: str) -> dict[str, dict[str, str]]:
    edits = {
        ORCHESTRATOR: {"num_speculative_tokens": str(max(args.ks)), "speculative_length_policy": policy},
        PROPOSER_MODEL: {"method": method},
        TARGET_MODEL: {"target_model": str(args.target.resolve())},
        # ids must index the target's vocabulary, so the target's tokenizer encodes and decodes
        TOKENIZER_MODEL: {"tokenizer_dir": str(args.target.resolve())},
        DETOKENIZER_MODEL: {"tokenizer_dir": str(args.target.resolve())},
    }
    if method == "draft_model":
        edits[PROPOSER_MODEL]["draft_model"] = str(args.draft.resolve())
    if args.synthetic_acceptance_rate is not None:
        edits[SAMPLER_MODEL] = {"rejection_sample_method": "synthetic",
                                "synthetic_acceptance_rate": str(args.synthetic_acceptance_rate)}
    return edits


def server_rows(
    args, method: str, policy: str, prompts, workdir: Path, outputs: Outputs, progress: Progress
) -> list[dict]:
    """One server, ``method`` and ``policy``: k = 0 and each k of ``args.ks`` (an upper bound if adaptive)."""
    variant = method if policy == "fixed" else f"{method}-{policy}"
    repository = make_variant(args.repository, workdir / f"repo-{variant}", server_edits(args, method, policy))
    base_name = f"server {method} k=0" + ("" if policy == "fixed" else f" ({policy})")
    rows = []
    log = args.out_dir / f"server-{variant}.log"
    env = {"OMP_NUM_THREADS": str(args.threads)}  # each model process gets what this process uses
    with TritonServer(REPO_ROOT / "scripts" / "serve.sh", repository, log, env) as server:
        progress.write(f"{method}: tritonserver ready on {server.grpc_url} (log {server.log_path})")
        warm_up(server, prompts, args)
        phases: dict[tuple[int, int], PhaseMeasurement] = {}  # (concurrency, k), in the order first run
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                for k in (0, *args.ks):
                    name = base_name if k == 0 else config_name(method, policy, k)
                    suffix = f" (round {round_ + 1}/{args.rounds})" if args.rounds > 1 else ""
                    progress.phase(f"{name} c={concurrency}{suffix}")
                    jobs = [Job(p, args.max_tokens, k, args.ignore_eos) for p in prompts]
                    measured = measure_phase(server, jobs, concurrency, progress)
                    previous = phases.get((concurrency, k))
                    phases[(concurrency, k)] = measured if previous is None else previous + measured
    for (concurrency, k), measured in phases.items():
        name = base_name if k == 0 else config_name(method, policy, k)
        row = phase_row(measured)
        outputs[(name, concurrency)] = [r.text for r in measured.results]
        row.update(config=name, concurrency=concurrency, k=k, proposer=method if k else None, baseline=base_name,
                   rounds=args.rounds, length_policy=policy)  # fmt: skip
        # the server counts positions up to its configured k; this phase drafts at most k
        row["per_position_acceptance"] = row.get("per_position_acceptance", [])[:k]
        if concurrency > 1:  # component models overlap in time: not a per-step overhead any more
            row["step_overhead_ms_concurrent"] = row.pop("step_overhead_ms")
        rows.append(row)
    return rows


def config_name(method: str, policy: str, k: int) -> str:
    return f"{method} k={k}" if policy == "fixed" else f"{method} {policy} k<={k}"


def warm_up(server: TritonServer, prompts, args) -> None:
    """Unmeasured load before the first phase: a full-length request alone, then a burst at the top concurrency.

    The first forwards of each batch shape pay one-off costs (oneDNN primitives, the
    allocator, lazy imports), which would otherwise land on whichever phase runs first:
    the one-stream baseline.
    """
    burst = max(args.concurrency)
    for k in (0, max(args.ks)):
        run_load(server.grpc_url, ORCHESTRATOR, [Job(prompts[0], args.max_tokens, k, args.ignore_eos)], 1)
        jobs = [Job(prompts[i % len(prompts)], min(16, args.max_tokens), k, args.ignore_eos) for i in range(burst)]
        run_load(server.grpc_url, ORCHESTRATOR, jobs, burst)


def wait_idle(server: TritonServer, timeout_s: float = 60.0) -> Samples:
    """Scrape the metrics once no model holds a sequence any more.

    A request's final response goes out before the orchestrator releases its
    sequences, so counters read right after the last response may miss those calls.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        samples = parse_prometheus(server.metrics_text())
        if metric_total(samples, ACTIVE_METRIC) == 0:
            return samples
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server still holds sequences {timeout_s:.0f} s after the last response")
        time.sleep(0.05)


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


def measure_phase(server: TritonServer, jobs: list[Job], concurrency: int, progress: Progress) -> PhaseMeasurement:
    client = InferenceServerClient(server.grpc_url)
    try:
        metrics_before = wait_idle(server)
        stats_before = model_counters(client.get_inference_statistics(as_json=True))
        results, elapsed = run_load(server.grpc_url, ORCHESTRATOR, jobs, concurrency, progress.step)
        metrics = samples_delta(wait_idle(server), metrics_before)
        stats = counters_delta(model_counters(client.get_inference_statistics(as_json=True)), stats_before)
    finally:
        client.close()
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
    verify_calls = metric_total(metrics, STAGE_CALLS_METRIC, stage="verify")
    if verify_calls:  # one call in flight at a time, so one forward per call: the sequences each forward served
        row["target_sequences_per_execution"] = steps / verify_calls
    elif TARGET_MODEL in stats and stats[TARGET_MODEL].execution_count:  # a repository without the counter
        target = stats[TARGET_MODEL]
        row["target_sequences_per_execution"] = target.inference_count / target.execution_count
    acceptance = acceptance_from_metrics(metrics)
    if acceptance is not None:
        row.update(acceptance.as_dict(), acceptance_source="prometheus")
    elif all(r.drafted is not None for r in results):  # totals only: no per-position figures this way
        drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
        row.update(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else math.nan, acceptance_source="request outputs")
    return row


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()  # one progress bar: the benchmark's
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    args.out_dir = args.out_dir or REPO_ROOT / "runs" / f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = server_parameter(args.repository, TARGET_MODEL, "dtype", "auto")

    tokenizer = load_tokenizer(args.target)
    prompts = select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"], args.num_prompts,
                             args.prompt_tokens, args.seed)
    print(f"[bench] {len(prompts)} held-out prompts, {sum(len(p.token_ids) for p in prompts) / len(prompts):.0f} "
          f"tokens on average; target {args.target}, draft {args.draft}, dtype {dtype}, device {device}, "
          f"{torch.get_num_threads()} torch threads")
    target = load_causal_lm(args.target, dtype=dtype, device=device)
    draft = load_causal_lm(args.draft, dtype=dtype, device=device)
    step_times, roofline, step_times_eager, timing_notes = in_process_timings(args, target, draft, dtype, device)
    for line in timing_notes:
        print(f"[bench] {line}")

    num_hf = (1 + (0 if args.synthetic_acceptance_rate is not None else 2 * len(args.ks))) if args.hf else 0
    num_servers = len(args.methods) * len(args.length_policies)
    num_server = args.rounds * num_servers * len(args.concurrency) * (1 + len(args.ks))
    progress = Progress(len(prompts) * (num_hf + num_server))
    rows: list[dict] = []
    outputs: Outputs = {}
    try:
        if args.hf:
            rows += hf_rows(args, prompts, target, draft, tokenizer, outputs, progress)
        del target, draft  # the servers load their own copies
        with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp:
            for method in args.methods:
                for policy in args.length_policies:
                    rows += server_rows(args, method, policy, prompts, Path(tmp), outputs, progress)
    finally:
        progress.close()
    annotate(rows, step_times)
    match_reference(rows, outputs, "hf plain" if args.hf else f"server {args.methods[0]} k=0")
    notes = [
        f"Workload: {len(prompts)} held-out stdlib prompts of >= {args.prompt_tokens} tokens, {args.max_tokens} "
        f"output tokens, greedy, ignore_eos={args.ignore_eos}; {device}, dtype {dtype}, "
        f"{torch.get_num_threads()} torch threads"
        + (f"; server phases run {args.rounds} times in turn, figures pooled" if args.rounds > 1 else ""),
        *timing_notes,
    ]
    notes += args.note
    if args.synthetic_acceptance_rate is not None:
        notes.append(f"Synthetic rejection sampler, acceptance rate {args.synthetic_acceptance_rate}: "
                     "outputs are not the target's")
    write_results(args, command, rows, prompts, {"step_times_ms": step_times, "roofline": roofline,
                                                  "step_times_eager_ms": step_times_eager}, notes)  # fmt: skip


def write_results(args, command: str, rows: list[dict], prompts, timings: dict, notes: list[str]) -> None:
    machine = report.machine_info()
    date = time.strftime("%Y-%m-%d %H:%M %Z")
    result = {"command": command, "date": date, "machine": machine, "notes": notes,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "prompts": [p.source for p in prompts], **timings, "rows": rows}
    (args.out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(report.markdown_table(rows))
    print(f"[bench] {report.plot(rows, args.out_dir / 'throughput.png')}")
    print(f"[bench] results written to {args.out_dir / 'results.json'}")
    if not args.no_docs:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        if not args.docs.exists():
            args.docs.write_text("# Benchmarks\n")
        with args.docs.open("a") as f:
            f.write("\n" + report.markdown_section(rows, machine, command, date, notes))
        print(f"[bench] table appended to {args.docs}")


if __name__ == "__main__":
    main()
