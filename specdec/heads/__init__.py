"""Draft heads that read the target's hidden states: EAGLE-3 (P-EAGLE with ``parallel_drafting``), the MLP
speculator, Medusa, DFlash and the target's own MTP layer (``specdec.heads.mtp``, read from the target's
checkpoint: ``path`` is not read).

``build_head_proposer`` loads a head directory (``specdec.heads.formats``) for the target
checkpoint it drafts for and wraps it in its proposer; ``describe_head`` is what the
draft_proposer model tells the orchestrator, the target hidden states it reads included.
"""
from __future__ import annotations

import os

import torch

from specdec.fast.checkpoint import read_config
from specdec.methods import HEAD, METHODS, names_of
from specdec.fast.cpu_linear import cpu_packing_available, pack_linears
from specdec.fast.llama import default_triton_attention
from specdec.models import resolve_dtype
from specdec.progress import Log
from specdec.tree import DraftTree
from specdec.types import ModelDescription

HEAD_METHODS = names_of(HEAD)


def check_head(method: str, path: str | os.PathLike, target_path: str | os.PathLike,
               parallel_drafting: bool = False) -> None:  # fmt: skip
    """Refuse a head of another kind than ``method``, or one built for another target, from the
    configs alone: what a load would refuse, without reading weights. ``parallel_drafting``: an
    EAGLE-3 head must be a P-EAGLE one (a mask token in its config, ``mask_hidden`` among its weights' names)."""
    from specdec.heads.formats import eagle3_config, head_kind, peagle_mask_token, read_head_config
    from specdec.heads.medusa import medusa_config
    from specdec.heads.mlp_speculator import mlp_speculator_config

    if parallel_drafting and not METHODS[method].parallel_drafting:
        able = [m.name for m in METHODS.values() if m.parallel_drafting]
        raise ValueError(f"parallel_drafting is for methods {able}, not {method!r}")
    if METHODS[method].in_target_checkpoint:
        from specdec.heads.mtp import mtp_config

        mtp_config(target_path)  # refuses a target without MTP layers
        return
    kind = head_kind(read_head_config(path))
    if kind != method:
        raise ValueError(
            f"draft head {os.fspath(path)!r} is a {kind or 'plain causal LM'} checkpoint, not {method}; "
            f"set method to match it (one of {HEAD_METHODS}, or draft_model for a causal LM)"
        )
    if method == "eagle3":
        eagle3_config(path, read_config(target_path), os.fspath(target_path))
        if parallel_drafting:
            peagle_mask_token(path)
    elif method == "dflash":
        from specdec.heads.dflash import dflash_config

        dflash_config(path, target_path)
    elif method == "medusa":
        medusa_config(path, target_path)
    else:
        mlp_speculator_config(path, target_path)


def build_head_proposer(
    method: str,
    path: str | os.PathLike,
    target_path: str | os.PathLike,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_num_seqs: int = 8,
    cpu_compile: bool = False,
    cuda_graphs: bool | None = None,
    max_model_len: int | None = None,
    tree: DraftTree | None = None,
    log: Log | None = None,
    parallel_drafting: bool = False,
):
    """The proposer for the head at ``path``; refuses a head of another kind or for another target.

    ``parallel_drafting``: an EAGLE-3 head trained to draft in parallel (P-EAGLE, ``specdec.heads.peagle``)
    drafts every token of a step in one forward (``specdec.proposers.peagle``); a head without a mask
    token or ``mask_hidden``, another method, or a tree is refused.

    ``tree``: the static draft tree it drafts (``specdec.tree``; None or a chain: a chain); EAGLE-3, Medusa
    and the MLP speculator draft trees, DFlash and MTP a chain only. A tree deeper than Medusa's heads or the
    MLP speculator's stages is refused.

    ``max_model_len``: the tokens a sequence may hold in the head's cache and feature buffer
    (None: the target's ``max_position_embeddings``, as vLLM sizes a head).

    ``cpu_compile``: an EAGLE-3 head's forward compiled on CPU (``specdec.fast.cpu_compile``);
    ignored on GPU and for the MLP speculator, Medusa and DFlash (one eager pass a step). ``cuda_graphs``: an
    EAGLE-3 head's passes replay captured graphs (None: wherever it runs on CUDA). ``log``: a line as its
    compile starts, progresses and ends.
    """
    check_head(method, path, target_path, parallel_drafting)
    if parallel_drafting and tree is not None and not (isinstance(tree, DraftTree) and tree.is_chain):
        raise ValueError("speculative_token_tree: parallel_drafting drafts a chain in one forward; a tree is drafted "
                         "with parallel_drafting false")  # fmt: skip
    torch_dtype = resolve_dtype(dtype, device)
    if METHODS[method].in_target_checkpoint:  # the target's own MTP layer
        return _mtp_proposer(target_path, torch_dtype, device, max_num_seqs, cpu_compile, cuda_graphs, max_model_len,
                             tree, log)  # fmt: skip
    if method == "eagle3":
        from specdec.heads.formats import load_eagle3
        from specdec.proposers.eagle3 import Eagle3Proposer

        head = load_eagle3(path, target_path, torch_dtype, device, parallel_drafting)
        positions = _place_decoder_head(head, target_path, torch_dtype, device, max_model_len)
        compiled = cpu_compile and torch.device(device).type == "cpu"
        if parallel_drafting:
            from specdec.proposers.peagle import PEagleProposer

            return PEagleProposer(head, max_num_seqs, positions, compiled, cuda_graphs, log)
        return Eagle3Proposer(head, max_num_seqs, positions, compiled, cuda_graphs, tree, log)
    if method == "medusa":
        from specdec.heads.medusa import load_medusa
        from specdec.proposers.medusa import MedusaProposer

        model = load_medusa(path, target_path, torch_dtype, device)
        return MedusaProposer(model, read_config(target_path).num_layers, tree)
    if method == "dflash":
        if tree is not None and not tree.is_chain:
            raise _chain_only(method)
        from specdec.heads.dflash import load_dflash
        from specdec.proposers.dflash import DFlashProposer

        model = load_dflash(path, target_path, torch_dtype, device)
        if torch.device(device).type == "cpu" and cpu_packing_available(torch_dtype):
            pack_linears(model)  # as the fast engine does: small-row passes near memory bandwidth
        positions = read_config(target_path).max_position_embeddings  # the context spans the target's positions
        if max_model_len is not None and max_model_len > positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds target {str(target_path)!r}'s "
                             f"max_position_embeddings {positions}")  # fmt: skip
        return DFlashProposer(model, max_num_seqs, max_model_len or positions)
    from specdec.heads.mlp_speculator import load_mlp_speculator
    from specdec.proposers.mlp_speculator import MLPSpeculatorProposer

    model = load_mlp_speculator(path, target_path, torch_dtype, device)
    return MLPSpeculatorProposer(model, read_config(target_path).num_layers, tree)


def _mtp_proposer(target_path, torch_dtype, device, max_num_seqs, cpu_compile, cuda_graphs, max_model_len, tree, log):
    """The target's own MTP layer as a chain proposer, placed and sized as an EAGLE-3 head is."""
    from specdec.heads.mtp import load_mtp
    from specdec.proposers.mtp import MTPProposer

    if tree is not None and not (isinstance(tree, DraftTree) and tree.is_chain):
        raise _chain_only("mtp")
    head = load_mtp(target_path, torch_dtype, device)
    positions = _place_decoder_head(head, target_path, torch_dtype, device, max_model_len)
    compiled = cpu_compile and torch.device(device).type == "cpu"
    return MTPProposer(head, max_num_seqs, positions, compiled, cuda_graphs, log)


def _place_decoder_head(head, target_path, torch_dtype, device, max_model_len: int | None) -> int:
    """Set up a head that runs a decoder layer with its own cache (EAGLE-3, MTP); the positions its cache spans.

    Its linears packed on CPU as the fast engine packs the target's (small-row passes near memory
    bandwidth), the Triton attention where it runs; its cache spans the target's positions (as in
    vLLM), not those its layer config names, or ``max_model_len`` where that is fewer.
    """
    if torch.device(device).type == "cpu" and cpu_packing_available(torch_dtype):
        pack_linears(head)
    if default_triton_attention(device):
        head.use_triton_attention()
    positions = read_config(target_path).max_position_embeddings
    if max_model_len is not None and max_model_len > positions:
        raise ValueError(f"max_model_len {max_model_len} exceeds target {str(target_path)!r}'s "
                         f"max_position_embeddings {positions}")  # fmt: skip
    return max_model_len or positions


def describe_head(proposer, path: str | os.PathLike) -> ModelDescription:
    return ModelDescription(
        os.path.realpath(path), proposer.vocab_size, proposer.max_model_len, proposer.max_num_seqs,
        proposer.method, tuple(proposer.hidden_state_layers),
    )  # fmt: skip


def _chain_only(method: str) -> ValueError:
    drafting = [m.name for m in METHODS.values() if m.drafts_static_trees]
    return ValueError(f"speculative_token_tree: method {method!r} drafts a chain only; trees are drafted by {drafting}")
