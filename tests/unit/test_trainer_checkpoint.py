"""Trainer checkpoints: a resumed trainer continues exactly; saves are atomic; last N are kept."""

from __future__ import annotations

import dataclasses
import os
import random

import torch

from rlharvest.models.tiny_model import build_model
from rlharvest.services.trainer.backend import OptimConfig, TorchBackend
from rlharvest.services.trainer.checkpoint import (
    TrainerState,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from rlharvest.services.trainer.tasks import DatasetState, TaskDataset


def _trained(seed: int) -> TorchBackend:
    backend = TorchBackend(build_model("tiny", seed=seed), OptimConfig(lr=1e-2, grad_clip=0.0))
    backend.model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits.square().mean().backward()
    backend.step()
    return backend


def test_a_resumed_trainer_has_the_same_weights_optimizer_data_position_and_randomness(tmp_path):
    backend = _trained(0)
    model, optimizer = backend.model, backend.optimizer
    data = TaskDataset(seed=4)
    data.next_batch(6)
    state = TrainerState(step=12, weight_version=12,
                         data_position=dataclasses.asdict(data.state()),
                         extra={"anchors": {"case-1": 0.4}})
    save_checkpoint(tmp_path, state, backend.save)
    expected_draws = (random.random(), torch.rand(3))
    expected_items = data.next_batch(3)

    fresh = _trained(1)  # a fresh process with different everything
    other, other_opt = fresh.model, fresh.optimizer
    random.random(), torch.rand(3)
    loaded = load_latest(tmp_path, fresh.load)

    assert loaded == state
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert str(optimizer.state_dict()) == str(other_opt.state_dict())
    assert (random.random(), torch.rand(3))[0] == expected_draws[0]
    resumed = TaskDataset.from_state(DatasetState(**loaded.data_position))
    assert resumed.next_batch(3) == expected_items


def test_only_the_last_n_checkpoints_are_kept(tmp_path):
    backend = _trained(0)
    for step in range(5):
        save_checkpoint(tmp_path, TrainerState(step, step, {}), backend.save, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000003", "step-000000004"]


def test_an_interrupted_save_is_invisible_and_swept_by_the_next_save(tmp_path):
    backend = _trained(0)
    save_checkpoint(tmp_path, TrainerState(1, 1, {}), backend.save)
    # A crash between writing and renaming leaves only a temp directory with a partial file.
    partial = tmp_path / ".tmp-crashed"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"\x80half a pickle")
    (tmp_path / "step-000000002").mkdir()  # renamed dir can't be empty, but be robust anyway
    assert load_latest(tmp_path, backend.load).step == 1
    save_checkpoint(tmp_path, TrainerState(3, 3, {}), backend.save)
    assert not partial.exists()
    assert load_latest(tmp_path, backend.load).step == 3


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert load_latest(tmp_path / "missing", _trained(0).load) is None


def test_a_step_saved_again_keeps_its_old_checkpoint_until_the_new_one_is_in_place(tmp_path):
    backend = _trained(0)
    save_checkpoint(tmp_path, TrainerState(1, 1, {}), backend.save)
    save_checkpoint(tmp_path, TrainerState(2, 2, {"at": "first"}), backend.save)
    # A crash while saving step 2 again, between moving the old one aside and renaming the new
    # one in: the old one is step 2's checkpoint, not lost.
    os.replace(tmp_path / "step-000000002", tmp_path / ".old-step-000000002")
    assert load_latest(tmp_path, backend.load).data_position == {"at": "first"}
    save_checkpoint(tmp_path, TrainerState(2, 2, {"at": "again"}), backend.save)
    assert load_latest(tmp_path, backend.load).data_position == {"at": "again"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000002"]
    save_checkpoint(tmp_path, TrainerState(2, 2, {"at": "third"}), backend.save)  # no crash
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000001", "step-000000002"]
    assert load_latest(tmp_path, backend.load).data_position == {"at": "third"}
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
