"""Worker side of a pull: decode a version's buckets against the version the worker holds.

RLBoost §4.3: a rollout instance pulls the latest weights on its own and starts generating once
they are in; ROSE §4.2 keeps W_{t-1} resident and applies the sparse ΔW_t to it. Every tensor is
checked against the checksum its agent computed before the caller may load it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rlharvest.services.transfer_agent.bucketing import (
    ManifestError,
    VersionManifest,
    manifest_dtype,
    unpack,
)
from rlharvest.services.transfer_agent.delta_codec import Encoding, decode


def apply_pull(manifest: VersionManifest,
               buckets: Sequence[bytes | memoryview] | Mapping[int, bytes | memoryview],
               held: Mapping[str, torch.Tensor], held_version: int | None, *,
               inplace: bool = False) -> dict[str, torch.Tensor]:
    """The pulled version's tensors by name. Deltas are applied to ``held`` (the worker's tensors
    of ``held_version``), into them when ``inplace``; dense entries need no held tensor."""
    deltas = [e for e in manifest.entries if e.encoding != Encoding.DENSE.name]
    if deltas and held_version != manifest.base_version:
        raise ManifestError(f"this pull carries deltas against version {manifest.base_version} "
                            f"but the worker holds {held_version}: ask for a dense pull instead")
    payloads = unpack(manifest, buckets)
    tensors = {}
    for entry in manifest.entries:
        base = held.get(entry.name)
        if entry.encoding != Encoding.DENSE.name and base is None:
            raise ManifestError(f"{entry.name} arrived as a delta but the worker holds no such "
                                "tensor: ask for a dense pull")
        tensor = decode(payloads[entry.name], base, inplace=inplace and base is not None)
        if tuple(tensor.shape) != entry.shape or tensor.dtype != manifest_dtype(entry):
            raise ManifestError(f"{entry.name} decoded as {tensor.dtype}{tuple(tensor.shape)} but "
                                f"the manifest says {entry.dtype}{entry.shape}")
        tensors[entry.name] = tensor
    return tensors
