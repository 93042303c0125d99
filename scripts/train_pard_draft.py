#!/usr/bin/env python3
"""Adapt the shipped draft into a parallel draft model (PARD) and measure it.

PARD (An et al. 2025, arXiv 2504.18583) fine-tunes an autoregressive draft to read mask
tokens after a prefix and predict, at the ``j``-th mask, the token ``j + 1`` places past the
prefix; served with ``parallel_drafting`` (``specdec.proposers.pard``) it drafts k tokens in
one forward. This script fine-tunes a copy of ``--draft`` (``models/tiny-draft``) that way:

* **Data.** Windows of ``--seq-len`` tokens from the training text of ``train_tiny_models.py``
  (the standard library's ``.py`` files, the same held-out split), ``--generated-share`` of
  them (all, by default) the target's greedy continuation of their first ``--prompt-tokens``
  tokens. In a generated window the tokens after any prefix *are* the target's greedy
  continuation of it, which is what a greedy draft is accepted against. The defaults match
  what the benchmarks serve: 128 tokens of text (a prompt's length), then 64 generated.
* **Objective.** Each window is fed once as text (every position predicts the next token, the
  draft's old task, offset 0) and ``--chains`` times as a chain of ``K - 1`` masks
  (``K = --max-k``) after a random prefix in the generated part (``--chain-prefixes``; masks
  after a prefix of plain text would learn the corpus's next tokens, not the target's):
  mask ``j`` sits at position ``prefix + j``, attends
  to the prefix's real tokens and the chain's earlier masks (one 4D attention mask over the
  packed row), and predicts the token at offset ``j``. A mask sees only its own chain's
  earlier masks, so a chain of ``K - 1`` masks holds the input of every shorter k: PARD's
  random k in 1..K is trained at once, every k on every chain. Keeping a few chains per
  window rather than one per position is the spirit of PARD's conditional drop-token (fewer of
  the costly masked copies); the text positions stay complete. Loss: cross-entropy on the
  window's tokens, every labelled position weighted alike.
* **The mask token.** The target's vocabulary is full (4096 ids, no spare row), and the draft
  must keep it (``check_draft_compatible``). The mask is the byte-level token of byte
  ``0xFF``, which never occurs in UTF-8: the tokenizer, which encodes ``str``, never produces
  it, and no merged token contains it. The script checks both, and that it occurs nowhere in
  the encoded corpus, before training; ``--mask-token-id`` overrides the choice. It is written
  to config.json as ``pard_token``, the key vLLM and PARD's checkpoints use.

Report (added to ``models/training_report.json`` as ``draft_pard``): per-offset top-1
agreement with the target's greedy tokens on held-out generated windows (offset 0: the next
token, as a chain drafter's first draft), for the PARD draft and the draft it started from;
and greedy decoding of held-out prompts through the engine at ``--eval-k`` with the PARD
draft drafting in parallel and the original draft drafting a chain (tokens per step,
acceptance per position). Seeded, on CPU in about 15 minutes with the defaults (one thread).

    python scripts/train_pard_draft.py --out models/tiny-draft-pard
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from eval_tiny_models import run  # noqa: E402
from train_tiny_models import corpus_files, encode_stream, lr_at, read_texts  # noqa: E402

from bench.workload import held_out_texts, select_prompts  # noqa: E402
from specdec.build import build_lm  # noqa: E402
from specdec.models import load_causal_lm  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402
from specdec.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec.proposers.pard import MASK_TOKEN_KEY, ParallelDraftProposer  # noqa: E402
from specdec.rejection_sampler import RejectionSampler  # noqa: E402

NEVER_IN_UTF8 = 0xFF  # a byte no UTF-8 text contains: its byte-level token is never produced
IGNORE = -100  # cross-entropy's ignored label


def byte_level_char(byte: int) -> str:
    """The printable character GPT-2's byte-level alphabet (``tokenizers.pre_tokenizers.ByteLevel``) gives ``byte``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def choose_mask_token(tokenizer, corpora: list[torch.Tensor], given: int | None) -> tuple[int, str]:
    """The mask id and why it is safe: ``given``, or the token of a byte UTF-8 never holds; checked on ``corpora``."""
    vocab = tokenizer.get_vocab()
    if given is None:
        char = byte_level_char(NEVER_IN_UTF8)
        if char not in vocab:
            raise SystemExit(f"the tokenizer has no byte-level token for 0x{NEVER_IN_UTF8:X}: pass --mask-token-id")
        merged = [t for t in vocab if char in t and t != char]
        if merged:
            raise SystemExit(f"tokens {merged[:5]} contain byte 0x{NEVER_IN_UTF8:X}'s character: pass --mask-token-id")
        given, why = vocab[char], (f"the byte-level token of byte 0x{NEVER_IN_UTF8:X}, which no UTF-8 text holds "
                                   "(the tokenizer encodes str: it never produces it; no merged token contains it)")
    else:
        why = "given by --mask-token-id"
    if not 0 <= given < len(tokenizer):
        raise SystemExit(f"--mask-token-id {given} is outside the vocabulary [0, {len(tokenizer)})")
    seen = sum(int((ids == given).sum()) for ids in corpora)
    if seen:
        raise SystemExit(f"mask token {given} occurs {seen} times in the encoded corpus: choose another")
    return given, why + f"; occurs 0 times in the {sum(map(len, corpora)):,} encoded corpus tokens (checked)"


@torch.no_grad()
def make_windows(target, data: torch.Tensor, count: int, args, seed: int) -> torch.Tensor:
    """``count`` windows [count, seq_len] from seeded offsets, ``--generated-share`` of them the target's greedy
    continuation of their first ``--prompt-tokens`` tokens (EOS is any token: the windows cross files)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - args.seq_len, (count,), generator=gen).tolist()
    windows = torch.stack([data[s : s + args.seq_len] for s in starts])  # [W, T]
    generated, prompt = round(count * args.generated_share), args.prompt_tokens
    for chunk in tqdm(range(0, generated, 64), desc="target continuations", mininterval=5):
        rows = slice(chunk, min(chunk + 64, generated))
        windows[rows] = target.generate(
            windows[rows, :prompt], attention_mask=torch.ones_like(windows[rows, :prompt]), do_sample=False,
            pad_token_id=0, max_new_tokens=args.seq_len - prompt, min_new_tokens=args.seq_len - prompt,
        )  # fmt: skip
    return windows


def pack(windows: torch.Tensor, prefixes: torch.Tensor, mask_id: int, num_masks: int):
    """Each window as text followed by its chains of masks, in one row.

    windows [B, T]; prefixes [B, C]: the last real position each chain reads. Returns input ids,
    position ids and labels [B, L] (L = T + C * num_masks) and the attention mask [B, 1, L, L]:
    text causal; mask j of a chain at prefix t sits at position t + j, sees text 0..t and its
    chain's masks 1..j, and is labelled with the window's token t + j + 1.
    """
    batch, length = windows.shape
    chains = prefixes.shape[1]
    j = torch.arange(1, num_masks + 1)  # [M]
    mask_pos = (prefixes[..., None] + j).flatten(1)  # [B, C * M]
    ids = torch.cat([windows, torch.full_like(mask_pos, mask_id)], 1)  # [B, L]
    positions = torch.cat([torch.arange(length).expand(batch, -1), mask_pos], 1)  # [B, L]
    labels = torch.cat([windows[:, 1:], torch.full((batch, 1), IGNORE), windows.gather(1, mask_pos + 1)], 1)
    total = length + chains * num_masks
    attend = torch.zeros(batch, total, total, dtype=torch.bool)
    attend[:, :length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    text = torch.arange(length)  # [T]
    sees_text = text[None, None] <= prefixes.repeat_interleave(num_masks, 1)[..., None]  # [B, C * M, T]
    attend[:, length:, :length] = sees_text
    chain_block = torch.ones(num_masks, num_masks, dtype=torch.bool).tril()  # [M, M]
    attend[:, length:, length:] = torch.block_diag(*[chain_block] * chains)
    return ids, positions, labels, attend[:, None]


def sample_prefixes(batch: int, args, gen: torch.Generator) -> torch.Tensor:
    """[B, C] chain prefixes: the last real position of each, leaving room for K - 1 labelled masks.

    ``--chain-prefixes generated`` starts every chain at the prompt's last token or later, so
    each mask's label is the target's greedy continuation of its prefix (what a draft is
    accepted against) rather than the corpus's next tokens.
    """
    low = args.prompt_tokens - 1 if args.chain_prefixes == "generated" else 0
    return torch.randint(low, args.seq_len - args.max_k, (batch, args.chains), generator=gen)


def train(args, draft, windows: torch.Tensor, mask_id: int) -> list[float]:
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    draft.train()
    losses = []
    progress = tqdm(range(args.steps), desc="train pard", mininterval=5)
    for step in progress:
        rows = windows[torch.randint(0, len(windows), (args.batch_size,), generator=gen)]  # [B, T]
        ids, positions, labels, attend = pack(rows, sample_prefixes(args.batch_size, args, gen), mask_id,
                                              args.max_k - 1)  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=min(30, args.steps // 10))
        logits = draft(ids, attention_mask=attend, position_ids=positions).logits  # [B, L, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    draft.eval()
    return losses


@torch.no_grad()
def offset_agreement(draft, windows: torch.Tensor, args, mask_id: int) -> list[float]:
    """Per offset 0..K-1, top-1 agreement with the window's tokens after every prefix in the generated part.

    On generated windows those tokens are the target's greedy continuation of the prefix.
    """
    start = args.prompt_tokens - 1
    prefixes = torch.arange(start, args.seq_len - args.max_k).expand(len(windows), -1)  # [W, P]
    agree, total = torch.zeros(args.max_k), 0
    for rows, chain_prefixes in zip(windows.split(8), prefixes.split(8)):
        ids, positions, labels, attend = pack(rows, chain_prefixes, mask_id, args.max_k - 1)
        top = draft(ids, attention_mask=attend, position_ids=positions).logits.argmax(-1)  # [b, L]
        hit = top == labels  # [b, L]
        agree[0] += hit[:, :args.seq_len].gather(1, chain_prefixes).sum()  # the real token at the prefix: offset 0
        by_offset = hit[:, args.seq_len:].view(len(rows), -1, args.max_k - 1)  # [b, P, K - 1]
        agree[1:] += by_offset.sum((0, 1))
        total += chain_prefixes.numel()
    return [round(float(a) / total, 4) for a in agree]


def evaluate_engine(args, tokenizer, mask_id: int) -> list[dict]:
    """Greedy decoding of held-out prompts at ``--eval-k``: the PARD draft in parallel, the original as a chain."""
    chosen = select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"], args.eval_prompts, 128,
                            args.seed)  # fmt: skip
    prompts = [p.token_ids for p in chosen]
    verifier_lm = build_lm(args.target, "fast", "float32", "cpu", max_num_seqs=2)
    from specdec.verifier import TargetVerifier

    verifier = TargetVerifier(verifier_lm)
    proposers = [("draft_model+parallel", ParallelDraftProposer(build_lm(args.out, "fast", "float32", "cpu", 2),
                                                                mask_id)),
                 ("draft_model", DraftModelProposer(build_lm(args.draft, "fast", "float32", "cpu", 2)))]  # fmt: skip
    at = argparse.Namespace(k=args.eval_k, max_tokens=args.eval_max_tokens)
    results = []
    for name, proposer in proposers:
        result = run(name, proposer, verifier, RejectionSampler("strict"), prompts, at, tokenizer.eos_token_id,
                     ban_eos=True)  # fmt: skip
        result.pop("outputs")
        print(f"[eval] {name}: {result['mean_accepted_length']} tokens per step at k={args.eval_k}, per position "
              f"{result['accepted_per_position']}, {result['propose_ms_per_call']} ms per propose", flush=True)
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft", help="the draft adapted")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "tiny-draft-pard")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "models" / "training_report.json",
                        help="the shipped models' report; this run's entry is its 'draft_pard'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-k", type=int, default=4, help="K: chains of K - 1 masks, drafts 1..K trained")
    parser.add_argument("--chains", type=int, default=32, help="mask chains per window")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=192)
    parser.add_argument("--windows", type=int, default=3072, help="training windows (the target continues a share once)")
    parser.add_argument("--generated-share", type=float, default=1.0,
                        help="share of windows continued by the target (1.0: every label is its greedy token)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="text tokens a generated window starts from")
    parser.add_argument("--chain-prefixes", choices=("generated", "all"), default="generated",
                        help="where mask chains start: in the generated part only, or anywhere in the window")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--corpus-chars", type=int, default=4_000_000)
    parser.add_argument("--mask-token-id", type=int, default=None, help="default: the token of byte 0xFF (checked)")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out generated windows for the agreement")
    parser.add_argument("--eval-k", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument("--eval-max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if not 2 <= args.max_k < args.seq_len - args.prompt_tokens:
        parser.error(f"--max-k must be in 2..{args.seq_len - args.prompt_tokens - 1}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()

    tokenizer = load_tokenizer(args.target)
    target = load_causal_lm(args.target, dtype="float32").requires_grad_(False).eval()
    draft = load_causal_lm(args.draft, dtype="float32")
    if draft.config.vocab_size != target.config.vocab_size:
        raise SystemExit(f"--draft's vocabulary ({draft.config.vocab_size}) differs from the target's")
    train_files, _ = corpus_files()
    data = encode_stream(tokenizer, read_texts(train_files, args.corpus_chars))
    held_out = encode_stream(tokenizer, list(held_out_texts().values()))
    mask_id, mask_why = choose_mask_token(tokenizer, [data, held_out], args.mask_token_id)
    print(f"[train] {len(data):,} training tokens; mask token {mask_id}: {mask_why}", flush=True)

    windows = make_windows(target, data, args.windows, args, args.seed)
    eval_args = argparse.Namespace(**{**vars(args), "generated_share": 1.0})
    eval_windows = make_windows(target, held_out, args.eval_windows, eval_args, args.seed + 1)
    before = offset_agreement(draft.eval(), eval_windows, args, mask_id)
    print(f"[eval] before: per-offset top-1 agreement {before}", flush=True)
    t0 = time.time()
    losses = train(args, draft, windows, mask_id)
    train_seconds = time.time() - t0
    after = offset_agreement(draft, eval_windows, args, mask_id)
    print(f"[eval] after: per-offset top-1 agreement {after}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    setattr(draft.config, MASK_TOKEN_KEY, mask_id)
    draft.config.dtype = torch.bfloat16
    draft.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # the draft's own, as shipped
        shutil.copy(args.draft / name, args.out / name)
    engine = evaluate_engine(args, tokenizer, mask_id)

    report = json.loads(args.report.read_text()) if args.report.is_file() else {}
    report["draft_pard"] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "started_from": args.draft.name,
        "seed": args.seed,
        "mask_token": {"key": MASK_TOKEN_KEY, "id": mask_id, "why": mask_why},
        "max_k": args.max_k, "chains_per_window": args.chains, "steps": args.steps, "batch_size": args.batch_size,
        "windows": args.windows, "generated_share": args.generated_share, "prompt_tokens": args.prompt_tokens,
        "seq_len": args.seq_len, "chain_prefixes": args.chain_prefixes,
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "held_out_offset_top1_agreement": {
            "what": f"argmax at offset j (0: the next token; j >= 1: mask j) == the target's greedy token, over "
                    f"every prefix of {args.eval_windows} held-out windows' generated part",
            "before": before, "after": after},
        "engine_greedy_eval": {"k": args.eval_k, "prompts": args.eval_prompts, "max_tokens": args.eval_max_tokens,
                               "results": engine},
        "train_seconds": round(train_seconds),
        "total_seconds": round(time.time() - started),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["draft_pard"], indent=2))


if __name__ == "__main__":
    main()
