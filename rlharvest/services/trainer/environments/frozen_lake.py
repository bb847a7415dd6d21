"""FrozenLake in text, written here to gymnasium's rules (``FrozenLake-v1``, the 4x4 map).

The agent starts on S and must reach G over frozen tiles F without falling into a hole H:

    SFFF
    FHFH
    FFFH
    HFFG

Actions are 0 LEFT, 1 DOWN, 2 RIGHT, 3 UP. A move into the edge stays put. Reaching G gives
reward 1 and ends the episode. A hole ends it with 0. With ``slippery`` (gymnasium's default),
the agent moves in the chosen direction or one of the two perpendicular ones, each with
probability 1/3, from a generator seeded by ``reset``. gymnasium's time limit for this map is
100 steps; ``max_steps`` is that limit.

In text: an observation shows the map with the agent as ``@`` and asks for a move. The action is
the first of ``L D R U`` in the completion (case-insensitive), so a model that writes a word
first still acts. A completion with none of them is a wasted step: the agent stays put, and the
observation says the move was not understood.

Defaults: not slippery, and 8 steps (the shortest path takes 6).
``FrozenLake(slippery=True, max_steps=100)`` is gymnasium's game.

``shaped`` (the built-in ``frozen_lake_shaped``) adds a progress reward to gymnasium's: 0.1 for
each step that brings the agent closer to G (Manhattan distance), -0.1 for each that takes it
further. The dynamics, the goal's 1 and the episode ends stay gymnasium's. Why: from a random
policy the goal is almost never reached, so every GRPO group scores 0 and nothing is learned.
The success rate (episodes reaching G) stays the measure of learning.
"""

from __future__ import annotations

import random

from rlharvest.services.trainer.environments.interface import EnvStep

MAP = ("SFFF", "FHFH", "FFFH", "HFFG")
MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
ORDER = "LDRU"  # gymnasium's action numbers 0..3


class FrozenLake:
    def __init__(self, slippery: bool = False, max_steps: int = 8, shaped: bool = False) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.slippery = slippery
        self.max_steps = max_steps
        self.shaped = shaped
        self._rng = random.Random(0)
        self.row = self.col = 0
        self.steps = 0
        self.done = True

    def reset(self, seed: int) -> str:
        self._rng = random.Random(seed)
        self.row = self.col = self.steps = 0
        self.done = False
        return self._render("")

    def step(self, action: str) -> EnvStep:
        if self.done:
            raise RuntimeError("the episode has ended; call reset first")
        self.steps += 1
        move = next((ch for ch in action.upper() if ch in MOVES), None)
        note = ""
        before = _distance(self.row, self.col)
        if move is None:
            note = "Not understood. "
        else:
            if self.slippery:  # gymnasium: intended, or either perpendicular, 1/3 each
                index = ORDER.index(move)
                move = ORDER[(index + self._rng.choice((-1, 0, 1))) % 4]
            d_row, d_col = MOVES[move]
            self.row = min(3, max(0, self.row + d_row))
            self.col = min(3, max(0, self.col + d_col))
        tile = MAP[self.row][self.col]
        reward = 1.0 if tile == "G" else 0.0
        if self.shaped:
            reward += 0.1 * (before - _distance(self.row, self.col))
        self.done = tile in "GH" or self.steps >= self.max_steps
        return EnvStep(self._render(note), reward, self.done)

    def _render(self, note: str) -> str:
        rows = ["".join("@" if (r, c) == (self.row, self.col) else MAP[r][c] for c in range(4))
                for r in range(4)]
        return note + "\n".join(rows) + "\nMove L D R U:"


def _distance(row: int, col: int) -> int:
    """Manhattan distance to G (3, 3)."""
    return 6 - row - col


class ShapedFrozenLake(FrozenLake):
    """``frozen_lake_shaped``: FrozenLake with the progress reward (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(shaped=True)
