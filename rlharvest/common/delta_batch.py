"""Columnar token deltas (``DeltaBatch`` on the wire, ``Rows`` in memory).

One engine step's new tokens for many requests travel as a handful of little-endian arrays, one
row per request, instead of one message per request: a reader takes each column with one
``numpy.frombuffer`` call and the manager's tracker appends a whole batch with array operations
(``bench/manager_relay.py`` measures it). ``Rows.iter`` gives Python rows to readers
that want them one by one (the trainer, tests); the hot paths never call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from rlharvest.common.pb import common_pb2

_I64, _I32, _F32 = np.dtype("<i8"), np.dtype("<i4"), np.dtype("<f4")
_ONES = np.ones(1 << 16, _I32)  # the counts of a batch of one token per row: a slice of this
_ONES.flags.writeable = False


def spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices of ``counts[i]`` consecutive items from ``starts[i]``, for every i, joined."""
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


class MalformedBatch(ValueError):
    """Columns whose lengths disagree: nothing in the batch can be attributed to a request."""


class Row(NamedTuple):
    request: int
    position: int
    token_ids: list[int]
    logprobs: list[float]
    end: str  # "" while the request goes on; else "length" | "stop" | "abort"


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs microseconds
class Rows:
    """Decoded columns. ``counts[i]`` tokens of row i sit at ``starts[i]`` in the token columns.
    Treated as immutable: every operation returns new Rows."""

    requests: np.ndarray  # int64
    positions: np.ndarray  # int32
    counts: np.ndarray  # int32
    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    weight_version: int
    ends: dict[int, str] = field(default_factory=dict)  # row -> reason
    unit: bool = False  # one token per row (decode's case): token column index = row index

    def __len__(self) -> int:
        return len(self.requests)

    def starts(self) -> np.ndarray:
        if self.unit:
            return np.arange(len(self.requests))
        return np.cumsum(self.counts) - self.counts

    def take(self, rows: np.ndarray) -> Rows:
        """The rows at ``rows`` (indices, increasing), ends renumbered."""
        if len(rows) == len(self.requests):
            return self
        tokens = rows if self.unit else spans(self.starts()[rows], self.counts[rows])
        renumber = {int(old): new for new, old in enumerate(rows)}
        return Rows(self.requests[rows], self.positions[rows], self.counts[rows],
                    self.token_ids[tokens], self.logprobs[tokens], self.weight_version,
                    {renumber[r]: why for r, why in self.ends.items() if r in renumber},
                    self.unit)

    def with_requests(self, requests: np.ndarray) -> Rows:
        return Rows(requests, self.positions, self.counts, self.token_ids, self.logprobs,
                    self.weight_version, self.ends, self.unit)

    def iter(self) -> Iterator[Row]:
        tokens, logprobs = self.token_ids.tolist(), self.logprobs.tolist()
        start = 0
        for i, (request, position, count) in enumerate(zip(
                self.requests.tolist(), self.positions.tolist(), self.counts.tolist())):
            yield Row(request, position, tokens[start:start + count],
                      logprobs[start:start + count], self.ends.get(i, ""))
            start += count


def decode(msg: common_pb2.DeltaBatch) -> Rows:
    """The batch's columns (views of the message's bytes, read-only); raises MalformedBatch."""
    try:
        requests = np.frombuffer(msg.requests, _I64)
        positions = np.frombuffer(msg.positions, _I32)
        tokens = np.frombuffer(msg.token_ids, _I32)
        logprobs = np.frombuffer(msg.logprobs, _F32)
        packed = msg.counts
        counts = np.frombuffer(packed, _I32) if packed else \
            _ONES[:len(requests)] if len(requests) <= len(_ONES) else np.ones(len(requests), _I32)
    except ValueError as e:  # a column whose byte length is not a multiple of its item size
        raise MalformedBatch(f"a column of the batch is cut short: {e}") from None
    n = len(requests)
    if len(positions) != n or len(counts) != n or len(logprobs) != len(tokens) or \
            (len(tokens) != n if not packed else
             n and (int(counts.min()) < 0 or int(counts.sum()) != len(tokens))):
        raise MalformedBatch(f"{n} rows with {len(positions)} positions, {len(counts)} counts "
                             f"summing to {int(counts.sum()) if n else 0}, {len(tokens)} tokens "
                             f"and {len(logprobs)} logprobs")
    ends = {}
    for end in msg.ends:
        if end.row >= n:
            raise MalformedBatch(f"an end names row {end.row} of {n}")
        ends[end.row] = end.reason
    return Rows(requests, positions, counts, tokens, logprobs, msg.weight_version, ends,
                not packed)


def encode(rows: Rows, out: common_pb2.DeltaBatch | None = None) -> common_pb2.DeltaBatch:
    msg = common_pb2.DeltaBatch() if out is None else out
    msg.requests = rows.requests.astype(_I64, copy=False).tobytes()
    msg.positions = rows.positions.astype(_I32, copy=False).tobytes()
    if not rows.unit:
        msg.counts = rows.counts.astype(_I32, copy=False).tobytes()
    msg.token_ids = rows.token_ids.astype(_I32, copy=False).tobytes()
    msg.logprobs = rows.logprobs.astype(_F32, copy=False).tobytes()
    msg.weight_version = rows.weight_version
    for row, reason in sorted(rows.ends.items()):
        msg.ends.add(row=row, reason=reason)
    return msg


def by_key(rows: Rows, keys: np.ndarray, names: np.ndarray) -> list[tuple[int, Rows]]:
    """The rows split by ``keys`` (one per row; the manager: each request's step), each part
    naming its requests by ``names`` (their index in the step) instead."""
    if not len(rows):
        return []
    first = keys[0]
    if not np.count_nonzero(keys != first):  # the common case: one step on the worker
        return [(int(first), rows.with_requests(names))]
    parts = []
    for key in np.unique(keys).tolist():
        picked = np.flatnonzero(keys == key)
        parts.append((key, rows.take(picked).with_requests(names[picked])))
    return parts


def empty(weight_version: int = 0) -> Rows:
    return Rows(np.zeros(0, _I64), np.zeros(0, _I32), np.zeros(0, _I32), np.zeros(0, _I32),
                np.zeros(0, _F32), weight_version, {}, True)


def concat(parts: Sequence[Rows]) -> Rows:
    """Rows of several batches of one weight version, in order."""
    parts = [p for p in parts if len(p)] or list(parts[:1])
    if len(parts) == 1:
        return parts[0]
    ends: dict[int, str] = {}
    offset = 0
    for part in parts:
        ends.update({offset + r: why for r, why in part.ends.items()})
        offset += len(part)
    return Rows(np.concatenate([p.requests for p in parts]),
                np.concatenate([p.positions for p in parts]),
                np.concatenate([p.counts for p in parts]),
                np.concatenate([p.token_ids for p in parts]),
                np.concatenate([p.logprobs for p in parts]), parts[0].weight_version, ends,
                all(p.unit for p in parts))


class RowsBuilder:
    """Rows added one at a time (a worker's step outputs, a replay), built into columns once."""

    def __init__(self, weight_version: int) -> None:
        self.weight_version = weight_version
        self._requests: list[int] = []
        self._positions: list[int] = []
        self._counts: list[int] = []
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._ends: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: int, position: int, token_ids: Iterable[int],
            logprobs: Iterable[float], end: str = "") -> None:
        before = len(self._tokens)
        self._tokens.extend(token_ids)
        self._logprobs.extend(logprobs)
        if end:
            self._ends[len(self._requests)] = end
        self._requests.append(request)
        self._positions.append(position)
        self._counts.append(len(self._tokens) - before)

    def build(self) -> Rows:
        counts = np.array(self._counts, _I32)
        return Rows(np.array(self._requests, _I64), np.array(self._positions, _I32), counts,
                    np.array(self._tokens, _I32), np.array(self._logprobs, _F32),
                    self.weight_version, dict(self._ends), len(self._tokens) == len(counts)
                    and not np.count_nonzero(counts != 1))


def build(rows: Iterable[tuple[int, int, Sequence[int], Sequence[float], str]],
          weight_version: int) -> Rows:
    """Rows from (request, position, token ids, logprobs, end) tuples."""
    builder = RowsBuilder(weight_version)
    for request, position, tokens, logprobs, end in rows:
        builder.add(request, position, tokens, logprobs, end)
    return builder.build()
