"""The trainer's side of delta publishing: what changed since the last published
version, encoded once where the change is known, instead of the agent diffing full copies.

ROSE §4.2 ships ΔW_t to workers holding W_{t-1}; in our first design the agent found ΔW_t by
comparing two full copies, then re-read the whole target to checksum it, on every worker's
first pull. Here the trainer keeps the version it last published (in the serving dtype: bf16
rounding is what makes RL deltas sparse, ROSE Fig. 11), finds the changed elements itself (a
compare on the device that holds the weights, ~free on a GPU; here a CPU pass), and encodes
only those elements (on an accelerator the gather and the sums run there too, and only the
changes cross to the host: ``encode_changes_on_device``), chaining the linear sums from version to version so nobody re-reads an
unchanged element. The agent stores the encodings as the pull plan for the base version.

Pure: no I/O. ``LastPublished.encode_next`` is called on a thread (it reads tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from rlharvest.services.transfer_agent.bucketing import ParallelMap
from rlharvest.services.transfer_agent.checksum import tensor_linear_sum
from rlharvest.services.transfer_agent.delta_codec import (
    EncodedTensor,
    decode,
    encode_changes,
    encode_changes_on_device,
    encode_dense_with_sum,
)


def _device_index(given: Positions | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The changed positions as int64 on the tensors' device: the optimizer's (the encoder
    checks them), or the device's own compare."""
    if given is None:
        return changed_index(old, new)
    return torch.as_tensor(given, dtype=torch.int64).reshape(-1).to(old.device)


@dataclass(frozen=True)
class DeltaStats:
    """What one publish changed: the measured sparsity operators ask about."""

    changed: int  # elements whose bits changed
    numel: int
    payload_bytes: int
    dense_bytes: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


def changed_index(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions where the bits of ``new`` differ from ``old`` (same shape, dtype and
    device), increasing, int64 on their device. Compares integer views, so NaN payloads and
    -0.0 count as the bits they are."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    a = old.detach().contiguous().reshape(-1).view(width)
    b = new.detach().contiguous().reshape(-1).view(width)
    return torch.nonzero(a != b).reshape(-1)


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """``changed_index`` on the host, as numpy."""
    return changed_index(old, new).cpu().numpy()


# Applying a delta costs ~60 ns per changed element (gather, XOR, scatter, sum check); copying
# ~0.6 ns per element: above ~1% changed a copy is cheaper (bench/transfer_delta.py, 48 MB
# bf16: at 1% both 15-17 ms, at 0.1% 3 ms vs 15 ms, at 10% 136 ms vs 12 ms).
APPLY_MAX_FRACTION = 0.005


def _private_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


Positions = np.ndarray | torch.Tensor


class LastPublished:
    """The last version published to one agent: its tensors (a private copy, on the device
    the weights were published from) and their linear sums where known. ``encode_next`` turns
    the next version into encodings against it.

    On an accelerator the copy stays there (one more copy of the weights in the serving
    dtype, in device memory), so the compare, the gather and the sums run at device speed
    and only the changes cross to the host; a CPU trainer's copy is on the CPU. (A trainer run
    with ``--device cuda`` snapshots each version on its GPU in the serving dtype, so
    ``Publisher`` hands it device tensors; bench/transfer_delta.py --device cuda times it.)

    ``advance`` trusts that ``tensors`` are what was encoded: on a device it copies them
    (cheaper than applying), so the record's bits follow the tensors and its sums the
    encodings; the two agree as long as the positions given to ``encode_next`` were all the
    changes."""

    def __init__(self, version: int, tensors: Mapping[str, torch.Tensor],
                 sums: Mapping[str, int | None] | None = None) -> None:
        self.version = version
        self.tensors = {name: _private_copy(t) for name, t in tensors.items()}
        self.sums: dict[str, int | None] = dict(sums or {})

    def encode_next(self, tensors: Mapping[str, torch.Tensor],
                    positions: Mapping[str, Positions] | None = None,
                    parallel_map: ParallelMap = map,
                    ) -> tuple[dict[str, EncodedTensor], DeltaStats]:
        """Every tensor of the next version: a sparse delta against this one where that is
        smaller, dense where it is not (a new name, a new shape or dtype, a dense change).
        ``positions``: per tensor, the flat positions that may have changed, increasing (from
        the optimizer step, when it knows them; numpy, or a tensor on any device); a tensor
        without them is compared in full, on the device that holds it.
        Tensors encode through ``parallel_map`` (a thread pool's map: numpy releases the GIL)."""
        given = positions or {}

        def one(name: str) -> tuple[str, EncodedTensor, int]:
            old = self.tensors.get(name)
            new = tensors[name].detach()
            if old is None or old.shape != new.shape or old.dtype != new.dtype:
                return name, encode_dense_with_sum(new), new.numel()
            new = new.to(old.device).contiguous()
            if old.device.type == "cpu":
                index = given.get(name)
                index = changed_positions(old, new) if index is None else np.asarray(
                    index.cpu().numpy() if isinstance(index, torch.Tensor) else index).reshape(-1)
                item = encode_changes(old, new, index, base_sum=self.sums.get(name))
            else:
                index = _device_index(given.get(name), old, new)
                item = encode_changes_on_device(old, new, index, base_sum=self.sums.get(name))
            if item.target_sum is None:  # too dense for a delta: keep the chain of sums
                item = replace(item, target_sum=tensor_linear_sum(new))
            return name, item, len(index)

        encoded: dict[str, EncodedTensor] = {}
        changed = 0
        for name, item, count in parallel_map(one, list(tensors)):
            encoded[name] = item
            changed += count
            if item.base_sum is not None:
                self.sums[name] = item.base_sum  # learned: computed once, then chained
        numel = sum(t.numel() for t in tensors.values())
        dense_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        payload = sum(item.nbytes for item in encoded.values())
        return encoded, DeltaStats(changed, numel, payload, dense_bytes)

    def advance(self, version: int, tensors: Mapping[str, torch.Tensor],
                encoded: Mapping[str, EncodedTensor]) -> LastPublished:
        """This record, moved on to ``version`` once ``tensors`` were published as ``encoded``
        (what ``encode_next`` made against it). A sparse delta is applied to the held copy in
        place, as a worker applies it: O(changes), and verified by the chained sums; only dense
        ones, and deltas too dense to apply faster than a copy, are copied. ``after`` copies
        every tensor, the whole model per publish."""
        for name, item in encoded.items():
            held = self.tensors.get(name)
            new = tensors[name].detach()
            if held is not None and held.device.type != "cpu" and held.shape == new.shape \
                    and held.dtype == new.dtype:
                held.copy_(new)  # a device-to-device copy: cheaper than any apply
            elif item.needs_base and held is not None and \
                    item.count <= APPLY_MAX_FRACTION * held.numel():
                decode(item, held, inplace=True, base_sum=item.base_sum)
            else:
                self.tensors[name] = _private_copy(new)
            self.sums[name] = item.target_sum
        for name in set(self.tensors) - set(encoded):  # gone from the model
            del self.tensors[name]
            self.sums.pop(name, None)
        self.version = version
        return self

    @classmethod
    def after(cls, version: int, tensors: Mapping[str, torch.Tensor],
              encoded: Mapping[str, EncodedTensor] | None = None) -> LastPublished:
        """The record after publishing ``tensors`` as ``version`` (``encoded``: the encodings
        it went as, whose target sums carry over; None after a dense publish)."""
        sums = {name: item.target_sum for name, item in (encoded or {}).items()}
        return cls(version, tensors, sums)
