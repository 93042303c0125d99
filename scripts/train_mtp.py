#!/usr/bin/env python3
"""Train one multi-token-prediction (MTP) layer for a frozen target and write it INTO the target.

DeepSeek-V3 (DeepSeek-AI 2024, section 2.2) trains its MTP module with the model; here the
target is frozen and the layer learns, by self-distillation as ``train_draft_head.py``'s heads
do, the target's distribution of token ``t + 2`` from the target's final hidden state at ``t``
and token ``t + 1`` (``specdec.heads.mtp``). ``--ttt-steps`` > 1 also trains the layer fed its
own output for later positions (``specdec.heads.mtp.train_forward``), weighted ``0.8 ** step``:
drafting k tokens chains the one layer k times. The block starts from the target's last
decoder layer, ``shared_head.norm`` from its final norm, ``eh_proj`` passing the normed hidden
state alone; the embedding and LM head are the target's, frozen, and are not written
(the loader shares them, as vLLM does).

Then the layer's tensors are added to the target's ``model.safetensors`` (every existing
tensor unchanged) with ``num_nextn_predict_layers: 1`` in its ``config.json``, the held-out
per-position top-1 agreement with the target is measured, the engine's tokens per step at
``--k`` beside ``--baseline-draft`` (``train_draft_head.evaluate``), and the run is recorded
under ``"mtp"`` in ``--report`` (``models/training_report.json``), the other entries kept.

    python scripts/train_mtp.py --target models/tiny-target
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from train_draft_head import STEP_DECAY, evaluate, soft_ce, target_outputs, train, training_windows  # noqa: E402
from train_tiny_models import corpus_files, encode_stream, read_texts  # noqa: E402

from specdec.fast.checkpoint import read_config  # noqa: E402
from specdec.heads.mtp import MTPConfig, MTPHead, train_forward, write_into_target  # noqa: E402
from specdec.models import load_causal_lm  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402


def build_mtp(target, arch) -> MTPHead:
    """The layer, warm-started from the target (module docstring); embedding and LM head frozen."""
    head = MTPHead(MTPConfig(replace(arch, num_layers=1), arch.num_layers, 1))
    layer = head.layers[0]
    last = target.model.layers[-1]
    h = arch.hidden_size
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
        attn = last.self_attn
        layer.self_attn.qkv_proj.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        layer.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
        layer.mlp.gate_up_proj.weight.copy_(torch.cat([last.mlp.gate_proj.weight, last.mlp.up_proj.weight]))
        layer.mlp.down_proj.weight.copy_(last.mlp.down_proj.weight)
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        layer.shared_head.norm.weight.copy_(target.model.norm.weight)
        layer.eh_proj.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], 1))  # [h, 2h]: h alone at first
    head.embed_tokens.weight.requires_grad_(False)
    head.lm_head.weight.requires_grad_(False)
    return head


def mtp_loss(head: MTPHead, window, features, target_logp, ttt_steps: int) -> torch.Tensor:
    """Row t reads token x_{t+1} and the target's final state at t; scored on the target's distribution at t + 1."""
    steps = train_forward(head, window[:, 1:], features[:, :-1].float(), ttt_steps)
    rows = torch.arange(window.shape[1] - 1)[None, :]  # [1, T-1]
    labels = target_logp[:, 1:].float()  # [B, T-1, vocab]
    total = sum(STEP_DECAY**j * soft_ce(logits, labels, rows >= j) for j, logits in enumerate(steps))
    return total / sum(STEP_DECAY**j for j in range(ttt_steps))


@torch.no_grad()
def held_out_agreement(head: MTPHead, pool, positions: int, batch_size: int) -> list[float]:
    """Per draft position j + 1 (the layer chained j times), the share of rows whose argmax is the target's."""
    hits, counts = [0] * positions, [0] * positions
    for window, features, target_logp in zip(*(t.split(batch_size) for t in pool)):
        steps = train_forward(head, window[:, 1:], features[:, :-1].float(), positions)
        wanted = target_logp[:, 1:].argmax(-1)  # [B, T-1]: the target's greedy token t + 2
        for j, logits in enumerate(steps):
            hits[j] += int((logits[:, j:].argmax(-1) == wanted[:, j:]).sum())
            counts[j] += wanted[:, j:].numel()
    return [round(h / c, 4) for h, c in zip(hits, counts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "models" / "training_report.json",
                        help="the JSON the run is recorded in, under 'mtp' (other entries kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--windows", type=int, default=768, help="training windows; the target runs once over each")
    parser.add_argument("--held-out-windows", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--corpus-chars", type=int, default=4_000_000)
    parser.add_argument("--ttt-steps", type=int, default=2, help="chained passes trained (1: DeepSeek-V3's objective)")
    parser.add_argument("--agreement-positions", type=int, default=4, help="draft positions measured held out")
    parser.add_argument("--k", type=int, default=2, help="the engine evaluation's drafts per step")
    parser.add_argument("--eval-prompts", type=int, default=24, help="as benchmark_engine.py's --num-prompts")
    parser.add_argument("--eval-seed", type=int, default=0, help="as benchmark_engine.py's --seed")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="as benchmark_engine.py's")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--baseline-draft", default=str(REPO_ROOT / "models" / "tiny-draft"), help="empty: none")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if args.ttt_steps < 1:
        parser.error(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    # what train_draft_head's helpers read: written text only, the engine evaluation of the target's own layer
    args = argparse.Namespace(**vars(args), method="mtp", out=args.target, generated_share=0.0,
                              generated_prompt_tokens=32, eval_tree=None)  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()

    tokenizer = load_tokenizer(args.target)
    arch = read_config(args.target)
    target = load_causal_lm(args.target, dtype="float32").requires_grad_(False)
    train_files, held_files = corpus_files()
    data = encode_stream(tokenizer, read_texts(train_files, args.corpus_chars))
    print(f"[train] {len(data)} training tokens", flush=True)
    head = build_mtp(target, arch)
    pool = target_outputs(target, training_windows(target, data, args), args, (arch.num_layers,), None)
    held = encode_stream(tokenizer, read_texts(held_files, args.corpus_chars // 10))
    held_args = argparse.Namespace(**{**vars(args), "windows": args.held_out_windows, "seed": args.seed + 100})
    held_pool = target_outputs(target, training_windows(target, held, held_args), args, (arch.num_layers,), None)
    before = held_out_agreement(head, held_pool, args.agreement_positions, args.batch_size)
    print(f"[eval] held-out top-1 agreement per position before training: {before}", flush=True)
    losses = train(args, head, lambda *batch: mtp_loss(head, *batch, args.ttt_steps), pool)
    agreement = held_out_agreement(head, held_pool, args.agreement_positions, args.batch_size)
    print(f"[eval] held-out top-1 agreement per position: {agreement}", flush=True)
    train_seconds = time.time() - started
    added = write_into_target(head, args.target)
    results = evaluate(args, tokenizer)
    report = json.loads(args.report.read_text()) if args.report.exists() else {}
    report["mtp"] = {
        "command": " ".join(sys.argv),
        "seed": args.seed,
        "written": f"{len(added)} tensors of model.layers.{arch.num_layers}.* into {args.target.name}/model.safetensors "
        f"in its dtype, num_nextn_predict_layers: 1 in its config.json; embedding and LM head shared with the target",
        "ttt_steps": args.ttt_steps,
        "train_windows": args.windows,
        "train_tokens_seen": args.steps * args.batch_size * (args.seq_len + 2),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "held_out_windows": args.held_out_windows,
        "held_out_top1_agreement_per_position": agreement,
        "held_out_top1_agreement_before_training": before,
        "train_seconds": round(train_seconds),
        "eval": {"prompts": "benchmark_engine.py's held-out slices, EOS banned", "num_prompts": args.eval_prompts,
                 "seed": args.eval_seed, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "results": results},  # fmt: skip
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["mtp"], indent=2))


if __name__ == "__main__":
    main()
