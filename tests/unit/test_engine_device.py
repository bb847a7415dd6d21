"""The device and dtype settings of the engine-hosting services: a bad value or a GPU flag on a
machine without one is refused with the config (exit 2, before anything starts), and what is
accepted reaches the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlharvest.common.config import ConfigError, load_config
from rlharvest.common.engine_device import resolve
from rlharvest.services.coexecutor.config import CoexecutorConfig
from rlharvest.services.rollout_worker.config import WorkerConfig

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("model", [WorkerConfig, CoexecutorConfig])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_naming_the_key(model):
    with pytest.raises(ConfigError, match="device"):
        load_config(model, flags={"device": "gpu"})
    with pytest.raises(ConfigError, match="dtype"):
        load_config(model, flags={"dtype": "int8"})


@NO_CUDA
@pytest.mark.parametrize("model", [WorkerConfig, CoexecutorConfig])
def test_a_cuda_device_on_a_machine_without_cuda_is_refused_with_the_config(model):
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        load_config(model, flags={"device": "cuda:0"})


@NO_CUDA
def test_the_worker_exits_2_on_a_cuda_flag_here_before_it_dials_etcd():
    # etcd at a closed port: had the check come after the join, the worker would fail there.
    done = subprocess.run([sys.executable, "-m", "rlharvest.services.rollout_worker.main",
                           "--device", "cuda", "--etcd", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "sees no CUDA device" in done.stderr + done.stdout


def test_cpu_and_a_dtype_resolve_to_torch_objects():
    assert resolve("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve("cpu", "float32") == (torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        resolve("cpu", "float64")


def test_a_bfloat16_engine_generates_what_its_float32_twin_does_on_a_tiny_model():
    from rlharvest.common.engine_types import EngineRequest, SamplingParams
    from rlharvest.services.rollout_worker.torch_engine import TorchEngine

    def run(dtype: torch.dtype) -> list[int]:
        engine = TorchEngine("tiny", dtype=dtype, kv_pages=32)
        engine.add(EngineRequest("r", [1, 5, 6, 7], SamplingParams(temperature=0.0,
                                                                    max_tokens=6)))
        tokens: list[int] = []
        while engine.has_work():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        return tokens

    half = TorchEngine("tiny", dtype=torch.bfloat16, kv_pages=32)
    assert half._model.model.embed_tokens.weight.dtype == torch.bfloat16  # the flag took
    assert half._cache.pages.dtype == torch.bfloat16  # and the KV pages with it
    assert len(run(torch.bfloat16)) == 6
    # bfloat16 rounds the weights; the tiny model's greedy path is far from ties at the start.
    assert run(torch.bfloat16)[:2] == run(torch.float32)[:2]
