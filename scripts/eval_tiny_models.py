#!/usr/bin/env python3
"""Measure the shipped pair on held-out code: greedy acceptance of the draft, and of n-gram lookup.

Runs the real engine (``specdec.generate.generate``) with greedy sampling over prompts
cut from the held-out files of the training corpus (the split the training script
uses). Every method is lossless, so their greedy outputs must agree; a difference is
reported. ``--eagle3-head`` and ``--mlp-speculator`` add a learned head on the same prompts
(an MLP speculator drafts at most its ``n_predict``: ``--k`` above it is refused).

Each method's propose calls are timed: milliseconds per drafted token is the proposer's
cost as speculation pays it. ``--engine fast --cpu-compile`` times the engine the
shipped server runs; ``--repeats N`` runs the methods N times in turn and reports the
median, so a burst of load elsewhere on the machine falls on every method alike.

    python scripts/eval_tiny_models.py --num-prompts 24 --max-tokens 64 --k 4
    python scripts/eval_tiny_models.py --engine fast --cpu-compile --eagle3-head models/tiny-eagle3 \
        --num-prompts 12 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

from bench.workload import held_out_texts  # noqa: E402
from specdec.engine import GenerationParams  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.build import build_lm  # noqa: E402
from specdec.heads import build_head_proposer  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402
from specdec.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec.proposers.ngram import NgramProposer  # noqa: E402
from specdec.rejection_sampler import RejectionSampler  # noqa: E402
from specdec.types import RequestStats  # noqa: E402
from specdec.verifier import TargetVerifier  # noqa: E402


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of held-out standard-library files, in path order."""
    prompts = []
    for text in held_out_texts().values():
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == num_prompts:
            break
    return prompts


class TimedProposer:
    """The proposer, with the wall time of its propose calls added up."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.seconds = 0.0
        self.calls = 0

    def propose(self, requests):
        started = time.perf_counter()
        try:
            return self.proposer.propose(requests)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def __getattr__(self, name):
        return getattr(self.proposer, name)


def run(method: str, proposer, verifier, sampler, prompts, args, eos_id: int, ban_eos: bool = False) -> dict:
    """Greedy decoding of every prompt with ``proposer`` at ``args.k``; ``ban_eos``: every output runs to
    ``args.max_tokens`` (EOS banned until then, as the benchmarks' requests ban it)."""
    total = RequestStats(accepted_per_position=[0] * args.k)
    outputs, started = [], time.time()
    proposer = TimedProposer(proposer)
    for prompt in prompts:
        params = GenerationParams(max_tokens=args.max_tokens, num_speculative_tokens=args.k, eos_token_ids=(eos_id,),
                                  min_tokens=args.max_tokens if ban_eos else 0)  # fmt: skip
        out, stats = [], None
        for step in generate(proposer, verifier, sampler, prompt, params):
            out.extend(step.new_token_ids)
            stats = step.stats or stats
        outputs.append(out)
        total.num_steps += stats.num_steps
        total.num_draft_tokens += stats.num_draft_tokens
        total.num_accepted_tokens += stats.num_accepted_tokens
        total.accepted_per_position = [a + b for a, b in zip(total.accepted_per_position, stats.accepted_per_position)]
    return {
        "method": method,
        "k": args.k,
        "acceptance_rate": round(total.acceptance_rate, 4),
        "mean_accepted_length": round(total.mean_accepted_length, 3),
        "accepted_per_position": total.accepted_per_position,
        "num_draft_tokens": total.num_draft_tokens,
        "propose_ms_per_call": round(1e3 * proposer.seconds / max(proposer.calls, 1), 3),
        "propose_ms_per_draft_token": round(1e3 * proposer.seconds / max(total.num_draft_tokens, 1), 3),
        "seconds": round(time.time() - started, 1),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    parser.add_argument("--eagle3-head", type=Path, help="an EAGLE-3 head for the target, measured beside the draft")
    parser.add_argument("--mlp-speculator", type=Path, help="an MLP speculator for the target, measured beside the draft")
    parser.add_argument("--engine", choices=("hf", "fast"), default="hf")
    parser.add_argument("--cpu-compile", action="store_true", help="the fast engine's models and the head compiled")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the server runs one per model)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every method, in turn; timings are medians")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.cpu_compile and args.engine != "fast":
        parser.error("--cpu-compile needs --engine fast")
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(args.target)
    target = build_lm(args.target, args.engine, dtype="float32", max_num_seqs=2, cpu_compile=args.cpu_compile)
    draft = build_lm(args.draft, args.engine, dtype="float32", max_num_seqs=2, cpu_compile=args.cpu_compile)
    methods = [("draft_model", DraftModelProposer(draft)), ("ngram", NgramProposer(1, 4))]
    if args.eagle3_head:
        methods.append(("eagle3", build_head_proposer("eagle3", args.eagle3_head, args.target, "float32", "cpu", 2,
                                                      cpu_compile=args.cpu_compile)))  # fmt: skip
    if args.mlp_speculator:
        speculator = build_head_proposer("mlp_speculator", args.mlp_speculator, args.target, "float32", "cpu", 2,
                                         cpu_compile=args.cpu_compile)  # fmt: skip
        if args.k > speculator.model.n_predict:
            parser.error(f"--k {args.k} exceeds the MLP speculator's n_predict={speculator.model.n_predict}")
        methods.append(("mlp_speculator", speculator))
    prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    verifier = TargetVerifier(target)
    sampler = RejectionSampler("strict")
    runs: dict[str, list[dict]] = {method: [] for method, _ in methods}
    for repeat in range(args.repeats):
        for method, proposer in methods:
            print(f"[eval] {method}: {len(prompts)} prompts x {args.max_tokens} tokens, k={args.k} "
                  f"(run {repeat + 1} of {args.repeats})", flush=True)  # fmt: skip
            result = run(method, proposer, verifier, sampler, prompts, args, tokenizer.eos_token_id)
            runs[method].append(result)
            print(f"[eval] {method}: acceptance {result['acceptance_rate']}, mean accepted length "
                  f"{result['mean_accepted_length']}, {result['propose_ms_per_draft_token']} ms per drafted token "
                  f"({result['seconds']} s)", flush=True)  # fmt: skip
    reference = runs["draft_model"][0]["outputs"]
    for method, results in runs.items():
        if any(r["outputs"] != reference for r in results):
            print(f"[eval] note: {method} and draft_model outputs differ (a numerical tie?)", file=sys.stderr)
    results = []
    for method, method_runs in runs.items():
        result = {key: value for key, value in method_runs[0].items() if key != "outputs"}
        for key in ("propose_ms_per_call", "propose_ms_per_draft_token", "seconds"):
            result[key] = round(statistics.median(r[key] for r in method_runs), 3)
        results.append(result)
    summary = {"num_prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "engine": args.engine, "cpu_compile": args.cpu_compile, "threads": args.threads,
               "repeats": args.repeats, "torch": torch.__version__, "results": results}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
