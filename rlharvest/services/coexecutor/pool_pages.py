"""The co-executor's ``PagePool`` as the pages its engines' KV lives in (ROSE §4.1, App. C).

Both engines run with the paged KV option over one ``PageStore`` of ``total_pages`` pages, and
the page ids their block tables hold are the pool's: the dual engine grants pages (prompt pages
when a request arrives, one more before a token needs it) and frees them, under its memory
policy; an engine only reads which pages a request holds. So the pool is the memory, and a page
reclaimed from rollout is serving's at once, with no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlharvest.services.coexecutor.page_pool import Owner, PagePool, PoolExhausted, pages_for


class PoolPages:
    """One engine's view of the pool. ``granting`` (measuring latency profiles at start, before
    the dual engine runs): requests take and give back their pages themselves."""

    def __init__(self, pool: PagePool, page_tokens: int, owner: Owner,
                 prefix_reuse: bool = False) -> None:
        self._pool = pool
        self._page_tokens = page_tokens
        self._owner = owner
        self._prefix_reuse = prefix_reuse  # the dual engine hands parked prefixes over
        self.granting = False

    def cached_tokens(self, request_id: str) -> int | None:
        """Tokens of ``request_id``'s prefix whose KV its adopted pages already hold (prefill
        starts after them); None without prefix reuse."""
        if not self._prefix_reuse:
            return None
        held = self._pool.table(request_id) if self._pool.holds(request_id) else None
        return held.adopted * self._page_tokens if held is not None else 0

    def reserve(self, request_id: str, tokens: int) -> bool:
        """A request starts once the dual engine granted its prompt pages."""
        if self.granting and not self._pool.holds(request_id):
            try:
                self._pool.allocate(request_id, self._owner,
                                    pages_for(tokens, self._page_tokens), 0.0)
            except PoolExhausted:
                return False
        return self._pool.holds(request_id)

    def table(self, request_id: str, tokens: int) -> Sequence[int]:
        pages = self._pool.table(request_id).pages
        if len(pages) * self._page_tokens < tokens:
            raise RuntimeError(f"request {request_id} holds {len(pages)} pages for {tokens} "
                               "tokens: the dual engine grants pages before they are written")
        return pages

    def release(self, request_id: str) -> None:
        """Nothing: the dual engine frees a request's pages when it forgets the request."""
        if self.granting and self._pool.holds(request_id):
            self._pool.free(request_id)
