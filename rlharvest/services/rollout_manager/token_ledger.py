"""Every tracked request's tokens and logprobs in arrays, appended a whole batch at a time.

The tracker's hot path: one worker message carries one engine step's tokens for every
request on that worker (``delta_batch.Rows``). Checking and appending them one request at a time
in Python costs microseconds per request; here the checks are array comparisons over the batch and
the tokens land in an arena with one scatter, so a message costs a few dozen numpy calls whatever
its rows (bench/manager_relay.py). Pure and synchronous, like the tracker that owns it.

* Per-request state is one row of an int64 table (``_COLUMNS``), so a batch reads everything it
  checks with one gather.
* A request holds a *slot* (its table row) while tracked. The handle a worker echoes is
  ``generation << 32 | slot``, and the generation moves on at every removal and every assignment:
  a late row for a slot's old request, or for an earlier dispatch of the same request (an abort's
  final row that crossed a re-add to the same worker), misses instead of landing on this one.
* Tokens live in an arena, each request in a region of ``room`` tokens at ``base``; a request that
  outgrows its region moves to one twice the size at the arena's top (rare: doubling). The arena is
  compacted when more than half of it is dead regions.
* ``owner`` is the assignee's worker number while the request is on a worker and not done, else
  ``NO_WORKER``: one comparison says "tracked, live, and this worker's".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rlharvest.common.delta_batch import Rows, spans

NO_WORKER = -1
_SHIFT = 32
MASK = (1 << _SHIFT) - 1
# A slot whose generation reaches this is not reused: its next handles could pass 2**63 after
# as many dispatches again (each dispatch moves the generation on). One table row per 2**30.
_RETIRE = 1 << 30
_FIRST_ROOM = 256  # tokens of a new request's region (or its max_tokens, if fewer)
(HANDLE, OWNER, VERSION, LENGTH, CAP, BASE, ROOM, HIGH, FRESH, TAG, INDEX, STOPS) = range(12)
_COLUMNS = STOPS + 2  # two stop ids to begin with; the table widens for more
count = np.count_nonzero  # far cheaper than ndarray.any()/all() on small arrays
_NONE = np.zeros(0, np.int64)


@dataclass
class Applied:
    """What one batch did: rows accepted (indices into it), refused, and requests that ended."""

    accepted: np.ndarray  # row indices, increasing
    dropped: np.ndarray  # row indices refused (the tracker names the reason)
    ended: list[tuple[int, str]] = field(default_factory=list)  # (row, reason)
    started: list[int] = field(default_factory=list)  # slots with their assignment's first token
    generated: int = 0
    regenerated: int = 0
    tags: np.ndarray = field(default_factory=lambda: _NONE)  # the accepted rows' ``label``s
    indices: np.ndarray = field(default_factory=lambda: _NONE)


class TokenLedger:
    def __init__(self, slots: int = 256) -> None:
        self.table = np.full((slots, _COLUMNS), -1, np.int64)
        self._mark = np.zeros(slots, np.int64)  # scratch: finds a request named twice in a batch
        self._free_slots: list[int] = []
        self._used = 0  # slots ever handed out: [0, _used)
        self._generation: list[int] = []
        self._tokens = np.zeros(1 << 16, np.int32)
        self._logprobs = np.zeros(1 << 16, np.float32)
        self._top = 0  # the arena's first unused token
        self._dead = 0  # tokens of regions no request uses

    # ---- slots --------------------------------------------------------------------------------

    @staticmethod
    def slot(handle: int) -> int:
        return handle & MASK

    def add(self, cap: int, version: int, stop_ids: Sequence[int],
            tokens: Sequence[int] = (), logprobs: Sequence[float] = ()) -> int:
        """Track a request (with already generated tokens: a resume); returns its handle."""
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._used
            self._used += 1
            self._generation.append(0)
            if slot >= len(self.table):
                grown = np.full((2 * len(self.table), self.table.shape[1]), -1, np.int64)
                grown[:len(self.table)] = self.table
                self.table = grown
                self._mark = np.zeros(len(grown), np.int64)
        if STOPS + len(stop_ids) > self.table.shape[1]:
            wider = np.full((len(self.table), STOPS + len(stop_ids)), -1, np.int64)
            wider[:, :self.table.shape[1]] = self.table
            self.table = wider
        handle = self._generation[slot] << _SHIFT | slot
        room = max(min(cap, _FIRST_ROOM), len(tokens))
        base = self._allocate(room)  # first: a compaction must not see this row half made
        row = self.table[slot]
        row[:] = -1
        row[HANDLE], row[OWNER], row[VERSION], row[CAP] = handle, NO_WORKER, version, cap
        row[LENGTH] = row[HIGH] = len(tokens)
        row[BASE], row[ROOM] = base, room
        row[FRESH], row[TAG], row[INDEX] = 1, 0, 0
        row[STOPS:STOPS + len(stop_ids)] = stop_ids
        if tokens:
            self._tokens[base:base + len(tokens)] = tokens
            self._logprobs[base:base + len(tokens)] = logprobs
        return handle

    def remove(self, handle: int) -> None:
        slot = self.slot(handle)
        self._dead += int(self.table[slot, ROOM])
        self.table[slot] = -1
        self._generation[slot] += 1
        if self._generation[slot] < _RETIRE:
            self._free_slots.append(slot)  # else retired: its handles would outgrow int64

    def truncate(self, slot: int) -> None:
        """Forget the tokens (the recompute baseline); positions below the old length that come
        again count as regenerated."""
        row = self.table[slot]
        row[HIGH] = max(row[HIGH], row[LENGTH])
        row[LENGTH] = 0

    @property
    def token_bytes(self) -> int:
        """The arena's size: the storage of the tokens and logprobs themselves (what a
        request's bookkeeping is measured without, bench/manager_scale_sim.py)."""
        return self._tokens.nbytes + self._logprobs.nbytes

    def length(self, slot: int) -> int:
        return int(self.table[slot, LENGTH])

    def lengths(self, handles: Sequence[int]) -> list[int]:
        """``length`` of each handle's slot, in one read of the table (a scalar read each
        was most of the cost-aware rule's loop over running requests)."""
        return self.table[np.asarray(handles, np.int64) & MASK, LENGTH].tolist()

    def tokens(self, slot: int) -> list[int]:
        base, n = int(self.table[slot, BASE]), int(self.table[slot, LENGTH])
        return self._tokens[base:base + n].tolist()

    def logprobs(self, slot: int) -> list[float]:
        base, n = int(self.table[slot, BASE]), int(self.table[slot, LENGTH])
        return self._logprobs[base:base + n].tolist()

    def assign(self, slot: int, worker: int) -> int:
        """Put the request on ``worker`` under a new handle (this dispatch's), returned."""
        self._generation[slot] += 1
        handle = self._generation[slot] << _SHIFT | slot
        row = self.table[slot]
        row[HANDLE], row[OWNER], row[FRESH] = handle, worker, 1
        return handle

    def unassign(self, slot: int) -> None:
        self.table[slot, OWNER] = NO_WORKER

    def label(self, slots: Sequence[int], tag: int) -> None:
        self.table[slots, TAG] = tag
        self.table[slots, INDEX] = np.arange(len(slots))

    # ---- a batch ------------------------------------------------------------------------------

    def apply(self, worker: int, rows: Rows, vocab_size: int) -> Applied:
        """Check every row against its request and append the good ones' tokens.

        A row is refused (``dropped``) unless its request is tracked, live and on ``worker``, the
        row's weight version is the request's, it starts where the request's tokens end, it stays
        within max_tokens and its tokens are in the vocabulary. A request named by several rows
        of one batch takes them in order, as if they came in as many batches.
        """
        requests = rows.requests
        slots = requests & MASK
        n = len(slots)
        if n > 1:  # a request named twice? Each row marks its slot; a later mark overwrites.
            # Slots past the table (rows naming no request) share its last row's mark: the
            # turns below separate them by that same key, so each turn has unique keys.
            keys = np.minimum(slots, len(self._mark) - 1)
            order = np.arange(n)
            self._mark[keys] = order
            if count(self._mark[keys] != order):
                return self._apply_in_turns(worker, rows, vocab_size, keys)
        state = self.table.take(slots, axis=0, mode="clip")  # one gather of every column
        length = state[:, LENGTH]
        counts = rows.counts
        end = length + counts
        ok = (state[:, HANDLE] == requests) & (state[:, OWNER] == worker) & \
            (state[:, VERSION] == rows.weight_version) & (rows.positions == length) & \
            (end <= state[:, CAP])
        tokens = rows.token_ids
        # A negative id viewed as uint32 is >= 2**31, so with the bound at most 2**31 one
        # comparison refuses both (an unknown vocabulary is passed as a huge bound).
        bad_token = tokens.view(np.uint32) >= min(vocab_size, 1 << 31)
        unit = rows.unit
        if unit:
            ok &= ~bad_token
        elif count(bad_token):
            ok[np.repeat(np.arange(n), counts)[bad_token]] = False
        if count(ok) == n:
            out = Applied(np.arange(n), np.zeros(0, np.int64))
        else:
            out = Applied(np.flatnonzero(ok), np.flatnonzero(~ok))
            if not len(out.accepted):
                return out
            state, slots, length, counts, end = (state[ok], slots[ok], length[ok], counts[ok],
                                                 end[ok])
        acc = out.accepted
        grows = end > state[:, ROOM]
        if count(grows):
            self._regrow(slots[grows], end[grows])
            state[:, BASE] = self.table[slots, BASE]
        if unit:
            index = state[:, BASE] + length
            kept_tokens, kept_logprobs = (tokens, rows.logprobs) if len(acc) == n else \
                (tokens[acc], rows.logprobs[acc])
        else:
            keep = np.repeat(ok, rows.counts)
            index = spans(state[:, BASE] + length, counts)
            kept_tokens, kept_logprobs = tokens[keep], rows.logprobs[keep]
        self._tokens[index] = kept_tokens
        self._logprobs[index] = kept_logprobs
        self.table[slots, LENGTH] = end
        out.generated = int(end.sum() - length.sum())
        high = state[:, HIGH]
        if count(high > length):  # positions held before and discarded come again
            out.regenerated = int(np.clip(np.minimum(high, end) - length, 0, None).sum())
        fresh = state[:, FRESH] == 1
        if count(fresh):
            started = slots[fresh & (counts > 0)]
            out.started = started.tolist()
            self.table[started, FRESH] = 0
        out.tags, out.indices = state[:, TAG], state[:, INDEX]
        # The request is whole after a stop token or at max_tokens (the manager's own rule,
        # ``natural_end``), or when the worker says so.
        last = kept_tokens if unit else self._tokens[np.maximum(state[:, BASE] + end - 1, 0)]
        stop = (state[:, STOPS:] == last[:, None]).any(axis=1) & (end > 0)
        whole = stop | (end >= state[:, CAP])
        if rows.ends or count(whole):
            out.ended = self._ends(rows, acc, stop, whole)
            # An ended request is on no worker from here (the tracker detaches it): a later
            # row of it, in this batch's next turn or a later batch, is refused.
            ended = rows.requests[[r for r, _ in out.ended]] & MASK
            self.table[ended, OWNER] = NO_WORKER
        return out

    @staticmethod
    def _ends(rows: Rows, acc: np.ndarray, stop: np.ndarray,
              whole: np.ndarray) -> list[tuple[int, str]]:
        ended = {int(acc[i]): "stop" if stop[i] else "length" for i in np.flatnonzero(whole)}
        for r, why in rows.ends.items():  # few: the rows whose request the worker ended
            i = int(np.searchsorted(acc, r))
            if i < len(acc) and acc[i] == r:
                # A worker's abort wins (the request goes on elsewhere, tokens kept).
                ended[r] = why if why == "abort" else ended.get(r, why or "stop")
        return sorted(ended.items())

    def _apply_in_turns(self, worker: int, rows: Rows, vocab_size: int,
                        keys: np.ndarray) -> Applied:
        # Rank each row among the rows of its key (its request's slot); apply rank 0, then 1...
        order = np.argsort(keys, kind="stable")
        sorted_slots = keys[order]
        first = np.r_[True, sorted_slots[1:] != sorted_slots[:-1]]
        group_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order)) - group_start
        total = Applied(np.zeros(0, np.int64), np.zeros(0, np.int64))
        accepted, dropped, tags, indices = [], [], [], []
        for turn in range(int(rank.max()) + 1):
            picked = np.flatnonzero(rank == turn)
            part = self.apply(worker, rows.take(picked), vocab_size)
            accepted.append(picked[part.accepted])
            dropped.append(picked[part.dropped])
            tags.append(part.tags)
            indices.append(part.indices)
            total.ended += [(int(picked[r]), why) for r, why in part.ended]
            total.started += part.started
            total.generated += part.generated
            total.regenerated += part.regenerated
        order_acc = np.argsort(np.concatenate(accepted))
        total.accepted = np.concatenate(accepted)[order_acc]
        total.dropped = np.sort(np.concatenate(dropped))
        total.tags = np.concatenate(tags)[order_acc]
        total.indices = np.concatenate(indices)[order_acc]
        total.ended.sort()
        return total

    # ---- the arena ----------------------------------------------------------------------------

    def _allocate(self, room: int) -> int:
        if self._top + room > len(self._tokens):
            live = self._top - self._dead
            if self._dead > live:  # mostly dead regions: compact instead of growing
                self._compact()
            while self._top + room > len(self._tokens):
                self._tokens = np.concatenate([self._tokens, np.zeros_like(self._tokens)])
                self._logprobs = np.concatenate([self._logprobs, np.zeros_like(self._logprobs)])
        base = self._top
        self._top += room
        return base

    def _regrow(self, slots: np.ndarray, needed: np.ndarray) -> None:
        """Move the requests of ``slots`` to regions of twice their room (at least ``needed``,
        at most their max_tokens), side by side at the arena's top, tokens copied in one go:
        a step's requests that started together outgrow their regions together."""
        rows = self.table[slots]
        rooms = np.minimum(np.maximum(2 * rows[:, ROOM], needed),
                           np.maximum(rows[:, CAP], needed))
        top = self._allocate(int(rooms.sum()))  # may compact: read the old bases after it
        old, lengths = self.table[slots, BASE], rows[:, LENGTH]
        bases = top + np.cumsum(rooms) - rooms
        src, dst = spans(old, lengths), spans(bases, lengths)
        self._tokens[dst] = self._tokens[src]
        self._logprobs[dst] = self._logprobs[src]
        self._dead += int(rows[:, ROOM].sum())
        self.table[slots, BASE], self.table[slots, ROOM] = bases, rooms

    def _compact(self) -> None:
        live = np.flatnonzero(self.table[:self._used, HANDLE] >= 0)
        rows = self.table[live]
        rooms, lengths = rows[:, ROOM], rows[:, LENGTH]
        bases = np.cumsum(rooms) - rooms  # side by side from 0, rooms kept
        src, dst = spans(rows[:, BASE], lengths), spans(bases, lengths)
        tokens, logprobs = np.zeros_like(self._tokens), np.zeros_like(self._logprobs)
        tokens[dst], logprobs[dst] = self._tokens[src], self._logprobs[src]
        self.table[live, BASE] = bases
        self._tokens, self._logprobs = tokens, logprobs
        self._top, self._dead = int(rooms.sum()), 0
