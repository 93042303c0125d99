"""The drafter a ``draft_proposer`` configuration names, built where it runs.

A draft model or head runs in one of two places, both configured in
``draft_proposer/config.pbtxt``: its own model (``draft_proposer``'s process, with its
own ``instance_group`` and device), or with the target (``run_with_target``: loaded by
``target_verifier`` on its device, one call a step; a head reads the target's hidden
states where they are made). n-gram lookup and suffix decoding hold nothing but the
sequence's tokens, so they run in the orchestrator, which holds those already
(:mod:`specdec.proposers.model_free`); draft_proposer then only describes their settings.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.fast.checkpoint import read_config
from specdec.grammar import GrammarCompiler
from specdec.guided_drafts import GuidedDrafts
from specdec.heads import HEAD_METHODS, build_head_proposer, describe_head
from specdec.methods import METHODS
from specdec.proposers import PROPOSERS, NgramProposer, SuffixProposer, describe_model_free
from specdec.proposers.base import Proposer
from specdec.proposers.pard import ParallelDraftProposer, read_mask_token
from specdec.tokenizer import load_tokenizer
from specdec.tree import DraftTree
from specdec.types import ModelDescription
from specdec_triton import wire
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.repository_config import model_settings


@dataclass(frozen=True)
class LoadedDraft:
    proposer: Proposer  # a draft model's, a head's or a model-free one's
    description: ModelDescription


def build_proposer(config: DraftProposerConfig, device: str, log=None) -> LoadedDraft:
    """The proposer ``config`` names, and its description: what draft_proposer serves, wherever it runs."""
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        return LoadedDraft(proposer, describe_model_free(proposer))
    if config.method == "suffix":
        proposer = SuffixProposer(config.suffix)
        return LoadedDraft(proposer, describe_model_free(proposer))
    if config.method in HEAD_METHODS:
        proposer = build_head_proposer(config.method, config.draft_model, config.target_model, config.dtype, device,
                                       config.max_num_seqs, config.cpu_compile, max_model_len=config.max_model_len,
                                       tree=config.token_tree, log=log, parallel_drafting=config.parallel_drafting)
        _check_draft_limit(proposer, config)
        if config.parallel_drafting and log is not None:
            log(f"parallel_drafting: {config.draft_model} drafts a step's tokens in one forward (P-EAGLE), mask "
                f"token {proposer.mask_token_id}")
        path = config.target_model if METHODS[config.method].in_target_checkpoint else config.draft_model  # MTP: its own
        return LoadedDraft(proposer, _with_suffix_first(describe_head(proposer, path), config))
    _check_draft_window(config)
    mask_token = read_mask_token(config.draft_model) if config.parallel_drafting else None  # before the load
    lm = build_lm(config.draft_model, config.engine, config.dtype, device, config.max_num_seqs, config.max_model_len,
                  log=log, cpu_compile=config.cpu_compile, warm_trees=config.token_tree is not None)  # fmt: skip
    description = describe_lm(lm, config.draft_model, config.method)
    if mask_token is None:
        proposer = PROPOSERS[config.method](lm, config.token_tree)
    else:
        proposer = ParallelDraftProposer(lm, mask_token)
        if log is not None:
            log(f"parallel_drafting: {config.draft_model} drafts a step's tokens in one forward, mask token "
                f"{mask_token} (pard_token)")
    return LoadedDraft(proposer, _with_suffix_first(description, config))  # a causal LM's


def drafting_under_grammars(loaded: LoadedDraft, config: DraftProposerConfig, log) -> GuidedDrafts:
    """The proposer, following each request's grammar while it drafts (:mod:`specdec.guided_drafts`)."""
    # a head's target checkpoint's tokenizer, or the draft model's own, which shares the target's vocabulary
    # (the orchestrator checks it): here the copy only steers drafting, the orchestrator's grammar verifies
    tokenizer_dir = config.target_model or config.draft_model
    return GuidedDrafts(loaded.proposer, grammar_compiler(tokenizer_dir, loaded.description.vocab_size), log=log)


def grammar_compiler(tokenizer_dir: str, vocab_size: int) -> Callable[[], GrammarCompiler]:
    """What makes the compiler of a drafter's guides for ``tokenizer_dir``'s tokenizer and ``vocab_size`` mask
    width, at the first request with a guide (a server that never sees one loads no tokenizer for it)."""
    return lambda: GrammarCompiler(load_tokenizer(tokenizer_dir), vocab_size)


def _with_suffix_first(description: ModelDescription, config: DraftProposerConfig) -> ModelDescription:
    """A model's description, carrying suffix decoding's settings when it runs in front (the orchestrator runs it)."""
    if config.suffix_first is None:
        return description
    return replace(description, settings=config.suffix_first.settings())


def _check_draft_limit(proposer: Proposer, config: DraftProposerConfig) -> None:
    """A drafter whose checkpoint caps a call's drafts (``Proposer.draft_limit``: an MLP speculator's
    ``n_predict`` stages, Medusa's heads, DFlash's ``block_size - 1`` masks): a server whose steps ask more
    would say ready and then fail every request, so the load fails instead, naming both values and the fix."""
    limit = proposer.draft_limit
    if limit is None:
        return
    if isinstance(config.token_tree, DraftTree):  # a tree's depth is what reaches the heads; its nodes are k
        return  # build_head_proposer refuses a tree deeper than the heads, naming both
    if config.most_drafts is not None and config.most_drafts > limit.most:
        setting = ("draft_proposer's model_num_speculative_tokens" if config.suffix_first is not None
                   and config.suffix_first.model_num_speculative_tokens else "speculative_decoding's "
                   "num_speculative_tokens (and the largest k of num_speculative_tokens_per_batch_size)")  # fmt: skip
        raise ValueError(
            f"{limit.drafter[:1].upper()}{limit.drafter[1:]} {config.draft_model!r} has {limit.setting} {limit.counts}, "
            f"but a step may ask it for {config.most_drafts} drafts: set {setting} to at most {limit.most}"
        )


def _check_draft_window(config: DraftProposerConfig) -> None:
    """A fast-engine draft trained for fewer positions than its window (often target_verifier's) is refused
    with the fix, before the engine's own refusal, which names only the draft's setting."""
    if config.max_model_len is None or config.engine != "fast":
        return
    positions = read_config(config.draft_model).max_position_embeddings
    if config.max_model_len > positions:
        raise ValueError(
            f"draft model {config.draft_model!r} has max_position_embeddings {positions} but would hold "
            f"{config.max_model_len} tokens of a sequence (draft_proposer's max_model_len, or target_verifier's "
            f"where that is empty): lower target_verifier's max_model_len to at most {positions}, or serve a "
            f"draft trained for as many positions as the target serves"
        )


def drafts_trees(repository_dir: str | os.PathLike) -> bool:
    """Whether draft_proposer's drafter makes draft trees (a static or dynamic tree, suffix decoding's own):
    target_verifier then compiles their passes at load. A draft_proposer that cannot be read says no; its
    own load names the fault."""
    found = model_settings(repository_dir, wire.DRAFT_PROPOSER)
    if found is None:
        return False
    try:
        config = DraftProposerConfig.from_parameters(found[0])
    except ValueError:
        return False
    suffix = config.suffix if config.method == "suffix" or config.suffix_first is not None else None
    return config.token_tree is not None or (suffix is not None and suffix.use_tree_spec)
