"""The environment contract of agentic rollout (``--env package.module:Class``).

An environment plays one episode per instance, in text:

- ``reset(seed) -> str``: starts the episode; returns the first observation, which is the
  trajectory's prompt.
- ``step(action) -> EnvStep``: the model's completion of a turn, as text. Returns the
  observation appended to the history before the next turn (never trained: masked out of the
  loss), the reward of this step, and whether the episode ended.

An environment that plays dataset items (``--data``, or the built-in task's items) takes the
item as a second argument: ``reset(seed, task)``, where ``task`` is the step's ``TaskItem``
(``rlharvest/services/trainer/tasks.py``: the item's prompt text, reference answer and data source). ``takes_task`` tells the two kinds
apart by ``reset``'s signature.

The trajectory's reward is the sum of its steps' rewards, given at its end (GRPO scores whole
trajectories). Both calls run in a worker thread under the runner's timeout. A raise, a hang past
the timeout, or a return of the wrong shape fails that trajectory with the reason recorded; the
step of training goes on without it. ``tests/unit/test_environments.py::check_contract`` is the
contract test a user's environment can run too.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Protocol



class EnvironmentError_(Exception):
    """The environment broke its contract (the trajectory fails with this reason)."""


@dataclass(frozen=True)
class EnvStep:
    observation: str
    reward: float
    done: bool


class Environment(Protocol):
    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> EnvStep: ...


def takes_task(env_class: type) -> bool:
    """Whether ``env_class.reset`` takes the dataset item (``reset(self, seed, task)``)."""
    try:
        params = list(inspect.signature(getattr(env_class, "reset")).parameters.values())
    except (AttributeError, TypeError, ValueError):
        return False
    return len(params) >= 3 or any(p.name == "task" for p in params)


def checked_observation(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise EnvironmentError_(f"{where} returned {type(value).__name__}, not an observation "
                                "string")
    return value


def checked_step(value: object) -> EnvStep:
    """``value`` as an ``EnvStep``, or EnvironmentError_ saying what is malformed."""
    if isinstance(value, tuple) and len(value) == 3:  # (observation, reward, done) is accepted
        value = EnvStep(*value)
    if not isinstance(value, EnvStep):
        raise EnvironmentError_(f"step returned {type(value).__name__}; return an EnvStep "
                                "(observation, reward, done)")
    checked_observation(value.observation, "step")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvironmentError_(f"step returned reward {reward!r}; a finite number is needed")
    if not isinstance(value.done, bool):
        raise EnvironmentError_(f"step returned done={value.done!r}; a bool is needed")
    return EnvStep(value.observation, float(reward), value.done)
