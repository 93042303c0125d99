#!/usr/bin/env python3
"""Write a copy of a draft checkpoint whose drafts almost never pass: its embedding rows permuted.

A speculation length that follows acceptance has to be shown on a draft that fails. Random
prompts are not one (a trained draft still predicts the target's continuations of them),
and a smaller or random draft costs less than the real one, which flatters it. A copy of
the shipped draft with the rows of its (tied) token embedding shuffled costs exactly what
the draft costs, runs the same shapes, and proposes ``perm^-1(f(perm(x)))`` -- tokens that
match the target's about as often as chance does. Output stays lossless: it is a draft.

    python scripts/make_permuted_draft.py --out /tmp/tiny-draft-permuted
    python scripts/benchmark_engine.py --draft /tmp/tiny-draft-permuted \\
        --configs k0,draft_model:4,draft_model+follow:4 --concurrency 1 --no-hf
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDING = "model.embed_tokens.weight"


def permuted_copy(source: Path, out: Path, seed: int) -> None:
    """``source``'s files in ``out``, the embedding's rows (and an untied LM head's, the same way) permuted."""
    if out.resolve() == source.resolve():
        raise SystemExit(f"--out must differ from the source checkpoint {source}")
    weights = load_file(source / "model.safetensors")
    if EMBEDDING not in weights:
        raise SystemExit(f"{source}: no {EMBEDDING} in model.safetensors; a Llama-family draft is expected")
    vocab = weights[EMBEDDING].shape[0]  # [V, H]
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))  # [V]
    weights[EMBEDDING] = weights[EMBEDDING][order].contiguous()
    if "lm_head.weight" in weights:  # untied: the same permutation, so the draft's predictions stay shuffled alike
        weights["lm_head.weight"] = weights["lm_head.weight"][order].contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy2(item, out / item.name)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    permuted_copy(args.draft, args.out, args.seed)
    print(f"wrote {args.out}: {args.draft} with its embedding rows permuted (seed {args.seed})")


if __name__ == "__main__":
    main()
