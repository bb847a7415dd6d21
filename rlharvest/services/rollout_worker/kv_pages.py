"""Paged KV memory (ROSE §4.1 and App. C; vLLM's PagedAttention, gathered in plain torch).

A ``PageStore`` is one byte buffer of ``num_pages`` pages. Each model sees it through its own
layout, ``[pages, layers, 2 (K, V), kv_heads, page_tokens, head_dim]`` of its dtype (``view``):
two models of different shapes share one pool, and a page changes owner without a copy — the
page ids are those of the co-executor's ``PagePool``, which says who holds which.

A ``PagedKVCache`` gives an engine the slot interface of ``SlotKVCache`` (compact slots, lengths
on host and device) with a block table per slot instead of a row of ``max_len`` tokens: memory
is held only for tokens that exist. Writing scatters into pages; reading a batch gathers its
pages, one index per layer — the price of paging without a kernel. Moving a slot (to keep slots
compact) moves its block table, not its KV.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

import torch


def page_bytes(layers: int, kv_heads: int, head_dim: int, page_tokens: int,
               dtype: torch.dtype) -> int:
    """Bytes one page of ``page_tokens`` tokens takes in a model's layout."""
    return layers * 2 * kv_heads * page_tokens * head_dim * torch.empty(0, dtype=dtype).element_size()


class PageStore:
    def __init__(self, num_pages: int, bytes_per_page: int,
                 device: torch.device | str = "cpu") -> None:
        if num_pages < 1 or bytes_per_page < 1:
            raise ValueError(f"need num_pages >= 1 and bytes_per_page >= 1, got {num_pages}, "
                             f"{bytes_per_page}")
        # Rows padded to 8 bytes, so any float dtype can view them in place.
        self.bytes_per_page = -(-bytes_per_page // 8) * 8
        self.num_pages = num_pages
        self.buffer = torch.zeros(num_pages, self.bytes_per_page, dtype=torch.uint8, device=device)

    def view(self, layers: int, kv_heads: int, head_dim: int, page_tokens: int,
             dtype: torch.dtype) -> torch.Tensor:
        """The pages as one model sees them (a view: writes land in the store)."""
        need = page_bytes(layers, kv_heads, head_dim, page_tokens, dtype)
        if need > self.bytes_per_page:
            raise ValueError(f"a page of this model takes {need} bytes; the store's pages hold "
                             f"{self.bytes_per_page}")
        return (self.buffer[:, :need].view(dtype)
                .view(self.num_pages, layers, 2, kv_heads, page_tokens, head_dim))


class PagedKVCache:
    """``pages``: a ``PageStore.view``. A slot's pages are bound by the engine (``bind``) before
    any of its tokens are written; reading or writing past the bound pages is a bug."""

    def __init__(self, pages: torch.Tensor, max_slots: int, max_len: int) -> None:
        self.pages = pages
        self.page_tokens = pages.shape[4]
        self.max_slots = max_slots
        self.max_len = max_len
        self.max_pages = math.ceil(max_len / self.page_tokens)
        device = pages.device
        self.tables = torch.zeros(max_slots, self.max_pages, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.host_lengths: list[int] = []
        self.bound: list[int] = []  # pages bound per occupied slot

    # ---- the slot interface (as SlotKVCache) ---------------------------------------------------

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
        return self.pages.shape[0] * self.page_tokens

    def acquire(self) -> int:
        if self.free_slots == 0:
            raise RuntimeError(f"all {self.max_slots} KV slots are taken; release one first")
        slot = self.occupied
        self.host_lengths.append(0)
        self.bound.append(0)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> int | None:
        last = self.occupied - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not occupied (occupied: 0..{last})")
        if slot != last:
            self.move(last, slot)
        self.host_lengths.pop()
        self.bound.pop()
        return last if slot != last else None

    def move(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes ``src``'s block table and length: no KV moves."""
        self.tables[dst] = self.tables[src]
        self.bound[dst] = self.bound[src]
        self.lengths[dst] = self.lengths[src]
        self.host_lengths[dst] = self.host_lengths[src]

    def advance(self, count: int, tokens: int = 1) -> None:
        self.lengths[:count] += tokens
        for slot in range(count):
            self.host_lengths[slot] += tokens

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length
        self.host_lengths[slot] = length

    # ---- pages ---------------------------------------------------------------------------------

    def bind(self, slot: int, pages: Sequence[int]) -> None:
        """The slot's KV lives in ``pages`` (in token order) from now on."""
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages for one slot; max_len allows {self.max_pages}")
        if pages:
            self.tables[slot, :len(pages)] = torch.as_tensor(pages, dtype=torch.int64)
        self.bound[slot] = len(pages)

    def _scatter(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """K, V ``[m, kv_heads, head_dim]`` of slot ``slots[i]`` at ``positions[i]``."""
        page = self.tables[slots, positions // self.page_tokens]
        offset = positions % self.page_tokens
        self.pages[page, layer, 0, :, offset] = k
        self.pages[page, layer, 1, :, offset] = v

    # ---- what the decoder reads and writes (kv_cache.KVCache) ---------------------------------

    def store_prefill(self, layer: int, first_slot: int, k: torch.Tensor, v: torch.Tensor,
                      lengths: list[int]) -> None:
        count, seq = k.shape[0], k.shape[2]
        device = k.device
        positions = torch.arange(seq, device=device).expand(count, seq)
        real = positions < torch.as_tensor(lengths, device=device)[:, None]  # no padding in pages
        slots = (torch.arange(count, device=device) + first_slot)[:, None].expand(count, seq)
        self._scatter(layer, slots[real], positions[real], k.transpose(1, 2)[real],
                      v.transpose(1, 2)[real])

    def store_chunk(self, layer: int, slot: int, start: int, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        seq = k.shape[1]
        positions = torch.arange(start, start + seq, device=k.device)
        slots = torch.full((seq,), slot, dtype=torch.int64, device=k.device)
        self._scatter(layer, slots, positions, k.transpose(0, 1), v.transpose(0, 1))

    def store_tokens(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        self._scatter(layer, torch.arange(k.shape[0], device=k.device), positions, k, v)

    def window(self, layer: int, first_slot: int, count: int,
               longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_pages = math.ceil(longest / self.page_tokens)
        table = self.tables[first_slot:first_slot + count, :n_pages]
        kv = self.pages[table, layer]  # [n, pages, 2, kvh, pt, hd]
        kv = kv.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)[:, :, :, :longest]
        return kv[0], kv[1]


class KVPages(Protocol):
    """Who says which pages a request's KV lives in: an engine's own allocator, or the
    co-executor's ``PagePool`` (where its dual engine grants pages before each step)."""

    def reserve(self, request_id: str, tokens: int) -> bool:
        """May ``request_id`` start, holding ``tokens`` tokens? (Its pages exist afterwards.)"""
        ...

    def table(self, request_id: str, tokens: int) -> Sequence[int]:
        """Its pages, enough for ``tokens`` tokens, in token order."""
        ...

    def release(self, request_id: str) -> None: ...

    def cached_tokens(self, request_id: str) -> int | None:
        """Tokens of the request's prefix its pages already hold the KV of (prefill starts
        after them); None when these pages never hand a prefix over."""
        ...


class OwnPages:
    """A dedicated engine's allocator: a request reserves every page it can need (prompt +
    max_tokens) when it starts, so it never runs out mid-decode; a request that does not fit
    waits. With as many pages as slots x max_len this never binds; with fewer, memory is held
    only for what requests can use (vLLM-style admission by KV memory)."""

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self._free = list(range(num_pages - 1, -1, -1))
        self._held: dict[str, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def reserve(self, request_id: str, tokens: int, prefix: Sequence[int] = ()) -> bool:
        """``prefix``: pages the request reads without owning (a prefix cache's hit), its first
        ones in token order; only the rest are taken from the free pages."""
        need = math.ceil(tokens / self.page_tokens) - len(prefix)
        if need > len(self._free):
            return False
        self._held[request_id] = [*prefix, *(self._free.pop() for _ in range(need))]
        return True

    def table(self, request_id: str, tokens: int) -> Sequence[int]:
        pages = self._held[request_id]
        if len(pages) * self.page_tokens < tokens:
            raise RuntimeError(f"request {request_id} reserved {len(pages)} pages, needs "
                               f"{math.ceil(tokens / self.page_tokens)}")
        return pages

    def held(self, request_id: str) -> list[int]:
        """The request's pages, in token order."""
        return self._held.get(request_id, [])

    def release(self, request_id: str, keep: Collection[int] = ()) -> None:
        """Frees the request's pages except ``keep`` (its prefix and what a prefix cache
        adopted)."""
        pages = self._held.pop(request_id, [])
        self._free.extend(page for page in reversed(pages) if page not in keep)

    def give(self, pages: Sequence[int]) -> None:
        """Pages back from a prefix cache (evicted or flushed)."""
        self._free.extend(pages)

    def cached_tokens(self, request_id: str) -> int | None:
        return None  # the engine's own PrefixCache reads prefixes (_reserve_with_prefix)
