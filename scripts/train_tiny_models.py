#!/usr/bin/env python3
"""Train the shipped tiny target/draft pair on the Python standard library's source.

The corpus is on every machine that runs Python: the ``.py`` files of the running
interpreter's standard library (site-packages excluded). Files are split into
train and held-out sets by a hash of their relative path, so the split does not
depend on file order or on which extra files a machine has.

Steps (seeded, CPU-friendly, ~20-30 minutes on 2 cores with the defaults):

1. a byte-level BPE tokenizer (any UTF-8 input encodes; ``<|endoftext|>`` is EOS);
2. the target: a Llama of ~6 M parameters, trained with next-token cross-entropy;
3. the draft (alone with ``--draft-only``, reusing the target in ``--out``): a Llama of ~1 M parameters (< 1/5 of the target), distilled from the
   target's logits (KL to the target's distribution plus a little cross-entropy),
   which raises the rate at which the target accepts its proposals.

Both are written in standard Hugging Face format (bf16 safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) and a ``training_report.json`` with
held-out losses and timings.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.workload import is_held_out  # the one definition of the held-out split

EOS = "<|endoftext|>"
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int


TARGET_SHAPE = Shape(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=704)
DRAFT_SHAPE = Shape(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=352)


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """Standard-library .py files, split ~95/5 into train/held-out by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        (held_out if is_held_out(rel) else train).append(path)
    return train, held_out


def read_texts(paths: list[Path], max_chars: int) -> list[str]:
    texts, total = [], 0
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, bos_token=None)


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    for batch_start in range(0, len(texts), 256):
        for row in tokenizer(texts[batch_start : batch_start + 256])["input_ids"]:
            ids.extend(row)
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def make_model(shape: Shape, vocab_size: int, eos_id: int, max_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,  # halves the parameters spent on a 4k vocabulary
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(config)


def batches(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])  # [B, T + 1]
        yield window[:, :-1], window[:, 1:]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, data: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    model.eval()
    losses = []
    for start in range(0, min(len(data) - seq_len - 1, max_windows * seq_len), seq_len):
        window = data[start : start + seq_len + 1].unsqueeze(0)
        logits = model(window[:, :-1]).logits
        losses.append(F.cross_entropy(logits[0], window[0, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def greedy_agreement(draft: LlamaForCausalLM, target: LlamaForCausalLM, data: torch.Tensor, seq_len: int) -> float:
    """Teacher-forced top-1 agreement of draft and target on held-out text (a quick proxy)."""
    draft.eval()
    agree = total = 0
    for start in range(0, min(len(data) - seq_len, 32 * seq_len), seq_len):
        window = data[start : start + seq_len].unsqueeze(0)
        same = draft(window).logits.argmax(-1) == target(window).logits.argmax(-1)
        agree += same.sum().item()
        total += same.numel()
    draft.train()
    return agree / total


def train(
    model: LlamaForCausalLM,
    data: torch.Tensor,
    args: argparse.Namespace,
    steps: int,
    name: str,
    teacher: LlamaForCausalLM | None = None,
) -> None:
    gen = torch.Generator().manual_seed(args.seed + (1 if teacher is not None else 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    started = time.time()
    for step, (inputs, labels) in zip(range(steps), batches(data, args.batch_size, args.seq_len, gen)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup=min(100, steps // 10))
        logits = model(inputs).logits  # [B, T, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                teacher_logp = teacher(inputs).logits.log_softmax(-1)  # [B, T, vocab]
            kl = F.kl_div(logits.log_softmax(-1), teacher_logp, log_target=True, reduction="batchmean")
            loss = 0.8 * kl / inputs.shape[1] + 0.2 * ce
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.time() - started
            eta = elapsed / (step + 1) * (steps - step - 1)
            log(f"{name} step {step + 1}/{steps} ce {ce.item():.3f} loss {loss.item():.3f} "
                f"({elapsed:.0f}s elapsed, ~{eta:.0f}s left)")


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, max_len: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(out)
    GenerationConfig(
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        max_new_tokens=128,
    ).save_pretrained(out)
    model.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--target-steps", type=int, default=800)
    parser.add_argument("--draft-steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--corpus-chars", type=int, default=16_000_000, help="train text to use (characters)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--draft-only", action="store_true",
                        help="keep the target (and tokenizer) already in --out; train only the draft")
    args = parser.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()

    train_paths, held_out_paths = corpus_files()
    rng = random.Random(args.seed)
    rng.shuffle(train_paths)
    train_texts = read_texts(train_paths, args.corpus_chars)
    held_out_texts = read_texts(held_out_paths, 2_000_000)
    log(f"corpus: {len(train_texts)} train files, {len(held_out_texts)} held-out files")

    if args.draft_only:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out / "tiny-target")
    else:
        tokenizer = train_tokenizer(train_texts[: max(1, len(train_texts) // 2)], args.vocab_size)
    train_ids = encode_stream(tokenizer, train_texts)
    held_out_ids = encode_stream(tokenizer, held_out_texts)
    log(f"tokenizer: vocab {len(tokenizer)}; {len(train_ids):,} train tokens, {len(held_out_ids):,} held-out")

    vocab = len(tokenizer)
    previous = json.loads((args.out / "training_report.json").read_text()) if args.draft_only else {}
    if args.draft_only:
        target = LlamaForCausalLM.from_pretrained(args.out / "tiny-target", dtype=torch.float32)
        target_seconds = previous["target"]["train_seconds"]
    else:
        target = make_model(TARGET_SHAPE, vocab, tokenizer.eos_token_id, args.max_model_len)
        t0 = time.time()
        train(target, train_ids, args, args.target_steps, "target")
        target_seconds = time.time() - t0
        target.to(torch.bfloat16).float()  # distil from, and report on, the weights that ship (bf16)
    target.eval()
    target_loss = held_out_loss(target, held_out_ids, args.seq_len)
    log(f"target held-out loss {target_loss:.3f}")

    torch.manual_seed(args.seed + 1)  # the draft starts the same with or without --draft-only
    draft = make_model(DRAFT_SHAPE, vocab, tokenizer.eos_token_id, args.max_model_len)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    log(f"target {n_target / 1e6:.2f} M params, draft {n_draft / 1e6:.2f} M params")
    t0 = time.time()
    train(draft, train_ids, args, args.draft_steps, "draft", teacher=target)
    draft_seconds = time.time() - t0
    draft_loss = held_out_loss(draft, held_out_ids, args.seq_len)
    agreement = greedy_agreement(draft, target, held_out_ids, args.seq_len)
    log(f"draft held-out loss {draft_loss:.3f}, teacher-forced top-1 agreement {agreement:.3f}")

    if not args.draft_only:
        save(target, tokenizer, args.out / "tiny-target", args.max_model_len)
    save(draft, tokenizer, args.out / "tiny-draft", args.max_model_len)
    report = {
        "command": "python scripts/train_tiny_models.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "draft_only")),
        "draft_only_rerun": args.draft_only,
        "seed": args.seed,
        "corpus": "Python standard library .py files (site-packages excluded), held-out = crc32(path) % 20 == 0",
        "train_tokens": len(train_ids),
        "held_out_tokens": len(held_out_ids),
        "target": {"params": n_target, "shape": asdict(TARGET_SHAPE), "held_out_loss": round(target_loss, 4),
                   "train_seconds": round(target_seconds)},
        "draft": {"params": n_draft, "shape": asdict(DRAFT_SHAPE), "held_out_loss": round(draft_loss, 4),
                  "train_seconds": round(draft_seconds), "teacher_forced_top1_agreement": round(agreement, 4)},
        "total_seconds": round(time.time() - started),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"done in {report['total_seconds']} s; wrote {args.out}")


if __name__ == "__main__":
    main()
