#!/usr/bin/env python3
"""Write a copy of the model repository to tune or to serve other checkpoints.

    scripts/new_repository.sh DIR [--target CKPT] [--tokenizer DIR]
                                  [--draft CKPT | --eagle3 HEAD | --mlp-speculator HEAD | --medusa HEAD
                                   | --ngram | --suffix]
                                  [--param MODEL.KEY=VALUE ...] [--source REPOSITORY]

Every checkpoint and tokenizer path of the copy is written absolute (resolved by the rule
of ``specdec_triton/paths.py`` against the source, with ``SPECDEC_MODELS_DIR`` defaulting
to this checkout's ``models/``), so the copy serves from anywhere, with or without the
variable set. ``--target`` also sets the tokenizer and detokenizer (the target's tokenizer
is the one whose ids index its logits) unless ``--tokenizer`` names another, and the
proposer's ``target_model`` (a head is checked against the target it drafts for). One of
the method flags picks ``draft_proposer.method`` and, for a learned one, its checkpoint.
Each model's parameters are then read by the model's own config class, and a head's
config against the target's, so a bad value, an unknown key or a head for another target
fails here, with the message the load would give, instead of at server start.

How many tokens a step drafts (speculative_decoding's ``num_speculative_tokens`` and
``num_speculative_tokens_per_batch_size``) is kept from the source, which chose it for its
own method and checkpoints: a copy with another method says so, since where drafting stops
paying is the method's, the pair's and the hardware's. An MLP speculator drafts at most its
``n_predict`` tokens a step, Medusa its ``num_heads``, so a copy for one has both cut to it
(and says so) unless ``--param`` sets them; set above it, the copy is refused.

    scripts/new_repository.sh /srv/repo --target /ckpt/llama-3-8b --draft /ckpt/llama-3.2-1b \\
        --param target_verifier.max_num_seqs=32 --param draft_proposer.max_num_seqs=32
    scripts/serve.sh --model-repository /srv/repo
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's packages, whichever checkout the venv installed

from bench.repository import checkpoint_edits, get_parameters, make_variant, parameter_edits  # noqa: E402
from specdec.heads import HEAD_METHODS, check_head  # noqa: E402
from specdec.heads.formats import read_head_config  # noqa: E402
from specdec.proposers.model_free import MODEL_FREE_METHODS  # noqa: E402
from specdec.speculation_length import parse_per_batch_size  # noqa: E402
from specdec_triton import configs, wire  # noqa: E402
from specdec_triton.parameters import MODELS  # noqa: E402
from specdec_triton.paths import MODELS_DIR_VARIABLE, resolve_path  # noqa: E402
from specdec_triton.plumbing import ParameterError, Parameters  # noqa: E402

ORCHESTRATOR = "speculative_decoding"
SPECULATION_LENGTH_KEYS = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")
# heads that draft at most a fixed number of tokens a step: what they are called, and the config key that says it
MOST_DRAFTS = {"mlp_speculator": ("the MLP speculator", "n_predict"), "medusa": ("the Medusa head", "num_heads")}
# the parameters holding a path, by model
PATH_PARAMETERS = {model: tuple(p.name for p in declared if p.kind == "path") for model, declared in MODELS.items()}
CONFIGS = {
    wire.TOKENIZER: configs.TokenizerConfig,
    wire.DETOKENIZER: configs.TokenizerConfig,
    wire.DRAFT_PROPOSER: configs.DraftProposerConfig,
    wire.TARGET_VERIFIER: configs.TargetVerifierConfig,
    wire.REJECTION_SAMPLER: configs.RejectionSamplerConfig,
    ORCHESTRATOR: configs.OrchestratorConfig,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path, metavar="DIR", help="the new repository; must not exist")
    p.add_argument("--source", type=Path, default=REPO_ROOT / "model_repository", help="the repository to copy")
    p.add_argument("--target", type=Path, help="target checkpoint (Hugging Face directory)")
    methods = p.add_mutually_exclusive_group()
    for flag, help_text in (("--draft", "draft model checkpoint: draft_proposer.method=draft_model"),
                            ("--eagle3", "EAGLE-3 head (speculators or original layout): method=eagle3"),
                            ("--mlp-speculator", "MLP speculator checkpoint: method=mlp_speculator"),
                            ("--medusa", "Medusa heads (vLLM's layout): method=medusa")):  # fmt: skip
        methods.add_argument(flag, type=Path, metavar="CKPT", help=help_text)
    methods.add_argument("--ngram", action="store_true", help="draft by prompt lookup: method=ngram")
    methods.add_argument("--suffix", action="store_true", help="suffix decoding: method=suffix")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the target's)")
    p.add_argument("--param", action="append", default=[], metavar="MODEL.KEY=VALUE",
                   help="any other parameter; repeatable")  # fmt: skip
    args = p.parse_args(argv)
    if args.dest.exists():
        p.error(f"{args.dest} exists; name a new directory")
    for flag in ("source", "target", "draft", "eagle3", "mlp_speculator", "medusa", "tokenizer"):
        path = getattr(args, flag)
        if path is not None and not path.exists():
            p.error(f"--{flag.replace('_', '-')} {path}: no such path")
    return args


def method_and_checkpoint(args: argparse.Namespace) -> tuple[str | None, Path | None]:
    """The proposer method the flags pick (None: the source's) and its checkpoint, if it has one."""
    for method, checkpoint in (("draft_model", args.draft), ("eagle3", args.eagle3),
                               ("mlp_speculator", args.mlp_speculator), ("medusa", args.medusa)):  # fmt: skip
        if checkpoint is not None:
            return method, checkpoint
    return ("ngram" if args.ngram else "suffix" if args.suffix else None), None


def absolute_path_edits(source: Path, edits: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Every path parameter the edits leave alone, resolved against ``source`` as the server would."""
    environ = {MODELS_DIR_VARIABLE: str(REPO_ROOT / "models"), **os.environ}
    out: dict[str, dict[str, str]] = {}
    for model, keys in PATH_PARAMETERS.items():
        config = source / model / "config.pbtxt"
        if not config.is_file():
            continue
        values = get_parameters(config.read_text())
        for key in keys:
            value = values.get(key, "")
            if value and key not in edits.get(model, {}):
                path = resolve_path(value, str(source), str(source / model), environ)
                out.setdefault(model, {})[key] = path
    return out


def speculation_length(args: argparse.Namespace, source: Path, edits: dict[str, dict[str, str]]) -> list[str]:
    """Cut the step's k and batch-size table to an MLP speculator's ``n_predict`` or Medusa's ``num_heads`` (added
    to ``edits``), or refuse them above it when ``--param`` sets them; the notes to print about what the copy
    keeps or cut."""
    method, checkpoint = method_and_checkpoint(args)
    given = {key: edits[ORCHESTRATOR][key] for key in SPECULATION_LENGTH_KEYS if key in edits.get(ORCHESTRATOR, {})}
    values = {**get_parameters((source / ORCHESTRATOR / "config.pbtxt").read_text()), **given}
    k, table = values.get("num_speculative_tokens", "4"), values.get("num_speculative_tokens_per_batch_size", "")
    if method in MOST_DRAFTS:
        head, key = MOST_DRAFTS[method]
        try:
            steps, per_batch_size = int(k), parse_per_batch_size(table)
            raw = read_head_config(checkpoint)
            n_predict = int(raw.get(key) or raw.get(f"medusa_{key}") or 0)  # medusa_num_heads: the original release's
        except (OSError, ValueError):
            return []  # the copy's checks name the bad value or head, as the load would
        most = max([steps] + [entry for _, entry in per_batch_size])
        if most <= n_predict or not n_predict:  # no n_predict: the copy's check refuses the head
            return []
        if given:
            raise ValueError(f"{ORCHESTRATOR}.num_speculative_tokens {k!r} / num_speculative_tokens_per_batch_size "
                             f"{table!r} ask for up to {most} drafts a step, but {head} {str(checkpoint)!r} "
                             f"drafts at most its {key}={n_predict}")  # fmt: skip
        cut_table = ",".join(f"{size}:{min(entry, n_predict)}" for size, entry in per_batch_size)
        edits.setdefault(ORCHESTRATOR, {}).update(num_speculative_tokens=str(min(steps, n_predict)),
                                                  num_speculative_tokens_per_batch_size=cut_table)  # fmt: skip
        return [f"{ORCHESTRATOR}: num_speculative_tokens {k} -> {min(steps, n_predict)} and "
                f"num_speculative_tokens_per_batch_size {table!r} -> {cut_table!r}, {head}'s "
                f"{key}={n_predict}"]  # fmt: skip
    source_method = get_parameters((source / wire.DRAFT_PROPOSER / "config.pbtxt").read_text()).get("method")
    if method in (None, source_method) or given:
        return []
    return [f"{ORCHESTRATOR}: kept num_speculative_tokens {k} and num_speculative_tokens_per_batch_size {table!r} "
            f"from {source}, chosen for its method and checkpoints; for {method}, measure yours with "
            f"scripts/benchmark.py at your concurrencies and set it with scripts/speculation_table.py "
            f"(docs/scheduling.md, \"How many tokens a step drafts\")"]


def follow_acceptance(args: argparse.Namespace, source: Path, edits: dict[str, dict[str, str]]) -> list[str]:
    """A copy that drafts with a model or head follows acceptance (the parameter's default), unless ``--param`` says.

    The shipped repository turns it off for suffix decoding, whose drafts it served faster
    without (docs/scheduling.md); a draft model or head is where a k that follows acceptance
    pays: it stops drafting what keeps failing.
    """
    method, _ = method_and_checkpoint(args)
    key = "speculation_follows_acceptance"
    kept = get_parameters((source / ORCHESTRATOR / "config.pbtxt").read_text()).get(key, "true")
    if method is None or method in MODEL_FREE_METHODS or key in edits.get(ORCHESTRATOR, {}) or kept == "true":
        return []
    edits.setdefault(ORCHESTRATOR, {})[key] = "true"
    return [f"{ORCHESTRATOR}: {key} false -> true: {method} drafts with a model, and drafts that keep failing "
            f"are then drafted less (docs/scheduling.md, \"Speculation that follows acceptance\")"]


def check_configs(repository: Path) -> None:
    """Read each model's parameters with its own config class: the checks its load would make,
    and for a head, that it is the method's kind and fits the target (from the configs alone)."""
    for model, config_type in CONFIGS.items():
        config = repository / model / "config.pbtxt"
        if config.is_file():
            raw = get_parameters(config.read_text())
            checked = config_type.from_parameters(Parameters(raw, str(repository), model, str(repository / model)))
            if model == wire.DRAFT_PROPOSER and checked.method in HEAD_METHODS:
                check_head(checked.method, checked.draft_model, checked.target_model, checked.parallel_drafting)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = args.source.resolve()
    try:
        edits = checkpoint_edits(args.target, *method_and_checkpoint(args), tokenizer=args.tokenizer)
        for model, values in parameter_edits(args.param).items():
            edits.setdefault(model, {}).update(values)
        for model, values in absolute_path_edits(source, edits).items():
            edits.setdefault(model, {}).update(values)
        notes = speculation_length(args, source, edits) + follow_acceptance(args, source, edits)
        make_variant(source, args.dest, edits)
        check_configs(args.dest.resolve())
    except (KeyError, ValueError) as err:  # ParameterError is a ValueError
        shutil.rmtree(args.dest, ignore_errors=True)  # it did not exist before: no half-written copy stays
        kind = "bad parameter" if isinstance(err, ParameterError) else "error"
        print(f"new_repository: {kind}: {err.args[0] if err.args else err}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"new_repository: note: {note}")
    print(f"wrote {args.dest}; serve it with: scripts/serve.sh --model-repository {args.dest.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
