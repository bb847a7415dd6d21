"""Where a run's prompts and rewards come from: a built-in task, or a dataset file and verifiers.

Everything a user can get wrong about them is checked here, before the first step, with a
message that names the file, row and limit: a malformed dataset, a prompt that cannot fit the
model's context, a ``data_source`` no built-in reward knows. A run that fails at step 40 on row
12 000 wastes an hour of GPUs; one that fails at start wastes a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlharvest.models.model_tokenizer import ModelTokenizer
from rlharvest.services.trainer.code_task import CodeTask, CodeTaskConfig
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.datasets import FieldMap, FileTask, Row, load_rows
from rlharvest.services.trainer.rewards.adaptive_timeout import TimeoutPolicy
from rlharvest.services.trainer.rewards.builtin import (
    BUILTIN_REWARDS,
    builtin_for_source,
    resolve_reward,
    reward_for,
)
from rlharvest.services.trainer.rewards.pool import RewardFn
from rlharvest.services.trainer.tasks import AdditionTask, Task, TaskItem


@dataclass(frozen=True)
class TaskSetup:
    factory: Callable[[int], Task]  # the task, as a function of the data seed
    reward_fn: RewardFn | None  # one reward for every sample (--reward); None: see below
    # data_source -> its built-in reward, when a dataset's rows pick their own (no --reward).
    by_source: dict[str, RewardFn] = field(default_factory=dict)
    longest_prompt: int = 0  # tokens of the dataset's longest prompt (0: a built-in task)
    # The kind of every sample's reward (a built-in reward or task name; "" for a user's
    # function); empty with by_source: each row's data_source says.
    kind: str = ""

    def reward_of(self, item: TaskItem) -> RewardFn | None:
        """This item's reward when it is not the pool's default."""
        return self.by_source.get(item.data_source) if self.by_source else None

    @property
    def runs_code(self) -> bool:
        """Whether some reward runs candidate programs in the sandbox."""
        kinds = {self.kind, *(builtin_for_source(s) for s in self.by_source)}
        return "code" in kinds

    def kind_of(self, item: TaskItem) -> str:
        """Which per-kind reward timeout applies to this item (``--reward-timeouts``)."""
        if self.by_source:
            return builtin_for_source(item.data_source) or ""
        return self.kind


def builtin_task_factory(cfg: TrainerConfig) -> Callable[[int], Task]:
    """The built-in task ``cfg.task`` names, as a function of the data seed."""
    if cfg.task == "code":
        policy = TimeoutPolicy(t_min_s=cfg.sandbox_t_min_s, t_max_s=cfg.sandbox_t_max_s,
                               slack=cfg.sandbox_slack)
        return lambda seed: CodeTask(seed, CodeTaskConfig(timeouts=policy,
                                                          workers=cfg.reward_concurrency))
    return AdditionTask


def build_task_setup(cfg: TrainerConfig, tokenizer: ModelTokenizer,
                     context_tokens: int) -> TaskSetup:
    """``context_tokens``: the model's context; a prompt and its completion must fit in it."""
    spec = cfg.reward or cfg.reward_fn
    fixed = resolve_reward(spec) if spec else None
    fixed_kind = spec if spec in BUILTIN_REWARDS else ""
    if not cfg.data:
        return TaskSetup(builtin_task_factory(cfg), fixed, kind=fixed_kind if spec else cfg.task)
    fields = FieldMap.parse(cfg.data_fields) if cfg.data_fields else FieldMap()
    rows = load_rows(cfg.data, fields)
    limit = cfg.max_prompt_tokens or context_tokens - cfg.max_new_tokens
    if limit <= 0:
        raise ValueError(f"max_new_tokens ({cfg.max_new_tokens}) leaves no room for a prompt in "
                         f"the model's context of {context_tokens} tokens; lower it")

    def factory(seed: int) -> FileTask:
        return FileTask(rows, seed=seed, source=cfg.data)

    lengths: list[int] = []

    def prompt_tokens(row: Row) -> int:
        try:
            lengths.append(len(tokenizer.encode_prompt(row.prompt)))
        except ValueError as exc:  # TokenizerError: a character or message the model cannot take
            raise ValueError(f"{cfg.data} line {row.line}: {exc}") from None
        return lengths[-1]

    factory(cfg.data_seed).check_prompt_lengths(prompt_tokens, limit)
    if fixed is not None:
        return TaskSetup(factory, fixed, longest_prompt=max(lengths), kind=fixed_kind)
    by_source: dict[str, RewardFn] = {}
    for row in rows:
        if row.data_source not in by_source:
            try:
                by_source[row.data_source] = reward_for(row.data_source, None)
            except ValueError as exc:
                raise ValueError(f"{cfg.data} line {row.line}: {exc}; or choose one reward for "
                                 "every row with --reward (math, exact, code or "
                                 "package.module:function)") from None
    return TaskSetup(factory, None, by_source, max(lengths))
