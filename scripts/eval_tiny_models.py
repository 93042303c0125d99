#!/usr/bin/env python3
"""Measure the shipped pair on held-out code: greedy acceptance of the draft, and of n-gram lookup.

Runs the real engine (``specdec.engine.generate``) with greedy sampling over prompts
cut from the held-out files of the training corpus (the split the training script
uses). Both methods are lossless, so their greedy outputs must agree; a difference is
reported.

    python scripts/eval_tiny_models.py --num-prompts 24 --max-tokens 64 --k 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

from bench.workload import held_out_texts  # noqa: E402
from specdec.engine import GenerationParams, generate  # noqa: E402
from specdec.build import build_lm  # noqa: E402
from specdec.models import load_tokenizer  # noqa: E402
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


def run(method: str, proposer, verifier, sampler, prompts, args, eos_id: int) -> dict:
    total = RequestStats(accepted_per_position=[0] * args.k)
    outputs, started = [], time.time()
    for prompt in prompts:
        params = GenerationParams(max_tokens=args.max_tokens, num_speculative_tokens=args.k, eos_token_ids=(eos_id,))
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
        "seconds": round(time.time() - started, 1),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.target)
    target = build_lm(args.target, "hf", dtype="float32")
    draft = build_lm(args.draft, "hf", dtype="float32")
    prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    verifier = TargetVerifier(target)
    sampler = RejectionSampler("strict")
    results = []
    for method, proposer in (("draft_model", DraftModelProposer(draft)), ("ngram", NgramProposer(1, 4))):
        print(f"[eval] {method}: {len(prompts)} prompts x {args.max_tokens} tokens, k={args.k}", flush=True)
        results.append(run(method, proposer, verifier, sampler, prompts, args, tokenizer.eos_token_id))
        print(f"[eval] {method}: acceptance {results[-1]['acceptance_rate']}, "
              f"mean accepted length {results[-1]['mean_accepted_length']} ({results[-1]['seconds']} s)", flush=True)
    if results[0]["outputs"] != results[1]["outputs"]:
        print("[eval] note: draft_model and ngram outputs differ (a numerical tie?)", file=sys.stderr)
    for result in results:
        result.pop("outputs")
    summary = {"num_prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "torch": torch.__version__, "results": results}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
