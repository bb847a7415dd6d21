"""Which prompts each step runs: the next items of the task's data, or with tail batching
(RollPacker, tail_batcher.py) the round it plans. The data position moves only with an applied
step, so a step cancelled before its optimizer step leaves its prompts to the resumed run."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from rlharvest.models.model_tokenizer import ModelTokenizer
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.step_plan import Acceptance, StepSpec
from rlharvest.services.trainer.tail_batcher import Round, TailBatcher
from rlharvest.services.trainer.tasks import DatasetState, Task, TaskDataset, TaskItem

log = logging.getLogger(__name__)


class StepPrompts:
    def __init__(self, cfg: TrainerConfig, tok: ModelTokenizer,
                 task_factory: Callable[[int], Task]) -> None:
        self._cfg = cfg
        self._tok = tok
        self._task_factory = task_factory
        self._data = TaskDataset(seed=cfg.data_seed, task_factory=task_factory)
        self._tail = TailBatcher(cfg.prompts_per_step, cfg.samples_per_prompt,
                                 cfg.data_prompts or None, eta_prompts=cfg.eta_prompts,
                                 eta_responses=cfg.eta_responses) if cfg.tail_batching else None
        self._round: Round | None = None  # the round the step in progress runs

    @property
    def task(self) -> Task:
        """The task in use; a resume replaces it (with its restored state)."""
        return self._data.task

    @property
    def done(self) -> bool:
        """Every prompt of ``--data-prompts`` trained (never, when unbounded)."""
        if self._tail is not None:
            return self._tail.done
        return bool(self._cfg.data_prompts) and \
            self._data.state().position >= self._cfg.data_prompts

    def next(self, step: int, version: int) -> StepSpec:
        """The spec of step ``step`` on ``version``: peeked, not taken (``commit`` takes it)."""
        if self._tail is not None:
            self._round = self._tail.plan()
            return self._round_spec(self._round, step, version)
        count = self._cfg.prompts_per_step
        if self._cfg.data_prompts:
            count = min(count, self._cfg.data_prompts - self._data.state().position)
        return self.spec(tuple(self._data.peek(count)), self._cfg.samples_per_prompt, step,
                         version)

    def peek(self, count: int) -> StepSpec:
        """A spec of the next ``count`` items, for measuring (nothing planned or taken)."""
        return self.spec(tuple(self._data.peek(count)), self._cfg.samples_per_prompt, 0, 0)

    def _round_spec(self, round_: Round, step: int, version: int) -> StepSpec:
        """A tail batching round as a step: a short round carries its acceptance rule."""
        items = tuple(self._data.task.item(i) for i in round_.prompts)
        accept = Acceptance(round_.accept_prompts, round_.accept_responses) \
            if round_.speculative else None
        return self.spec(items, round_.responses, step, version, accept, round_.kind)

    def spec(self, items: tuple[TaskItem, ...], responses: int, step: int, version: int,
             accept: Acceptance | None = None, round_kind: str = "") -> StepSpec:
        return StepSpec(step=step, weight_version=version, items=items,
                        prompts=tuple(tuple(self._tok.encode_prompt(it.messages or it.prompt))
                                      for it in items),
                        samples_per_prompt=responses, accept=accept, round=round_kind)

    def commit(self, spec: StepSpec, accepted: Sequence[int], deferred: Sequence[int]) -> None:
        """After the optimizer step, with the step count: the step's prompts are spent (a short
        round's ``accepted`` groups; its ``deferred`` ones wait for a long round)."""
        if self._tail is None:
            self._data.seek(self._data.state().position + len(spec.items))
            return
        assert self._round is not None, "a tail batching step runs a planned round"
        self._tail.commit(self._round, [spec.items[g].index for g in accepted])
        self._round = None
        self._data.seek(self._tail.position)
        metrics.ROUNDS.labels(spec.round).inc()
        metrics.PROMPTS_DEFERRED.inc(len(deferred))

    def restore(self, position: dict, extra: dict) -> None:
        """The data position and task state of a checkpoint (``checkpoint_state``)."""
        self._data = TaskDataset.from_state(DatasetState(**position), self._task_factory)
        self._data.task.restore_state(extra.get("task", {}))
        state = extra.get("tail_batching")
        if self._tail is not None:
            self._tail.load_state_dict(state or {"position": self._data.state().position,
                                                 "deferred": []})
        elif state and state["deferred"]:
            log.warning("the checkpoint holds %d prompts tail batching deferred; without "
                        "--tail-batching they are not trained", len(state["deferred"]))

    def position(self) -> dict:
        return dataclasses.asdict(self._data.state())

    def checkpoint_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"task": self._data.task.checkpoint_state()}
        if self._tail is not None:
            extra["tail_batching"] = self._tail.state_dict()
        return extra
