"""The environment contract and the built-in FrozenLake: gymnasium's 4x4 rules (moves, edges,
holes, the goal, the slippery 1/3 rule, the time limit), text actions, and the loader's refusals.
``check_contract`` is the test any environment can run."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import pytest

from rlharvest.models.tokenizer import CharTokenizer
from rlharvest.services.trainer.environments.frozen_lake import FrozenLake
from rlharvest.services.trainer.tasks import TaskItem
from rlharvest.services.trainer.environments.interface import (
    EnvironmentError_,
    EnvStep,
    checked_step,
)
from rlharvest.services.trainer.environments.catalog import load_environment

TOK = CharTokenizer()


def check_contract(env_class: type, actions: Sequence[str] = "LDRU", seeds: range = range(3),
                   task: TaskItem | None = None) -> None:
    """What the runner relies on: reset gives a string the built-in tokenizer encodes, step
    gives a well-formed EnvStep, an episode ends, and one seed replays identically. ``task``:
    the dataset item an environment that plays them is reset with."""
    for seed in seeds:
        runs = []
        for _ in range(2):
            env = env_class()
            transcript = [env.reset(seed) if task is None else env.reset(seed, task)]
            TOK.encode(transcript[0])
            for turn in range(1000):
                step = checked_step(env.step(actions[turn % len(actions)]))
                TOK.encode(step.observation, add_bos=False)
                transcript.append((step.observation, step.reward, step.done))
                if step.done:
                    break
            else:
                pytest.fail(f"{env_class.__name__}: no episode end within 1000 steps")
            runs.append(transcript)
        assert runs[0] == runs[1], "the same seed must replay the same episode"


def test_frozen_lake_keeps_the_contract_slippery_or_not():
    check_contract(FrozenLake)
    check_contract(lambda: FrozenLake(slippery=True, max_steps=100))  # type: ignore[arg-type]


def play(env: FrozenLake, moves: str) -> list[EnvStep]:
    env.reset(0)
    return [env.step(m) for m in moves]


def test_the_shortest_safe_path_reaches_the_goal_for_reward_one():
    steps = play(FrozenLake(), "RRDDDR")
    assert [s.done for s in steps] == [False] * 5 + [True]
    assert steps[-1].reward == 1.0 and sum(s.reward for s in steps[:-1]) == 0
    assert "@" in steps[-1].observation.splitlines()[3]


def test_a_hole_ends_the_episode_with_nothing_and_edges_hold_the_agent():
    env = FrozenLake()
    steps = play(env, "LUR")  # bumps into the corner twice, then right
    assert (env.row, env.col) == (0, 1) and not steps[-1].done
    hole = play(FrozenLake(), "DR")  # (1, 1) is a hole
    assert hole[-1].done and hole[-1].reward == 0.0


def test_text_actions_take_the_first_move_letter_and_nonsense_wastes_a_step():
    env = FrozenLake()
    env.reset(0)
    assert "Not understood" in env.step("???").observation
    assert (env.row, env.col) == (0, 0)
    env.step("go right")  # 'g', 'o' are no moves; 'r' of "right" is
    assert (env.row, env.col) == (0, 1)


def test_the_time_limit_ends_an_episode_and_a_finished_one_refuses_steps():
    env = FrozenLake(max_steps=3)
    steps = play(env, "LLL")
    assert [s.done for s in steps] == [False, False, True]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("R")


def test_slippery_moves_go_the_intended_way_a_third_of_the_time():
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    for seed in range(3000):
        env = FrozenLake(slippery=True)
        env.reset(seed)
        env.step("D")  # from S: down (1,0), or left/right perpendicular: (0,0) edge, (0,1)
        counts[(env.row, env.col)] += 1
    for cell in ((1, 0), (0, 0), (0, 1)):
        assert 850 < counts[cell] < 1150, counts


def test_malformed_steps_and_bad_specs_are_refused_with_the_reason():
    with pytest.raises(EnvironmentError_, match="EnvStep"):
        checked_step({"observation": "x"})
    with pytest.raises(EnvironmentError_, match="finite"):
        checked_step(EnvStep("x", float("nan"), False))
    with pytest.raises(EnvironmentError_, match="bool"):
        checked_step(EnvStep("x", 0.0, "yes"))  # type: ignore[arg-type]
    assert checked_step(("x", 1, True)) == EnvStep("x", 1.0, True)
    assert load_environment("frozen_lake") is FrozenLake
    assert load_environment("rlharvest.services.trainer.environments.frozen_lake:FrozenLake") \
        is FrozenLake
    with pytest.raises(ValueError, match="package.module:Class"):
        load_environment("nonsense")
    with pytest.raises(ValueError, match="not a class"):
        load_environment("rlharvest.services.trainer.environments.frozen_lake:MAP")


def test_the_shaped_variant_adds_progress_to_gymnasiums_reward_and_nothing_else():
    shaped = play(FrozenLake(shaped=True), "RRDDDR")
    plain = play(FrozenLake(), "RRDDDR")
    assert [s.done for s in shaped] == [s.done for s in plain]
    assert [round(s.reward - p.reward, 6) for s, p in zip(shaped, plain)] == [0.1] * 6
    away = play(FrozenLake(shaped=True), "RL")  # closer, then back
    assert [round(s.reward, 6) for s in away] == [0.1, -0.1]
    assert play(FrozenLake(shaped=True), "?")[0].reward == 0.0
    assert load_environment("frozen_lake_shaped")().shaped


def test_the_trainer_refuses_an_unknown_env_and_combinations_it_cannot_run():
    from rlharvest.common.config import ConfigError, load_config
    from rlharvest.services.trainer.config import TrainerConfig

    with pytest.raises(ConfigError, match="package.module:Class"):
        load_config(TrainerConfig, flags={"env": "chess"})
    # The seed engine must hold a trajectory's whole context to take its later turns.
    with pytest.raises(ConfigError, match="--seed-max-len 256 is shorter than --env-context"):
        load_config(TrainerConfig, flags={"env": "frozen_lake", "seed_role": True,
                                          "instance_cap": "auto", "seed_max_len": "256"})
    assert load_config(TrainerConfig, flags={"env": "frozen_lake", "seed_role": True,
                                             "instance_cap": "auto"}).seed_role
    with pytest.raises(ConfigError, match="reset takes no task"):
        load_config(TrainerConfig, flags={"env": "frozen_lake", "data": "x.jsonl"})
    cfg = load_config(TrainerConfig, flags={"env": "frozen_lake_shaped", "env_max_turns": "6"})
    assert cfg.env_max_turns == 6 and cfg.env_timeout_s == 5.0
    cfg = load_config(TrainerConfig, flags={"env": "calculator", "data": "x.jsonl"})
    assert cfg.env == "calculator"


def test_the_calculator_keeps_the_contract():
    from rlharvest.services.trainer.environments.calculator import Calculator

    check_contract(Calculator, ["CALC 12 * 7", "no tool", "CALC 1/0"],
                   task=TaskItem(3, "What is 12 * 7?", "84"))


def test_an_environment_that_plays_dataset_items_is_told_apart_by_its_reset():
    from rlharvest.services.trainer.environments.calculator import Calculator
    from rlharvest.services.trainer.environments.interface import takes_task

    assert takes_task(Calculator) and load_environment("calculator") is Calculator
    assert not takes_task(FrozenLake)


def test_the_calculator_computes_only_arithmetic_and_scores_the_answer_against_the_item():
    from rlharvest.services.trainer.environments.calculator import Calculator, evaluate
    from rlharvest.services.trainer.tasks import TaskItem

    task = TaskItem(0, "Lea walks 2 miles a day for 5 days. How many miles?", "10")
    env = Calculator(max_steps=4)
    first = env.reset(0, task)
    assert task.prompt in first and "CALC" in first and TOK.encode(first)
    assert checked_step(env.step("CALC (2 + 3) * 2")) == EnvStep("\n= 10\n", 0.0, False)
    assert "Cannot compute" in env.step("CALC __import__('os')").observation
    assert "Cannot compute: division by zero" in env.step("CALC 1/0").observation
    assert env.step("ANSWER 10.0") == EnvStep("\n", 1.0, True)
    env.reset(0, task)
    assert env.step("#### 11").reward == 0.0
    env.reset(0, task)
    outcomes = [env.step("hmm") for _ in range(4)]  # neither: ends after max_steps, scored 0
    assert [o.done for o in outcomes] == [False, False, False, True]
    assert [o.reward for o in outcomes] == [0.0] * 4
    with pytest.raises(ValueError):
        evaluate("2 ** 99999")
    assert evaluate("1,000 - -5") == 1005.0


async def test_a_short_rounds_group_keeps_the_first_trajectories_to_end_and_cancels_the_rest():
    """Tail batching with --env: of R trajectories launched, the first R0 to end train (in the
    order they ended); the others are cancelled mid-turn, not awaited to their end."""
    import asyncio

    from rlharvest.services.trainer.environments.runner import PlayConfig, play_group

    delays = {"g-t0": 0.2, "g-t1": 0.0, "g-t2": 5.0, "g-t3": 0.05}  # seconds per turn
    cancelled: list[str] = []

    async def generate(trajectory_id: str, turn: int, history: list[int], seed: int):
        try:
            await asyncio.sleep(delays[trajectory_id])
        except asyncio.CancelledError:
            cancelled.append(trajectory_id)
            raise
        return CharTokenizer().encode("R", add_bos=False), [-0.1]

    cfg = PlayConfig(max_turns=2, max_new_tokens=1, context=512)
    started = asyncio.get_running_loop().time()
    kept = await play_group(generate, FrozenLake, "g", seed=0, size=4, cfg=cfg, keep=2)
    assert [t.trajectory_id for t in kept] == ["g-t1", "g-t3"]
    assert all(t.turns >= 1 and not t.failed for t in kept)
    assert sorted(cancelled) == ["g-t0", "g-t2"]
    assert asyncio.get_running_loop().time() - started < 2.0


async def test_a_trajectory_whose_reset_failed_scores_zero_in_its_group_and_the_step_trains_on():
    """The agentic step's contract: a trajectory the environment failed (here its reset) scores
    0, still counts in its group's advantages, trains nothing, and the step goes on."""
    from rlharvest.models.tiny_model import build_model
    from rlharvest.models.tokenizer import PAD_ID
    from rlharvest.services.trainer.backend import OptimConfig, make_backend
    from rlharvest.services.trainer.environments.runner import (
        PlayConfig,
        play_group,
        rewarded_group,
    )
    from rlharvest.services.trainer.grpo import LossConfig
    from rlharvest.services.trainer.stream_trainer import StreamingStep

    made: list[int] = []

    class FlakyReset:
        """The first instance's reset fails (a transient error); the others score 1 or 0.5."""

        def __init__(self) -> None:
            self.n = len(made)
            made.append(self.n)

        def reset(self, seed: int) -> str:
            if self.n == 0:
                raise OSError("transient")
            return "go:"

        def step(self, action: str) -> EnvStep:
            return EnvStep("", 1.0 if self.n == 1 else 0.5, True)

    async def generate(trajectory_id: str, turn: int, history: list[int], seed: int):
        return [5, 6], [-1.0, -1.0]

    played = await play_group(generate, FlakyReset, "g", 0, 3,
                              PlayConfig(max_turns=1, context=64))
    assert "reset" in played[0].failed and not played[1].failed and not played[2].failed
    group = rewarded_group(0, played)
    assert list(group.rewards) == [0.0, 1.0, 0.5]
    step = StreamingStep(make_backend("torch", build_model("tiny", seed=0),
                                      OptimConfig(lr=0.1, optimizer="sgd", grad_clip=0.0)),
                         num_groups=1, group_size=3, micro_batch_groups=1,
                         loss=LossConfig(beta=0.05), pad_id=PAD_ID,
                         ref_model=build_model("tiny", seed=1))
    step.add_groups([group])
    stats = step.finish()
    assert stats.num_tokens == 4  # the two played trajectories' tokens; none of the failed one
    assert stats.mean_reward == pytest.approx(0.5)
    assert stats.grad_norm > 0
