"""The trainer's RL loop: one GRPO step after another, streaming (RLBoost §4.1, RollPacker §4.4).

One step, as in the papers' pseudo-code::

    prompts   <- next P0 items of the task
    stream    <- manager.SubmitStep(prompts x R0, version v)        # rollout on workers of v
    for each completion in stream, as it finishes:
        reward it in the bounded pool                                 # next to rollout
        when its group's R0 rewards are in: group -> ready
    while groups remain: once >= m_b groups are ready, all of them form one micro-batch;
                         accumulate its gradients (the step's last groups: one more)
    optimizer step once                                               # == the monolithic update
    publish v+1 to the node's transfer agent; go on                   # workers pull it
    every K steps: checkpoint (model, optimizer, step, version, data position, RNG)

Torch work runs on one dedicated thread so the stream keeps being read while gradients compute;
the pure parts live in ``step_plan.py`` and ``stream_trainer.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grpc
import json
import logging
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from rlharvest.common import keys, registry, rpc, start_weights
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.aio import wait_event
from rlharvest.common.authorization import SERVICE_ROLES
from rlharvest.common.pb import rollout_manager_pb2 as mpb, trainer_pb2 as tpb
from rlharvest.common.retry import Backoff, retry
from rlharvest.models.model_tokenizer import load_tokenizer
from rlharvest.models.tiny_model import build_model
from rlharvest.services.trainer import (
    checkpoint, metrics, rollout_client, tail_reports, warmup_profile)
from rlharvest.services.trainer.backend import OptimConfig, TrainBackend, Where, make_backend
from rlharvest.services.trainer.bench_harness import LengthModel, delay_rewards, delayed
from rlharvest.services.trainer.ranks import LeaderRanks, RankFailed, check_world, join
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.trainer.curves import CurveWriter
from rlharvest.services.trainer.device import (
    module_device,
    published_dtype,
    rank_device,
    served_dtype,
)
from rlharvest.services.trainer.environments.interface import load_environment, takes_task
from rlharvest.services.trainer.environments.runner import (
    PlayConfig,
    Trajectory,
    manager_generator,
    play_group,
    rewarded_group,
)
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.rollout_manager.stream_accounting import parse_scale_record
from rlharvest.services.trainer.instance_cap import InstanceCap
from rlharvest.services.trainer.lent_capacity import LentCapacity
from rlharvest.services.placement_scheduler.model import JobProfile
from rlharvest.services.trainer.placed_phases import PlacedPhases
from rlharvest.services.trainer.rollout_client import StepScope
from rlharvest.services.trainer.rewards.pool import RewardOutcome, RewardPool, RewardRequest
from rlharvest.services.trainer.seed_role import SeedRole
from rlharvest.services.trainer.shard_publish import ShardTarget
from rlharvest.services.trainer.step_plan import (
    Acceptance,
    GroupAssembler,
    OnPolicyViolation,
    ReadyGroup,
    RolloutFailed,
    StepSpec,
    StreamIncomplete,
    resume_version,
    sample_seed,
    submit_request,
)
from rlharvest.services.trainer.stream_trainer import (
    Completion,
    RewardedGroup,
    StepStats,
    StreamingStep,
)
from rlharvest.services.trainer.tail_batcher import Round, TailBatcher
from rlharvest.services.rollout_manager.status_client import wait_workers
from rlharvest.services.trainer.rewards.sandbox import configure_isolation
from rlharvest.services.trainer.task_setup import build_task_setup
from rlharvest.services.trainer.tasks import DatasetState, Task, TaskDataset, TaskItem

if TYPE_CHECKING:
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:  # Python 3.10: the backports of the 3.11 structured-concurrency API
    from exceptiongroup import BaseExceptionGroup
    from taskgroup import TaskGroup

log = logging.getLogger(__name__)

# Failures after which the same step is simply tried again (nothing of it was applied).
_RETRYABLE = (rollout_client.RolloutStreamError, StreamIncomplete, RolloutFailed,
              OnPolicyViolation)
_STEP_BACKOFF = Backoff(first_s=2.0, max_s=10.0, jitter=0.0)
_PUBLISH_RETRYABLE = rollout_client.PUBLISH_RETRYABLE
_PUBLISH_BACKOFF = rollout_client.PUBLISH_BACKOFF
_SHARD_PUBLISH_ATTEMPTS = 3  # each rank also retries its own shard on transport errors
# Reward failures kept for inspection: a few steps' worth even when every sample fails.
_KEPT_REWARD_FAILURES = 1000


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
        default_factory=lambda: deque(maxlen=_KEPT_REWARD_FAILURES))


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
        # The benchmark harness's reward delay (--bench-reward-delay-s) wraps every reward once.
        self._setup = delay_rewards(build_task_setup(cfg, self._tok, max_positions(self._model)),
                                    cfg.bench_reward_delay_s)
        if self._setup.runs_code:  # refuses (SandboxUnavailable) when it cannot isolate
            log.info("code sandbox: %s", configure_isolation(cfg.allow_unisolated_sandbox))
        self._task_factory = self._setup.factory
        self._data = TaskDataset(seed=cfg.data_seed, task_factory=self._task_factory)
        # RollPacker's tail batching decides each step's prompts (tail_batcher.py).
        self._tail = TailBatcher(cfg.prompts_per_step, cfg.samples_per_prompt,
                                 cfg.data_prompts or None, eta_prompts=cfg.eta_prompts,
                                 eta_responses=cfg.eta_responses) if cfg.tail_batching else None
        self._round: Round | None = None  # the round the step in progress runs
        # Agentic RL (--env): the environment class whose episodes are the step's prompts.
        self._env: type | None = load_environment(cfg.env) if cfg.env else None
        # It plays the step's dataset items (reset(seed, task)), or episodes of its own.
        self._env_takes_task = self._env is not None and takes_task(self._env)
        self._lengths = LengthModel(cfg.bench_length_median, cfg.max_new_tokens, cfg.data_seed) \
            if cfg.bench_length_median else None
        self._rewards = RewardPool(delayed(self._setup.reward_fn or self._task_reward,
                                           cfg.bench_reward_delay_s),
                                   max_concurrency=cfg.reward_concurrency,
                                   timeout_s=cfg.reward_timeout_s, clock=clock)
        self._curves = CurveWriter(cfg.tensorboard_dir, cfg.wandb_project, run_name=cfg.job,
                                   config=cfg.model_dump(mode="json"))
        self._publish_dtype = publish_dtype = published_dtype(cfg.publish_dtype)
        self._publisher = (rollout_client.Publisher(etcd, cfg.job, cfg.agent, cfg.bucket_bytes,
                                                    cfg.publish_deltas, publish_dtype)
                           if cfg.publish else None)
        # A GPU trainer's deltas are found and encoded on the GPU (ROSE §4.2: only what changed
        # crosses to the host); its version copy is made there, in the serving dtype. Not under
        # ZeRO-3: a model partitioned because it does not fit one GPU would not fit there whole,
        # twice (the version and the record of the last), so it goes to host memory.
        model_device = module_device(self._model)
        self._publish_where = Where(model_device, publish_dtype) \
            if model_device.type != "cpu" and cfg.publish_deltas \
            and not self._backend.weights_are_sharded else None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="train")
        # RollPacker §4.4's handoff on this machine: lent workers' threads join training.
        self._lent = LentCapacity(cfg.torch_threads or torch.get_num_threads(),
                                  cfg.borrow_lent_threads, os.cpu_count() or 1) \
            if cfg.borrow_lent_threads else None
        self._lent_record: dict[str, object] | None = None
        self._step_id: str | None = None  # the SubmitStep in progress
        # --placement-scheduler: the job's phases run under WEAVE's permits (main.py sets it).
        self.placed: PlacedPhases | None = None
        self._manager = cfg.manager
        self._version = 0
        self._step = 0  # steps applied
        self._applying = False  # an optimizer step is under way (its failure may leave it half)
        # What the next step awaits before its rollout: the last version's publish (its
        # seconds, and what it changed when it went as deltas).
        self._pending_publish: Callable[[], Awaitable[tuple[float, DeltaStats | None]]] | None \
            = None
        # Every rank publishes its own shard; one rank always publishes whole.
        self._shard_publish = cfg.publish_mode == "shards" and isinstance(self._ranks, LeaderRanks)
        self._run_number = time.time_ns() // 1_000_000  # a restart's shards never join ours
        self.status = RunStatus()

    # ---- the run -------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Resume from the newest checkpoint, if any, and make its weights the current version."""
        if self._cfg.checkpoint_dir:
            state = await self._run(checkpoint.load_latest, self._cfg.checkpoint_dir,
                                    self._ranks.load)
            if state is not None:
                self._step = state.step
                self._data = TaskDataset.from_state(DatasetState(**state.data_position),
                                                    self._task_factory)
                self._data.task.restore_state(state.extra.get("task", {}))
                self._restore_tail(state.extra.get("tail_batching"))
                announced = await rollout_client.announced_version(self._etcd, self._cfg.job)
                if self._publisher is not None:  # held but not announced yet counts too
                    held = await self._publisher.latest_held()
                    announced = max((v for v in (announced, held) if v is not None),
                                    default=None)
                self._version, publish = resume_version(state.weight_version, announced)
                self.status.resumed_from_step = state.step
                log.info("resumed from checkpoint of step %d (version %d, announced %s): "
                         "continuing as version %d", state.step, state.weight_version, announced,
                         self._version)
                if publish and self._publisher is not None:
                    await self._start_publish(self._version)
                if self._seed is not None and self._seed.weight_version != self._version:
                    served = await self._run(lambda: self._as_served(self._ranks.weights()))
                    await self._seed.load(served, self._version)
        self._sync_status()

    async def run(self) -> None:
        """Steps until ``cfg.steps`` are applied (forever when 0). Cancel to stop: the step in
        progress is abandoned, nothing of it applied."""
        self.status.state = "training"
        try:
            if not self._step and self._version == 0:
                await self._declare_start_weights()
            if self._cfg.min_workers and not self._step:
                await self._await_workers()
            while (not self._cfg.steps or self._step < self._cfg.steps) and not self._data_done:
                await self._step_with_retries(self._next_spec())
            await self._await_publish()
            self.status.state = "done"
            self.status.current.phase = "done"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.status.state, self.status.error = "failed", f"{type(exc).__name__}: {exc}"
            raise

    async def _declare_start_weights(self) -> None:
        """The job's version 0 is these weights (rlharvest/common/start_weights.py): written before the
        first step, so the job's manager sends version-0 requests only to workers whose start
        weights are the same, never to another job's at the same version number.
        The step cannot be on-policy without it, so a failure to write it fails the run."""
        cfg = self._cfg
        fingerprint = await self._run(
            lambda: start_weights.fingerprint(self._as_served(self._ranks.weights())))
        record = start_weights.record(fingerprint, f"{cfg.model} seed {cfg.model_seed}")
        await with_etcd(partial(self._etcd.put, keys.start_weights_key(cfg.job).encode(), record),
                        "writing the job's start weights")
        log.info("job %s starts from weights %s (%s seed %d)", cfg.job, fingerprint, cfg.model,
                 cfg.model_seed)

    async def _await_workers(self) -> None:
        """``--min-workers``: the job's manager sees that many healthy workers."""
        cfg = self._cfg
        self.status.current.phase = "waiting_workers"
        manager = self._manager or await rollout_client.find_manager(self._etcd, cfg.job)
        log.info("waiting for %d healthy workers at the manager %s before the first step",
                 cfg.min_workers, manager)
        joined = await wait_workers(manager, cfg.min_workers, timeout=cfg.min_workers_timeout_s)
        log.info("%d workers healthy: %s", len(joined.workers), ", ".join(
            w.worker_id for w in joined.workers if w.state == "healthy"))

    @property
    def _data_done(self) -> bool:
        """Every prompt of ``--data-prompts`` trained (never, when unbounded)."""
        if self._tail is not None:
            return self._tail.done
        return bool(self._cfg.data_prompts) and \
            self._data.state().position >= self._cfg.data_prompts

    def _next_spec(self) -> StepSpec:
        if self._tail is not None:
            self._round = self._tail.plan()
            return self._round_spec(self._round)
        count = self._cfg.prompts_per_step
        if self._cfg.data_prompts:
            count = min(count, self._cfg.data_prompts - self._data.state().position)
        # Peeked, not taken: the data position moves with the step (_commit_data), so a step
        # cancelled before its optimizer step leaves its prompts to the resumed run.
        return self._spec(tuple(self._data.peek(count)), self._cfg.samples_per_prompt)

    def _round_spec(self, round_: Round) -> StepSpec:
        """A tail batching round as a step: a short round carries its acceptance rule."""
        items = tuple(self._data.task.item(i) for i in round_.prompts)
        accept = Acceptance(round_.accept_prompts, round_.accept_responses) \
            if round_.speculative else None
        return self._spec(items, round_.responses, accept, round_.kind)

    def _spec(self, items: tuple[TaskItem, ...], responses: int,
              accept: Acceptance | None = None, round_kind: str = "") -> StepSpec:
        return StepSpec(step=self._step + 1, weight_version=self._version, items=items,
                        prompts=tuple(tuple(self._tok.encode_prompt(it.messages or it.prompt))
                                      for it in items),
                        samples_per_prompt=responses, accept=accept, round=round_kind)

    def _commit_data(self, spec: StepSpec, assembler: GroupAssembler) -> None:
        """After the optimizer step, with the step count: the step's prompts are spent."""
        if self._tail is None:
            self._data.seek(self._data.state().position + len(spec.items))
            return
        assert self._round is not None, "a tail batching step runs a planned round"
        self._tail.commit(self._round, [spec.items[g].index for g in assembler.accepted])
        self._round = None
        self._data.seek(self._tail.position)
        metrics.ROUNDS.labels(spec.round).inc()
        metrics.PROMPTS_DEFERRED.inc(len(assembler.deferred))

    def _restore_tail(self, state: dict | None) -> None:
        position = self._data.state().position
        if self._tail is not None:
            self._tail.load_state_dict(state or {"position": position, "deferred": []})
        elif state and state["deferred"]:
            log.warning("the checkpoint holds %d prompts tail batching deferred; without "
                        "--tail-batching they are not trained", len(state["deferred"]))

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
        self._record(summary)
        await self._after_step()

    async def _attempt_step(self, spec: StepSpec) -> tpb.StepSummary:
        """One try of a step; a failed one leaves no gradient behind for the next."""
        try:
            return await self.train_step(spec)
        except _RETRYABLE:
            await self._run(self._ranks.discard)
            metrics.STEPS.labels("retried").inc()
            raise
        except BaseException:
            await asyncio.shield(self._run(self._ranks.discard))
            raise

    # ---- one step --------------------------------------------------------------------------

    async def train_step(self, spec: StepSpec) -> tpb.StepSummary:
        try:
            return await self._train_step(spec)
        finally:
            self._step_id = None  # a lent record of this step no longer lends anything

    def measure_profile(self) -> JobProfile:
        """--placement-scheduler without durations: the job's profile, measured now
        (warmup_profile.py) on a step's batch of the longest prompts it will send."""
        cfg = self._cfg
        batch = cfg.prompts_per_step * cfg.samples_per_prompt
        if self._env is not None:
            # A trajectory's worst case: every turn prefills a history as long as the context
            # and samples max_new_tokens (the environment's own time is not measured).
            profile = warmup_profile.measure_profile(
                cfg.model, self._ranks.forward_seconds, module_device(self._model), batch,
                cfg.env_context,
                cfg.env_max_turns * cfg.max_new_tokens, served=served_dtype(cfg.publish_dtype))
            return dataclasses.replace(profile, prefill_s=profile.prefill_s * cfg.env_max_turns)
        peeked = self._spec(tuple(self._data.peek(cfg.prompts_per_step)), cfg.samples_per_prompt)
        longest = max([self._setup.longest_prompt, *(len(p) for p in peeked.prompts)])
        return warmup_profile.measure_profile(cfg.model, self._ranks.forward_seconds,
                                              module_device(self._model), batch, longest,
                                              cfg.max_new_tokens,
                                              served=served_dtype(cfg.publish_dtype))

    def _report_tail(self, tasks: TaskGroup, manager: Callable[[], str], total: int,
                     finished: Callable[[], int]) -> asyncio.Task | None:
        """--placement-scheduler: report the rollout's progress until its tail migrates
        (tail_reports.py); None when not placed or reports are off."""
        run = self.placed.rollout_run if self.placed is not None else None
        if run is None or not self._cfg.placement_progress_s:
            return None
        return tasks.create_task(tail_reports.report_until_migrated(
            run, self._etcd, manager, total, finished, self._cfg.placement_progress_s))

    async def _train_step(self, spec: StepSpec) -> tpb.StepSummary:
        cfg = self._cfg
        started = self._clock()
        progress = self.status.current = Progress(step=spec.step, weight_version=spec.weight_version,
                                                  samples=spec.samples, phase="waiting_version")
        await self._await_publish()  # the step's version must be out before workers can hold it
        await self._republish_if_lost()
        if self.placed is not None:
            progress.phase = "waiting_permit"
            await self.placed.rollout()
        # Discovered through etcd: its incarnation tells its successor from it (_successor).
        member: dict = {} if self._manager else \
            await rollout_client.find_manager_member(self._etcd, cfg.job)
        manager = self._manager or member["endpoint"]
        if self.placed is not None:  # the permit's node switches its worker to this job now
            try:
                await wait_workers(manager, 1, timeout=cfg.no_worker_deadline_s, poll_s=0.01)
            except TimeoutError as exc:  # retried under the rollout permit it holds
                raise RolloutFailed(f"no worker joined the job's manager under its rollout "
                                    f"permit: {exc}") from exc
            progress.phase = "rollout"
        if self._env is not None:
            return await self._agentic_step(spec, manager, progress, started)
        window_s = await self._seed_window_s()
        request = submit_request(spec, max_new_tokens=cfg.max_new_tokens,
                                 temperature=cfg.temperature, top_p=cfg.top_p,
                                 stop_token_ids=list(self._tok.stop_ids),
                                 data_seed=cfg.data_seed,
                                 no_worker_deadline_s=cfg.no_worker_deadline_s,
                                 lengths=self._lengths, seed_window_s=window_s)
        self._step_id = request.step_id
        assembler = GroupAssembler(spec)
        sync = cfg.pipeline == "sync"  # the veRL-like baseline: one stage after the other
        held: list[tuple[int, int, mpb.Completion]] = []  # sync: rewarded after the rollout
        ready: asyncio.Queue[ReadyGroup] = asyncio.Queue()
        micro_batch = min(cfg.micro_batch_groups, spec.train_groups)
        train = self._streaming_step(spec)
        progress.phase = "rollout"

        async def reward(group: int, sample: int, completion) -> None:
            item = spec.items[group]
            text = self._tok.decode(completion.token_ids)
            try:
                outcome = await self._rewards.score(RewardRequest(
                    completion.request_id, item.prompt, text, item.answer,
                    reward_fn=self._setup.reward_of(item),
                    timeout_s=cfg.reward_timeout_of(self._setup.kind_of(item))))
            except asyncio.CancelledError:
                metrics.REWARDS.labels("cancelled").inc()
                raise
            metrics.REWARDS.labels("scored" if outcome.ok else "failed").inc()
            if not outcome.ok:
                self._record_reward_failure(spec.step, outcome)
            if group == 0 and sample == 0:  # one sample per step, to read what the policy writes
                log.info("sample of step %d: reward %.3f for completion %s (reference %s)",
                         spec.step, outcome.reward, json.dumps(text), json.dumps(item.answer))
            done = assembler.reward(group, sample, outcome.reward)
            phases["rewards"] = self._clock() - started
            if done is not None:
                ready.put_nowait(done)

        remote: list[mpb.RemoteTimings] = []  # the manager's half of Algorithm 1's inputs
        phases = {"rollout": 0.0, "rewards": 0.0}  # seconds from the step's start
        rewarding: dict[int, list[asyncio.Task]] = {}  # by group: a deferred one's are cancelled

        def complete(completion: mpb.Completion, tasks: TaskGroup) -> None:
            if (place := assembler.completion(completion)) is None:
                return
            if sync:
                held.append((*place, completion))
            else:
                rewarding.setdefault(place[0], []).append(
                    tasks.create_task(reward(*place, completion)))

        def take(event: mpb.StepEvent, tasks: TaskGroup, ids: list[str]) -> None:
            if event.HasField("remote"):
                remote.append(event.remote)
            assembler.rows(event.batch, ids)  # ids: the submission's, which rows index
            for completion in event.completions:
                complete(completion, tasks)
            for verdict in event.verdicts:  # after the completions that decided them
                if (done := assembler.verdict(verdict.group_id, verdict.accepted)) is not None:
                    ready.put_nowait(done)
                if not verdict.accepted:
                    for task in rewarding.pop(assembler.group_of(verdict.group_id), []):
                        task.cancel()  # its tokens are discarded; so is its reward
            progress.completions = assembler.completions
            progress.tokens_generated = assembler.tokens_generated

        async def rollout(tasks: TaskGroup) -> None:
            submit, endpoint = request, manager
            incarnation: str | None = member.get("incarnation")
            reporter = self._report_tail(tasks, lambda: endpoint, len(request.requests),
                                         lambda: assembler.completions)
            while submit.requests:
                ids = [r.request_id for r in submit.requests]
                try:
                    async for event in rollout_client.stream_step(endpoint, submit,
                                                                  cfg.max_message_bytes):
                        take(event, tasks, ids)
                    break
                except grpc.aio.AioRpcError as exc:
                    if submit is request:
                        raise
                    # The successor refused the resume payload: start the step over.
                    raise rollout_client.RolloutStreamError(
                        f"the successor refused step {spec.step}'s resume: {exc.details()}"
                    ) from exc
                except rollout_client.RolloutStreamError as exc:
                    submit, finished = assembler.resume(request)
                    for completion in finished:
                        complete(completion, tasks)
                    if not submit.requests:
                        break  # every request's end had streamed: nothing to resume
                    successor = await self._successor(endpoint, incarnation, spec, exc)
                    # The seeding window is over, and a resumed step borrows no lent workers
                    # (a dead manager's "lent" record would match the step id for ever).
                    submit.seed_window_s = 0.0
                    self._step_id = None
                    metrics.STEP_RESUMES.inc()
                    log.warning("step %d: the manager at %s is gone (%s); resuming %d requests "
                                "with %d tokens already generated at %s", spec.step, endpoint,
                                exc, len(submit.requests),
                                sum(len(r.resume_token_ids) for r in submit.requests),
                                successor["endpoint"])
                    endpoint, incarnation = successor["endpoint"], successor.get("incarnation")
            if reporter is not None:
                reporter.cancel()
            assembler.check_complete()
            phases["rollout"] = self._clock() - started
            rollout_done.set()
            if self.placed is not None:  # the rollout nodes go to the next job's rollout now
                await self.placed.end_rollout()
            for group, sample, completion in held:  # sync: the reward stage starts now
                if group not in assembler.deferred:
                    tasks.create_task(reward(group, sample, completion))

        waited = 0.0
        rollout_done = asyncio.Event()
        try:
            async with TaskGroup() as tasks:
                tasks.create_task(rollout(tasks))
                if window_s:  # the trainer's engine rolls out: training waits for the window
                    progress.phase = "seeding"
                    await wait_event(rollout_done, window_s)
                    progress.phase = "rollout"
                while train.groups_received < spec.train_groups:  # train on groups as they come
                    idle_since = self._clock()
                    groups = [await ready.get()]
                    if sync:  # train after every group is rewarded, m_b groups at a time
                        groups += [await ready.get() for _ in range(spec.train_groups - 1)]
                    wait = self._clock() - idle_since
                    waited += wait
                    metrics.MICRO_BATCH_WAIT.observe(wait)
                    # Groups rewarded while the last micro-batch computed are ready at once: the
                    # core trains them together (RLBoost §4.1) instead of m_b at a time.
                    while not ready.empty():
                        groups.append(ready.get_nowait())
                    if self.placed is not None:  # WEAVE: one phase at a time (placed_phases)
                        await rollout_done.wait()
                        await self.placed.train()
                    cut = micro_batch if sync else len(groups)
                    for first in range(0, len(groups), cut):
                        await self._run(train.add_groups, [self._rewarded(spec, g)
                                                           for g in groups[first:first + cut]])
                    progress.groups_trained = train.groups_received
        except BaseExceptionGroup as failed:
            # Rollout and rewards fail for one reason at a time; surface it, not the group.
            raise next((e for e in failed.exceptions
                        if not isinstance(e, asyncio.CancelledError)), failed) from None
        return await self._conclude(spec, train, assembler, progress, started, waited, phases,
                                    remote)

    def _streaming_step(self, spec: StepSpec) -> StreamingStep:
        """The step's GRPO update, fed group by group (micro-batches of m_b ready groups)."""
        return StreamingStep(self._backend, num_groups=spec.train_groups,
                             group_size=spec.group_size,
                             micro_batch_groups=min(self._cfg.micro_batch_groups,
                                                    spec.train_groups),
                             loss=self._loss, pad_id=self._tok.pad_id,
                             ref_model=self._ref_model, ranks=self._ranks, clock=self._clock)

    async def _conclude(self, spec: StepSpec, train: StreamingStep, assembler: GroupAssembler,
                        progress: Progress, started: float, waited: float,
                        phases: dict[str, float], remote: list[mpb.RemoteTimings]
                        ) -> tpb.StepSummary:
        """The optimizer step, Algorithm 1's update, the publish and the step's summary."""
        progress.phase = "optimizer"
        stats = await self._apply(spec, train, assembler)
        n_prem = 0
        if self._instance_cap is not None:
            self._instance_cap.rollout_measured(phases["rollout"])
            n_prem = await self._instance_cap.after_step(
                stats.compute_s, waited, remote[-1] if remote else None) or 0
        elapsed = self._clock() - started

        if self._publisher is not None:
            await self._start_publish(self._version)
        if self.placed is not None:
            await self.placed.done()
        return tpb.StepSummary(
            step=spec.step, weight_version=spec.weight_version, mean_reward=stats.mean_reward,
            step_time_s=elapsed, tokens=stats.num_tokens,
            tokens_per_second=stats.num_tokens / max(elapsed, 1e-9),
            migrations=assembler.migrations, micro_batches=stats.micro_batches,
            micro_batch_wait_s=waited, loss=stats.loss, grad_norm=stats.grad_norm,
            train_compute_s=stats.compute_s, n_prem=n_prem,
            t_seed_s=self._instance_cap.window.schedule.t_seed if self._instance_cap else 0.0,
            published_version=self._version if self._publisher is not None else 0,
            round=spec.round, prompts_launched=len(spec.items),
            prompts_deferred=len(assembler.deferred), tokens_discarded=assembler.tokens_discarded,
            rollout_s=phases["rollout"], rewards_s=phases["rewards"],
            rollout_digest=assembler.digest())

    async def _agentic_step(self, spec: StepSpec, manager: str, progress: Progress,
                            started: float) -> tpb.StepSummary:
        """A step of multi-turn trajectories (``--env``): each prompt item is one episode (its
        reset seed follows from the item's index, so a resumed run replays the same episodes),
        played by a GRPO group of ``samples_per_prompt`` trajectories through the manager turn
        by turn (environments/runner.py). A group trains as soon as it is played. The model's
        tokens train; the environment's observations are context only (loss mask). A trajectory
        the environment failed scores 0 and trains nothing; the step goes on."""
        assert self._env is not None
        cfg = self._cfg
        play_cfg = PlayConfig(weight_version=spec.weight_version, max_turns=cfg.env_max_turns,
                              max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, context=cfg.env_context,
                              env_timeout_s=cfg.env_timeout_s,
                              no_worker_deadline_s=cfg.no_worker_deadline_s,
                              stop_token_ids=tuple(self._tok.stop_ids))
        train = self._streaming_step(spec)
        progress.phase = "rollout"
        env_class = self._env

        waited = 0.0
        # Placed (WEAVE): one phase at a time, so the groups train once the rollout phase ended
        # and the training permit is held; else each trains as soon as it is played (the
        # last one once the step's scope on the manager ended).
        held: list[RewardedGroup] = []
        # Tail batching's short round (RollPacker): every episode of the round plays R
        # trajectories; the first P0 groups to end R0 of them train, and the rest (the tail)
        # are cancelled and deferred to a long round. Otherwise every group trains whole.
        trained: list[int] = []
        async with self._hold_agentic_step(manager, spec, await self._seed_window_s()) as scope, \
                manager_generator(manager, play_cfg) as generate, TaskGroup() as tasks:

            async def group(g: int) -> tuple[int, list[Trajectory]]:
                item = spec.items[g]
                seed = sample_seed(cfg.data_seed, 0, item.index, 0)
                return g, await play_group(generate, env_class, f"s{spec.step}-g{g}", seed,
                                           spec.samples_per_prompt, play_cfg,
                                           keep=spec.group_size, tokenizer=self._tok,
                                           task=item if self._env_takes_task else None)

            reporter = self._report_tail(tasks, lambda: manager, spec.samples,
                                         lambda: progress.completions)
            playing = [tasks.create_task(group(g)) for g in range(len(spec.items))]
            for played in asyncio.as_completed(playing):
                idle_since = self._clock()
                g, trajectories = await played
                waited += self._clock() - idle_since
                trained.append(g)
                self._count_played(spec, trajectories, progress)
                last = len(trained) == spec.train_groups
                # The last group trains after the step's scope ends: the manager's timings
                # (Algorithm 1's inputs) measure the rollout, as a SubmitStep step's do.
                if self.placed is not None or last:
                    held.append(rewarded_group(g, trajectories))
                else:
                    await self._run(train.add_groups, [rewarded_group(g, trajectories)])
                    progress.groups_trained = train.groups_received
                if last:
                    break
            for tail in playing:  # a short round's tail (none otherwise)
                tail.cancel()
            if reporter is not None:
                reporter.cancel()
        rollout_s = self._clock() - started
        if self.placed is not None:
            await self.placed.end_rollout()
            await self.placed.train()
        if held:
            await self._run(train.add_groups, held)
            progress.groups_trained = train.groups_received
        phases = {"rollout": rollout_s, "rewards": 0.0}
        assembler = GroupAssembler(spec)  # what _commit_data reads: trained and deferred groups
        assembler.accepted = sorted(trained)
        assembler.deferred = sorted(set(range(len(spec.items))) - set(trained))
        remote = [scope.remote] if scope is not None and scope.remote is not None else []
        return await self._conclude(spec, train, assembler, progress, started, waited, phases,
                                    remote)

    def _hold_agentic_step(self, manager: str, spec: StepSpec, window_s: float
                           ) -> contextlib.AbstractAsyncContextManager[StepScope | None]:
        """--env with the instance cap on: the step's turns are many Generate calls, not one
        SubmitStep that carries the seeding window and comes back with the step's remote
        timings, so the step is held open on the manager while they play
        (``rollout_client.hold_agentic_step``). With --seed-role the seed engine takes turns for
        T_seed, then its running turns move with their tokens to the remote workers; either
        way the manager's timings of the step feed Algorithm 1. Nothing without the cap."""
        if self._instance_cap is None:
            return contextlib.nullcontext()
        # Unique per attempt: a retried step's window must not be ended by its predecessor's.
        step_id = f"{self._cfg.job}-s{spec.step}-{uuid.uuid4().hex[:8]}"
        return rollout_client.hold_agentic_step(manager, step_id, window_s)

    @staticmethod
    def _count_played(spec: StepSpec, trajectories: list[Trajectory], progress: Progress) -> None:
        for t in trajectories:
            metrics.TRAJECTORIES.labels("failed" if t.failed else "played").inc()
            if t.failed:
                log.warning("step %d: trajectory %s failed: %s", spec.step, t.trajectory_id,
                            t.failed)
            progress.completions += 1
            progress.tokens_generated += sum(t.trained)

    async def _seed_window_s(self) -> float:
        """The next step's seeding window T_seed (Algorithm 1), 0 without the seed role; a
        window waits for a manager to hold a session with the seed engine (else it is idle)."""
        if self._seed is None or self._instance_cap is None:
            return 0.0
        window_s = self._instance_cap.window.schedule.t_seed
        if window_s:
            await self._seed.wait_connected()
        return window_s

    async def _apply(self, spec: StepSpec, train: StreamingStep,
                     assembler: GroupAssembler) -> StepStats:
        """The one optimizer step of this RL step, and with it the step count, the round and
        the version the weights now carry. Once the optimizer runs it finishes even if the step
        is cancelled (SIGTERM), and the bookkeeping with it: a goodbye checkpoint then holds the
        updated weights with their step, queue and version, never the old ones."""

        async def apply() -> StepStats:
            self._applying = True  # until the optimizer step returns: a failure leaves it half
            stats = await self._run(train.finish)
            self._applying = False
            if self._cfg.bench_train_delay_s:  # the harness's slower training node
                await asyncio.sleep(self._cfg.bench_train_delay_s)
            self._step = spec.step
            self._commit_data(spec, assembler)  # with the step: a retried one never commits
            if self._publisher is not None:
                self._version += 1
            return stats

        task = asyncio.ensure_future(apply())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    async def _task_reward(self, prompt: str, completion: str, reference: str) -> float:
        # Looked up per call: a resume replaces the dataset, and with it the task's state.
        return await self._data.task.score(prompt, completion, reference)

    def _record_reward_failure(self, step: int, outcome: RewardOutcome) -> None:
        metrics.REWARD_FAILURES.inc()
        self.status.current.reward_failures += 1
        self.status.reward_failures.append(
            RewardFailureRecord(step, outcome.sample_id, outcome.error))
        # Debug, not warning: early in training most code samples may fail; the step logs a count.
        log.debug("reward of %s failed: %s", outcome.sample_id, outcome.error)

    def _rewarded(self, spec: StepSpec, group: ReadyGroup) -> RewardedGroup:
        prompt = spec.prompts[group.group]
        return RewardedGroup(group.group, [
            Completion(prompt, list(c.token_ids), list(c.logprobs)) for c in group.completions],
            list(group.rewards))

    # ---- after the step: publish and checkpoint ---------------------------------------------

    async def _start_publish(self, version: int) -> None:
        """Snapshot the weights now and hand them to the agent in the background: the trainer
        goes on at once; the next step waits for it only before submitting its rollout."""
        if self._shard_publish:
            await self._start_shard_publish(version)
            return
        assert self._publisher is not None
        # On the training thread, as every rank command: a copy of the whole model (seconds
        # for a large one on the CPU; under ZeRO-3 a gather every rank joins) must not stall
        # the event loop, whose lease keepalives and streams would lapse meanwhile.
        # Cast to the serving dtype there too, once for the seed engine and the publisher both
        # (the publisher's cast of tensors already in it copies nothing).
        tensors = await self._run(lambda: self._as_served(
            self._ranks.weights(where=self._publish_where)))
        if self._seed is not None:  # the trainer's own engine: in memory, before the next step
            await self._seed.load(tensors, version)
        publisher = self._publisher

        async def publish() -> tuple[float, DeltaStats | None]:
            started = self._clock()
            try:
                await retry(partial(publisher.publish, version, tensors), attempts=5,
                            retry_if=lambda exc: isinstance(exc, _PUBLISH_RETRYABLE),
                            backoff=_PUBLISH_BACKOFF, what=f"publishing version {version}")
            except _PUBLISH_RETRYABLE as exc:
                raise RuntimeError(f"could not publish version {version}: "
                                   f"{rpc.error_text(exc, SERVICE_ROLES['transfer_agent'])}"
                                   ) from exc
            elapsed = self._clock() - started
            metrics.PUBLISH_SECONDS.observe(elapsed)
            log.info("published version %d in %.2fs", version, elapsed)
            return elapsed, publisher.last_stats

        task = asyncio.get_running_loop().create_task(publish(), name=f"publish v{version}")
        self._pending_publish = lambda: task

    def _as_served(self, tensors: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The weights as the workers serve them (in the publish dtype): the seed engine rolls
        out the same policy as they do, wherever the trainer snapshotted them."""
        return rollout_client.as_served(tensors, self._publish_dtype)

    async def _start_shard_publish(self, version: int) -> None:
        """Every rank copies its shard now, in the serving dtype, and sends it on its own thread
        (as a delta against its last shard, with ``--publish-deltas``); the next step asks the
        ranks how that ended and what the version changed (a command, so it waits until then:
        the compute thread stays free for the checkpoint meanwhile). Versions stay unchanged
        until that step trains, so an incomplete version (the agent restarted and lost shards)
        is simply published again."""
        assert self._publisher is not None and isinstance(self._ranks, LeaderRanks)
        ranks, publisher = self._ranks, self._publisher
        started = self._clock()

        async def start() -> None:
            endpoint = await retry(publisher.endpoint, attempts=5, backoff=_PUBLISH_BACKOFF,
                                   retry_if=lambda exc: isinstance(exc, LookupError),
                                   what="finding a transfer agent")
            target = ShardTarget(endpoint, self._cfg.job, self._cfg.bucket_bytes,
                                 self._run_number, self._publish_dtype, self._cfg.publish_deltas)
            await self._run(ranks.publish_shards, version, target)

        async def finish() -> tuple[float, DeltaStats | None]:
            for attempt in range(1, _SHARD_PUBLISH_ATTEMPTS + 1):
                try:
                    if await self._run(ranks.await_published, version):
                        break
                    problem = "every shard was accepted but none completed the version"
                except RankFailed as exc:
                    problem = str(exc)
                if attempt == _SHARD_PUBLISH_ATTEMPTS:
                    raise RuntimeError(f"could not publish version {version} as shards: "
                                       f"{problem}")
                log.warning("publishing version %d again (%s)", version, problem)
                await start()
            elapsed = self._clock() - started
            metrics.PUBLISH_SECONDS.observe(elapsed)
            log.info("published version %d as %d shards in %.2fs", version, ranks.world_size,
                     elapsed)
            stats = ranks.last_stats
            if stats is not None:
                metrics.PUBLISH_CHANGED.set(stats.changed_fraction)
                metrics.PUBLISH_PAYLOAD.set(stats.payload_bytes / max(stats.dense_bytes, 1))
                log.info("version %d: %.3f%% of the elements changed over %d shards; sent %.2f "
                         "of %.2f MB", version, 100 * stats.changed_fraction, ranks.world_size,
                         stats.payload_bytes / 1e6, stats.dense_bytes / 1e6)
            return elapsed, stats

        await start()
        self._pending_publish = finish

    async def _republish_if_lost(self) -> None:
        """A version published to an agent that died before any worker pulled it is nowhere:
        no live agent's holder record lists it (the records live on the agents' leases) and no
        worker of the job holds it. The trainer learns so here, from etcd, before each step's
        rollout — a step retried because no worker got the version comes here again — and
        publishes it again from its own weights, which are still exactly that version (the
        next optimizer step has not run)."""
        if self._publisher is None or self._shard_publish or self._version == 0:
            return
        version = self._version
        if await self._publisher.held_anywhere(version):
            return
        log.warning("version %d is held by no agent and no worker (its agent died before the "
                    "workers pulled it): publishing it again", version)
        metrics.REPUBLISHED.inc()
        await self._start_publish(version)
        await self._await_publish()

    async def _await_publish(self) -> None:
        pending, self._pending_publish = self._pending_publish, None
        if pending is None:
            return
        self.status.current.phase = "publish"
        elapsed, stats = await pending()
        if self.status.summaries and self.status.summaries[-1].published_version == \
                self._version:
            summary = self.status.summaries[-1]
            summary.publish_s = elapsed
            if stats is not None:
                summary.published_changed = stats.changed_fraction
                summary.published_payload_ratio = stats.payload_bytes / max(stats.dense_bytes, 1)

    async def _after_step(self) -> None:
        if self._cfg.checkpoint_dir and self._step % self._cfg.checkpoint_every == 0:
            await self.save_checkpoint()
        self._sync_status()

    def can_save_after(self, failure: BaseException) -> bool:
        """Whether the weights still are exactly the steps applied after ``failure`` ended
        training, so a checkpoint may keep them: not when an optimizer step failed halfway,
        nor when a rank (or the ranks' collectives) failed, where ranks may disagree or a save
        would wait on a dead one."""
        if self._applying or not self._cfg.checkpoint_dir:
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
        extra: dict[str, Any] = {"task": self._data.task.checkpoint_state()}
        if self._tail is not None:
            extra["tail_batching"] = self._tail.state_dict()
        state = checkpoint.TrainerState(step=self._step, weight_version=self._version,
                                        data_position=dataclasses.asdict(self._data.state()),
                                        extra=extra)
        path = await self._run(checkpoint.save_checkpoint, self._cfg.checkpoint_dir, state,
                               self._ranks.save, self._cfg.keep_checkpoints)
        metrics.CHECKPOINT_SECONDS.observe(self._clock() - started)
        log.info("checkpoint of step %d (version %d) at %s", self._step, self._version, path)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _record(self, summary: tpb.StepSummary) -> None:
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
        self.status.summaries.append(summary)
        del self.status.summaries[:-self._cfg.keep_step_summaries]
        self._curves.step(summary, {"reward/failures": self.status.current.reward_failures})
        log.info("step %d on version %d: reward %.3f, %d tokens in %.2fs (%.0f tokens/s), %d "
                 "micro-batches, waited %.2fs, %d migrations, %d reward failures", summary.step,
                 summary.weight_version, summary.mean_reward, summary.tokens, summary.step_time_s,
                 summary.tokens_per_second, summary.micro_batches, summary.micro_batch_wait_s,
                 summary.migrations, self.status.current.reward_failures)
        if summary.round:
            log.info("step %d was a %s round: %d prompts launched, %d deferred, %d tokens "
                     "discarded", summary.step, summary.round, summary.prompts_launched,
                     summary.prompts_deferred, summary.tokens_discarded)

    def _sync_status(self) -> None:
        self.status.steps_done = self._step
        self.status.weight_version = self._version
        metrics.STEP.set(self._step)
        metrics.WEIGHT_VERSION.set(self._version)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def steps_done(self) -> int:
        return self._step

    @property
    def task(self) -> Task:
        """The built-in task in use; a resume replaces it (with its restored state)."""
        return self._data.task

    async def _successor(self, endpoint: str, incarnation: str | None, spec: StepSpec,
                         broke: Exception) -> dict:
        """The member record of the manager that succeeds a dead one, to resume the step at.
        Re-raises ``broke`` (the step is then retried whole, as before resumes existed) when the
        manager was given by --manager, the step is a short round (its acceptance state died
        with the manager), the manager still answers (the stream broke, not the manager), or
        no successor registers within --resume-wait-s."""
        if incarnation is None or spec.accept is not None:
            raise broke
        deadline = self._clock() + self._cfg.resume_wait_s
        while self._clock() < deadline:
            try:
                return await rollout_client.find_manager_member(  # one look, no wait
                    self._etcd, self._cfg.job, timeout=0, unlike=incarnation)
            except TimeoutError:
                pass
            except Exception as exc:  # etcd down or refusing a stale token: ask again
                log.warning("looking for the successor of the manager at %s: %r", endpoint, exc)
                await asyncio.sleep(0.5)
            with contextlib.suppress(TimeoutError):
                await rpc.wait_healthy(endpoint, timeout=0.5)
                raise broke  # it answers: the same manager lives, the step is retried whole
        raise broke

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """On the training thread: one at a time, in order, never blocking the event loop; with
        the lent workers' threads added while the manager lends them (``lent_capacity.py``)."""
        if self._lent is not None:
            fn = partial(self._with_threads, self._lent, fn)
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def _with_threads(self, lent: LentCapacity, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` with the threads lent workers add now: decided and set here, on the training
        thread when the call runs (torch's thread count is per calling thread, and a call
        queued while workers were lent may run after they came back)."""
        threads = lent.threads(self._lent_record, self._cfg.job, self._step_id)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        metrics.THREADS.set(threads)
        if threads > lent.base_threads:
            metrics.LENT_THREAD_CALLS.inc()
        return fn(*args)

    async def watch_lent_workers(self) -> None:
        """The job's stream-scale record (RollPacker §4.4), for ``--borrow-lent-threads``."""
        key = keys.stream_scale_key(self._cfg.job)
        async for event in registry.list_and_watch(self._etcd, key, prefix=False):
            raw = event.values.get(key) if isinstance(event, registry.Listing) else event.value
            try:
                self._lent_record = parse_scale_record(raw)
            except ValueError as exc:
                log.warning("ignoring the stream-scale record: %s", exc)
                self._lent_record = None

    def close(self) -> None:
        self._compute.shutdown(wait=True, cancel_futures=True)
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
