#!/usr/bin/env python3
"""Benchmark proposers on workloads that repeat themselves: n-gram, suffix decoding, a draft model, a head.

One server per method (a copy of the model repository, k fixed for every batch size and step),
all up at once, plus k = 0 requests on the n-gram server (n-gram lookup learns
nothing across requests, so its baseline is not disturbed by earlier phases). For each
repetition, on fresh prompts, in an order rotated per repetition:

* ``repeat``: round 1 sends the held-out prompts, round 2 sends them again;
* ``templated``: prompts that repeat one code template (``bench/repeat.py``).

A method written ``METHOD+beside`` is served with ``run_with_target`` (the draft in
target_verifier's process, one call a step).

Figures per (workload, round, method): tokens/s (median, min, max over repetitions),
the median of per-repetition ratios against k = 0 on the same prompts, tokens per
verify step, acceptance, ITL, and whether every output equals k = 0's (greedy).
Writes the run as JSON to ``--out-dir`` (``repeat-<UTC date-time>-<commit>.json``) and
prints the table; it edits no docs.

    python scripts/benchmark_repeat.py --num-prompts 8 --max-tokens 64 --repetitions 3
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import report
from bench.client import Job
from bench.phase import ORCHESTRATOR, Progress, measure_phase, phase_row, warm_up
from bench.repeat import COLUMNS, RepeatPhase, summary_rows, templated_prompts
from bench.repository import checkpoint_edits, variant_edits, make_variant, method_of
from bench.server import SERVE_SCRIPT, TritonServer
from bench.workload import held_out_texts, select_prompts
from specdec.heads import HEAD_METHODS
from specdec.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE_METHOD = "ngram"  # k = 0 requests run on its server: it keeps nothing between requests


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    p.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    p.add_argument("--head", type=Path, default=REPO_ROOT / "models" / "tiny-eagle3",
                   help="the head's directory for methods eagle3 / mlp_speculator")
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    p.add_argument("--ks", default="ngram:8,suffix:8,draft_model:4",
                   help="method:k pairs (METHOD+beside: the draft beside the target; METHOD+suffix: suffix decoding "
                        "in front of a model method); each one gets a server")
    p.add_argument("--model-k", type=int, default=0,
                   help="METHOD+suffix servers: model_num_speculative_tokens, the model's drafts (0: its k)")
    p.add_argument("--suffix-min-score", type=float, default=None,
                   help="METHOD+suffix servers: suffix_decoding_min_score (default: the model's, 2.0)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per workload and repetition")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--repetitions", type=int, default=3, help="interleaved, each on fresh prompts")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = p.parse_args()
    try:
        args.ks = {m.strip(): int(k) for m, k in (pair.split(":") for pair in args.ks.split(",") if pair.strip())}
    except ValueError:
        p.error(f"--ks must be method:k pairs, got {args.ks!r}")
    if BASELINE_METHOD not in args.ks:
        p.error(f"--ks must include {BASELINE_METHOD} (its server runs the k = 0 baseline)")
    if min(args.repetitions, args.num_prompts, args.concurrency, *args.ks.values()) < 1:
        p.error("--repetitions, --num-prompts, --concurrency and every k must be >= 1")
    return args


def server_repository(args, name: str, k: int, workdir: Path) -> Path:
    method = method_of(name)
    edits = variant_edits(name, checkpoint_edits(args.target, method, args.head if method in HEAD_METHODS else args.draft),
                          args.model_k, args.suffix_min_score)  # fmt: skip
    edits[ORCHESTRATOR] = {"num_speculative_tokens": str(k), "num_speculative_tokens_per_batch_size": "",
                           "speculative_disable_by_batch_size": "0",
                           "speculation_follows_acceptance": "false"}  # fmt: skip
    return make_variant(args.repository, workdir / f"repo-{name}", edits)


def workloads(args, tokenizer, texts, repetition: int) -> list[tuple[str, int, list]]:
    """(workload, round, prompts) in the order they run; the repeat rounds share their prompts."""
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    held_out = select_prompts(texts, encode, args.num_prompts, args.prompt_tokens, seed=1000 + repetition)
    return [("repeat", 1, held_out), ("repeat", 2, held_out),
            ("templated", 1, templated_prompts(args.num_prompts, encode, seed=repetition))]  # fmt: skip


def main() -> None:
    args = parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    commit, dirty = report.git_commit(REPO_ROOT)
    out_path = report.result_path(args.out_dir, commit)
    out_path = out_path.with_name("repeat-" + out_path.name)
    log_dir = REPO_ROOT / "runs" / out_path.stem
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, texts = load_tokenizer(args.target), held_out_texts()
    methods = list(args.ks)
    num_configs = len(methods) + 1
    per_repetition = sum(len(p) for _, _, p in workloads(args, tokenizer, texts, 0)) * num_configs
    progress = Progress(args.repetitions * per_repetition)
    phases: list[RepeatPhase] = []
    with tempfile.TemporaryDirectory(prefix="specdec-repeat-") as tmp, ExitStack() as stack:
        servers = {}
        for method in methods:
            repository = server_repository(args, method, args.ks[method], Path(tmp))
            servers[method] = stack.enter_context(
                TritonServer(SERVE_SCRIPT, repository, log_dir / f"server-{method}.log", {"OMP_NUM_THREADS": "1"}))
            progress.write(f"{method}: tritonserver ready on {servers[method].grpc_url}")
        # warm every server on text no workload uses (warm-up requests complete: they teach suffix nothing useful)
        warm = templated_prompts(1, lambda t: tokenizer(t)["input_ids"], seed=-1)[0]
        for method, server in servers.items():
            warm_up(server, [Job(warm, args.max_tokens, k, True) for k in (0, args.ks[method])], burst=args.concurrency)
        configs = [(m, m, args.ks[m]) for m in methods]
        for repetition in range(args.repetitions):
            shift = repetition % len(configs)  # k=0 first (its outputs are the reference), then the rest rotated
            order = [("k=0", BASELINE_METHOD, 0), *configs[shift:], *configs[:shift]]
            baseline_texts = {}
            for workload, round_, prompts in workloads(args, tokenizer, texts, repetition):
                for config, method, k in order:
                    progress.phase(f"rep {repetition + 1} {workload} r{round_} {config}")
                    jobs = [Job(p, args.max_tokens, k, True) for p in prompts]
                    measured = measure_phase(servers[method], jobs, args.concurrency, progress.step)
                    row = phase_row(measured)
                    texts_out = [r.text for r in measured.results]
                    if config == "k=0":
                        baseline_texts[(workload, round_)] = texts_out
                    elif (workload, round_) in baseline_texts:
                        row["outputs_equal_k0"] = texts_out == baseline_texts[(workload, round_)]
                    phases.append(RepeatPhase(workload, round_, repetition, config, k, row))
    progress.close()
    rows = summary_rows(phases)
    result = report.result_document(
        rows, command=command, args=vars(args), commit=commit, dirty=dirty,
        phases=[{**p.row, "workload": p.workload, "round": p.round, "repetition": p.repetition, "config": p.config,
                 "k": p.k} for p in phases],
        notes=["k = 0 runs on the ngram server; every server fixes k for all batch sizes",
               "templated prompts: bench/repeat.py; repeat prompts: held-out stdlib slices, fresh per repetition"],
    )  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\n{report.machine_line(result)}\n\n{report.markdown_table(rows, COLUMNS)}\n")
    print(f"[bench] results written to {out_path}")


if __name__ == "__main__":
    main()
