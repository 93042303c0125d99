#!/usr/bin/env python3
"""Train a draft head (EAGLE-3, MLP speculator, Medusa or DFlash) for a target by self-distillation, and measure it.

The head learns the frozen target's next-token distributions (soft labels, as EAGLE) from its hidden states
over ``train_tiny_models.py``'s text (``--generated-share`` of the windows continued by the target's greedy
output); its embedding is the target's (frozen, as EAGLE-3), its LM head starts from the target's rows.

* ``eagle3``: layers ``--aux-layers`` (vLLM's ``[2, L // 2, L - 3]``, spread where they collide), the
  ``--draft-vocab-size`` most frequent training tokens, and ``--ttt-steps`` (>= 3) training-time-test
  passes reading its own output (``specdec.heads.eagle3.train_forward``), weighted ``0.8 ** step``.
* ``mlp_speculator``: ``--n-predict`` stages over the target's final hidden state, stage ``i`` fed
  the text's tokens and trained on the target's distribution ``i + 1`` tokens on (``--mlp-labels
  greedy``: its greedy token); ``--tie-weights`` shares one embedding, head and norm (``tie_weights``).
* ``medusa``: ``--medusa-heads`` heads of ``--medusa-layers`` residual blocks over the final hidden state
  at t, head ``i`` trained on the target's distribution at t + 1 + i; blocks start at zero (the identity,
  as Medusa's), LM heads from the target's (``--medusa-lm-head shared``: the target's, frozen:
  ``original_lm_head``); ``--eval-tree`` also measures a tree.
* ``dflash``: a block drafter of ``--num-layers`` layers over the target's layer outputs ``--target-layer-ids``,
  trained on blocks of ``--block-size`` (``train_dflash.py``); held-out top-1 agreement per block position.
* ``eagle3 --parallel-drafting``: a P-EAGLE head from ``--init-head``, ``--parallel-depths`` drafts from one forward
  (``train_peagle.py``); held-out top-1 agreement per depth, and the engine beside the EAGLE-3 chain.

Then the head is written (speculators / MLPSpeculator format) and run in the real engine at ``--k``
(greedy), beside ``--baseline-draft``, on ``benchmark_engine.py``'s held-out prompts (``--eval-prompts``,
``--eval-seed``, EOS banned): the report gives both's mean tokens per verify step over all steps.
Seeded; the frozen target runs once over ``--windows`` windows; each step draws its batch from them.

    python scripts/train_draft_head.py --method eagle3 --target models/tiny-target --out models/tiny-eagle3
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from eval_tiny_models import run  # noqa: E402
from train_dflash import add_arguments as add_dflash_arguments, fit_dflash, held_out_report  # noqa: E402
import train_peagle  # noqa: E402
from train_tiny_models import corpus_files, encode_stream, lr_at, read_texts  # noqa: E402

from bench.workload import held_out_texts, select_prompts  # noqa: E402
from specdec.build import build_lm  # noqa: E402
from specdec.fast.checkpoint import read_config  # noqa: E402
from specdec.heads import build_head_proposer  # noqa: E402
from specdec.heads.dflash import save_dflash  # noqa: E402
from specdec.heads.eagle3 import Eagle3Head, default_aux_layers, eagle3_config_for, train_forward  # noqa: E402
from specdec.heads.formats import save_eagle3  # noqa: E402
from specdec.heads.medusa import Medusa, MedusaConfig, save_medusa  # noqa: E402
from specdec.heads.mlp_speculator import MLPSpeculator, first_stages, save_mlp_speculator  # noqa: E402
from specdec.models import load_causal_lm  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402
from specdec.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec.rejection_sampler import RejectionSampler  # noqa: E402
from specdec.tree import parse_token_tree  # noqa: E402
from specdec.verifier import TargetVerifier  # noqa: E402

STEP_DECAY = 0.8  # EAGLE-3's weight of training-time-test step j: 0.8 ** j


def aux_layers_for(num_layers: int, given: str | None) -> tuple[int, ...]:
    if given:
        return tuple(int(x) for x in given.split(","))
    layers = default_aux_layers(num_layers)  # where they collide (a shallow target): low, middle and last, distinct
    return layers if len(set(layers)) == 3 else (1, num_layers // 2, num_layers - 1)


def soft_ce(logits: torch.Tensor, target_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target's distribution over the rows in ``valid`` ([B, T] bool)."""
    per_row = -(target_logp.exp() * logits.float().log_softmax(-1)).sum(-1)  # [B, T]
    valid = valid.expand_as(per_row)
    return (per_row * valid).sum() / valid.sum().clamp(min=1)


def build_eagle3(target, arch, args, train_ids: torch.Tensor) -> Eagle3Head:
    """The head, its draft vocabulary the most frequent training tokens; embedding, LM head and
    final norm start from the target's at the target's width, from ``--init-from`` below it."""
    counts = torch.bincount(train_ids, minlength=arch.vocab_size)  # [vocab]
    draft_vocab = min(args.draft_vocab_size, arch.vocab_size)
    kept = counts.topk(draft_vocab).indices.sort().values  # [draft_vocab]: the most frequent target ids
    config = eagle3_config_for(arch, draft_vocab, aux_layers_for(arch.num_layers, args.aux_layers),
                               args.hidden_size or None, args.intermediate_size or None, args.num_layers)  # fmt: skip
    head = Eagle3Head(config)
    source = target if config.hidden_size == arch.hidden_size else init_source(args, config.hidden_size, arch)
    with torch.no_grad():
        head.d2t.copy_(kept - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[kept] = True
        if source is not None:
            head.embed_tokens.weight.copy_(source.get_input_embeddings().weight)
            head.lm_head.weight.copy_(source.get_output_embeddings().weight[kept])
            head.norm.weight.copy_(source.model.norm.weight)
    head.embed_tokens.weight.requires_grad_(source is not target)  # the target's is shared, frozen
    return head


def init_source(args, width: int, arch):
    """The causal LM at ``--init-from`` (same vocabulary, the head's width), or None: random start."""
    if not args.init_from:
        return None
    model = load_causal_lm(args.init_from, dtype="float32")
    size, vocab = model.config.hidden_size, model.config.vocab_size
    if size != width or vocab != arch.vocab_size:
        raise SystemExit(
            f"--init-from {args.init_from}: hidden size {size} and {vocab} tokens; the head needs "
            f"hidden size {width} and the target's {arch.vocab_size} tokens"
        )
    return model


@torch.no_grad()
def training_windows(target, data: torch.Tensor, args) -> torch.Tensor:
    """``--windows`` windows of ``seq_len + 2`` tokens [W, T]: text from seeded random offsets,
    ``--generated-share`` of them the target's greedy continuation of their first
    ``--generated-prompt-tokens`` tokens.

    A served head drafts after text the target wrote itself (greedy output of a small model
    repeats itself far more than written text does); a head trained only on written text never
    sees those contexts. Measured on the shipped target (docs/models.md), it raised the MLP
    speculator's acceptance and lowered the EAGLE-3 head's.
    """
    gen = torch.Generator().manual_seed(args.seed + 1)
    length = args.seq_len + 2
    starts = torch.randint(0, len(data) - length, (args.windows,), generator=gen).tolist()
    windows = torch.stack([data[s : s + length] for s in starts])  # [W, T]
    generated = round(args.windows * args.generated_share)
    prompt = args.generated_prompt_tokens
    if generated == 0:
        return windows
    if not 0 < prompt < length:
        raise SystemExit(f"--generated-prompt-tokens must be in 1..{length - 1} (seq_len + 1), got {prompt}")
    for chunk in tqdm(range(0, generated, 64), desc="target continuations", mininterval=5):
        rows = slice(chunk, min(chunk + 64, generated))
        prompts = windows[rows, :prompt]  # [b, prompt]
        windows[rows] = target.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=False, pad_token_id=0,
            max_new_tokens=length - prompt, min_new_tokens=length - prompt,
        )  # fmt: skip
    return windows


@torch.no_grad()
def target_outputs(target, windows: torch.Tensor, args, layers: tuple[int, ...], kept: torch.Tensor | None):
    """The target's hidden states ``layers`` and log-probabilities over ``kept`` ids for the windows [W, T].

    Computed once: the frozen target's forward is most of a step's cost on a CPU, and
    every epoch reuses it.
    """
    features, logps = [], []
    for chunk in tqdm(windows.split(args.batch_size), desc="target outputs", mininterval=5):
        out = target(chunk, output_hidden_states=True)
        features.append(torch.cat([out.hidden_states[i] for i in layers], -1).to(torch.bfloat16))  # [b, T, F]
        logits = out.logits if kept is None else out.logits[..., kept]
        logps.append(logits.float().log_softmax(-1).to(torch.bfloat16))  # [b, T, vocab or draft_vocab]
    return windows, torch.cat(features), torch.cat(logps)


def eagle3_loss(head: Eagle3Head, window, features, target_logp, ttt_steps: int) -> torch.Tensor:
    """Row t reads token x_{t+1} and the features at t; it is scored on the target's distribution at t + 1."""
    steps = train_forward(head, window[:, 1:], features[:, :-1].float(), ttt_steps)
    rows = torch.arange(window.shape[1] - 1)[None, :]  # [1, T-1]
    labels = target_logp[:, 1:].float()  # [B, T-1, draft_vocab]
    total = sum(STEP_DECAY**j * soft_ce(logits, labels, rows >= j) for j, logits in enumerate(steps))
    return total / sum(STEP_DECAY**j for j in range(ttt_steps))


def build_mlp(target, arch, args) -> MLPSpeculator:
    config = dict(n_predict=args.n_predict, emb_dim=arch.hidden_size, inner_dim=args.inner_dim or arch.hidden_size,
                  vocab_size=arch.vocab_size, tie_weights=args.tie_weights, scale_input=True,
                  top_k_tokens_per_head=[1] * args.n_predict, n_candidates=1)  # fmt: skip
    model = MLPSpeculator(config)
    if model.inner_dim == arch.hidden_size:
        with torch.no_grad():
            for head in model.head:
                head.weight.copy_(target.lm_head.weight)
    return model


def mlp_loss(model: MLPSpeculator, window, last, target_logp, greedy_labels: bool = False) -> torch.Tensor:
    """Stage i at base t reads token x_{t+1+i} and is scored on the target's distribution at t + 1 + i
    (``greedy_labels``: on the target's greedy token there, as IBM's trainer scores on generated text)."""
    n = model.n_predict
    span = window.shape[1] - n  # bases t = 0 .. span - 1
    state = model.first_state(last[:, :span].float())  # [B, span, h]
    losses = []
    for i in range(n):
        logits, state = model.stage(i, state, window[:, 1 + i : 1 + i + span])
        valid = torch.ones(window.shape[0], span, dtype=torch.bool)
        labels = target_logp[:, 1 + i : 1 + i + span].float()  # [B, span, vocab]
        if greedy_labels:  # the target's greedy token alone, as a one-hot distribution
            labels = F.one_hot(labels.argmax(-1), labels.shape[-1]).float().clamp(min=1e-9).log()
        losses.append(soft_ce(logits, labels, valid))
    return sum(losses) / n


def build_medusa(target, arch, args) -> Medusa:
    shared = args.medusa_lm_head == "shared"
    config = MedusaConfig(args.medusa_heads, args.medusa_layers, arch.hidden_size, arch.vocab_size, arch.vocab_size,
                          bias=True, shared_lm_head=shared)  # fmt: skip
    model = Medusa(config)
    with torch.no_grad():
        for block in model.blocks:
            for layer in block.layers:  # x + SiLU(0) = x: each head starts as the target's own next-token head
                layer.weight.zero_()
                layer.bias.zero_()
        for lm_head in model.lm_heads:
            lm_head.weight.copy_(target.lm_head.weight)
            lm_head.weight.requires_grad_(not shared)
    return model


def medusa_loss(model: Medusa, window, last, target_logp) -> torch.Tensor:
    """Head i at base t reads the target's final hidden state at t and is scored on the target's distribution
    at t + 1 + i (its prediction of token t + 2 + i)."""
    n = model.num_heads
    span = window.shape[1] - n  # bases t = 0 .. span - 1
    logits = model(last[:, :span].float())  # [n, B, span, vocab]
    valid = torch.ones(window.shape[0], span, dtype=torch.bool)
    return sum(soft_ce(logits[i], target_logp[:, 1 + i : 1 + i + span].float(), valid) for i in range(n)) / n


def train(args, head, loss_fn, pool) -> list[float]:
    """``--steps`` AdamW steps over batches drawn (seeded) from the precomputed ``pool``."""
    gen = torch.Generator().manual_seed(args.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    head.train()
    losses = []
    progress = tqdm(range(args.steps), desc=f"train {args.method}", mininterval=5)
    for step in progress:
        rows = torch.randint(0, args.windows, (args.batch_size,), generator=gen)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=min(50, args.steps // 10))
        loss = loss_fn(*(t[rows] for t in pool))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    head.eval()
    return losses


def evaluate(args, tokenizer) -> list[dict]:
    """Greedy mean tokens per verify step at k on held-out prompts: the new head and the baseline draft."""
    prompts = [p.token_ids for p in select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"],
                                                   args.eval_prompts, args.prompt_tokens, args.eval_seed)]  # fmt: skip
    verifier = TargetVerifier(build_lm(args.target, "fast", "float32", "cpu", max_num_seqs=2))
    proposers = (train_peagle.engine_proposers(args) if args.parallel_drafting else
                 [(args.method, build_head_proposer(args.method, args.out, args.target, "float32", "cpu", 2))])
    tree = parse_token_tree(args.eval_tree) if args.eval_tree else None
    if tree is not None:
        proposers.append((f"{args.method}+tree", build_head_proposer(args.method, args.out, args.target, "float32",
                                                                     "cpu", 2, tree=tree)))  # fmt: skip
    if args.baseline_draft:
        draft = build_lm(args.baseline_draft, "fast", "float32", "cpu", max_num_seqs=2)
        proposers.append(("draft_model", DraftModelProposer(draft)))
    results = []
    for name, proposer in proposers:
        at = argparse.Namespace(**{**vars(args), "k": tree.num_nodes}) if name.endswith("+tree") else args
        result = run(name, proposer, verifier, RejectionSampler("strict"), prompts, at, tokenizer.eos_token_id,
                     ban_eos=True)
        result.pop("outputs")
        print(f"[eval] {name}: {result['mean_accepted_length']} tokens per step at k={at.k}, acceptance "
              f"{result['acceptance_rate']}, per position {result['accepted_per_position']}", flush=True)
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("eagle3", "mlp_speculator", "medusa", "dflash"), required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--windows", type=int, default=256, help="training windows; the target runs once over each")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--corpus-chars", type=int, default=4_000_000)
    parser.add_argument("--generated-share", type=float, default=0.0,
                        help="share of windows that are the target's greedy continuation of their start "
                        "(docs/models.md: it helped the MLP speculator, not the EAGLE-3 head)")
    parser.add_argument("--generated-prompt-tokens", type=int, default=32,
                        help="text tokens a generated window starts from")
    parser.add_argument("--ttt-steps", type=int, default=3, help="eagle3: training-time-test passes (>= 3)")
    parser.add_argument("--draft-vocab-size", type=int, default=2048, help="eagle3")
    parser.add_argument("--hidden-size", type=int, default=0, help="eagle3: the head's width; 0 = the target's")
    parser.add_argument("--intermediate-size", type=int, default=0, help="eagle3: 0 = the target's MLP ratio")
    parser.add_argument("--num-layers", type=int, default=1,
                        help="eagle3: decoder layers (the first reads the embedding, the rest are Llama layers); dflash")
    parser.add_argument("--init-from", help="eagle3 narrower than the target: a causal LM of the head's width "
                        "whose embedding, LM head and final norm start the head's (default: random)")
    parser.add_argument("--aux-layers", help="eagle3: comma-separated target hidden-state ids")
    parser.add_argument("--n-predict", type=int, default=4, help="mlp_speculator: stages")
    parser.add_argument("--keep-stages", type=int, default=0,
                        help="mlp_speculator: after the evaluation, write only the first N stages (0: all)")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="mlp_speculator, medusa: the written weights' dtype")
    parser.add_argument("--tie-weights", action="store_true",
                        help="mlp_speculator: one embedding, head and norm for every stage (the format's tie_weights)")
    parser.add_argument("--mlp-labels", choices=("distribution", "greedy"), default="distribution",
                        help="mlp_speculator: each stage trained to the target's distribution or its greedy token")
    parser.add_argument("--inner-dim", type=int, default=0, help="mlp_speculator: 0 = the target's hidden size")
    parser.add_argument("--medusa-heads", type=int, default=4, help="medusa: heads (the format's num_heads)")
    parser.add_argument("--medusa-layers", type=int, default=1, help="medusa: residual blocks per head")
    parser.add_argument("--medusa-lm-head", choices=("shared", "own"), default="shared",
                        help="medusa: one LM head, the target's, frozen (original_lm_head), or one trained per head")
    parser.add_argument("--eval-tree", help="medusa, eagle3: also measure this speculative_token_tree (all its nodes)")
    add_dflash_arguments(parser)
    train_peagle.add_arguments(parser)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=24, help="as benchmark_engine.py's --num-prompts")
    parser.add_argument("--eval-seed", type=int, default=0, help="as benchmark_engine.py's --seed")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="as benchmark_engine.py's")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--baseline-draft", default=str(REPO_ROOT / "models" / "tiny-draft"), help="empty: none")
    # one thread: on a shared CPU, torch's threads wait on each other at every op (ten times slower here)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if not 0.0 <= args.generated_share <= 1.0:
        parser.error(f"--generated-share must be in [0, 1], got {args.generated_share}")
    if args.method == "mlp_speculator" and not 0 <= args.keep_stages <= args.n_predict:
        parser.error(f"--keep-stages must be in 0..{args.n_predict} (--n-predict), got {args.keep_stages}")
    if args.method == "eagle3" and (args.num_layers < 1 or args.ttt_steps < 3):
        parser.error(f"eagle3 needs --num-layers >= 1, --ttt-steps >= 3; got {args.num_layers}, {args.ttt_steps}")
    train_peagle.check_arguments(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()

    tokenizer = load_tokenizer(args.target)
    arch = read_config(args.target)
    target = load_causal_lm(args.target, dtype="float32").requires_grad_(False)
    train_files, _ = corpus_files()
    data = encode_stream(tokenizer, read_texts(train_files, args.corpus_chars))
    print(f"[train] {len(data)} training tokens", flush=True)
    windows = training_windows(target, data, args)
    extra = {}  # the method's own report entries
    if args.parallel_drafting:  # P-EAGLE, written by train_peagle.fit
        head, losses, extra = train_peagle.fit(args, target, data, windows, target_outputs, train, training_windows)
    elif args.method == "eagle3":
        head = build_eagle3(target, arch, args, data)
        pool = target_outputs(target, windows, args, head.config.aux_layers, head.t2d.nonzero().flatten())
        losses = train(args, head, lambda *batch: eagle3_loss(head, *batch, args.ttt_steps), pool)
        # at the target's width the embedding is the target's, frozen: the loader shares it, as vLLM does
        shared = head.config.hidden_size == arch.hidden_size
        save_eagle3(head, args.out, verifier=str(args.target), num_speculative_tokens=args.k, embedding=not shared)
    elif args.method == "dflash":
        head, losses = fit_dflash(args, target, arch, data, windows, target_outputs, train)
        save_dflash(head, args.out)
        extra = {"held_out_blocks": held_out_report(head, target, tokenizer, args, training_windows)}
    elif args.method == "medusa":
        head = build_medusa(target, arch, args)
        pool = target_outputs(target, windows, args, (arch.num_layers,), None)
        losses = train(args, head, lambda *batch: medusa_loss(head, *batch), pool)
        save_medusa(head, args.out)
    else:
        head = build_mlp(target, arch, args)
        pool = target_outputs(target, windows, args, (arch.num_layers,), None)
        losses = train(args, head, lambda *batch: mlp_loss(head, *batch, args.mlp_labels == "greedy"), pool)
        save_mlp_speculator(head, args.out)
    train_seconds = time.time() - started
    results = evaluate(args, tokenizer)  # every stage trained, in float32
    written = "the head as trained, float32"
    if args.method == "mlp_speculator":
        stages = args.keep_stages or args.n_predict
        save_mlp_speculator(first_stages(head, stages).to(getattr(torch, args.save_dtype)), args.out)
        written = f"the first {stages} of {args.n_predict} stages, {args.save_dtype}"
    elif args.method == "medusa" and args.save_dtype != "float32":
        save_medusa(head.to(getattr(torch, args.save_dtype)), args.out)
        written = f"the heads as trained, {args.save_dtype}"
    report = {
        "command": " ".join(sys.argv), "method": args.method + ("+parallel_drafting" if args.parallel_drafting else ""),
        "train_windows": args.windows, "train_tokens_seen": args.steps * args.batch_size * (args.seq_len + 2),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "train_seconds": round(train_seconds), "written": written,
        **extra,
        "eval": {"prompts": "benchmark_engine.py's held-out slices, EOS banned", "num_prompts": args.eval_prompts,
                 "seed": args.eval_seed, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "results": results},  # fmt: skip
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
