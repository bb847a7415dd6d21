"""A prefix cache over full KV pages (vLLM's automatic prefix caching and SGLang's
radix cache, at page granularity).

A multi-turn trajectory sends its whole history again every turn: turn t's prompt is turn t-1's
prompt, its completion and the environment's reply. ROSE (§2.2, Table 3) measures prefill at
77–86% of agentic rollout tokens. Keeping the KV pages of finished requests lets the next turn
(or a migrated request's resume) prefill only what it adds.

A full page of ``page_tokens`` tokens is cached under a key chained from its parent's:
``key_i = H(key_{i-1}, tokens of page i, weight version, generation)``. So a key names the whole
prefix up to its page's end, under one load of the weights: a hit is exact. The engine flushes
at every weight load, and a flush starts a new generation: keys of old weights are unreachable
even when the load kept the version number (a placed worker switching to a job at the same
version; a LoadWeights of the current version), and an entry flushed while a request reads it
never shares its key with one cached after the flush, so the reader's release finds its own.
Only full pages are cached. A request writes only positions after its cached prefix, so shared
pages are never written.

Ownership: a page is the cache's (an entry) or one request's. Requests that hit hold references on
the entries they read. An entry with references or cached children is never evicted; a child
without its parent could never be matched again. Eviction frees leaves: those unused for longer
than ``lease_s`` first, then the least recently used. Memory pressure beats the lease: the lease
orders eviction, it does not pin.

Pure: no torch, no I/O, an injected clock.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


def page_keys(tokens: Sequence[int], page_tokens: int, version: int,
              generation: int = 0) -> Iterator[bytes]:
    """The chain keys of ``tokens``' full pages, one page at a time (a lookup stops hashing at
    its first miss): ``key_i = H(key_{i-1}, tokens of page i, weight version, generation)``."""
    parent = b""
    salt = (version.to_bytes(8, "little", signed=True)
            + generation.to_bytes(8, "little", signed=True))
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(salt)
        digest.update(array("I", tokens[start:start + page_tokens]).tobytes())
        parent = digest.digest()
        yield parent


def check_prefix_cache(enabled: bool, kv_pages: int, shared_pool: bool = False) -> None:
    """Raises ValueError saying why the prefix cache cannot be used with these engine options."""
    if enabled and (shared_pool or not kv_pages):
        raise ValueError("the prefix cache keeps KV pages: it needs the engine's own paged KV "
                         "(kv_pages > 0); in the co-executor's shared pool the dual engine "
                         "keeps them (its --prefix-cache)")


@dataclass
class _Entry:
    page: int
    parent: bytes | None
    children: int = 0
    refs: int = 0
    last_used: float = 0.0


class PrefixCache:
    def __init__(self, page_tokens: int, lease_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if page_tokens < 1 or lease_s <= 0:
            raise ValueError(f"need page_tokens >= 1 and lease_s > 0, got {page_tokens}, "
                             f"{lease_s}")
        self.page_tokens = page_tokens
        self.lease_s = lease_s
        self._clock = clock
        self._entries: dict[bytes, _Entry] = {}
        self._doomed: dict[bytes, _Entry] = {}  # flushed while referenced: freed on release
        self.generation = 0  # flushes so far: part of every key (see the module doc)
        self.evicted = 0  # pages evicted for room, since start

    @property
    def pages(self) -> int:
        """Pages the cache holds (referenced ones included, flushed ones not)."""
        return len(self._entries)

    def keys(self, tokens: Sequence[int], version: int) -> list[bytes]:
        """The chain keys of ``tokens``' full pages, in order."""
        return list(self._chain(tokens, version))

    def _chain(self, tokens: Sequence[int], version: int) -> Iterator[bytes]:
        return page_keys(tokens, self.page_tokens, version, self.generation)

    def match(self, tokens: Sequence[int], version: int) -> tuple[list[bytes], list[int]]:
        """The longest cached run of full pages at the start of ``tokens``, leaving at least one
        token uncached (its prefill yields the logits the next token is sampled from): the
        pages' keys and ids. Acquire the keys before anything can evict them."""
        keys: list[bytes] = []
        pages: list[int] = []
        for key in self._chain(tokens[:len(tokens) - 1], version):
            entry = self._entries.get(key)
            if entry is None:
                break
            keys.append(key)
            pages.append(entry.page)
        return keys, pages

    def acquire(self, keys: Sequence[bytes]) -> None:
        now = self._clock()
        for key in keys:
            entry = self._entries[key]
            entry.refs += 1
            entry.last_used = now

    def release(self, keys: Sequence[bytes]) -> list[int]:
        """Drops a request's references; returns the pages that are free now (entries flushed
        while it read them)."""
        now = self._clock()
        freed = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.refs -= 1
                entry.last_used = now
                continue
            doomed = self._doomed[key]
            doomed.refs -= 1
            if doomed.refs == 0:
                freed.append(self._doomed.pop(key).page)
        return freed

    def insert(self, tokens: Sequence[int], pages: Sequence[int], version: int) -> set[int]:
        """Offers a finished request's pages: ``pages[i]`` holds the KV of ``tokens``' page i
        (only full pages count). Adopts each page whose prefix is not cached yet; returns the
        adopted pages (the cache's now; the caller frees the rest)."""
        now = self._clock()
        adopted: set[int] = set()
        parent: bytes | None = None
        for key, page in zip(self._chain(tokens, version), pages):
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(page, parent, last_used=now)
                if parent is not None:
                    self._entries[parent].children += 1
                adopted.add(page)
            else:
                entry.last_used = now
            parent = key
        return adopted

    def evict(self, count: int) -> list[int]:
        """Frees up to ``count`` pages: unreferenced leaves, expired ones first, then the least
        recently used. Returns the freed pages."""
        freed: list[int] = []
        while len(freed) < count:
            victims = self._leaves()
            if not victims:
                break
            for key in victims[:count - len(freed)]:
                freed.append(self._drop(key))
        self.evicted += len(freed)
        return freed

    def flush(self) -> list[int]:
        """Forgets every entry (a weight load) and starts a new generation; returns the pages
        free now. Referenced pages are freed when their last reader releases them."""
        self.generation += 1
        freed = []
        for key, entry in self._entries.items():
            if entry.refs:
                self._doomed[key] = entry
            else:
                freed.append(entry.page)
        self._entries.clear()
        return freed

    def _leaves(self) -> list[bytes]:
        """Evictable keys in eviction order: expired first, then oldest use first."""
        now = self._clock()
        leaves = [(now - e.last_used <= self.lease_s, e.last_used, key)
                  for key, e in self._entries.items() if not e.refs and not e.children]
        return [key for *_, key in sorted(leaves)]

    def _drop(self, key: bytes) -> int:
        entry = self._entries.pop(key)
        if entry.parent is not None:
            self._entries[entry.parent].children -= 1
        return entry.page
