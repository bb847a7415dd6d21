"""What the trainer shows of its run (GetStatus, metrics, curves, the log): the step in
progress, the steps applied, and the rewards that failed."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.curves import CurveWriter
from rlharvest.services.trainer.rewards.pool import RewardOutcome

if TYPE_CHECKING:
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

log = logging.getLogger(__name__)

# Reward failures kept for inspection: a few steps' worth even when every sample fails.
KEPT_REWARD_FAILURES = 1000


@dataclass(frozen=True)
class RewardFailureRecord:
    """A sample whose reward function raised, hung or refused it: it trained with reward 0."""

    step: int
    sample_id: str
    reason: str


@dataclass
class Progress:
    """The step in progress, as GetStatus shows it."""

    step: int = 0
    weight_version: int = 0
    samples: int = 0
    completions: int = 0
    groups_trained: int = 0
    tokens_generated: int = 0
    reward_failures: int = 0  # samples of this step trained with the failure reward
    phase: str = "starting"


@dataclass
class RunStatus:
    state: str = "starting"  # starting | training | done | failed
    steps_done: int = 0
    weight_version: int = 0
    resumed_from_step: int = -1
    error: str = ""
    current: Progress = field(default_factory=Progress)
    summaries: list[tpb.StepSummary] = field(default_factory=list)
    reward_failures: deque[RewardFailureRecord] = field(
        default_factory=lambda: deque(maxlen=KEPT_REWARD_FAILURES))

    def reward_failed(self, step: int, outcome: RewardOutcome) -> None:
        """A sample of ``step`` trains with the failure reward."""
        metrics.REWARD_FAILURES.inc()
        self.current.reward_failures += 1
        self.reward_failures.append(RewardFailureRecord(step, outcome.sample_id, outcome.error))
        # Debug, not warning: early in training most code samples may fail; the step logs a
        # count.
        log.debug("reward of %s failed: %s", outcome.sample_id, outcome.error)

    def published(self, version: int, elapsed: float, stats: DeltaStats | None) -> None:
        """The publish of ``version`` ended (``stats``: what it changed, sent as deltas): the
        summary of the step that made it says so."""
        if not self.summaries or self.summaries[-1].published_version != version:
            return
        summary = self.summaries[-1]
        summary.publish_s = elapsed
        if stats is not None:
            summary.published_changed = stats.changed_fraction
            summary.published_payload_ratio = stats.payload_bytes / max(stats.dense_bytes, 1)


def record_step(status: RunStatus, summary: tpb.StepSummary, curves: CurveWriter,
                keep: int) -> None:
    """An applied step into the metrics, the curves, the log and the last ``keep`` summaries."""
    metrics.STEPS.labels("applied").inc()
    metrics.REWARD.set(summary.mean_reward)
    metrics.LOSS.set(summary.loss)
    metrics.GRAD_NORM.set(summary.grad_norm)
    metrics.STEP_SECONDS.observe(summary.step_time_s)
    metrics.TOKENS_TRAINED.inc(summary.tokens)
    metrics.TOKENS_PER_SECOND.set(summary.tokens_per_second)
    metrics.MICRO_BATCHES.inc(summary.micro_batches)
    metrics.MIGRATIONS.inc(summary.migrations)
    metrics.TOKENS_DISCARDED.inc(summary.tokens_discarded)
    status.summaries.append(summary)
    del status.summaries[:-keep]
    failures = status.current.reward_failures
    curves.step(summary, {"reward/failures": failures})
    log.info("step %d on version %d: reward %.3f, %d tokens in %.2fs (%.0f tokens/s), %d "
             "micro-batches, waited %.2fs, %d migrations, %d reward failures", summary.step,
             summary.weight_version, summary.mean_reward, summary.tokens, summary.step_time_s,
             summary.tokens_per_second, summary.micro_batches, summary.micro_batch_wait_s,
             summary.migrations, failures)
    if summary.round:
        log.info("step %d was a %s round: %d prompts launched, %d deferred, %d tokens "
                 "discarded", summary.step, summary.round, summary.prompts_launched,
                 summary.prompts_deferred, summary.tokens_discarded)
