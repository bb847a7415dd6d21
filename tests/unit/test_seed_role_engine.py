"""The trainer's seed engine: what it is built with."""

from __future__ import annotations

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
