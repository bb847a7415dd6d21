"""The trainer's RL loop: one GRPO step after another, streaming (RLBoost §4.1, RollPacker §4.4).

One step, as in the papers' pseudo-code (step.py)::

    prompts   <- next P0 items of the task                            # step_prompts.py
    stream    <- manager.SubmitStep(prompts x R0, version v)        # rollout on workers of v
    for each completion in stream, as it finishes:
        reward it in the bounded pool                                 # next to rollout
        when its group's R0 rewards are in: group -> ready            # grpo_source.py
    while groups remain: once >= m_b groups are ready, all of them form one micro-batch;
                         accumulate its gradients (the step's last groups: one more)
    optimizer step once                                               # == the monolithic update
    publish v+1 to the node's transfer agent; go on                   # publishing.py
    every K steps: checkpoint (model, optimizer, step, version, data position, RNG)

An agentic step (``--env``) is the same loop with another rollout source (agentic_source.py);
the placement scheduler's permits gate its phases (permits.py). Torch work runs on one
dedicated thread (compute.py) so the stream keeps being read while gradients compute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from rlharvest.common import keys, start_weights
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.common.retry import Backoff, retry
from rlharvest.models.model_tokenizer import load_tokenizer
from rlharvest.models.tiny_model import build_model
from rlharvest.services.placement_scheduler.model import JobProfile
from rlharvest.services.rollout_manager.client import (
    RolloutStreamError, find_manager, wait_workers)
from rlharvest.services.trainer import checkpoint, metrics, warmup_profile
from rlharvest.services.trainer.agentic_source import AgenticSource
from rlharvest.services.trainer.backend import OptimConfig, TrainBackend, make_backend
from rlharvest.services.trainer.compute import ComputeThread
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.curves import CurveWriter
from rlharvest.services.trainer.device import module_device, rank_device, served_dtype
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.trainer.grpo_source import GrpoSource
from rlharvest.services.trainer.instance_cap import InstanceCap
from rlharvest.services.trainer.load_model import LengthModel, delay_rewards, delayed
from rlharvest.services.trainer.permits import PlacedPermits
from rlharvest.services.trainer.placed_phases import PlacedPhases
from rlharvest.services.trainer.publishing import Publishing
from rlharvest.services.trainer.ranks import LeaderRanks, RankFailed, check_world, join
from rlharvest.services.trainer.rewards.pool import RewardPool
from rlharvest.services.trainer.rewards.sandbox import configure_isolation
from rlharvest.services.trainer.rollout_source import RolloutSource, SeedWindow
from rlharvest.services.trainer.seed_role import SeedRole
from rlharvest.services.trainer.status import RunStatus, record_step
from rlharvest.services.trainer.step_plan import (
    OnPolicyViolation, RolloutFailed, StepSpec, StreamIncomplete, resume_version)
from rlharvest.services.trainer.step import Applied, TrainerStep
from rlharvest.services.trainer.step_prompts import StepPrompts
from rlharvest.services.trainer.stream_trainer import StreamingStep
from rlharvest.services.trainer.task_setup import build_task_setup
from rlharvest.services.trainer.tasks import Task

log = logging.getLogger(__name__)

# Failures after which the same step is simply tried again (nothing of it was applied).
_RETRYABLE = (RolloutStreamError, StreamIncomplete, RolloutFailed, OnPolicyViolation)
_STEP_BACKOFF = Backoff(first_s=2.0, max_s=10.0, jitter=0.0)


class TrainerLoop:
    def __init__(self, cfg: TrainerConfig, etcd: Any, *,
                 clock: Callable[[], float] = time.perf_counter,
                 seed: SeedRole | None = None) -> None:
        self._cfg = cfg
        self._etcd = etcd
        self._clock = clock
        # The model's own tokenizer, EOS/stop and pad ids (the built-in one for presets).
        self._tok = load_tokenizer(cfg.model)
        self._backend, self._ref_model = build_trainee(cfg)
        self._model = self._backend.model
        # With N launched ranks this is rank 0: micro-batches and the update spread over them.
        self._ranks = join(self._backend, self._ref_model)
        if seed is not None and isinstance(self._ranks, LeaderRanks):
            raise ValueError("--seed-role runs on one rank (its engine holds the whole model); "
                             "launch the trainer without torchrun")
        self._seed = seed  # RLBoost's seed role: the trainer's own engine (seed_role.py)
        self._instance_cap = InstanceCap(
            etcd, cfg.job, seeding=seed is not None, t_init=cfg.seed_window_init_s,
            eta=cfg.seed_eta) if cfg.instance_cap == "auto" else None
        self._loss = LossConfig(eps_low=cfg.eps_low, eps_high=cfg.eps_high, beta=cfg.beta,
                                aggregation=cfg.aggregation)
        # A benchmark's reward delay (--bench-reward-delay-s) wraps every reward once.
        self._setup = delay_rewards(build_task_setup(cfg, self._tok, max_positions(self._model)),
                                    cfg.bench_reward_delay_s)
        if self._setup.runs_code:  # refuses (SandboxUnavailable) when it cannot isolate
            log.info("code sandbox: %s", configure_isolation(cfg.allow_unisolated_sandbox))
        self._prompts = StepPrompts(cfg, self._tok, self._setup.factory)
        self._rewards = RewardPool(delayed(self._setup.reward_fn or self._task_reward,
                                           cfg.bench_reward_delay_s),
                                   max_concurrency=cfg.reward_concurrency,
                                   timeout_s=cfg.reward_timeout_s, clock=clock)
        self._curves = CurveWriter(cfg.tensorboard_dir, cfg.wandb_project, run_name=cfg.job,
                                   config=cfg.model_dump(mode="json"))
        self._compute = ComputeThread(cfg.job, cfg.torch_threads, cfg.borrow_lent_threads)
        self._publishing = Publishing(cfg, etcd, self._ranks, self._compute, self._model,
                                      self._backend.weights_are_sharded, seed, clock)
        self.status = RunStatus()
        self._applied = Applied()
        self._one_step = TrainerStep(cfg, etcd, applied=self._applied, status=self.status,
                                     source=self._rollout_source(), prompts=self._prompts,
                                     publishing=self._publishing, compute=self._compute,
                                     instance_cap=self._instance_cap,
                                     update=self._streaming_step, clock=clock)

    def _rollout_source(self) -> RolloutSource:
        cfg = self._cfg
        window = SeedWindow(self._seed, self._instance_cap)
        if cfg.env:  # agentic RL: the environment's episodes are the step's prompts
            return AgenticSource(cfg, self._tok, window=window,
                                 hold_steps=self._instance_cap is not None, clock=self._clock)
        lengths = LengthModel(cfg.bench_length_median, cfg.max_new_tokens, cfg.data_seed) \
            if cfg.bench_length_median else None
        return GrpoSource(cfg, self._etcd, self._tok, self._setup, self._rewards,
                          compute=self._compute, window=window, status=self.status,
                          lengths=lengths, clock=self._clock)

    def place(self, phases: PlacedPhases) -> None:
        """Run each step's phases under the placement scheduler's permits."""
        self._one_step.permits = PlacedPermits(
            phases, self._etcd, no_worker_deadline_s=self._cfg.no_worker_deadline_s,
            progress_s=self._cfg.placement_progress_s)

    # ---- the run -------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Resume from the newest checkpoint, if any, and make its weights the current version."""
        if self._cfg.checkpoint_dir:
            state = await self._compute.run(checkpoint.load_latest, self._cfg.checkpoint_dir,
                                            self._ranks.load)
            if state is not None:
                await self._resume(state)
        self._sync_status()

    async def _resume(self, state: checkpoint.TrainerState) -> None:
        applied = self._applied
        applied.step = state.step
        self._prompts.restore(state.data_position, state.extra)
        announced = await self._publishing.announced()
        applied.version, publish = resume_version(state.weight_version, announced)
        self.status.resumed_from_step = state.step
        log.info("resumed from checkpoint of step %d (version %d, announced %s): continuing as "
                 "version %d", state.step, state.weight_version, announced, applied.version)
        if publish and self._publishing.enabled:
            await self._publishing.start(applied.version)
        if self._seed is not None and self._seed.weight_version != applied.version:
            served = await self._compute.run(self._served_weights)
            await self._seed.load(served, applied.version)

    async def run(self) -> None:
        """Steps until ``cfg.steps`` are applied (forever when 0). Cancel to stop: the step in
        progress is abandoned, nothing of it applied."""
        self.status.state = "training"
        try:
            applied = self._applied
            if not applied.step and applied.version == 0:
                await self._declare_start_weights()
            if self._cfg.min_workers and not applied.step:
                await self._await_workers()
            while (not self._cfg.steps or applied.step < self._cfg.steps) and \
                    not self._prompts.done:
                await self._step_with_retries(self._prompts.next(applied.step + 1,
                                                                 applied.version))
            await self._one_step.await_publish()
            self.status.state = "done"
            self.status.current.phase = "done"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.status.state, self.status.error = "failed", f"{type(exc).__name__}: {exc}"
            raise

    async def _declare_start_weights(self) -> None:
        """The job's version 0 is these weights (rlharvest/common/start_weights.py): written
        before the first step, so the job's manager sends version-0 requests only to workers
        whose start weights are the same, never to another job's at the same version number.
        The step cannot be on-policy without it, so a failure to write it fails the run."""
        cfg = self._cfg
        fingerprint = await self._compute.run(self._fingerprint)
        record = start_weights.record(fingerprint, f"{cfg.model} seed {cfg.model_seed}")
        await with_etcd(partial(self._etcd.put, keys.start_weights_key(cfg.job).encode(), record),
                        "writing the job's start weights")
        log.info("job %s starts from weights %s (%s seed %d)", cfg.job, fingerprint, cfg.model,
                 cfg.model_seed)

    def _served_weights(self) -> Mapping[str, torch.Tensor]:
        """On the training thread: the weights as the workers serve them."""
        return self._publishing.as_served(self._ranks.weights())

    def _fingerprint(self) -> str:
        return start_weights.fingerprint(self._served_weights())

    async def _await_workers(self) -> None:
        """``--min-workers``: the job's manager sees that many healthy workers."""
        cfg = self._cfg
        self.status.current.phase = "waiting_workers"
        manager = cfg.manager or await find_manager(self._etcd, cfg.job)
        log.info("waiting for %d healthy workers at the manager %s before the first step",
                 cfg.min_workers, manager)
        joined = await wait_workers(manager, cfg.min_workers, timeout=cfg.min_workers_timeout_s)
        log.info("%d workers healthy: %s", len(joined.workers), ", ".join(
            w.worker_id for w in joined.workers if w.state == "healthy"))

    async def _step_with_retries(self, spec: StepSpec) -> None:
        attempts = self._cfg.step_attempts
        try:
            summary = await retry(partial(self._attempt_step, spec), attempts=attempts,
                                  retry_if=lambda exc: isinstance(exc, _RETRYABLE),
                                  backoff=_STEP_BACKOFF, what=f"step {spec.step} (retried whole)")
        except _RETRYABLE as exc:
            metrics.STEPS.labels("failed").inc()
            raise RuntimeError(f"step {spec.step} failed {attempts} times; last: {exc}. Check "
                               "that the job's rollout manager and workers run (rlharvest "
                               "status)") from exc
        record_step(self.status, summary, self._curves, self._cfg.keep_step_summaries)
        if self._cfg.checkpoint_dir and self._applied.step % self._cfg.checkpoint_every == 0:
            await self.save_checkpoint()
        self._sync_status()

    async def _attempt_step(self, spec: StepSpec) -> tpb.StepSummary:
        """One try of a step; a failed one leaves no gradient behind for the next."""
        try:
            return await self.train_step(spec)
        except _RETRYABLE:
            await self._compute.run(self._ranks.discard)
            metrics.STEPS.labels("retried").inc()
            raise
        except BaseException:
            await asyncio.shield(self._compute.run(self._ranks.discard))
            raise

    # ---- one step ---------------------------------------------------------------------------

    async def train_step(self, spec: StepSpec) -> tpb.StepSummary:
        """One step: generate -> reward -> train -> publish (step.py)."""
        return await self._one_step.run(spec)

    def _streaming_step(self, spec: StepSpec) -> StreamingStep:
        """The step's GRPO update, fed group by group (micro-batches of m_b ready groups)."""
        return StreamingStep(self._backend, num_groups=spec.train_groups,
                             group_size=spec.group_size,
                             micro_batch_groups=min(self._cfg.micro_batch_groups,
                                                    spec.train_groups),
                             loss=self._loss, pad_id=self._tok.pad_id,
                             ref_model=self._ref_model, ranks=self._ranks, clock=self._clock)

    async def _task_reward(self, prompt: str, completion: str, reference: str) -> float:
        # Looked up per call: a resume replaces the dataset, and with it the task's state.
        return await self._prompts.task.score(prompt, completion, reference)

    # ---- checkpoints -------------------------------------------------------------------------

    def can_save_after(self, failure: BaseException) -> bool:
        """Whether the weights still are exactly the steps applied after ``failure`` ended
        training, so a checkpoint may keep them: not when an optimizer step failed halfway,
        nor when a rank (or the ranks' collectives) failed, where ranks may disagree or a save
        would wait on a dead one."""
        if self._applied.applying or not self._cfg.checkpoint_dir:
            return False
        cause: BaseException | None = failure
        while cause is not None:
            if isinstance(cause, (RankFailed, torch.distributed.DistError)):
                return False
            cause = cause.__cause__ or cause.__context__
        return True

    async def save_checkpoint(self) -> None:
        self.status.current.phase = "checkpoint"
        started = self._clock()
        applied = self._applied
        state = checkpoint.TrainerState(step=applied.step, weight_version=applied.version,
                                        data_position=self._prompts.position(),
                                        extra=self._prompts.checkpoint_state())
        path = await self._compute.run(checkpoint.save_checkpoint, self._cfg.checkpoint_dir,
                                       state, self._ranks.save, self._cfg.keep_checkpoints)
        metrics.CHECKPOINT_SECONDS.observe(self._clock() - started)
        log.info("checkpoint of step %d (version %d) at %s", applied.step, applied.version, path)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _sync_status(self) -> None:
        self.status.steps_done = self._applied.step
        self.status.weight_version = self._applied.version
        metrics.STEP.set(self._applied.step)
        metrics.WEIGHT_VERSION.set(self._applied.version)

    @property
    def weight_version(self) -> int:
        return self._applied.version

    @property
    def steps_done(self) -> int:
        return self._applied.step

    @property
    def task(self) -> Task:
        """The built-in task in use; a resume replaces it (with its restored state)."""
        return self._prompts.task

    def measure_profile(self) -> JobProfile:
        """--placement-scheduler without durations: the job's profile, measured now
        (warmup_profile.py) on a step's batch of the longest prompts it will send."""
        cfg = self._cfg
        batch = cfg.prompts_per_step * cfg.samples_per_prompt
        device, served = module_device(self._model), served_dtype(cfg.publish_dtype)
        if cfg.env:
            # A trajectory's worst case: every turn prefills a history as long as the context
            # and samples max_new_tokens (the environment's own time is not measured).
            profile = warmup_profile.measure_profile(
                cfg.model, self._ranks.forward_seconds, device, batch, cfg.env_context,
                cfg.env_max_turns * cfg.max_new_tokens, served=served)
            return dataclasses.replace(profile, prefill_s=profile.prefill_s * cfg.env_max_turns)
        peeked = self._prompts.peek(cfg.prompts_per_step)
        longest = max([self._setup.longest_prompt, *(len(p) for p in peeked.prompts)])
        return warmup_profile.measure_profile(cfg.model, self._ranks.forward_seconds, device,
                                              batch, longest, cfg.max_new_tokens, served=served)

    async def watch_lent_workers(self) -> None:
        """The job's stream-scale record (RollPacker §4.4), for ``--borrow-lent-threads``."""
        await self._compute.watch_lent_workers(self._etcd)

    def close(self) -> None:
        self._compute.close()
        self._ranks.close()  # after the training thread: no two collectives at once
        self._curves.close()


def build_trainee(cfg: TrainerConfig) -> tuple[TrainBackend, torch.nn.Module | None]:
    """What every rank trains with: the model in its backend, and the frozen reference model
    when the loss has a KL term. Every rank builds the same (same preset or checkpoint, seed)."""
    check_world(cfg.backend)
    device = rank_device(cfg.device)
    log.info("training on %s", device)
    # Module.to: transformers' own annotation of ``to`` does not take a device.
    model = torch.nn.Module.to(build_model(cfg.model, cfg.model_seed), device).train()
    ref_model = torch.nn.Module.to(build_model(cfg.model, cfg.model_seed), device).eval() \
        if cfg.beta > 0 else None
    backend = make_backend(cfg.backend, model, OptimConfig(
        lr=cfg.lr, optimizer=cfg.optimizer, weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip, zero_stage=cfg.zero_stage))
    return backend, ref_model


def max_positions(model: torch.nn.Module) -> int:
    """The context length of a transformers model (its config says)."""
    return int(getattr(model, "config").max_position_embeddings)


def torch_threads(count: int) -> None:
    if count:
        torch.set_num_threads(count)
