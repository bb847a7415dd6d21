"""Pack encoded tensors into large buckets and split them back (ROSE §4.2, App. F).

ROSE's trainers push fixed-size buckets (64 MB) and workers pull in larger batches: a few large
messages keep the data path near link speed where one message per tensor would be dominated by
per-message overhead. Small payloads are packed whole into a bucket; one larger than a bucket is
cut across consecutive buckets. The manifest (plain JSON-able dict) says where every tensor's
payload lies, with per-tensor checksums (of the decoded tensor) and per-bucket checksums (of the
bytes on the wire), so a damaged bucket is re-pulled alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlharvest.services.transfer_agent.checksum import ChecksumMismatchError, bytes_checksum
from rlharvest.services.transfer_agent.delta_codec import (
    EncodedTensor,
    Encoding,
    codec_dtype,
    codec_dtype_names,
    read_header,
)

DEFAULT_BUCKET_BYTES = 64 << 20  # ROSE's bucket size
MANIFEST_FORMAT = 1

# ``map``-like callable: the caller may pass a thread pool's map (zlib and numpy release the GIL).
ParallelMap = Callable[..., Iterator]


class ManifestError(ValueError):
    """A manifest or bucket set that does not fit together; the message says what to re-pull.
    ``VersionManifest.from_dict`` refuses every field the codec cannot read (dtype, encoding,
    shape, names, layout) when the manifest is parsed, so a bad field is named at the boundary.
    Not a service status by itself: the agent answers a publish's manifest that does not parse
    INVALID_ARGUMENT and bytes that do not fit it DATA_LOSS (``errors.py``'s classes, where
    each case is known); a puller fails the pull at that sender."""


@dataclass(frozen=True)
class Segment:
    bucket: int
    offset: int
    length: int


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    encoding: str  # "DENSE" | "COO" | "BITMAP"
    checksum: int  # DENSE: CRC-32 of the decoded tensor; sparse: 0 (the payload carries sums)
    segments: tuple[Segment, ...]
    # The decoded tensor's linear sum (checksum.linear_sum) when the sender knows it: always
    # for a delta, for a dense entry once the agent has it. The receiver records it to verify
    # the next delta against what it holds without re-reading the tensor.
    sum: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True)
class VersionManifest:
    """What one pull carries: ``version`` for TP slice (tp_rank, tp_size), as deltas against
    ``base_version`` where an entry's encoding is not DENSE. ``run``: on a published TP or DP
    shard, the trainer run it comes from (shard_staging.py); 0 everywhere else. ``full_shapes``:
    on a published flat DP shard (flat_shards.py), each entry's whole tensor shape, in entry
    order; empty everywhere else."""

    version: int
    base_version: int | None
    tp_rank: int
    tp_size: int
    bucket_sizes: tuple[int, ...]
    bucket_checksums: tuple[int, ...]
    entries: tuple[ManifestEntry, ...]
    run: int = 0
    full_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def full_shape_of(self) -> dict[str, tuple[int, ...]]:
        """A flat DP shard's entries' whole shapes by name ({} when the manifest has none)."""
        return {e.name: shape for e, shape in zip(self.entries, self.full_shapes)}

    def to_dict(self) -> dict:
        # Publish-only fields appear only when set: pull manifests (and their plan ids) unchanged.
        extra: dict = {"run": self.run} if self.run else {}
        if self.full_shapes:
            extra["full_shapes"] = [list(shape) for shape in self.full_shapes]
        return {
            "format": MANIFEST_FORMAT, "version": self.version, "base_version": self.base_version,
            "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "bucket_sizes": list(self.bucket_sizes),
            "bucket_checksums": list(self.bucket_checksums),
            "entries": [
                {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "encoding": e.encoding,
                 "checksum": e.checksum,
                 "segments": [[s.bucket, s.offset, s.length] for s in e.segments],
                 **({} if e.sum is None else {"sum": e.sum})}
                for e in self.entries
            ],
            **extra,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> VersionManifest:
        """Validate and rebuild a manifest; raises ManifestError naming the bad field."""
        try:
            if data["format"] != MANIFEST_FORMAT:
                raise ManifestError(f"manifest format {data['format']} is not {MANIFEST_FORMAT}: "
                                    "sender and receiver run different versions")
            entries = tuple(
                ManifestEntry(str(e["name"]), str(e["dtype"]), tuple(int(n) for n in e["shape"]),
                              str(e["encoding"]), int(e["checksum"]),
                              tuple(Segment(int(b), int(o), int(n)) for b, o, n in e["segments"]),
                              None if e.get("sum") is None else int(e["sum"]))
                for e in data["entries"]
            )
            base = data["base_version"]
            manifest = cls(int(data["version"]), None if base is None else int(base),
                           int(data["tp_rank"]), int(data["tp_size"]),
                           tuple(int(n) for n in data["bucket_sizes"]),
                           tuple(int(c) for c in data["bucket_checksums"]), entries,
                           int(data.get("run", 0)),
                           tuple(tuple(int(n) for n in shape)
                                 for shape in data.get("full_shapes", ())))
            if manifest.full_shapes and len(manifest.full_shapes) != len(entries):
                raise ManifestError(f"the manifest has {len(entries)} entries but "
                                    f"{len(manifest.full_shapes)} full_shapes; one per entry")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"malformed weight manifest ({type(exc).__name__}: {exc}); "
                                "ask the agent for it again") from exc
        _check_layout(manifest)
        return manifest


def layout_segments(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[Segment, ...]]:
    """Greedy placement: an item that fits in a bucket is never split; a larger one starts a
    fresh bucket and spans consecutive full buckets. Every bucket is at most ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    placed, bucket, fill = [], 0, 0
    for size in sizes:
        if fill and fill + size > bucket_bytes:
            bucket, fill = bucket + 1, 0
        segments = []
        remaining = size
        while True:
            take = min(remaining, bucket_bytes - fill)
            segments.append(Segment(bucket, fill, take))
            fill, remaining = fill + take, remaining - take
            if not remaining:
                break
            bucket, fill = bucket + 1, 0
        placed.append(tuple(segments))
    return placed


def pack(version: int, base_version: int | None, items: Sequence[tuple[str, EncodedTensor]],
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, tp_rank: int = 0, tp_size: int = 1,
         parallel_map: ParallelMap = map) -> tuple[VersionManifest, list[bytes]]:
    """Lay the payloads out in buckets; returns the manifest and the buckets' bytes. Buckets are
    joined and checksummed through ``parallel_map``."""
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("pack() got the same tensor name twice; each tensor goes in once")
    placed = layout_segments([item.nbytes for _, item in items], bucket_bytes)
    n_buckets = max((seg[-1].bucket + 1 for seg in placed), default=0)
    parts: list[list[memoryview]] = [[] for _ in range(n_buckets)]
    entries = []
    for (name, item), segments in zip(items, placed):
        view, at = memoryview(item.payload), 0
        for seg in segments:
            parts[seg.bucket].append(view[at:at + seg.length])
            at += seg.length
        entries.append(ManifestEntry(name, str(item.dtype).removeprefix("torch."), item.shape,
                                     item.encoding.name, item.checksum, segments,
                                     item.target_sum))
    joined = list(parallel_map(_join_and_sum, parts))
    buckets = [b for b, _ in joined]
    manifest = VersionManifest(version, base_version, tp_rank, tp_size,
                               tuple(len(b) for b in buckets),
                               tuple(c for _, c in joined), tuple(entries))
    return manifest, buckets


def unpack(manifest: VersionManifest,
           buckets: Sequence[bytes | memoryview] | Mapping[int, bytes | bytearray | memoryview],
           names: Collection[str] | None = None,
           verified: Iterable[int] = ()) -> dict[str, memoryview]:
    """Each entry's payload (zero-copy when it lies in one bucket), after checking every bucket
    it touches against the manifest. ``names`` restricts to entries whose buckets have arrived;
    ``verified`` buckets passed their CRC on arrival already and are not checksummed again."""
    by_index = buckets if isinstance(buckets, Mapping) else dict(enumerate(buckets))
    wanted = [e for e in manifest.entries if names is None or e.name in names]
    checked: set[int] = set(verified)
    payloads = {}
    for entry in wanted:
        views = []
        for seg in entry.segments:
            if seg.bucket not in checked:
                _check_bucket(manifest, seg.bucket, by_index)
                checked.add(seg.bucket)
            views.append(memoryview(by_index[seg.bucket])[seg.offset:seg.offset + seg.length])
        payload = views[0] if len(views) == 1 else memoryview(b"".join(views))
        header = read_header(payload)
        if header.checksum != entry.checksum or (header.encoding.name != "DENSE"
                                                 and header.target_sum != entry.sum):
            raise ManifestError(f"payload of {entry.name} does not belong to this manifest "
                                "(tensor checksums differ): buckets of two pulls were mixed")
        payloads[entry.name] = payload
    return payloads


def _join_and_sum(parts: list[memoryview]) -> tuple[bytes, int]:
    bucket = b"".join(parts)
    return bucket, bytes_checksum(bucket)


def entries_ready(manifest: VersionManifest, received: Collection[int]) -> list[str]:
    """Names whose every bucket is in ``received``: a worker decodes them while the rest stream."""
    return [e.name for e in manifest.entries if all(s.bucket in received for s in e.segments)]


def manifest_dtype(entry: ManifestEntry) -> torch.dtype:
    """The entry's dtype (one ``from_dict`` accepted: the codec carries it)."""
    dtype = codec_dtype(entry.dtype)
    if dtype is None:
        raise ManifestError(f"manifest entry {entry.name} has unknown dtype {entry.dtype!r}; "
                            f"the weight codec carries {codec_dtype_names()}")
    return dtype


def _check_bucket(manifest: VersionManifest, index: int,
                  buckets: Mapping[int, bytes | bytearray | memoryview]) -> None:
    if index not in buckets:
        raise ManifestError(f"bucket {index} of version {manifest.version} has not arrived; "
                            "pull it before unpacking the tensors it holds")
    data = buckets[index]
    if len(data) != manifest.bucket_sizes[index]:
        raise ManifestError(f"bucket {index} is {len(data)} bytes, the manifest says "
                            f"{manifest.bucket_sizes[index]}: it was truncated — pull it again")
    actual = bytes_checksum(data)
    if actual != manifest.bucket_checksums[index]:
        raise ChecksumMismatchError(f"bucket {index} of version {manifest.version}",
                                    manifest.bucket_checksums[index], actual)


def _check_entries(manifest: VersionManifest) -> None:
    """Every entry's fields are ones the codec reads: a known dtype and encoding, a shape of
    non-negative sizes, a name given once."""
    names: set[str] = set()
    for entry in manifest.entries:
        if entry.name in names:
            raise ManifestError(f"the manifest names tensor {entry.name!r} twice; each tensor "
                                "goes in once")
        names.add(entry.name)
        manifest_dtype(entry)
        if entry.encoding not in Encoding.__members__:
            raise ManifestError(f"manifest entry {entry.name} has unknown encoding "
                                f"{entry.encoding!r}; one of {list(Encoding.__members__)}")
        if any(n < 0 for n in entry.shape):
            raise ManifestError(f"manifest entry {entry.name} has shape {list(entry.shape)}; "
                                "sizes are >= 0")


def _check_layout(manifest: VersionManifest) -> None:
    _check_entries(manifest)
    n = len(manifest.bucket_sizes)
    if len(manifest.bucket_checksums) != n:
        raise ManifestError(f"manifest lists {n} bucket sizes but "
                            f"{len(manifest.bucket_checksums)} bucket checksums")
    for entry in manifest.entries:
        if not entry.segments:
            raise ManifestError(f"manifest entry {entry.name} has no segments")
        for seg in entry.segments:
            if not (0 <= seg.bucket < n and seg.offset >= 0 and seg.length >= 0
                    and seg.offset + seg.length <= manifest.bucket_sizes[seg.bucket]):
                raise ManifestError(f"manifest entry {entry.name} points at {seg}, outside the "
                                    f"{n} buckets it describes")
