"""The trainer's ``--device``: the model trains where it says, every tensor of the loss is made
there, DeepSpeed's accelerator follows it, and a GPU asked of a machine without one is refused
at once. This machine has no GPU: the loss runs against a stand-in on torch's ``meta`` device
(any device but the CPU shows a tensor left behind on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from rlharvest.services.trainer.backend import Where, snapshot
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.device import (
    module_device,
    pin_deepspeed_accelerator,
    rank_device,
)
from rlharvest.services.trainer.grpo import LossConfig, completion_logprobs
from rlharvest.services.trainer.ranks import MicroBatch, Sample, micro_batch_loss

META = torch.device("meta")
VOCAB = 11


class OnMeta(torch.nn.Module):
    """A causal LM's interface on the meta device, refusing inputs from anywhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.device = META
        self.seen: list[torch.device] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        self.seen += [input_ids.device, attention_mask.device]
        if input_ids.device != META or attention_mask.device != META:
            raise RuntimeError(f"inputs on {input_ids.device}, the model on {META}")
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, VOCAB, device=META))


def test_the_loss_of_a_micro_batch_is_built_on_the_models_device() -> None:
    model = OnMeta()
    batch = MicroBatch((Sample((1, 2, 3), (6, 7), (-0.5, -0.6), 1.0, (True, False)),
                        Sample((4, 5), (8,), None, -1.0, None)), LossConfig(), 0, 3.0)
    loss = micro_batch_loss(model, batch, None)
    assert loss.device == META and loss.shape == ()
    assert model.seen == [META, META]
    logprobs, mask = completion_logprobs(model, [[1, 2]], [[3, 4, 5]], 0)
    assert (logprobs.device, mask.device, tuple(mask.shape)) == (META, META, (1, 3))


def test_module_device_asks_an_engine_then_the_parameters() -> None:
    assert module_device(OnMeta()) == META  # a DeepSpeed engine names its device
    assert module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(torch.nn.Linear(2, 2, device=META)) == META
    assert module_device(torch.nn.ReLU()) == torch.device("cpu")  # no parameters


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_trainer_on_a_machine_without_one_is_refused_with_the_config() -> None:
    with pytest.raises(ValidationError, match="sees no CUDA device"):
        TrainerConfig(device="cuda")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        rank_device("cuda")
    assert TrainerConfig().device == "cpu"


def test_rank_device_names_the_cpu_or_refuses_what_it_does_not_know() -> None:
    assert rank_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        rank_device("tpu")


def test_deepspeed_trains_where_the_trainer_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored after the test, whatever it sets
    pin_deepspeed_accelerator(torch.device("cpu"))
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == "cpu"
    # DeepSpeed chose once for this process: a GPU trainer here is refused, not misplaced.
    with pytest.raises(RuntimeError, match="already chose the 'cpu' accelerator"):
        pin_deepspeed_accelerator(torch.device("cuda", 0))


def test_a_publish_snapshot_takes_the_serving_dtype_and_is_a_copy() -> None:
    model = torch.nn.Embedding(5, 3)
    model.register_buffer("steps", torch.arange(4))
    copy = snapshot(model, Where("cpu", torch.bfloat16))
    assert copy["weight"].dtype == torch.bfloat16 and copy["steps"].dtype == torch.int64
    assert torch.equal(copy["weight"], model.weight.detach().to(torch.bfloat16))
    with torch.no_grad():
        model.weight.add_(1.0)  # a later update leaves the version as it was
        model.steps.add_(1)
    assert not torch.equal(copy["weight"], model.weight.detach().to(torch.bfloat16))
    assert copy["steps"].tolist() == [0, 1, 2, 3]
    assert snapshot(model)["weight"].dtype == torch.float32  # by default: as the model holds it


def test_the_seed_engine_gets_the_weights_as_the_workers_serve_them() -> None:
    from rlharvest.services.trainer.publishing import Publishing

    weights = {"w": torch.tensor([1.0 + 2**-12, 3.0]), "ids": torch.arange(3)}
    served = Publishing.as_served(SimpleNamespace(_dtype=torch.bfloat16), weights)
    assert served["w"].dtype == torch.bfloat16 and served["w"].tolist() == [1.0, 3.0]
    assert served["ids"] is weights["ids"]
    as_is = Publishing.as_served(SimpleNamespace(_dtype=None), weights)
    assert as_is is weights  # --publish-dtype model: the trainer's own bits


_NO_COMPILER_STEP = """
import deepspeed.comm.comm, torch
from deepspeed.git_version_info import installed_ops
from rlharvest.services.trainer.backend import OptimConfig, make_backend

model = torch.nn.Linear(4, 2)
before = model.weight.detach().clone()
backend = make_backend("deepspeed", model, OptimConfig(optimizer="sgd", lr=0.1))
backend.backward(backend.module(torch.ones(3, 4)).sum())
backend.step()
print(installed_ops["deepspeed_shm_comm"], deepspeed.comm.comm.cdb.shm_comm_op is None,
      type(backend.module).__name__, not torch.equal(before, backend.model.weight))
"""


def test_deepspeed_trains_where_its_cpu_op_is_not_built_and_no_compiler_is_found() -> None:
    # The container image's case: a wheel without DeepSpeed's prebuilt shared-memory op and no
    # C++ compiler. In a process of its own: DeepSpeed keeps its op probes per process.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CXX": "/nonexistent/c++", "PYTHONPATH": str(root)}
    env.pop("DS_ACCELERATOR", None)
    run = subprocess.run([sys.executable, "-c", _NO_COMPILER_STEP], capture_output=True,
                         text=True, timeout=300, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-4000:]
    built, skipped, engine, updated = run.stdout.split()[-4:]
    if built == "True":
        pytest.skip("this DeepSpeed carries its shared-memory op built")
    assert (skipped, engine, updated) == ("True", "DeepSpeedEngine", "True")
