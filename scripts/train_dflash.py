"""DFlash training for ``train_draft_head.py --method dflash``: the drafter, its block loss, its held-out report.

As DFlash trains (Chen et al. 2026, arXiv 2602.06036, section 4): each training window is read by
the frozen target once (its hidden states at ``target_layer_ids`` and its distributions); the
drafter is scored on ``--anchors`` blocks per window at random anchor positions ``a``, each block
``[x_a, mask x (block_size - 1)]`` at positions ``a ..`` attending to the context at positions
``< a`` and, non-causally, to its own block (one attention over every block of the window, a
block-sparse mask: the blocks never see each other), so one pass trains what one served step
runs for as many anchors as the window holds. Block position ``j`` is trained on the target's
distribution of the token at ``a + j`` (soft labels, as the other heads here; DFlash trains on
the target's own generated tokens), weighted ``exp(-(j - 1) / gamma)`` (``--loss-decay``, the
paper's decay: the first positions decide how many drafts a step keeps). The embedding and LM
head are the target's, frozen, as in DFlash; the layers start from the target's first ones
(``--dflash-init-layers``: after 150 steps one layer so started agreed with the target's greedy token
at block position 1 on 0.41 of held-out blocks, 0.24 started at random and 0.19 from the last
layer), the ``fc`` fusion at random, ``mask_token_id`` is the least frequent
token of the training text (the target has no spare id; its embedding only marks a masked
position, and a block holds it nowhere else but, rarely, as its first token).
"""
from __future__ import annotations

import argparse
import math

import torch
from tqdm import tqdm
from train_tiny_models import corpus_files, encode_stream, read_texts

from specdec.heads.dflash import DFlashDrafter, dflash_config_for


def add_arguments(parser) -> None:
    parser.add_argument("--block-size", type=int, default=9,
                        help="dflash: the last token and block_size - 1 masks (at most block_size - 1 drafts)")
    parser.add_argument("--target-layer-ids", default="1,3,5",
                        help="dflash: 0-based target layers whose outputs form the context (the format's)")
    parser.add_argument("--dflash-init-layers", choices=("first", "last", "none"), default="first",
                        help="dflash: start the drafter's layers from the target's first or last layers, or at random")
    parser.add_argument("--anchors", type=int, default=6, help="dflash: blocks trained per window")
    parser.add_argument("--loss-decay", type=float, default=4.0, help="dflash: gamma of exp(-(j - 1) / gamma)")


def build_dflash(target, arch, args, train_ids: torch.Tensor) -> DFlashDrafter:
    """The drafter with the target's embedding and LM head, its layers copied from the target's."""
    counts = torch.bincount(train_ids, minlength=arch.vocab_size)  # [vocab]
    counts[0] = counts.max() + 1  # never EOS (id 0), which ends every file
    mask_id = int(counts.argmin())
    ids = tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    config = dflash_config_for(arch, args.block_size, mask_id, args.num_layers, ids)
    model = DFlashDrafter(config)
    with torch.no_grad():
        model.target_embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.target_lm_head.weight.copy_(target.get_output_embeddings().weight)
        model.norm.weight.copy_(target.model.norm.weight)
        source = {"first": range(args.num_layers), "last": range(arch.num_layers - args.num_layers, arch.num_layers),
                  "none": ()}[args.dflash_init_layers]  # fmt: skip
        for mine, theirs in zip(model.layers, (target.model.layers[i] for i in source)):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(mine.self_attn, name).weight.copy_(getattr(theirs.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mine.mlp, name).weight.copy_(getattr(theirs.mlp, name).weight)
            mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
    return model


def fit_dflash(args, target, arch, train_ids, windows, target_outputs, train) -> tuple[DFlashDrafter, list[float]]:
    """The drafter trained on ``windows`` [W, T] (``target_outputs`` and ``train``: the trainer's)."""
    model = build_dflash(target, arch, args, train_ids)
    pool = target_outputs(target, windows, args, model.config.hidden_state_layers, None)
    anchors = torch.Generator().manual_seed(args.seed + 3)

    def loss(window, features, target_logp):
        return dflash_loss(model, window, features, target_logp,
                           draw_anchors(window.shape[0], window.shape[1], args, anchors), args.loss_decay)  # fmt: skip

    return model, train(args, model, loss, pool)


def draw_anchors(batch: int, length: int, args, generator: torch.Generator) -> torch.Tensor:  # [B, A]
    """Anchors ``a`` in ``1 .. length - block_size + 1``: a block's labels end at row ``a + block_size - 2``."""
    return torch.randint(1, length - args.block_size + 2, (batch, args.anchors), generator=generator)


def block_logits(model: DFlashDrafter, window: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor):
    """Logits ``[B, A, block_size - 1, vocab]`` of every block, through the served forward itself.

    window [B, T], features [B, T, F] (the target's at each position), anchors [B, A].
    """
    b, t = window.shape
    bs, a = model.config.block_size, anchors.shape[1]
    context = model.context(features)  # [B, T, h]
    kv = [(k.transpose(1, 2), v.transpose(1, 2))
          for k, v in model.context_keys_values(context, torch.arange(t))]  # [B, kv_heads, T, D] each  # fmt: skip
    positions = (anchors[..., None] + torch.arange(bs)).view(b, a * bs)  # [B, S]
    block_ids = torch.full((b, a, bs), model.config.mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = window.gather(1, anchors)
    sees_context = torch.arange(t)[None, None, :] < anchors[..., None]  # [B, A, T]: positions before the anchor
    block_of = torch.arange(a * bs) // bs  # [S]
    same_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, S, S]
    mask = torch.cat([sees_context.repeat_interleave(bs, 1), same_block], -1)[:, None]  # [B, 1, S, T + S]
    hidden = model(block_ids.view(b, a * bs), positions, kv, mask).view(b, a, bs, -1)
    return model.logits(hidden[:, :, 1:])


def dflash_loss(model: DFlashDrafter, window, features, target_logp, anchors, decay: float) -> torch.Tensor:
    """Soft cross-entropy of block position j (the token at a + j: the target's row a + j - 1), decayed by j."""
    logits = block_logits(model, window, features.float(), anchors)  # [B, A, bs - 1, vocab]
    rows = anchors[..., None] + torch.arange(logits.shape[2])  # [B, A, bs - 1]: rows a .. a + bs - 2
    labels = target_logp[torch.arange(window.shape[0])[:, None, None], rows].float()  # [B, A, bs - 1, vocab]
    per_row = -(labels.exp() * logits.log_softmax(-1)).sum(-1)  # [B, A, bs - 1]
    weights = torch.tensor([math.exp(-j / decay) for j in range(logits.shape[2])])  # position j + 1
    return (per_row * weights).sum(-1).mean() / weights.sum()


@torch.no_grad()
def held_out_report(model: DFlashDrafter, target, tokenizer, args, make_windows) -> dict:
    """Per block position, top-1 agreement of the drafter with the target's greedy token there, and the
    share of blocks whose positions 1 .. j all agree (what a greedy step would accept), on windows of
    held-out text (``make_windows``: the trainer's, ``--generated-share`` of them continued by the target)."""
    _, held_files = corpus_files()
    held = encode_stream(tokenizer, read_texts(held_files, args.corpus_chars // 8))
    at = argparse.Namespace(**{**vars(args), "windows": args.eval_prompts * 4, "seed": args.eval_seed})
    windows = make_windows(target, held, at)  # [W, T]
    model.eval()
    gen = torch.Generator().manual_seed(args.eval_seed)
    layers = model.config.hidden_state_layers
    agree = torch.zeros(args.block_size - 1)
    prefix = torch.zeros(args.block_size - 1)
    total = 0
    for chunk in tqdm(windows.split(args.batch_size), desc="held-out report", mininterval=5):
        out = target(chunk, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in layers], -1)  # [b, T, F]
        anchors = draw_anchors(chunk.shape[0], chunk.shape[1], args, gen)
        logits = block_logits(model, chunk, features, anchors)  # [b, A, bs - 1, vocab]
        rows = anchors[..., None] + torch.arange(logits.shape[2])
        greedy = out.logits.argmax(-1)[torch.arange(chunk.shape[0])[:, None, None], rows]  # [b, A, bs - 1]
        hits = (logits.argmax(-1) == greedy).float()
        agree += hits.sum((0, 1))
        prefix += hits.cumprod(-1).sum((0, 1))
        total += hits.shape[0] * hits.shape[1]
    report = {"windows": f"{len(windows)} of held-out text, --generated-share of them continued by the target",
              "blocks": total, "top1_agreement_per_position": [round(x, 4) for x in (agree / total).tolist()],
              "all_agree_up_to_position": [round(x, 4) for x in (prefix / total).tolist()]}  # fmt: skip
    print(f"[held-out] {report}", flush=True)
    return report
