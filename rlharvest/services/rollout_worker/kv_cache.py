"""A slot-based KV cache for continuous batching on CPU (and small GPUs).

Each running request owns one slot: a row of the preallocated K and V tensors
``[layers, max_slots, kv_heads, max_len, head_dim]``. Occupied slots are kept *compact* (always
``0 .. occupied-1``) by moving the last slot into any slot that is freed. The decode step then
reads its batch as a plain slice ``k[layer, :occupied, :, :longest]`` (a view: no gather, no copy)
and new requests are appended at the end, so a prefill batch is a slice too. Moving one slot on
release costs one row copy, far less than gathering every slot on every step.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    """What the decoder reads and writes (``SlotKVCache``, or ``kv_pages.PagedKVCache``)."""

    lengths: torch.Tensor  # tokens held per slot, on the device
    host_lengths: list[int]

    def store_prefill(self, layer: int, first_slot: int, k: torch.Tensor, v: torch.Tensor,
                      lengths: list[int]) -> None:
        """K, V ``[n, kv_heads, T, head_dim]`` of right-padded sequences at positions [0, T)
        of slots first_slot..; only each one's first ``lengths[i]`` positions are real."""
        ...

    def store_chunk(self, layer: int, slot: int, start: int, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """K, V ``[kv_heads, T, head_dim]`` of one slot at positions [start, start + T)."""
        ...

    def store_tokens(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """One token's K, V ``[n, kv_heads, head_dim]`` for each of the first n slots, at
        ``positions`` ``[n]``."""
        ...

    def window(self, layer: int, first_slot: int, count: int,
               longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[count, kv_heads, longest, head_dim]`` of slots first_slot.. (positions a
        slot does not hold are garbage: the caller masks them)."""
        ...

    def set_length(self, slot: int, length: int) -> None: ...

    def advance(self, count: int, tokens: int = 1) -> None: ...


class SlotKVCache:
    def __init__(self, layers: int, max_slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (layers, max_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_slots = max_slots
        self.max_len = max_len
        # Tokens held per slot, on the device (positions and masks) and mirrored in Python
        # (scheduling and load reports without a device sync).
        self.lengths = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.host_lengths: list[int] = []

    @property
    def occupied(self) -> int:
        return len(self.host_lengths)

    @property
    def free_slots(self) -> int:
        return self.max_slots - self.occupied

    @property
    def used_tokens(self) -> int:
        return sum(self.host_lengths)

    @property
    def capacity_tokens(self) -> int:
        return self.max_slots * self.max_len

    def acquire(self) -> int:
        """Takes the next slot (always ``occupied``); its length starts at 0."""
        if self.free_slots == 0:
            raise RuntimeError(f"all {self.max_slots} KV slots are taken; release one first")
        slot = self.occupied
        self.host_lengths.append(0)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> int | None:
        """Frees ``slot``. Returns the slot whose contents moved into it to keep slots compact
        (the caller moves its own per-slot state the same way), or None if nothing moved."""
        last = self.occupied - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not occupied (occupied: 0..{last})")
        if slot != last:
            self.move(last, slot)
        self.host_lengths.pop()
        return last if slot != last else None

    def move(self, src: int, dst: int) -> None:
        """Copies occupied slot ``src``'s tokens and length into occupied slot ``dst`` (whose
        contents are lost); ``src`` keeps its copy until released."""
        held = self.host_lengths[src]
        self.k[:, dst, :, :held] = self.k[:, src, :, :held]
        self.v[:, dst, :, :held] = self.v[:, src, :, :held]
        self.lengths[dst] = held
        self.host_lengths[dst] = held

    def advance(self, count: int, tokens: int = 1) -> None:
        """Records that the first ``count`` slots each appended ``tokens`` tokens."""
        self.lengths[:count] += tokens
        for slot in range(count):
            self.host_lengths[slot] += tokens

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length
        self.host_lengths[slot] = length

    # ---- what the decoder reads and writes (KVCache): plain slices ----------------------------

    def store_prefill(self, layer: int, first_slot: int, k: torch.Tensor, v: torch.Tensor,
                      lengths: list[int]) -> None:
        # The padded tail lands beyond each slot's length, where it is masked and overwritten.
        slots, seq = slice(first_slot, first_slot + k.shape[0]), k.shape[2]
        self.k[layer, slots, :, :seq] = k
        self.v[layer, slots, :, :seq] = v

    def store_chunk(self, layer: int, slot: int, start: int, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        self.k[layer, slot, :, start:start + k.shape[1]] = k
        self.v[layer, slot, :, start:start + k.shape[1]] = v

    def store_tokens(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    def window(self, layer: int, first_slot: int, count: int,
               longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slice(first_slot, first_slot + count)
        return self.k[layer, slots, :, :longest], self.v[layer, slots, :, :longest]
