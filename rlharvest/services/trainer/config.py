"""Configuration of a trainer (file, RLH_ environment, flags; see rlharvest/common/config.py)."""

from __future__ import annotations

import math
import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from rlharvest.common.config import ServiceConfig
from rlharvest.common.rpc import DEFAULT_MAX_MESSAGE_BYTES


# What a per-kind reward timeout can name: the built-in rewards and the built-in tasks.
REWARD_KINDS = ("math", "exact", "code", "addition")


def parse_timeouts(text: str) -> dict[str, float]:
    """``'math=5,code=90'`` -> {"math": 5.0, "code": 90.0}; a clear error for anything else."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or kind.strip() not in REWARD_KINDS or not seconds > 0:
            raise ValueError(f"reward_timeouts entry {part!r}: give kind=seconds with a kind of "
                             f"{', '.join(REWARD_KINDS)} and seconds > 0")
        out[kind.strip()] = seconds
    return out


def _default_trainer_id() -> str:
    return f"trainer-{socket.gethostname()}-{os.getpid()}"


class TrainerConfig(ServiceConfig):
    trainer_id: str = Field(default_factory=_default_trainer_id, pattern=r"^[A-Za-z0-9_.-]+$")
    job: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="the RL job it trains")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="gRPC port (status); 0 picks a free one")
    advertise_host: str = Field("", description="host others dial; defaults to host")
    metrics_port: int = Field(0, ge=0, lt=65536)
    etcd: str = Field("127.0.0.1:2379", description="etcd host:port")
    lease_ttl: int = Field(5, ge=1, le=300)
    manager: str = Field("", description="rollout manager host:port; empty = the job's manager "
                                         "registered in etcd")
    min_workers: int = Field(0, ge=0, description="before the first step, wait until the job's "
                             "manager has this many healthy workers (seed and serving ones "
                             "included), so a fleet still starting is not left out of the first "
                             "steps; 0 = start at once")
    min_workers_timeout_s: float = Field(600.0, gt=0, description="give up waiting for "
                                         "min_workers after this long")
    # The model: the same preset + seed (or checkpoint directory) the job's workers serve, so
    # version 0 is the same weights on both sides.
    model: str = Field("tiny", description="a model preset name or a local checkpoint directory")
    model_seed: int = 0
    task: Literal["addition", "code"] = Field("addition", description="built-in task with its "
                                              "reward: addition (rule-based) or code (sandboxed); "
                                              "--data replaces it")
    data: str = Field("", description="a JSONL or Parquet dataset (veRL layout: prompt, "
                                      "reward_model.ground_truth, data_source) instead of --task")
    data_fields: str = Field("", description="field mapping for another layout, e.g. "
                                             "'prompt=question,ground_truth=answer'")
    reward: str = Field("", description="reward of every sample: a built-in (math, exact, code) "
                                        "or 'package.module:function'; empty = by each row's "
                                        "data_source (--data) or the task's own")
    reward_fn: str = Field("", description="'package.module:function' (prompt, completion, "
                                           "reference) -> float; the same as --reward with an "
                                           "import path (docs/rewards.md)")
    env: str = Field("", description="agentic RL: an environment ('frozen_lake' or "
                     "'package.module:Class', rlharvest/services/trainer/environments/interface.py) whose "
                     "episodes are the prompts; each sample is a multi-turn trajectory, "
                     "max_new_tokens per turn, observations masked out of the loss")
    env_max_turns: int = Field(8, ge=1, description="turns per trajectory at most")
    env_timeout_s: float = Field(5.0, gt=0, description="an environment call slower than this "
                                 "fails its trajectory")
    env_context: int = Field(512, ge=8, description="tokens a trajectory may reach (the "
                             "workers' max_len)")
    max_prompt_tokens: int = Field(0, ge=0, description="longest prompt accepted from --data; 0 = "
                                                        "the model's context minus max_new_tokens")
    data_seed: int = 0
    steps: int = Field(0, ge=0, description="RL steps to run (a resume counts those done); 0 = "
                                            "no limit")
    prompts_per_step: int = Field(8, ge=1, description="P0: prompts (GRPO groups) per step")
    samples_per_prompt: int = Field(8, ge=2, description="R0: samples per prompt (group size)")
    micro_batch_groups: int = Field(2, ge=1, description="m_b: rewarded groups per micro-batch")
    data_prompts: int = Field(0, ge=0, description="prompts of the data the run trains, then it "
                                                   "ends (tail batching flushes its deferred "
                                                   "queue there); 0 = unbounded")
    # RollPacker's tail batching (§3): short rounds of ceil(eta_P*P0) x ceil(eta_R*R0) that train
    # the first P0 prompts to finish R0 responses, long rounds of the deferred ones.
    pipeline: Literal["stream", "sync"] = Field(
        "stream", description="stream: rewards as completions arrive, micro-batches as groups "
        "are rewarded; sync: the veRL-like baseline (rewards after the rollout, training after "
        "the rewards)")
    # Modelled load for benchmarks (load_model.py): never set in production.
    bench_length_median: float = Field(0.0, ge=0, description="benchmark harness: responses "
                                       "run a modelled long-tailed length around this median "
                                       "(no stop tokens); 0 = off")
    bench_seed_step_delay_s: float = Field(0.0, ge=0, description="benchmark harness: each "
                                           "engine step of the seed role's engine also takes "
                                           "this long (as a rollout worker's --step-delay-s)")
    bench_train_delay_s: float = Field(0.0, ge=0, description="benchmark harness: sleep this "
                                       "long in each step's training phase after the "
                                       "optimizer step (a slower training node)")
    bench_reward_delay_s: float = Field(0.0, ge=0, description="benchmark harness: each reward "
                                        "also takes this long (a verifier's latency)")
    # RLBoost's seeding window (§4.1, seed_role.py): the trainer's own engine rolls out during
    # [0, T_seed] of each step, then hands its partial responses to the remote workers.
    seed_role: bool = Field(False, description="roll out on the trainer's own engine during the "
                            "seeding window T_seed of each step (RLBoost Algorithm 1; needs "
                            "--instance-cap auto, one rank, publishing)")
    seed_window_init_s: float = Field(0.0, ge=0, description="T_seed of the first step")
    seed_eta: float = Field(1.0, gt=0, description="eta: Algorithm 1's adaptation rate")
    seed_max_running: int = Field(16, ge=1, description="requests the seed engine runs at once")
    seed_max_len: int = Field(512, ge=8, description="prompt + completion tokens per request on "
                                                     "the seed engine")
    tail_batching: bool = Field(False, description="RollPacker's tail batching: speculative "
                                                   "short rounds, deferred prompts in long ones")
    eta_prompts: float = Field(1.25, ge=1, description="eta_P: prompts launched per prompt "
                                                       "trained in a short round")
    eta_responses: float = Field(1.25, ge=1, description="eta_R: responses launched per "
                                                         "response trained (keeps the R0 "
                                                         "shortest of R draws)")
    max_new_tokens: int = Field(4, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    backend: Literal["deepspeed", "torch"] = Field("deepspeed", description="where gradients "
                                                   "accumulate; torch is the plain reference")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the model trains: cpu, or "
                                           "cuda (each rank its own GPU, cuda:LOCAL_RANK); the "
                                           "seed role's engine runs there too")
    zero_stage: int = Field(0, ge=0, le=3)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-2, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.2, ge=0)
    beta: float = Field(0.0, ge=0, description="KL coefficient against the initial policy")
    aggregation: Literal["token", "sequence"] = "token"
    reward_concurrency: int = Field(8, ge=1, description="rewards computed at once")
    reward_timeout_s: float = Field(10.0, gt=0, description="seconds one reward may take")
    # RollPacker §5: math verifiers answer in milliseconds, code sandboxes take seconds; one
    # timeout either waits too long on a hung math checker or cuts correct programs short.
    reward_timeouts: str = Field("", description="per reward kind, e.g. 'math=5,code=90' "
                                                 "(kinds: " + ", ".join(REWARD_KINDS) + "); "
                                                 "others use reward_timeout_s, except code "
                                                 "where the built-in code reward runs (--reward "
                                                 "code, --data): at least its worst case, all "
                                                 "of its test cases at their limit")
    # RollPacker's adaptive sandbox timeout for --task code, T = min(max(T_min, lambda*T_anchor),
    # T_max). The paper's 2 s / 30 s are for real programs; a one-line expression runs in
    # milliseconds, so 1 s / 5 s, which still covers interpreter start-up on a loaded CPU.
    sandbox_t_min_s: float = Field(1.0, gt=0)
    sandbox_t_max_s: float = Field(5.0, gt=0)
    sandbox_slack: float = Field(1.5, ge=1.0, description="lambda: headroom over the slowest "
                                                          "correct run")
    allow_unisolated_sandbox: bool = Field(False, description="where Linux namespaces are "
                                           "unavailable, run code rewards with resource limits "
                                           "only (no network or filesystem isolation) instead "
                                           "of refusing them")
    publish: bool = Field(True, description="publish each new version to the node's transfer "
                                            "agent; off, every step runs on version 0 (only the "
                                            "first is on-policy)")
    agent: str = Field("", description="transfer agent host:port; empty = find it in etcd")
    publish_wait_s: float = Field(120.0, gt=0, description="how long a publish waits for a "
                                  "transfer agent to answer (one restarting, none registered "
                                  "yet) before the step fails")
    bucket_bytes: int = Field(64 << 20, ge=1 << 16, description="publish bucket size")
    publish_dtype: Literal["model", "bfloat16", "float16"] = Field(
        "model", description="dtype of the published weights: the model's own, or the serving "
        "dtype (floating tensors cast before publishing). bf16 is what makes RL deltas sparse "
        "(an update smaller than half a bf16 ulp leaves the element's bits unchanged; "
        "bench/README.md: trainer_learnability --publish-dtype)")
    publish_deltas: bool = Field(True, description="publish each version as what changed "
                                 "since the last one published to the same agent (a sparse "
                                 "delta per tensor where smaller; costs one copy of the model "
                                 "in the publish dtype, on the training device: with --device "
                                 "cuda in GPU memory, next to the version's own snapshot, "
                                 "except under ZeRO-3, in host memory); "
                                 "off: every version dense")
    # shards is the default because it measured faster on 2 ranks (bench/trainer_publish.py:
    # the version held 1.27x sooner at ZeRO-2, 1.56x at ZeRO-3, where it also blocks the
    # trainer 7x less: no gather). One rank always publishes the whole model.
    publish_mode: Literal["gather", "shards"] = Field(
        "shards", description="with several ranks: every rank publishes its own flat shard and "
        "the agent joins them (shards; no ZeRO-3 gather), or rank 0 gathers the model and "
        "publishes it (gather)")
    instance_cap: Literal["off", "auto"] = Field(
        "off", description="auto: after each step write the job's spot-instance cap N_prem "
        "(RLBoost Algorithm 1) to etcd for the manager and an autoscaler")
    no_worker_deadline_s: float = Field(120.0, ge=0, description="how long a request may wait "
                                        "for a worker holding the step's version")
    step_attempts: int = Field(3, ge=1, description="tries of one step when its rollout fails")
    checkpoint_dir: str = Field("", description="where checkpoints go; empty = no checkpoints "
                                                "and no resume")
    tensorboard_dir: str = Field("", description="write training curves as TensorBoard event "
                                                 "files here; empty = none")
    wandb_project: str = Field("", description="log training curves to this W&B project (needs "
                                               "wandb installed); WANDB_PROJECT works too")
    checkpoint_every: int = Field(5, ge=1, description="K: checkpoint every K steps")
    keep_checkpoints: int = Field(3, ge=1)
    keep_step_summaries: int = Field(1000, ge=1, description="finished steps GetStatus reports")
    exit_when_done: bool = Field(True, description="exit after the last step; off, keep serving "
                                                   "status until SIGTERM")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default")
    resume_wait_s: float = Field(60.0, ge=0, description="when the step's manager dies: "
                                 "seconds to wait for its successor (another incarnation in "
                                 "etcd), which gets the unfinished requests with the tokens "
                                 "already streamed; then the step is retried whole. Short "
                                 "rounds of tail batching are always retried whole")
    borrow_lent_threads: int = Field(0, ge=0, description="RollPacker's stream scaling (a "
                                     "manager with --stream-scaling): intra-op threads the "
                                     "training thread adds per rollout worker lent to training, "
                                     "for the rest of the step; for workers on this machine. "
                                     "0 = off")
    placement_scheduler: bool = Field(False, description="WEAVE: submit the job to the "
                                      "placement scheduler for the run and run every rollout "
                                      "and training phase under its permits")
    placement_endpoint: str = Field("", description="the scheduler's host:port; empty = its "
                                    "elected leader, found in etcd")
    placement_t_roll_s: float = Field(0.0, ge=0, description="0 with --placement-t-train-s 0: "
                                      "measured at start-up (warmup_profile.py); else the "
                                      "job's worst-case rollout "
                                      "phase in seconds (Algorithm 1's T_roll)")
    placement_t_train_s: float = Field(0.0, ge=0, description="the job's worst-case training "
                                       "phase in seconds (T_train)")
    placement_slo: float = Field(1.5, ge=1, description="the slowdown of an iteration against "
                                 "running solo the job accepts")
    placement_rollout_nodes: int = Field(1, ge=1, description="rollout nodes the job needs")
    placement_train_nodes: int = Field(1, ge=1, description="training nodes the job needs")
    placement_progress_s: float = Field(0.5, ge=0, description="how often a placed rollout "
                                        "reports its progress, so the scheduler's long-tail "
                                        "migration can fire; 0 = never")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    shutdown_grace: float = Field(5.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = True

    @model_validator(mode="after")
    def _device_present(self) -> TrainerConfig:
        # Checked with the config: a GPU flag on a machine without one exits 2 at once.
        if self.device != "cpu":
            from rlharvest.common.engine_device import resolve

            resolve(self.device, "float32")
        return self

    @model_validator(mode="after")
    def _placement_fits(self) -> TrainerConfig:
        if not self.placement_scheduler:
            return self
        if bool(self.placement_t_roll_s) != bool(self.placement_t_train_s):
            raise ValueError("--placement-scheduler takes both worst-case phase durations "
                             "(--placement-t-roll-s and --placement-t-train-s) or neither (the "
                             "trainer then measures its profile at start-up)")
        if self.seed_role:
            raise ValueError("--placement-scheduler and --seed-role exclude each other: the "
                             "seed role rolls out on the training node, which the scheduler "
                             "hands to other jobs' training phases")
        return self

    @model_validator(mode="after")
    def _env_fits(self) -> TrainerConfig:
        if not self.env:
            return self
        if self.seed_role and self.seed_max_len < self.env_context:
            raise ValueError(f"--seed-max-len {self.seed_max_len} is shorter than --env-context "
                             f"{self.env_context}: the seed engine could not take a trajectory's "
                             "later turns; raise --seed-max-len or lower --env-context")
        from rlharvest.services.trainer.environments.catalog import load_environment
        from rlharvest.services.trainer.environments.interface import takes_task

        env = load_environment(self.env)  # a bad name fails here, naming the key
        if self.data and not takes_task(env):
            raise ValueError(f"--env {self.env} plays its own episodes (its reset takes no "
                             "task), so --data would be ignored; use an environment whose "
                             "reset(seed, task) plays dataset items, e.g. --env calculator")
        return self

    @model_validator(mode="after")
    def _micro_batch_fits(self) -> TrainerConfig:
        if self.micro_batch_groups > self.prompts_per_step:
            raise ValueError(f"micro_batch_groups ({self.micro_batch_groups}) exceeds "
                             f"prompts_per_step ({self.prompts_per_step}): a micro-batch would "
                             "wait for groups the step does not have")
        return self

    @model_validator(mode="after")
    def _one_source_of_prompts(self) -> TrainerConfig:
        if self.data and self.task != "addition":
            raise ValueError(f"--data {self.data!r} and --task {self.task} both name the prompts; "
                             "give one (a dataset's rewards come from --reward or its data_source)")
        if self.data_fields and not self.data:
            raise ValueError("--data-fields maps the fields of a --data file; give --data too")
        if self.reward and self.reward_fn and self.reward != self.reward_fn:
            raise ValueError(f"--reward {self.reward!r} and --reward-fn {self.reward_fn!r} both "
                             "set the reward; give one")
        return self

    def reward_timeout_of(self, kind: str) -> float:
        """The timeout of rewards of ``kind`` (a built-in reward or task name). Where the
        built-in code reward scores ``code`` samples, their timeout is by default at least its
        worst case (``code_reward_worst_s``): a shorter one would score correct programs 0."""
        given = parse_timeouts(self.reward_timeouts)
        if kind in given:
            return given[kind]
        if kind == "code" and self.builtin_code_reward_may_run:
            return max(self.reward_timeout_s, code_reward_worst_s())
        return self.reward_timeout_s

    @property
    def builtin_code_reward_may_run(self) -> bool:
        """Whether the built-in code reward (test cases in the sandbox, one after another) may
        score some sample: ``--reward code``, or a dataset whose rows pick their reward by
        data_source (codecontests, apps, ... pick it). ``--task code`` alone runs the task's
        own reward, one sandbox run per sample."""
        spec = self.reward or self.reward_fn
        return spec == "code" or (bool(self.data) and not spec)

    @model_validator(mode="after")
    def _seed_role_fits(self) -> TrainerConfig:
        if self.seed_role and (self.instance_cap != "auto" or not self.publish):
            raise ValueError("--seed-role needs --instance-cap auto (Algorithm 1 sets T_seed) "
                             "and publishing (the seed engine holds the step's version)")
        return self

    @model_validator(mode="after")
    def _reward_timeouts_parse(self) -> TrainerConfig:
        parse_timeouts(self.reward_timeouts)
        return self

    @model_validator(mode="after")
    def _sandbox_timeouts_fit(self) -> TrainerConfig:
        if self.sandbox_t_min_s > self.sandbox_t_max_s:
            raise ValueError(f"sandbox_t_min_s ({self.sandbox_t_min_s}) exceeds sandbox_t_max_s "
                             f"({self.sandbox_t_max_s})")
        code_timeout = self.reward_timeout_of("code")
        if self.task == "code" and code_timeout <= self.sandbox_t_max_s:
            # The pool would abandon a run the sandbox is still allowed to finish.
            raise ValueError(f"the code reward's timeout ({code_timeout}) must exceed "
                             f"sandbox_t_max_s ({self.sandbox_t_max_s}) for the code task")
        # Checked here, from the flags alone, rather than once the dataset's rows are read: that
        # a row may name the code reward is known now, so a run exits 2 at once instead of
        # scoring every correct but slow program 0 for hours. Only a per-kind code timeout
        # given by the user can fall short (the default covers the worst case).
        if not self.builtin_code_reward_may_run:
            return self
        from rlharvest.services.trainer.rewards.builtin import MAX_CODE_CASES

        worst = code_reward_worst_s()
        if code_timeout < worst:
            source = "--reward code" if (self.reward or self.reward_fn) else \
                f"--data {self.data} (rows may pick the code reward by data_source)"
            raise ValueError(
                f"the code reward's timeout ({code_timeout:g} s) cannot cover its worst case with "
                f"{source}: up to {MAX_CODE_CASES} test cases run one after another, "
                f"{worst:g} s in all; give --reward-timeouts code={math.ceil(worst)} or more")
        return self


def code_reward_worst_s() -> float:
    """Seconds one call of the built-in code reward may take (rewards/builtin.py)."""
    # Imported here: the config is read by processes that never score a reward.
    from rlharvest.services.trainer.rewards.builtin import CODE_REWARD_WORST_S

    return CODE_REWARD_WORST_S

