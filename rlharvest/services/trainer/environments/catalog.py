"""Which environment ``--env`` names: a built-in one by its name, or a user's class by its
``package.module:Class`` path. Apart from the interface, which the built-ins import."""

from __future__ import annotations

from rlharvest.common.plugin import load_object
from rlharvest.services.trainer.environments.calculator import Calculator
from rlharvest.services.trainer.environments.frozen_lake import FrozenLake, ShapedFrozenLake

BUILTIN: dict[str, type] = {"frozen_lake": FrozenLake, "frozen_lake_shaped": ShapedFrozenLake,
                            "calculator": Calculator}


def load_environment(spec: str) -> type:
    """The environment class named by ``package.module:Class`` or a built-in name."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    env = load_object(spec, "environment", "Class")
    if not isinstance(env, type):
        raise ValueError(f"{spec!r} is not a class; --env names an environment class")
    return env
