"""Built-in verifiable tasks: prompts, reference answers, rule-based rewards, resumable data.

docs/architecture.md ("Models, data and engines without the internet"): the demo and tests train a
seeded tiny Qwen3 on a CPU, so the task must be learnable from a random init in a few dozen
GRPO steps. Single-digit addition with a shaped reward is: the format terms (answer with a
number, then stop) are learnt first and lift the mean reward within ~10 steps; the closeness
term then pulls guesses towards the right sum. The sandboxed code task is in ``code_task.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# One chat message, {"role": ..., "content": ...}, as in veRL/OpenRLHF datasets.
Message = Mapping[str, str]


@dataclass(frozen=True)
class TaskItem:
    index: int  # position in the task's deterministic sequence
    prompt: str  # the prompt as text (a chat prompt's messages joined), what rewards see
    answer: str  # the reference a reward compares against (veRL's reward_model.ground_truth)
    # A chat prompt's messages: the model is fed them through its chat template. Empty: the
    # prompt is plain text, fed as it is.
    messages: tuple[Message, ...] = ()
    data_source: str = ""  # selects the built-in reward for this item (datasets from files)


class Task(Protocol):
    """What the trainer needs of a built-in task (``--task``)."""

    name: str

    def item(self, index: int) -> TaskItem:
        """The index-th item, a pure function of (seed, index)."""

    async def score(self, prompt: str, completion: str, answer: str) -> float:
        """The task's reward (a ``pool.RewardFn``); may raise ``pool.RewardFailure``."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What the task learnt while training (e.g. sandbox timeout anchors), for checkpoints."""

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take back what ``checkpoint_state`` returned."""


class AdditionTask:
    """Prompts like ``"3+4="`` whose answer is the sum, kept to one digit (``max_sum`` <= 9)
    so that every completion is a short string the char tokenizer spells token by token."""

    name = "addition"

    def __init__(self, seed: int = 0, max_sum: int = 9) -> None:
        if not 1 <= max_sum <= 9:
            raise ValueError(f"max_sum must be in 1..9 (one-digit answers), got {max_sum}")
        self._seed = seed
        self._max_sum = max_sum

    def item(self, index: int) -> TaskItem:
        """The index-th item; a pure function of (seed, index), which makes resuming trivial."""
        rng = random.Random(self._seed * 1_000_003 + index)
        total = rng.randint(0, self._max_sum)
        a = rng.randint(0, total)
        return TaskItem(index=index, prompt=f"{a}+{total - a}=", answer=str(total))

    @staticmethod
    def reward(completion: str, answer: str) -> float:
        """Shaped reward in [0, 1]; ``completion`` is the decoded text up to (without) EOS.

        0.2  the completion starts with a digit (it tries to answer);
        0.2  it is exactly one digit, i.e. it stopped right after answering;
        0.6  scaled by how close that first digit is: 0.6 for the exact sum, 0 at 5 or more away.
        Only the first digit counts, so padding an answer ("0000") earns nothing extra.
        """
        text = completion.strip()
        if not text or not text[0].isdigit():
            return 0.0
        stopped = 0.2 if len(text) == 1 else 0.0
        distance = abs(int(text[0]) - int(answer))
        return 0.2 + stopped + 0.6 * max(0.0, 1.0 - distance / 5.0)

    async def score(self, prompt: str, completion: str, answer: str) -> float:
        # Pure and microseconds: async so the reward pool needs no thread for it.
        return self.reward(completion, answer)

    def checkpoint_state(self) -> dict[str, Any]:
        return {}  # a rule-based reward learns nothing

    def restore_state(self, state: dict[str, Any]) -> None:
        pass


@dataclass(frozen=True)
class DatasetState:
    seed: int
    position: int  # index of the next item to hand out
    task: str = "addition"  # the default reads checkpoints written before there were two tasks


class TaskDataset:
    """Deterministic, resumable iterator: ``state()`` after n items, fed back to ``from_state``,
    continues with exactly the items a never-interrupted run would have seen."""

    def __init__(self, seed: int = 0, position: int = 0,
                 task_factory: Callable[[int], Task] = AdditionTask) -> None:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self._seed = seed
        self._position = position
        self.task = task_factory(seed)

    @classmethod
    def from_state(cls, state: DatasetState,
                   task_factory: Callable[[int], Task] = AdditionTask) -> TaskDataset:
        dataset = cls(seed=state.seed, position=state.position, task_factory=task_factory)
        if dataset.task.name != state.task:
            # Positions of one task's sequence mean nothing in another's.
            raise ValueError(f"the saved data position is of task {state.task!r}, not "
                             f"{dataset.task.name!r}: resume with --task {state.task} or start "
                             "from an empty --checkpoint-dir")
        return dataset

    def state(self) -> DatasetState:
        return DatasetState(seed=self._seed, position=self._position, task=self.task.name)

    def seek(self, position: int) -> None:
        """Go on from ``position`` (tail batching hands out prompts itself)."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self._position = position

    def peek(self, count: int) -> list[TaskItem]:
        """The next ``count`` items, the position left where it is (``seek`` past them once
        they trained)."""
        return [self.task.item(self._position + i) for i in range(count)]

    def next_batch(self, count: int) -> list[TaskItem]:
        items = [self.task.item(self._position + i) for i in range(count)]
        self._position += count
        return items
