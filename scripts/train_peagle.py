"""P-EAGLE training for ``train_draft_head.py --method eagle3 --parallel-drafting``: the head, its loss, its report.

P-EAGLE (AWS 2026: the speculators library's ``peagle`` algorithm, the ``amazon/*-p-eagle``
checkpoints) trains an EAGLE-3 head to draft
``K = --parallel-depths`` tokens in one forward (``specdec.heads.peagle``). Each training window is
read by the frozen target once (its hidden states at the head's ``aux_layers``, its distributions
over the head's draft vocabulary); each step runs ``parallel_train_forward`` over a batch: depth 0
is every row's ordinary EAGLE-3 prediction (row ``t``: token ``x_{t+1}`` beside the target's
features at ``t``, predicting ``x_{t+2}``, as ``train_forward``'s step 0), depth ``d >= 1`` a mask
copy of anchor ``t`` (the mask token beside ``mask_hidden``) at position ``t + d`` predicting
``x_{t+2+d}``, seeing the real rows up to its anchor and its group's shallower copies. Deeper depths
keep fewer anchors (COD sampling, ``--cod-ratio`` r: depth ``d`` about ``n * r^d``, drawn afresh
each step), all in a window's generated part when it has one (``first_anchor``). The run below shapes
its windows as the benchmarks serve: 128 tokens of text, then 64 of the target's greedy continuation,
which is what a served step's drafts are accepted against (after 400 steps, greedy on 12 held-out
prompts at k = 4: windows of 98 tokens of plain text gave 1.84 tokens per step, of 32 text tokens then
the target's 1.95, these windows 2.13 at lr 1e-3 and 2.19 at 2e-3, the lr kept). The loss
is the soft cross-entropy against the target's distribution at each row's label (as the EAGLE-3
loss), depth ``d`` weighted ``0.8 ** d`` as EAGLE-3's training-time-test steps.

The head starts from an EAGLE-3 head (``--init-head``, the shipped ``models/tiny-eagle3``: its draft
vocabulary, its embedding, its layers), with ``mask_hidden`` drawn from a normal(0, 1) as speculators
initialises it; every weight trains but an embedding shared with the target (frozen, as EAGLE-3's).
The mask token is ``train_pard_draft.py``'s (the byte-level token of byte 0xFF, which UTF-8 never
holds; checked absent from the corpus), written to config.json as ``mask_token_id``.

Report: per-depth top-1 agreement with the target's greedy token on held-out windows, before and after
training, with the share of anchors whose depths ``0 .. d`` all agree (what one greedy step accepts);
and greedy decoding of held-out prompts in the engine at ``--k``, the P-EAGLE head drafting in
parallel beside the EAGLE-3 head it started from drafting a chain (tokens per step).

    python scripts/train_draft_head.py --method eagle3 --parallel-drafting --target models/tiny-target \
        --out models/tiny-peagle --steps 2200 --windows 2400 --seq-len 190 --generated-share 1.0 \
        --generated-prompt-tokens 128 --parallel-depths 5 --cod-ratio 0.8 --lr 2e-3 --corpus-chars 16000000 \
        --baseline-draft ""
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm
from train_pard_draft import choose_mask_token
from train_tiny_models import corpus_files, encode_stream, read_texts

from specdec.fast.checkpoint import read_config
from specdec.heads import build_head_proposer
from specdec.heads.formats import load_eagle3, save_eagle3
from specdec.heads.peagle import PEagleHead, cod_anchors, parallel_train_forward
from specdec.tokenizer import load_tokenizer

DEPTH_DECAY = 0.8  # depth d's weight: 0.8 ** d, EAGLE-3's weight of its training-time-test step d
REPO_ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser) -> None:
    parser.add_argument("--parallel-drafting", action="store_true",
                        help="eagle3: a P-EAGLE head, every draft of a step from one forward (train_peagle.py)")
    parser.add_argument("--parallel-depths", type=int, default=4, help="eagle3 --parallel-drafting: depths K trained")
    parser.add_argument("--cod-ratio", type=float, default=0.8,
                        help="eagle3 --parallel-drafting: depth d keeps about n * ratio ** d anchors (COD sampling)")
    parser.add_argument("--init-head", type=Path, default=REPO_ROOT / "models" / "tiny-eagle3",
                        help="eagle3 --parallel-drafting: the EAGLE-3 head it starts from (and is compared with)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="eagle3 --parallel-drafting: the mask token (default: byte 0xFF's token)")


def check_arguments(parser, args) -> None:
    if args.parallel_drafting and args.method != "eagle3":
        parser.error(f"--parallel-drafting is for --method eagle3, not {args.method}")
    if args.parallel_drafting and (args.parallel_depths < 2 or not 0.0 < args.cod_ratio <= 1.0):
        parser.error(f"--parallel-depths must be >= 2 and --cod-ratio in (0, 1], got {args.parallel_depths} and "
                     f"{args.cod_ratio}")  # fmt: skip


def build_peagle(args, arch, mask_token_id: int) -> PEagleHead:
    """The P-EAGLE head: ``--init-head``'s weights, ``mask_hidden`` normal(0, 1) (seeded)."""
    eagle = load_eagle3(args.init_head, args.target, torch.float32, "cpu")
    head = PEagleHead(eagle.config, mask_token_id)
    missing, unexpected = head.load_state_dict(eagle.state_dict(), strict=False)
    assert missing == ["mask_hidden"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        head.mask_hidden.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(args.seed + 7))
    head.embed_tokens.weight.requires_grad_(head.config.hidden_size != arch.hidden_size)  # the target's: frozen
    return head


def peagle_loss(head: PEagleHead, window, features, target_logp, groups: list[torch.Tensor]) -> torch.Tensor:
    """Depth 0's row t and depth d's copy of anchor t scored on the target's distribution at row t + 1 + d."""
    outputs = parallel_train_forward(head, window[:, 1:], features[:, :-1].float(), groups)
    labels = target_logp[:, 1:].float()  # [B, T, draft_vocab]: row t's label, depth 0
    anchors = [torch.arange(labels.shape[1]), *groups]
    total = weights = 0.0
    for d, (logits, rows) in enumerate(zip(outputs, anchors)):
        want = labels[:, rows + d]  # [B, n_d, draft_vocab]
        total = total + DEPTH_DECAY**d * -(want.exp() * logits.float().log_softmax(-1)).sum(-1).mean()
        weights += DEPTH_DECAY**d
    return total / weights


def fit(args, target, data, windows, target_outputs, train, make_windows):
    """The head trained on ``windows`` and written to ``--out`` (``target_outputs``, ``train`` and ``make_windows``:
    the trainer's); returns it, the losses and the report's P-EAGLE entries."""
    tokenizer = load_tokenizer(args.target)
    _, held_files = corpus_files()
    held = encode_stream(tokenizer, read_texts(held_files, args.corpus_chars // 8))
    mask_token_id, why = choose_mask_token(tokenizer, [data, held], args.mask_token_id)
    arch = read_config(args.target)
    head = build_peagle(args, arch, mask_token_id)
    held_windows = make_windows(target, held, argparse.Namespace(**{**vars(args), "windows": args.eval_prompts * 4,
                                                                    "seed": args.eval_seed}))  # fmt: skip
    before = held_out_depths(head, target, held_windows, args)  # the init head's depth 0, a random mask's others
    pool = target_outputs(target, windows, args, head.config.aux_layers, head.t2d.nonzero().flatten())
    anchors = torch.Generator().manual_seed(args.seed + 3)

    def loss(window, features, target_logp):
        groups = cod_anchors(window.shape[1] - 1, args.parallel_depths, args.cod_ratio, anchors, first_anchor(args))
        return peagle_loss(head, window, features, target_logp, groups)

    losses = train(args, head, loss, pool)
    after = held_out_depths(head, target, held_windows, args)
    shared = head.config.hidden_size == arch.hidden_size  # the target's embedding: the loader shares it
    save_eagle3(head, args.out, verifier=str(args.target), num_speculative_tokens=args.k, embedding=not shared)
    started_from = args.init_head.resolve()
    started_from = started_from.relative_to(REPO_ROOT) if started_from.is_relative_to(REPO_ROOT) else started_from
    report = {"started_from": str(started_from), "mask_token": {"key": "mask_token_id", "id": mask_token_id,
                                                                  "why": why},
              "parallel_depths": args.parallel_depths, "cod_ratio": args.cod_ratio,
              "held_out_depth_top1_agreement": {"what": held_out_what(held_windows, args), "before": before,
                                                "after": after}}
    return head, losses, report  # fmt: skip


def first_anchor(args) -> int:
    """The first anchor row whose copies are trained and measured: where a window's generated part starts when it
    has one (row ``t`` reads token ``x_{t+1}``; a copy's label rows must follow the target's own tokens: the
    target's distribution after written text is not what a served step is accepted against, as PARD found)."""
    return max(args.generated_prompt_tokens - 2, 0) if args.generated_share > 0 else 0


def held_out_what(windows: torch.Tensor, args) -> str:
    return (f"argmax at depth d (0: the next draft; d >= 1: mask d) == the target's greedy token there, every anchor "
            f"from row {first_anchor(args)} of {len(windows)} held-out windows of {windows.shape[1]} tokens "
            f"(--generated-share {args.generated_share} of them the target's continuation from token "
            f"{args.generated_prompt_tokens}); all_agree: depths 0 .. d all agree")


@torch.no_grad()
def held_out_depths(head: PEagleHead, target, windows: torch.Tensor, args) -> dict:
    """Per depth, top-1 agreement with the target's greedy token, and the share of anchors whose depths 0 .. d
    all agree, over every anchor of ``windows`` [W, T] from ``first_anchor`` whose depths all have a label."""
    head.eval()
    depths = args.parallel_depths
    agree, prefix, total = torch.zeros(depths), torch.zeros(depths), 0
    for chunk in tqdm(windows.split(args.batch_size), desc="held-out depths", mininterval=5):
        out = target(chunk, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in head.config.aux_layers], -1)[:, :-1]  # [b, T, F]
        rows = chunk.shape[1] - 1
        groups = [torch.arange(first_anchor(args), rows - depths + 1)] * (depths - 1)  # labels at every depth
        outputs = parallel_train_forward(head, chunk[:, 1:], features, groups)
        greedy = out.logits.argmax(-1)[:, 1:]  # [b, T]: row t's target greedy token (x_{t+2})
        anchors, targets = groups[0], torch.arange(head.config.draft_vocab_size) + head.d2t  # [n], [draft_vocab]
        hits = torch.stack([targets[(o[:, anchors] if d == 0 else o).argmax(-1)] == greedy[:, anchors + d]
                            for d, o in enumerate(outputs)], -1).float()  # [b, n, depths]  # fmt: skip
        agree += hits.sum((0, 1))
        prefix += hits.cumprod(-1).sum((0, 1))
        total += hits.shape[0] * hits.shape[1]
    return {"top1": [round(x, 4) for x in (agree / total).tolist()],
            "all_agree": [round(x, 4) for x in (prefix / total).tolist()], "anchors": total}  # fmt: skip


def engine_proposers(args) -> list[tuple[str, object]]:
    """What the engine evaluation compares: the new head drafting in parallel, the head it started from as a chain."""
    return [("eagle3+parallel", build_head_proposer("eagle3", args.out, args.target, "float32", "cpu", 2,
                                                    parallel_drafting=True)),
            ("eagle3", build_head_proposer("eagle3", args.init_head, args.target, "float32", "cpu", 2))]  # fmt: skip
