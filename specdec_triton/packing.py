"""How per-sequence values, lists and distributions are laid into the tensors of a packed request.

A request to draft_proposer, target_verifier or rejection_sampler carries one or more
sequences: a per-sequence value is an ``[S]`` array, a per-sequence list is one flat
array plus ``num_<name>`` (its length for each sequence), and distributions are rows
stacked across the sequences that have one, flagged by ``has_<name>``. ``wire`` names
the tensors of each model; this module packs and unpacks them, and names the input at
fault when a request does not add up.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from specdec_triton.plumbing import RequestError

NO_PROBS = np.zeros((0, 0), dtype=np.float32)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def one(value, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)


def required(inputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in inputs:
        raise RequestError(f"input '{name}' is required")
    return inputs[name]


def each(inputs: Mapping[str, np.ndarray], name: str, count: int, kind: type, default) -> list:
    """One value per sequence from an ``[S]`` input; ``default`` for each when it is absent."""
    if name not in inputs:
        return [default] * count
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size != count:
        raise RequestError(f"input '{name}' must hold one value per sequence ({count}), got {values.size}")
    if kind is float and not np.all(np.isfinite(values)):
        raise RequestError(f"input '{name}' must hold finite numbers, got {values.tolist()}")
    return [kind(v) for v in values.tolist()]


NO_POSITION = -1  # on the wire: a sequence whose sampler draws are keyed by its seed alone


def optional_positions(positions) -> np.ndarray:
    """``[S]`` int64 of sampling positions; a None goes as ``NO_POSITION``."""
    return i64([NO_POSITION if position is None else position for position in positions])


def each_optional_position(inputs: Mapping[str, np.ndarray], name: str, count: int) -> list[int | None]:
    """``optional_positions`` read back: one position or None per sequence (None for all when absent)."""
    positions = each(inputs, name, count, int, NO_POSITION)
    if any(n < NO_POSITION for n in positions):
        raise RequestError(f"input '{name}' must hold output positions >= 0 ({NO_POSITION}: none), got {positions}")
    return [None if n == NO_POSITION else n for n in positions]


def validated(items: list) -> list:
    """``items``, each of whose ``validate()`` passed; its ValueError names a field, which is the input's name."""
    for item in items:
        try:
            item.validate()
        except ValueError as err:
            raise RequestError(f"input {err}") from None
    return items


def flat(lists: Sequence[Sequence[int]]) -> np.ndarray:
    return i64([value for values in lists for value in values])


def split(inputs: Mapping[str, np.ndarray], name: str, lengths: list[int] | str, count: int) -> list[list[int]]:
    """A flat input cut into the sequences' lists; ``lengths`` a str: the input that holds them."""
    flat = i64(inputs.get(name, np.zeros(0, np.int64))).tolist()
    if isinstance(lengths, str):
        count_name = lengths
        if count_name not in inputs:
            if count != 1:
                raise RequestError(f"input '{count_name}' is required when a request carries {count} sequences")
            return [flat]
        lengths = each(inputs, count_name, count, int, 0)
        if any(n < 0 for n in lengths):
            raise RequestError(f"input '{count_name}' must not be negative, got {lengths}")
    if sum(lengths) != len(flat):
        raise RequestError(
            f"input '{name}' holds {len(flat)} values but its sequences' lengths add up to {sum(lengths)}"
        )
    return cut(flat, lengths)


def cut(values: list, lengths: Sequence[int]) -> list[list]:
    """``values`` in consecutive pieces of ``lengths`` (the caller has checked that they add up)."""
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def stack_probs(probs: Sequence[torch.Tensor | None]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the sequences that have a distribution, stacked, and the ``has_*`` flag of each."""
    has = np.array([p is not None for p in probs], dtype=np.bool_)
    present = [p.detach().float().cpu() for p in probs if p is not None]
    if not present:
        return NO_PROBS, has
    return (present[0] if len(present) == 1 else torch.cat(present)).numpy(), has  # one alone: no copy


def unstack_probs(
    inputs: Mapping[str, np.ndarray], name: str, rows: list[int]
) -> list[torch.Tensor | None]:
    """Each sequence's ``[rows, vocab]`` slice of ``name``, or None when it has none (``has_<name>``)."""
    array = inputs.get(name)
    if array is None or array.size == 0:
        return [None] * len(rows)
    tensor = torch.from_numpy(np.ascontiguousarray(array, np.float32))
    flag_name = f"has_{name}"
    if flag_name not in inputs:
        if len(rows) == 1:  # a lone sequence: its distribution, whatever its shape (the model checks it)
            return [tensor]
        has = [True] * len(rows)
    else:
        has = each(inputs, flag_name, len(rows), bool, False)
    wanted = sum(n for n, h in zip(rows, has) if h)
    if tensor.dim() != 2 or tensor.shape[0] != wanted:
        raise RequestError(f"input '{name}' must have {wanted} rows (one per position of the flagged sequences), "
                           f"got shape {list(tensor.shape)}")  # fmt: skip
    out, start = [], 0
    for n, h in zip(rows, has):
        out.append(tensor[start : start + n] if h else None)
        start += n if h else 0
    return out
