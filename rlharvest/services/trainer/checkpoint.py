"""Trainer checkpoints: model, optimizer, step, weight version, data position and RNG states.

A checkpoint is a directory ``step-<n>``: the weights and optimizer state of every rank, as the
backend writes them (``write_weights``: a DeepSpeed checkpoint of all ranks, or one torch file),
and ``state.pt``, the control state, written last. It is assembled under a temporary name and
renamed into place, so a crash of any rank mid-save leaves either the previous checkpoints or the
new one, never a half-written ``step-*``; leftovers of an interrupted save are ignored and swept
by the next save. Saving a step again (a trainer stopped twice with no step between) moves the
old one aside (``.old-step-<n>``) and deletes it only once the new one is in place: a crash
between the two renames leaves the old one, which counts as that step's checkpoint. The newest ``keep_last`` checkpoints are kept. With ranks on several nodes the
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
_ASIDE_PREFIX = ".old-"


@dataclass
class TrainerState:
    step: int
    weight_version: int
    data_position: dict[str, Any]  # e.g. dataclasses.asdict(TaskDataset.state())
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. adaptive-timeout anchors


def capture_rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a GPU trainer's generators
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


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
    aside = root_path / f"{_ASIDE_PREFIX}{final.name}"
    if final.exists():  # re-saving the same step (e.g. after a resume) replaces it
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root_path)
    _prune(root_path, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    kept = list_checkpoints(root)
    for old in kept[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in [*root.glob(f"{_TMP_PREFIX}*"), *root.glob(f"{_ASIDE_PREFIX}*")]:
        if leftover not in kept:  # an aside whose step was saved again, or a dead save's
            shutil.rmtree(leftover, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first: ``step-<n>``, or its ``.old-`` copy where a save of
    the same step crashed between moving it aside and renaming the new one in."""
    root_path = Path(root)
    if not root_path.is_dir():
        return []
    by_step: dict[int, Path] = {}
    for prefix in (_ASIDE_PREFIX + _PREFIX, _PREFIX):  # the step's own directory wins
        for path in root_path.glob(f"{prefix}*"):
            if (path / "state.pt").is_file():
                by_step[int(path.name[len(prefix):])] = path
    return [by_step[step] for step in sorted(by_step)]


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
