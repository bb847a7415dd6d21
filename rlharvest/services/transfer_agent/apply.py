"""Worker side of a pull: decode a version's buckets against the version the worker holds.

RLBoost §4.3: a rollout instance pulls the latest weights on its own and starts generating once
they are in; ROSE §4.2 keeps W_{t-1} resident and applies the sparse ΔW_t to it. Every tensor is
checked against the checksum its agent computed before the caller may load it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from rlharvest.services.transfer_agent.bucketing import (
    ManifestEntry,
    ManifestError,
    ParallelMap,
    VersionManifest,
    manifest_dtype,
    unpack,
)
from rlharvest.services.transfer_agent.delta_codec import Encoding, decode, undo_delta


def apply_pull(manifest: VersionManifest,
               buckets: Sequence[bytes | memoryview] | Mapping[int, bytes | bytearray | memoryview],
               held: Mapping[str, torch.Tensor], held_version: int | None, *,
               inplace: bool = False, names: Collection[str] | None = None,
               verified: Iterable[int] = (),
               parallel_map: ParallelMap = map,
               held_sums: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The pulled version's tensors by name (those in ``names`` when given). Deltas are applied
    to ``held`` (the worker's tensors of ``held_version``), into them when ``inplace``; dense
    entries always decode into fresh tensors. ``verified`` buckets already passed their CRC.
    Tensors decode through ``parallel_map`` (a thread pool's map runs them side by side).
    ``held_sums``: the linear sums recorded for ``held`` (the manifest sums of the pull that
    brought them); a delta against a tensor without one re-reads it to compute it. The pulled
    tensors' own sums are their manifest entries' ``sum``.

    All or nothing: if any entry fails, deltas already applied in place are taken back out, so
    ``held`` is again exactly ``held_version`` when the error propagates."""
    deltas = [e for e in manifest.entries if e.encoding != Encoding.DENSE.name]
    if deltas and held_version != manifest.base_version:
        raise ManifestError(f"this pull carries deltas against version {manifest.base_version} "
                            f"but the worker holds {held_version}: ask for a dense pull instead")
    payloads = unpack(manifest, buckets, names, verified)
    entries = [e for e in manifest.entries if names is None or e.name in names]
    for entry in entries:
        if entry.encoding != Encoding.DENSE.name and held.get(entry.name) is None:
            raise ManifestError(f"{entry.name} arrived as a delta but the worker holds no such "
                                "tensor: ask for a dense pull")

    def one(entry: ManifestEntry) -> tuple[str, torch.Tensor | None, Exception | None, bool]:
        """(name, tensor, error, whether a delta now sits in ``held``)."""
        in_place = inplace and entry.encoding != Encoding.DENSE.name
        base = held.get(entry.name) if entry.encoding != Encoding.DENSE.name else None
        base_sum = None if held_sums is None else held_sums.get(entry.name)
        try:
            tensor = decode(payloads[entry.name], base, inplace=in_place, base_sum=base_sum)
        except Exception as exc:  # gathered, so the deltas that did apply can be undone
            return entry.name, None, exc, False  # a failed in-place decode restores its base
        if tuple(tensor.shape) != entry.shape or tensor.dtype != manifest_dtype(entry):
            return entry.name, tensor, ManifestError(
                f"{entry.name} decoded as {tensor.dtype}{tuple(tensor.shape)} but the manifest "
                f"says {entry.dtype}{entry.shape}"), in_place
        return entry.name, tensor, None, in_place

    results = list(parallel_map(one, entries))
    failed = [exc for _, _, exc, _ in results if exc is not None]
    if failed:
        undo_inplace(manifest, payloads, held, [name for name, _, _, applied in results if applied])
        raise failed[0]
    return {name: tensor for name, tensor, _, _ in results}


def undo_inplace(manifest: VersionManifest, payloads: Mapping[str, memoryview],
                 held: Mapping[str, torch.Tensor], names: Collection[str]) -> None:
    """Take deltas of ``names`` that were applied in place back out of ``held``."""
    for entry in manifest.entries:
        if entry.name in names and entry.encoding != Encoding.DENSE.name:
            undo_delta(payloads[entry.name], held[entry.name])
