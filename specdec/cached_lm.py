"""The one contract every engine keeps: a causal LM that owns one KV cache per sequence.

Each call names a ``seq_id``, the ``position`` of its first token and how many trailing
logits it wants; the cache is cut back to ``position`` first, so rolling back rejected
drafts moves a length and recomputes nothing (gpt-fast's ``input_pos``). The target
verifier and the draft proposer are written once against :class:`CachedLM`; the
``hf`` engine (:class:`specdec.models.CachedCausalLM`, any ``AutoModelForCausalLM``,
one sequence at a time) and the ``fast`` engine (:class:`specdec.fast.FastCausalLM`,
Llama family, ragged batches over a static slot cache) both implement it, and
:func:`specdec.build.build_lm` picks one from a config's ``engine``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.tree import check_parents
from specdec.types import ModelDescription

ENGINES = ("fast", "hf")  # fast: Llama family, batched, static slot cache; hf: any AutoModelForCausalLM
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: float32 on CPU, bfloat16 on GPU (specdec.models.resolve_dtype)


@dataclass(frozen=True)
class ForwardCall:
    seq_id: str
    position: int  # sequence index of token_ids[0]; the cache is cut back to this length first
    token_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens
    # token_ids[1:] form a tree under token_ids[0] (specdec.tree): each attends to its ancestors
    # alone, at the position of its depth; None: a chain
    tree_parents: tuple[int, ...] | None = None
    # (from, to) cache positions whose keys and values are copied before the call, in order: an
    # accepted tree path moving down to the positions of its depths
    moves: tuple[tuple[int, int], ...] = ()


@runtime_checkable
class CachedLM(Protocol):
    vocab_size: int  # width of the logits
    max_model_len: int | None  # tokens a sequence may hold; None: unbounded
    max_num_seqs: int | None  # sequences held at once; None: unbounded
    device: torch.device

    @property
    def num_active_sequences(self) -> int: ...

    def forward(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """One float32 ``[num_logits, vocab]`` tensor per call, in order; each seq_id at most once."""
        ...

    def forward_with_hidden(
        self, calls: list[ForwardCall], hidden_layers: tuple[int, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """``forward``, and per call the hidden states of every token fed: ``[n, len(hidden_layers) * hidden]``.

        Ids index transformers' ``output_hidden_states``: ``i`` below the layer count is the
        input of layer ``i``, the layer count itself the final normed state.
        """
        ...

    def cached_length(self, seq_id: str) -> int:
        """Tokens the cache holds for ``seq_id``; 0 for an unknown one."""
        ...

    def release(self, seq_id: str) -> None:
        """Free the sequence's cache; a no-op for an unknown id."""
        ...


def check_forward_calls(lm: CachedLM, calls: list[ForwardCall], num_fresh: int) -> None:
    """Refuse a batch before any cache moves: the one place both engines check their input.

    ``num_fresh``: how many of the calls' sequences the engine holds no cache for yet.
    """
    seq_ids = [c.seq_id for c in calls]
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"a batch may hold each seq_id once, got {seq_ids}")
    for call in calls:
        n, cached = len(call.token_ids), lm.cached_length(call.seq_id)
        if n == 0:
            raise ValueError(f"seq {call.seq_id!r}: token_ids must not be empty")
        if not 1 <= call.num_logits <= n:
            raise ValueError(f"seq {call.seq_id!r}: num_logits must be in [1, {n}], got {call.num_logits}")
        if not 0 <= call.position <= cached:
            raise ValueError(
                f"seq {call.seq_id!r}: position {call.position} is outside the {cached} tokens cached; "
                f"a call may only continue or cut back the cache"
            )
        if lm.max_model_len is not None and call.position + n > lm.max_model_len:
            raise ValueError(
                f"seq {call.seq_id!r}: {call.position + n} tokens exceed max_model_len={lm.max_model_len}"
            )
        if not all(0 <= t < lm.vocab_size for t in call.token_ids):
            raise ValueError(f"seq {call.seq_id!r}: token_ids must be in [0, {lm.vocab_size})")
        if call.tree_parents is not None:
            check_parents(call.tree_parents, n - 1, f"seq {call.seq_id!r}: tree_parents")
        if any(not (0 <= a < cached and 0 <= b < cached) for a, b in call.moves):
            raise ValueError(f"seq {call.seq_id!r}: moves {list(call.moves)} reach past the {cached} tokens cached")
    if lm.max_num_seqs is None:
        return
    free = lm.max_num_seqs - lm.num_active_sequences
    if num_fresh > free:
        raise RuntimeError(
            f"KV cache is full: {num_fresh} new sequences but only {free} of max_num_seqs={lm.max_num_seqs} "
            f"slots are free; release finished sequences or raise max_num_seqs"
        )


def check_model_dir(path: str | os.PathLike) -> str:
    """Models load from local directories only; a missing one is named before any loader runs."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} does not exist or is not a directory")
    return path


def describe_lm(lm: CachedLM, path: str | os.PathLike, method: str) -> ModelDescription:
    """What a served model tells the orchestrator at load: which checkpoint, and its limits."""
    return ModelDescription(os.path.realpath(path), lm.vocab_size, lm.max_model_len, lm.max_num_seqs, method)


class OwnsOneModel:
    """What a verifier or draft proposer reports about the one :class:`CachedLM` it owns (``self.lm``)."""

    lm: CachedLM

    @property
    def num_active_sequences(self) -> int:
        return self.lm.num_active_sequences

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self.lm.max_model_len

    @property
    def max_num_seqs(self) -> int | None:
        return self.lm.max_num_seqs

    def release(self, seq_id: str) -> None:
        self.lm.release(seq_id)
