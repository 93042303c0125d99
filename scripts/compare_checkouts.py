#!/usr/bin/env python3
"""Compare the served speed of two checkouts of this project in one run, their phases interleaved.

Each checkout (a git worktree with its own venv, e.g. ``git worktree add ../old <commit>``
and ``python -m venv ../old/.venv && ../old/.venv/bin/pip install -e ../old``) serves its
own ``model_repository`` with its own ``scripts/serve.sh``; both servers run at once
and idle while the other is measured. Every round measures every checkout at every
``num_speculative_tokens`` and concurrency in turn, so drift over the run falls on both;
the figure per configuration is the median over rounds. Writes one JSON and prints a
table of tokens/s and ITL p50, and each checkout's ratio to the first.

    python scripts/compare_checkouts.py ../old . --ks 0,4 --concurrency 1,8 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.client import Job
from bench.phase import measure_phase, warm_up
from bench.report import git_commit, machine_info
from bench.server import TritonServer
from bench.workload import held_out_texts, select_prompts
from specdec.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+", type=Path, help="checkout directories; the first is the baseline")
    parser.add_argument("--ks", default="0,4", help="num_speculative_tokens per request; 'default': none sent")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="above 0: sampled requests, each seeded from its prompt; 0: greedy")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ks = [None if k == "default" else int(k) for k in args.ks.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    tokenizer = load_tokenizer(ROOT / "models" / "tiny-target")
    prompts = select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"], args.num_prompts,
                             args.prompt_tokens, args.seed)  # fmt: skip
    log_dir = ROOT / "runs" / time.strftime("compare-%Y%m%dT%H%M%SZ", time.gmtime())
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for i, checkout in enumerate(args.checkouts):
        checkout = checkout.resolve()
        env = {"VENV": str(checkout / ".venv"), "OMP_NUM_THREADS": "1"}
        servers.append(TritonServer(checkout / "scripts" / "serve.sh", checkout / "model_repository",
                                    log_dir / f"server-{i}.log", env, cwd=checkout))  # fmt: skip
    figures: dict[tuple[int, str, int], list[dict]] = {}
    try:
        for server in servers:
            server.start()
            warm_up(server, [Job(prompts[0], args.max_tokens, k, True, args.temperature) for k in ks],
                    burst=max(concurrencies))  # fmt: skip
        for round_ in range(args.rounds):
            for concurrency in concurrencies:
                for k in ks:
                    for i, server in enumerate(servers):
                        jobs = [Job(p, args.max_tokens, k, True, args.temperature) for p in prompts]
                        measured = measure_phase(server, jobs, concurrency)
                        itl = statistics.median(t for r in measured.results for t in r.timing.inter_token_latencies())
                        figures.setdefault((i, str(k), concurrency), []).append(
                            {"tokens_per_s": measured.tokens_per_s, "itl_ms_p50": 1e3 * itl})
                        print(f"round {round_ + 1} checkout {i} k={k} c={concurrency}: "
                              f"{measured.tokens_per_s:.1f} tok/s, ITL p50 {1e3 * itl:.2f} ms", flush=True)
    finally:
        for server in servers:
            server.stop()
    rows = []
    for (i, k, concurrency), runs in sorted(figures.items(), key=lambda item: (item[0][2], item[0][1], item[0][0])):
        base = figures[(0, k, concurrency)]
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs, base)]
        rows.append({"checkout": str(args.checkouts[i]), "commit": git_commit(args.checkouts[i])[0], "k": k,
                     "concurrency": concurrency, "rounds": runs,
                     "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
                     "itl_ms_p50_median": statistics.median(r["itl_ms_p50"] for r in runs),
                     "x_first_median": statistics.median(ratios)})  # fmt: skip
    print("\n| checkout | k | concurrency | tokens/s | ITL p50 ms | x first (median of rounds) |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['commit']} | {row['k']} | {row['concurrency']} | {row['tokens_per_s_median']:.1f} | "
              f"{row['itl_ms_p50_median']:.2f} | {row['x_first_median']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / time.strftime("compare-%Y%m%dT%H%M%SZ.json", time.gmtime())
    document = {"command": " ".join(sys.argv), "machine": machine_info(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "workload": {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                             "temperature": args.temperature},
                "rows": rows}  # fmt: skip
    path.write_text(json.dumps(document, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
