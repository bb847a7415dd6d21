"""Trainer checkpoints: model, optimizer, step, weight version, data position and RNG states.

A checkpoint is a directory ``step-<n>``: the weights and optimizer state of every rank, as the
backend writes them (``write_weights``: a DeepSpeed checkpoint of all ranks, or one torch file),
and ``state.pt``, the control state, written last. It is assembled under a temporary name and
renamed into place, so a crash of any rank mid-save leaves either the previous checkpoints or the
new one, never a half-written ``step-*``; leftovers of an interrupted save are ignored and swept
by the next save. The newest ``keep_last`` checkpoints are kept. With ranks on several nodes the
root must be a shared file system (every rank writes into the same temporary directory).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"


@dataclass
class TrainerState:
    step: int
    weight_version: int
    data_position: dict[str, Any]  # e.g. dataclasses.asdict(TaskDataset.state())
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. adaptive-timeout anchors


def capture_rng_states() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


WeightsIO = Callable[[Path], None]  # every rank writes (or reads) its part under the directory


def save_checkpoint(root: str | os.PathLike, state: TrainerState, write_weights: WeightsIO,
                    keep_last: int = 3) -> Path:
    """Atomically write checkpoint ``step-<state.step>`` under ``root``; returns its path."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root_path = Path(root)
    root_path.mkdir(parents=True, exist_ok=True)
    final = root_path / f"{_PREFIX}{state.step:09d}"
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root_path))
    write_weights(tmp)
    payload = {"state": state.__dict__, "rng": capture_rng_states()}
    with open(tmp / "state.pt", "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. after a resume) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root_path)
    _prune(root_path, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root_path = Path(root)
    if not root_path.is_dir():
        return []
    found = [p for p in root_path.glob(f"{_PREFIX}*") if (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def load_checkpoint(path: str | os.PathLike, read_weights: WeightsIO,
                    restore_rng: bool = True) -> TrainerState:
    """Load weights and optimizer state in place; returns step/version/data position."""
    file = Path(path) / "state.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist; pass a directory from list_checkpoints()")
    # weights_only=False: the payload holds RNG states and plain dicts we wrote ourselves.
    payload = torch.load(file, map_location="cpu", weights_only=False)
    read_weights(Path(path))
    if restore_rng:
        restore_rng_states(payload["rng"])
    return TrainerState(**payload["state"])


def load_latest(root: str | os.PathLike, read_weights: WeightsIO,
                restore_rng: bool = True) -> TrainerState | None:
    """Resume from the newest complete checkpoint; None when there is none (a fresh start)."""
    checkpoints = list_checkpoints(root)
    if not checkpoints:
        return None
    return load_checkpoint(checkpoints[-1], read_weights, restore_rng)
