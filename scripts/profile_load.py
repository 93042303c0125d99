#!/usr/bin/env python3
"""Where the CPU goes while the server decodes concurrent streams (Linux).

Starts ``scripts/serve.sh`` on a copy of the model repository with the chosen proposer
method, warms it up, sends the held-out prompts at the given concurrency and prints:
aggregate tokens/s, how busy the machine's cores were, CPU seconds per process
(``tritonserver`` and each model's Python stub), and sequences per target forward
(``spec_decode_num_steps`` / verify calls) and each stage's calls, batch and latency
(``spec_decode_stage_*``), the latency split into the time queued and executing in the
stage's model (Triton's statistics, plus the calls the model answered on its socket,
which it counts itself; releases included) and the rest: the round trip (a BLS request
or a socket call) and the orchestrator's turnaround.

    python scripts/profile_load.py --concurrency 8 --k 4
    python scripts/profile_load.py --concurrency 1 --k 0 --method ngram
    python scripts/profile_load.py --param speculative_decoding.num_speculative_tokens_per_batch_size=1:2

The server's log goes to a temporary directory, or to ``$SPECDEC_PROFILE_LOG`` when set
(to read what the server logged during the load afterwards).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.client import Job, run_load
from bench.cpu import CpuSnapshot, process_tree
from bench.repository import make_variant, parameter_edits
from bench.server import TritonServer
from bench.stats import (
    StageTimes,
    counters_delta,
    metric_total,
    model_counters,
    parse_prometheus,
    samples_delta,
    with_socket_calls,
)
from bench.workload import held_out_texts, select_prompts
from specdec.tokenizer import load_tokenizer
from specdec.proposers import PROPOSERS
from specdec_triton import wire
from specdec_triton.metrics import STAGES

REPO_ROOT = Path(__file__).resolve().parent.parent
ORCHESTRATOR = "speculative_decoding"
STAGE_MODELS = {"propose": wire.DRAFT_PROPOSER, "verify": wire.TARGET_VERIFIER, "sample": wire.REJECTION_SAMPLER,
                "propose_verify": wire.TARGET_VERIFIER}  # a drafter beside the target answers in target_verifier


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    p.add_argument("--method", default="draft_model", choices=sorted(PROPOSERS))
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every request")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every model process")
    p.add_argument("--param", action="append", default=[], metavar="MODEL.KEY=VALUE",
                   help="set a config.pbtxt parameter of the served copy (repeatable), "
                        "e.g. speculative_decoding.num_speculative_tokens_per_batch_size=1:2")  # fmt: skip
    args = p.parse_args()
    try:
        args.edits = parameter_edits(args.param)
    except ValueError as err:
        p.error(str(err))
    if min(args.k + 1, args.concurrency, args.num_prompts, args.max_tokens, args.threads) < 1:
        p.error("--k must be >= 0 and --concurrency, --num-prompts, --max-tokens, --threads >= 1")
    return args


SHIPPED_HEADS = {"eagle3": REPO_ROOT / "models" / "tiny-eagle3", "mlp_speculator": REPO_ROOT / "models" / "tiny-mlp-speculator"}


def main() -> None:
    if not Path("/proc/stat").exists():
        sys.exit("profile_load.py reads /proc: it runs on Linux only")
    args = parse_args()
    tokenizer = load_tokenizer(REPO_ROOT / "models" / "tiny-target")
    prompts = select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"], args.num_prompts,
                             args.prompt_tokens, seed=0)  # fmt: skip
    jobs = [Job(p, args.max_tokens, args.k, ignore_eos=True) for p in prompts]
    with tempfile.TemporaryDirectory() as workdir:
        proposer = {"method": args.method}
        if args.method in SHIPPED_HEADS:  # a head's method needs a head to load, not the repository's draft model
            proposer["draft_model"] = str(SHIPPED_HEADS[args.method])
        edits = {**args.edits, "draft_proposer": {**proposer, **args.edits.get("draft_proposer", {})}}
        repository = make_variant(args.repository, Path(workdir) / "repo", edits)
        log = Path(os.environ.get("SPECDEC_PROFILE_LOG", Path(workdir) / "server.log"))
        env = {"OMP_NUM_THREADS": str(args.threads)}
        print(f"[profile] starting tritonserver ({args.method}) ...", flush=True)
        with TritonServer(REPO_ROOT / "scripts" / "serve.sh", repository, log, env) as server:
            print(f"[profile] warming up; then {len(jobs)} requests at concurrency {args.concurrency}, k = {args.k}",
                  flush=True)  # fmt: skip
            run_load(server.grpc_url, ORCHESTRATOR, jobs[: args.concurrency], args.concurrency)
            labels = process_tree(server.pid)
            metrics_before, cpu_before = parse_prometheus(server.metrics_text()), CpuSnapshot.take(labels)
            models_before = model_counters(server.statistics())
            start, client_start = time.monotonic(), time.process_time()
            results, _ = run_load(server.grpc_url, ORCHESTRATOR, jobs, args.concurrency)
            wall, client_cpu = time.monotonic() - start, time.process_time() - client_start
            cpu_after = CpuSnapshot.take(labels)
            time.sleep(0.2)  # the last releases and counter updates land after the last response
            metrics = samples_delta(parse_prometheus(server.metrics_text()), metrics_before)
            models = with_socket_calls(counters_delta(model_counters(server.statistics()), models_before), metrics)
    tokens = sum(sum(r.timing.tokens) for r in results)
    per_process, busy = cpu_before.until(cpu_after)
    steps = metric_total(metrics, "spec_decode_num_steps")
    calls = metric_total(metrics, "spec_decode_stage_calls", stage="verify")
    print(f"{tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s; "
          f"machine {100 * busy:.0f}% busy over its {os.cpu_count()} cores")  # fmt: skip
    if calls:
        print(f"sequences per target forward: {steps / calls:.2f} ({steps:.0f} steps in {calls:.0f} verifier calls)")
    for stage in STAGES:  # as the orchestrator waited on them, and the share of that spent in the model
        times = StageTimes.of(metrics, stage, models.get(STAGE_MODELS[stage]))
        if times is not None:
            print(f"stage {stage:11s} {times.calls:6.0f} calls, {times.sequences / times.calls:5.2f} sequences and "
                  f"{times.ms_per_call:6.2f} ms per call (queued {times.queue_ms_per_call:5.2f}, executing "
                  f"{times.execute_ms_per_call:5.2f}, round trip {times.round_trip_ms_per_call:5.2f}), "
                  f"busy {100 * times.wait_s / wall:3.0f}% of wall")
    print(f"{'process':24s} {'CPU s':>7s} {'% of wall':>9s}")
    for label, seconds in sorted(per_process.items(), key=lambda item: -item[1]):
        print(f"{label:24s} {seconds:7.2f} {100 * seconds / wall:8.1f}%")
    print(f"{'server total':24s} {sum(per_process.values()):7.2f} {100 * sum(per_process.values()) / wall:8.1f}%")
    print(f"{'client (this process)':24s} {client_cpu:7.2f} {100 * client_cpu / wall:8.1f}%")


if __name__ == "__main__":
    main()
