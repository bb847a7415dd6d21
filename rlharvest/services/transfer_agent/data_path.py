"""The weight data path's framing, both transports: buckets cut into chunks of tens of MB on a
gRPC server stream (``PullBuckets``, publish) and put back together on the receiving side, and
the byte ranges a puller asks for over HTTP (http_data.py: the path pulls take, measured fastest).

Measured (bench/transfer_data_path.py, loopback, 2 shared cores) against a raw socket: a bare
grpc.aio stream of 16 MB messages ~0.75x, raw asyncio streams ~0.85x, aiohttp ~1.0x — so pulls
fetch bucket ranges from the agent's HTTP data server, over several connections at once, and
keep gRPC for control (plan, manifest, refusals) and for publishing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from rlharvest.common.errors import OutOfRange
from rlharvest.common.pb import transfer_agent_pb2 as pb
from rlharvest.services.transfer_agent.bucketing import VersionManifest
from rlharvest.services.transfer_agent.checksum import bytes_checksum
from rlharvest.services.transfer_agent.throttle import TokenBucket


MIN_PART_BYTES = 1 << 20  # below this a range's request overhead shows


class RangeError(OutOfRange, ValueError):
    """An HTTP Range header the data server does not serve; the message says why."""


def parse_range(header: str | None, size: int) -> tuple[int, int]:
    """[start, stop) of one ``bytes=START-END`` range (END inclusive, optional) inside a bucket
    of ``size`` bytes; the whole bucket when ``header`` is None."""
    if header is None:
        return 0, size
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or "," in spec or not first.strip().isdigit() or \
            (last.strip() and not last.strip().isdigit()):
        raise RangeError(f"Range {header!r} is not one 'bytes=START-END' range; ask for one "
                         "range per request")
    start = int(first)
    stop = int(last) + 1 if last.strip() else size
    if not start < stop <= size:
        raise RangeError(f"Range {header!r} is outside the bucket's {size} bytes")
    return start, stop


# (bucket index, start, stop): a byte range inside one bucket, the unit a puller fetches.
Part = tuple[int, int, int]


def split_parts(sizes: dict[int, int], streams: int,
                min_part: int = MIN_PART_BYTES) -> list[Part]:
    """(bucket, start, stop) ranges covering every bucket in ``sizes`` (index -> bytes), in
    bucket order, about total / streams bytes each (at least ``min_part``) so ``streams``
    connections share a pull evenly, and never crossing a bucket (each is checksummed alone).
    Empty buckets get no range."""
    return cut_parts([(index, 0, sizes[index]) for index in sorted(sizes)], streams, min_part)


def cut_parts(parts: Sequence[Part], streams: int, min_part: int = MIN_PART_BYTES) -> list[Part]:
    """``parts`` cut, in order, into near-equal pieces of about total / streams bytes (at least
    ``min_part``) so ``streams`` connections share them evenly. Empty parts are dropped."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    total = sum(stop - start for _, start, stop in parts)
    piece = max(min_part, -(-total // streams), 1)
    pieces = []
    for index, start, stop in parts:
        count = max(1, -(-(stop - start) // piece))
        cuts = [start + (stop - start) * k // count for k in range(count + 1)]
        pieces += [(index, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    return pieces


def byte_range_parts(bucket_sizes: Sequence[int], start: int, stop: int) -> list[Part]:
    """The bytes [start, stop) of a pull's buckets laid end to end, as ranges inside buckets."""
    parts, bucket_start = [], 0
    for index, size in enumerate(bucket_sizes):
        lo, hi = max(start, bucket_start), min(stop, bucket_start + size)
        if lo < hi:
            parts.append((index, lo - bucket_start, hi - bucket_start))
        bucket_start += size
    return parts


async def stream_buckets(buckets: Sequence[bytes], indices: Sequence[int], chunk_bytes: int,
                         throttles: Sequence[TokenBucket] = (),
                         damage: Callable[[], bool] | None = None) -> AsyncIterator[pb.BucketChunk]:
    """Chunks of the given buckets in order. Every throttle is charged for every chunk (the
    sender waits for the slowest); ``damage()`` True flips a byte of that chunk (test hook)."""
    for index in indices:
        bucket = buckets[index]
        view = memoryview(bucket)
        for offset in range(0, max(len(bucket), 1), chunk_bytes):
            data = bytes(view[offset:offset + chunk_bytes])
            for bucket_throttle in throttles:
                wait = bucket_throttle.reserve(len(data), time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)
            if damage is not None and data and damage():
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            yield pb.BucketChunk(bucket=index, offset=offset, data=data)


def chunk_buckets(buckets: Sequence[bytes], chunk_bytes: int):
    """Publish side: every bucket's chunks in order (no throttle, no damage)."""
    for index, bucket in enumerate(buckets):
        view = memoryview(bucket)
        for offset in range(0, max(len(bucket), 1), chunk_bytes):
            yield pb.BucketChunk(bucket=index, offset=offset, data=bytes(view[offset:offset + chunk_bytes]))


class BucketAssembler:
    """Receiving side of one pull or publish: writes chunks into per-bucket buffers and says when a
    bucket is complete, so its checksum is checked as soon as its last byte lands."""

    def __init__(self, manifest: VersionManifest,
                 buffers: dict[int, bytearray] | None = None) -> None:
        self.manifest = manifest
        self.buffers: dict[int, bytearray] = {} if buffers is None else buffers
        self._filled: dict[int, int] = {}

    def reset(self, index: int) -> None:
        self.buffers.pop(index, None)
        self._filled.pop(index, None)

    def add(self, chunk: pb.BucketChunk) -> int | None:
        """Store a chunk; returns the bucket index once that bucket is complete. Raises
        ValueError for a chunk outside the manifest's buckets (the message says which)."""
        sizes = self.manifest.bucket_sizes
        index, offset, data = chunk.bucket, chunk.offset, chunk.data
        if not 0 <= index < len(sizes):
            raise ValueError(f"chunk for bucket {index}, but the manifest has {len(sizes)} buckets")
        if offset < 0 or offset + len(data) > sizes[index]:
            raise ValueError(f"chunk [{offset}, {offset + len(data)}) lies outside bucket {index} "
                             f"of {sizes[index]} bytes")
        buffer = self.buffers.get(index)
        if buffer is None:
            buffer = self.buffers[index] = bytearray(sizes[index])
            self._filled[index] = 0
        buffer[offset:offset + len(data)] = data
        self._filled[index] += len(data)
        return index if self._filled[index] >= sizes[index] else None

    def missing(self) -> list[int]:
        return [i for i, size in enumerate(self.manifest.bucket_sizes)
                if self._filled.get(i, -1) < size]

    def intact(self, index: int) -> bool:
        return bytes_checksum(self.buffers[index]) == self.manifest.bucket_checksums[index]
