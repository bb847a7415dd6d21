"""One paged KV pool that the serving model and the rollout model share (ROSE §4.1, App. C).

The pool is a fixed number of pages of one size in bytes; each model views a page in its own
layout (its own tokens per page), so handing a page from one model to the other changes only
who owns it: nothing is copied. A page has exactly one state:

- ``FREE``;
- ``SERVING``: in a serving request's block table;
- ``ROLLOUT_ACTIVE``: in a running rollout request's block table;
- ``ROLLOUT_CACHED``: a finished rollout request's KV kept for prefix reuse.

Rollout pages carry a lease (10 s by default), renewed whenever the request uses them; an expired
lease frees them (``expire``). Rollout never holds more than ``rollout_budget`` pages (B_roll,
set by ``memory_sharing``): a grant past it is refused, so the caller reclaims first. Serving
is never refused for the budget, only for pages that are not free.

Pure bookkeeping: no tensors, no clock (times are arguments). ``check`` verifies the invariants
(states sum to the pool, no page in two tables, a table's pages in its state).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rlharvest.common.errors import InvalidArgument, ResourceExhausted


class PageState(enum.Enum):
    FREE = "free"
    SERVING = "serving"
    ROLLOUT_ACTIVE = "rollout_active"
    ROLLOUT_CACHED = "rollout_cached"


class Owner(enum.Enum):
    SERVING = "serving"
    ROLLOUT = "rollout"


class PoolError(InvalidArgument, ValueError):
    """A call the pool's state does not allow (an unknown or doubly freed request, ...)."""


class PoolExhausted(ResourceExhausted, RuntimeError):
    """Not enough free pages, or a rollout grant past B_roll: reclaim first, then ask again."""


def pages_for(tokens: int, tokens_per_page: int) -> int:
    """Pages a model whose page holds ``tokens_per_page`` tokens needs for ``tokens`` tokens."""
    if tokens_per_page < 1:
        raise PoolError(f"a page must hold at least one token, got {tokens_per_page}")
    return -(-max(tokens, 0) // tokens_per_page)


@dataclass
class BlockTable:
    """One request's pages, in order (page i holds its tokens [i * per_page, (i + 1) * per_page))."""

    owner: Owner
    pages: list[int] = field(default_factory=list)
    last_used: float = 0.0
    cached: bool = False  # a finished rollout request's KV, kept for prefix reuse
    adopted: int = 0  # leading pages taken over from a parked table (their KV is written)

    @property
    def state(self) -> PageState:
        if self.owner is Owner.SERVING:
            return PageState.SERVING
        return PageState.ROLLOUT_CACHED if self.cached else PageState.ROLLOUT_ACTIVE


class PagePool:
    def __init__(self, total_pages: int, lease_s: float = 10.0) -> None:
        if total_pages < 1:
            raise PoolError(f"total_pages must be >= 1, got {total_pages}")
        if lease_s <= 0:
            raise PoolError(f"lease_s must be > 0, got {lease_s}")
        self.total_pages = total_pages
        self.lease_s = lease_s
        self.rollout_budget = total_pages  # B_roll; memory_sharing sets it
        self._free: list[int] = list(range(total_pages - 1, -1, -1))  # pop() hands out 0 first
        self._tables: dict[str, BlockTable] = {}
        self._counts = {state: 0 for state in PageState}
        self._counts[PageState.FREE] = total_pages

    # ---- reading -------------------------------------------------------------------------------

    def count(self, state: PageState) -> int:
        return self._counts[state]

    @property
    def free_pages(self) -> int:
        return self._counts[PageState.FREE]

    @property
    def serving_pages(self) -> int:
        return self._counts[PageState.SERVING]

    @property
    def rollout_pages(self) -> int:
        return self._counts[PageState.ROLLOUT_ACTIVE] + self._counts[PageState.ROLLOUT_CACHED]

    def table(self, request_id: str) -> BlockTable:
        try:
            return self._tables[request_id]
        except KeyError:
            raise PoolError(f"request {request_id!r} holds no pages") from None

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def tables(self, owner: Owner | None = None) -> dict[str, BlockTable]:
        return {rid: t for rid, t in self._tables.items() if owner is None or t.owner is owner}

    # ---- granting and freeing ------------------------------------------------------------------

    def allocate(self, request_id: str, owner: Owner, pages: int, now: float) -> list[int]:
        """Give ``request_id`` ``pages`` more pages (a new table, or appended to its own);
        returns the new pages. PoolExhausted when they are not free, or when a rollout grant
        would pass B_roll; nothing changes then. A cached rollout table is active again."""
        if pages < 0:
            raise PoolError(f"pages must be >= 0, got {pages}")
        table = self._tables.get(request_id)
        if table is not None and table.owner is not owner:
            raise PoolError(f"request {request_id!r} is a {table.owner.value} request, not "
                            f"{owner.value}")
        if pages > self.free_pages:
            raise PoolExhausted(f"{pages} pages wanted for {request_id!r}, {self.free_pages} "
                                "free")
        if owner is Owner.ROLLOUT and self.rollout_pages + pages > self.rollout_budget:
            raise PoolExhausted(f"{pages} rollout pages for {request_id!r} would pass B_roll "
                                f"({self.rollout_pages} held of {self.rollout_budget})")
        if table is None:
            table = self._tables[request_id] = BlockTable(owner, last_used=now)
        else:
            self._restate(table, cached=False)
            table.last_used = now
        granted = [self._free.pop() for _ in range(pages)]
        table.pages.extend(granted)
        self._counts[PageState.FREE] -= pages
        self._counts[table.state] += pages
        return granted

    def free(self, request_id: str) -> int:
        """Return every page of ``request_id`` to the pool; returns how many. A request that
        holds none (never granted, or freed already) is a PoolError: a double free is a bug."""
        table = self.table(request_id)
        del self._tables[request_id]
        self._counts[table.state] -= len(table.pages)
        self._counts[PageState.FREE] += len(table.pages)
        self._free.extend(reversed(table.pages))
        return len(table.pages)

    def park(self, request_id: str, now: float) -> None:
        """A finished rollout request keeps its KV as a prefix cache (until its lease ends)."""
        table = self.table(request_id)
        if table.owner is not Owner.ROLLOUT:
            raise PoolError(f"only rollout KV is cached; {request_id!r} is serving")
        self._restate(table, cached=True)
        table.last_used = now

    def adopt(self, parked_id: str, request_id: str, pages: int, now: float) -> list[int]:
        """``request_id`` takes over the first ``pages`` pages of the parked (cached) table of
        ``parked_id``, which holds its prefix's KV; the parked table's other pages are freed and
        the table is gone. Returns the adopted pages (the start of ``request_id``'s table)."""
        table = self.table(parked_id)
        if not table.cached:
            raise PoolError(f"{parked_id!r} is not a parked rollout table")
        if self.holds(request_id):
            raise PoolError(f"{request_id!r} holds pages already; it adopts a prefix first")
        if not 0 < pages <= len(table.pages):
            raise PoolError(f"adopt {pages} pages of {parked_id!r}, which has "
                            f"{len(table.pages)}")
        del self._tables[parked_id]
        kept, freed = table.pages[:pages], table.pages[pages:]
        self._counts[PageState.ROLLOUT_CACHED] -= len(table.pages)
        self._tables[request_id] = BlockTable(Owner.ROLLOUT, kept, now, adopted=pages)
        self._counts[PageState.ROLLOUT_ACTIVE] += len(kept)
        self._free.extend(reversed(freed))
        self._counts[PageState.FREE] += len(freed)
        return kept

    def touch(self, request_id: str, now: float) -> None:
        """The request used its pages: renew the lease."""
        self.table(request_id).last_used = now

    def expired(self, now: float) -> list[str]:
        """Rollout requests whose lease ran out (last use ``lease_s`` or more ago), oldest
        first. The caller frees them (and aborts the active ones) within the tick."""
        stale = [(t.last_used, rid) for rid, t in self._tables.items()
                 if t.owner is Owner.ROLLOUT and now - t.last_used >= self.lease_s]
        return [rid for _, rid in sorted(stale)]

    def _restate(self, table: BlockTable, cached: bool) -> None:
        before = table.state
        table.cached = cached
        self._counts[before] -= len(table.pages)
        self._counts[table.state] += len(table.pages)

    # ---- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError unless every invariant holds (tests and debug builds)."""
        seen: dict[int, str] = {}
        by_state = {state: 0 for state in PageState}
        for rid, table in self._tables.items():
            for page in table.pages:
                assert page not in seen, f"page {page} is in {seen[page]!r} and {rid!r}"
                seen[page] = rid
            by_state[table.state] += len(table.pages)
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert not free & set(seen), f"pages {sorted(free & set(seen))[:5]} free and held"
        by_state[PageState.FREE] = len(self._free)
        assert by_state == self._counts, f"counts {self._counts} but tables say {by_state}"
        assert sum(by_state.values()) == self.total_pages, "pages are missing from the pool"
        assert free | set(seen) == set(range(self.total_pages)), "a page left the pool"

