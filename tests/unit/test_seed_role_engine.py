"""The trainer's seed engine: what it is built with."""

from __future__ import annotations

import torch

from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.seed_role import SeedRole


def _engine(**flags):
    cfg = TrainerConfig(seed_role=True, instance_cap="auto", seed_max_running=4, seed_max_len=512,
                        **flags)
    return SeedRole(cfg, etcd=None, endpoint="127.0.0.1:1")._engine


def test_with_an_environment_the_seed_engine_caches_prefixes_for_the_next_turn():
    engine = _engine(env="frozen_lake")
    assert engine._prefix is not None
    # pages for the running requests twice over: 2 x 4 x 512 / 16
    assert engine._own is not None and engine._own.free_pages == 256


def test_single_turn_steps_keep_the_seed_engine_unpaged():
    engine = _engine()
    assert engine._prefix is None and engine._own is None


def _rollout(engine) -> dict[str, tuple[list[int], list[float]]]:
    """Four requests to the end on ``engine``: each one's tokens and logprobs."""
    for i in range(4):
        engine.add(EngineRequest(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=12, seed=i)))
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    return got


def test_the_seed_engine_samples_in_the_dtype_the_workers_serve():
    """With --publish-dtype bfloat16 the workers serve bf16 (the GPU overlay's RLH_DTYPE): the
    seed engine computes in bf16 too, so its tokens and logprobs are a worker's, and a request
    handed over mid-flight goes on in the precision it began in. An fp32 engine holding the
    same bf16-rounded weights samples differently."""
    seed = _engine(publish_dtype="bfloat16")
    assert next(seed._model.parameters()).dtype == torch.bfloat16
    worker = TorchEngine(model="tiny", seed=0, max_running=4, max_len=512, dtype=torch.bfloat16)
    assert _rollout(seed) == _rollout(worker)
    fp32_on_bf16_weights = TorchEngine(model="tiny", seed=0, max_running=4, max_len=512)
    fp32_on_bf16_weights.load_weights({k: v.float() for k, v in worker.weights().items()}, 0)
    assert _rollout(fp32_on_bf16_weights) != _rollout(worker)  # the check can fail


def test_the_seed_engine_publishing_the_models_dtype_serves_fp32():
    assert next(_engine()._model.parameters()).dtype == torch.float32
