"""Training curves for people: TensorBoard event files, and W&B when it is installed and asked for.

Prometheus (``metrics.py``) answers "how is the run doing now"; these answer "how did it go",
one point per RL step, in the tools RL engineers already read (veRL and OpenRLHF log the same
way). TensorBoard files are written with tensorboardX, which needs neither TensorFlow nor the
TensorBoard server. W&B is optional: ``wandb_project`` set (or ``WANDB_PROJECT`` in the
environment) and ``wandb`` importable; asked for but not installed is a start-up error, not a
silently empty dashboard.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rlharvest.common.pb import trainer_pb2 as tpb

log = logging.getLogger(__name__)

# StepSummary field -> curve name. Grouped by prefix so TensorBoard shows one section per theme.
CURVES: dict[str, str] = {
    "mean_reward": "reward/mean",
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "tokens": "train/tokens",
    "micro_batches": "train/micro_batches",
    "micro_batch_wait_s": "time/micro_batch_wait_s",
    "train_compute_s": "time/train_compute_s",
    "step_time_s": "time/step_s",
    "tokens_per_second": "throughput/tokens_per_second",
    "migrations": "rollout/migrations",
}


class CurveWriter:
    """One point per finished step on every configured sink. ``close`` flushes them."""

    def __init__(self, tensorboard_dir: str = "", wandb_project: str = "", run_name: str = "",
                 config: dict[str, Any] | None = None) -> None:
        self._tensorboard = None
        self._wandb: Any = None
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(logdir=tensorboard_dir, flush_secs=5)
        project = wandb_project or os.environ.get("WANDB_PROJECT", "")
        if project:
            self._wandb = _start_wandb(project, run_name, config or {}, required=bool(wandb_project))

    @property
    def enabled(self) -> bool:
        return self._tensorboard is not None or self._wandb is not None

    def step(self, summary: tpb.StepSummary, extra: dict[str, float] | None = None) -> None:
        points = {name: float(getattr(summary, field)) for field, name in CURVES.items()}
        points.update(extra or {})
        if self._tensorboard is not None:
            for name, value in points.items():
                self._tensorboard.add_scalar(name, value, global_step=summary.step)
        if self._wandb is not None:
            self._wandb.log(points, step=summary.step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(project: str, run_name: str, config: dict[str, Any], required: bool) -> Any:
    try:
        import wandb
    except ImportError:
        if required:
            raise ValueError(f"--wandb-project {project!r} needs the wandb package: pip install "
                             "wandb (or leave --wandb-project empty)") from None
        log.warning("WANDB_PROJECT=%s is set but wandb is not installed: no W&B curves", project)
        return None
    return wandb.init(project=project, name=run_name or None, config=config)
