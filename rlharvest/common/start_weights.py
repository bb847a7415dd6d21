"""A job's start weights, named by their content.

Weight versions 1, 2, ... of a job come from its trainer, through the transfer agents, under the
job's name. Version 0 does not: every worker builds it itself (a model preset and a seed, or a
checkpoint directory), and two jobs at version 0 are two different policies whenever their start
weights differ. So version 0 is fenced by a fingerprint of the weights themselves: the trainer
records its job's (``keys.start_weights_key``), every worker reports its own, and a manager sends
a version-0 request only to a worker whose start weights are the job's.

The fingerprint is a SHA-256 over every tensor's name, shape and values rounded to bfloat16,
in name order. Rounding makes it the same for a trainer holding float32 master weights and a
worker serving them in bfloat16 (a cast rounds to nearest, both ways the same) while any two
start weights that differ beyond bfloat16's precision (another seed, another checkpoint) differ.
Its cost is one pass over the weights (about a second per GB on one core), paid when a worker
builds its engine and when the trainer starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the control plane reads records without torch
    import torch

_CHUNK_ELEMENTS = 1 << 24  # hash a large tensor in slices: its bf16 copy stays small


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The start-weights fingerprint of ``tensors`` (hex, 16 characters)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
            part = flat[start:start + _CHUNK_ELEMENTS].to("cpu", torch.bfloat16).contiguous()
            digest.update(part.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def record(fingerprint_: str, source: str) -> bytes:
    """The job's start-weights record as the trainer writes it."""
    return json.dumps({"fingerprint": fingerprint_, "source": source}).encode()


def parse_record(raw: bytes | None) -> str:
    """The fingerprint a job's start-weights record names; "" for none (no record, or one that
    is not a record: then nothing is checked, as for a job whose trainer declared nothing)."""
    if raw is None:
        return ""
    try:
        data = json.loads(raw)
    except ValueError:
        return ""
    value = data.get("fingerprint") if isinstance(data, dict) else None
    return value if isinstance(value, str) else ""
