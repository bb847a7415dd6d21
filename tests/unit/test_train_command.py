"""`rlharvest train`'s pure parts: the trainer command line it builds, and the trainer config's
refusals of contradictory data and reward flags."""

from __future__ import annotations

import pytest

from rlharvest.common.cli import parse_flags
from rlharvest.common.config import ConfigError, load_config
from rlharvest.cli.train_command import trainer_flags
from rlharvest.services.trainer.config import TrainerConfig


def test_the_trainer_flags_it_builds_parse_back_into_the_same_config():
    cfg = TrainerConfig.model_validate(dict(
        model="/models/qwen3", data="/data/gsm8k.parquet", reward="math",
                        data_fields="prompt=question,ground_truth=answer", steps=7,
                        prompts_per_step=4, samples_per_prompt=4, micro_batch_groups=1,
                        max_new_tokens=128, temperature=0.7, lr=1e-6, backend="torch",
                        checkpoint_dir="/out/ckpt", checkpoint_every=2,
                        tensorboard_dir="/out/tb", data_seed=3))
    again = load_config(TrainerConfig, flags=parse_flags(TrainerConfig, trainer_flags(cfg)))
    fields = ("model", "data", "reward", "data_fields", "steps", "prompts_per_step",
              "samples_per_prompt", "micro_batch_groups", "max_new_tokens", "temperature", "lr",
              "backend", "checkpoint_dir", "checkpoint_every", "tensorboard_dir", "data_seed")
    assert {f: getattr(again, f) for f in fields} == {f: getattr(cfg, f) for f in fields}


def test_defaults_are_left_to_the_trainer():
    assert trainer_flags(TrainerConfig.model_validate({})) == []


@pytest.mark.parametrize("flags, fragment", [
    ({"data": "d.jsonl", "task": "code"}, "both name the prompts"),
    ({"data_fields": "prompt=q"}, "give --data too"),
    ({"reward": "math", "reward_fn": "pkg.mod:fn"}, "both set the reward"),
])
def test_contradictory_data_and_reward_flags_are_refused_naming_both(flags, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(TrainerConfig, flags=flags)


def test_a_prompt_the_models_tokenizer_cannot_encode_is_refused_naming_its_line(tmp_path):
    from rlharvest.models.model_tokenizer import load_tokenizer
    from rlharvest.services.trainer.task_setup import build_task_setup

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n'
                    '{"prompt": "caf\\u00e9?", "reward_model": {"ground_truth": "x"}}\n')
    cfg = TrainerConfig.model_validate(dict(data=str(data), reward="exact"))
    with pytest.raises(ValueError, match=r"d.jsonl line 2: character 'é'"):
        build_task_setup(cfg, load_tokenizer("tiny"), context_tokens=1024)
