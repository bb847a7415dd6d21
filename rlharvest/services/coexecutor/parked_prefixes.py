"""Prefix reuse in the co-executor's shared pool (ROSE §4.3's cache affinity on serving GPUs).

A dedicated worker keeps finished requests' KV pages in its own prefix cache
(``rollout_worker/prefix_cache.py``). In the co-executor every page belongs to the pool that
serving and rollout share, and a page is in at most one request's block table. So a finished
rollout request's table is *parked* whole (``PagePool.park``: ROLLOUT_CACHED, under its lease
and reclaimable first when serving needs memory), and the next request whose tokens start with
its full pages *adopts* them (``PagePool.adopt``): they move to the new request's table, which
prefills only the rest. Move, not share: an agentic trajectory's next turn is the only reader
of its last turn's history, and moving keeps the pool's one-table-per-page invariant.

This index says which parked table holds the longest run of a request's full pages. Keys are
the dedicated cache's chain keys (``page_keys``: the whole prefix and the weight version), so a
hit is exact. Pure: no pool, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlharvest.services.rollout_worker.prefix_cache import page_keys


class ParkedPrefixes:
    def __init__(self, page_tokens: int) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        self.page_tokens = page_tokens
        self._where: dict[bytes, tuple[str, int]] = {}  # chain key -> (parked request, pages)
        self._keys: dict[str, list[bytes]] = {}  # parked request -> its chain keys

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def park(self, request_id: str, kv_tokens: Sequence[int], version: int) -> int:
        """``request_id`` finished holding the KV of ``kv_tokens`` (prompt and every generated
        token but the last) under ``version``; indexes its full pages, returns how many."""
        self.forget(request_id)
        keys = list(page_keys(kv_tokens, self.page_tokens, version))
        for pages, key in enumerate(keys, start=1):
            self._where[key] = (request_id, pages)
        if keys:
            self._keys[request_id] = keys
        return len(keys)

    def match(self, tokens: Sequence[int], version: int) -> tuple[str, int] | None:
        """The parked request holding the longest run of ``tokens``' full pages, leaving at
        least one token to prefill (its logits sample the next token), and how many pages."""
        best = None
        for key in page_keys(tokens[:len(tokens) - 1], self.page_tokens, version):
            found = self._where.get(key)
            if found is None:
                break
            best = found
        return best

    def forget(self, request_id: str) -> None:
        """Its pages were adopted, freed or reclaimed: they are no prefix any more."""
        for key in self._keys.pop(request_id, []):
            if self._where.get(key, ("", 0))[0] == request_id:
                del self._where[key]

    def clear(self) -> list[str]:
        """Every parked request (a weight load: their KV is of old weights)."""
        parked = list(self._keys)
        self._keys.clear()
        self._where.clear()
        return parked
