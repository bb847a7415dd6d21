"""A worker's copy of the pulled weights on its engine's device (``--held-weights device``): dense
results go into the held tensors there, and a failure on the way leaves no
half-placed version behind. The device here is ``meta`` (placement without data); the CUDA
run is tests/integration/test_transfer_agent.py on a GPU node."""

from __future__ import annotations

import pytest
import torch

from rlharvest.services.rollout_worker.puller import Puller
from rlharvest.services.transfer_agent.client import PullResult


def _puller() -> Puller:
    return Puller(None, None, "worker-1", "job", held_device="meta")  # no etcd: not started


def test_dense_results_are_copied_into_the_held_tensors_of_their_form_on_the_device():
    puller = _puller()
    held = {"a": torch.empty(4, device="meta"), "b": torch.empty(2, device="meta")}
    already = torch.empty(2, device="meta")  # a delta applied in place lives there already
    placed = puller._to_held_device({"a": torch.ones(4), "b": torch.ones(3),
                                     "c": torch.ones(1), "d": already}, dict(held))
    assert placed["a"] is held["a"]  # no second copy of the model on the device
    assert placed["b"] is not held["b"] and placed["b"].shape == (3,) and placed["b"].is_meta
    assert placed["c"].is_meta and placed["d"] is already


async def test_a_failure_placing_a_pull_forgets_the_held_version():
    puller = _puller()
    puller.held, puller.held_version, puller.held_sums = {"a": torch.empty(4)}, 3, {"a": 7}

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    puller._to_held_device = out_of_memory  # type: ignore[method-assign]
    result = PullResult(4, {"a": torch.ones(4)}, "", False, 16, 16, 0, 0.1)
    with pytest.raises(torch.OutOfMemoryError):
        await puller._load(result, "agent-a", 0.1)
    assert puller.held == {} and puller.held_version is None and puller.held_sums == {}
