"""A preallocated KV cache with one slot per sequence (after gpt-fast's static cache).

Every sequence owns one slot of a tensor allocated once, so shapes never change and
the forward pass can be captured as a CUDA graph. A slot's *length* says how many
positions hold valid keys and values; rolling back rejected draft tokens only lowers
the length -- stale entries past it are masked out and overwritten by the next write.

One extra *scratch* slot (index ``max_num_seqs``) absorbs the writes of padding
tokens in a ragged batch, so padding never lands in a live sequence's slot.
"""
from __future__ import annotations

import heapq

import torch


class StaticKVCache:
    """The single owner of a model's keys and values and of the seq_id -> slot mapping."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.scratch_slot = max_num_seqs
        # kv: [num_layers, 2 (key, value), max_num_seqs + 1, num_kv_heads, max_model_len, head_dim]
        self.kv = torch.zeros(
            (num_layers, 2, max_num_seqs + 1, num_kv_heads, max_model_len, head_dim), dtype=dtype, device=device
        )
        self._free = list(range(max_num_seqs))  # a min-heap: the lowest free slot is reused first
        self._slots: dict[str, int] = {}
        self._lengths: dict[str, int] = {}

    @property
    def num_active(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._slots

    def slot(self, seq_id: str) -> int:
        return self._slots[seq_id]

    def length(self, seq_id: str) -> int:
        """Valid positions cached for ``seq_id``; 0 for a sequence without a slot."""
        return self._lengths.get(seq_id, 0)

    def allocate(self, seq_id: str) -> int:
        if seq_id in self._slots:
            raise ValueError(f"seq {seq_id!r} already holds slot {self._slots[seq_id]}")
        if not self._free:
            raise RuntimeError(
                f"KV cache is full: all max_num_seqs={self.max_num_seqs} slots are in use; "
                f"release finished sequences or raise max_num_seqs"
            )
        slot = heapq.heappop(self._free)
        self._slots[seq_id] = slot
        self._lengths[seq_id] = 0
        return slot

    def set_length(self, seq_id: str, length: int) -> None:
        """Roll back (or advance after a write) by moving the length; nothing is copied."""
        if not 0 <= length <= self.max_model_len:
            raise ValueError(f"seq {seq_id!r}: length must be in [0, {self.max_model_len}], got {length}")
        self._lengths[self._check(seq_id)] = length

    def move(self, seq_id: str, moves: tuple[tuple[int, int], ...]) -> None:
        """Copy the keys and values at each ``from`` position to its ``to`` (an accepted tree path moving down).

        The sources are read before any destination is written, so overlapping moves are safe.
        """
        if not moves:
            return
        slot = self.slot(self._check(seq_id))
        index = torch.tensor(moves, dtype=torch.long).to(self.kv.device, non_blocking=True)  # [m, 2]
        self.kv[:, :, slot, :, index[:, 1]] = self.kv[:, :, slot, :, index[:, 0]]

    def release(self, seq_id: str) -> None:
        """Free the slot of ``seq_id``; a no-op for unknown ids."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            del self._lengths[seq_id]
            heapq.heappush(self._free, slot)

    def _check(self, seq_id: str) -> str:
        if seq_id not in self._slots:
            raise KeyError(f"seq {seq_id!r} has no KV cache slot")
        return seq_id
