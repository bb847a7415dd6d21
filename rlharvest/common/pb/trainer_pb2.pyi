from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatusRequest(_message.Message):
    __slots__ = ("last_steps",)
    LAST_STEPS_FIELD_NUMBER: _ClassVar[int]
    last_steps: int
    def __init__(self, last_steps: _Optional[int] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("step", "weight_version", "mean_reward", "step_time_s", "tokens", "tokens_per_second", "migrations", "micro_batches", "micro_batch_wait_s", "loss", "grad_norm", "publish_s", "published_version", "train_compute_s", "n_prem", "t_seed_s", "round", "prompts_launched", "prompts_deferred", "tokens_discarded", "rollout_s", "rewards_s", "rollout_digest", "published_changed", "published_payload_ratio")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAIN_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    N_PREM_FIELD_NUMBER: _ClassVar[int]
    T_SEED_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_S_FIELD_NUMBER: _ClassVar[int]
    REWARDS_S_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_CHANGED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_PAYLOAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    mean_reward: float
    step_time_s: float
    tokens: int
    tokens_per_second: float
    migrations: int
    micro_batches: int
    micro_batch_wait_s: float
    loss: float
    grad_norm: float
    publish_s: float
    published_version: int
    train_compute_s: float
    n_prem: int
    t_seed_s: float
    round: str
    prompts_launched: int
    prompts_deferred: int
    tokens_discarded: int
    rollout_s: float
    rewards_s: float
    rollout_digest: str
    published_changed: float
    published_payload_ratio: float
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., mean_reward: _Optional[float] = ..., step_time_s: _Optional[float] = ..., tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., migrations: _Optional[int] = ..., micro_batches: _Optional[int] = ..., micro_batch_wait_s: _Optional[float] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., publish_s: _Optional[float] = ..., published_version: _Optional[int] = ..., train_compute_s: _Optional[float] = ..., n_prem: _Optional[int] = ..., t_seed_s: _Optional[float] = ..., round: _Optional[str] = ..., prompts_launched: _Optional[int] = ..., prompts_deferred: _Optional[int] = ..., tokens_discarded: _Optional[int] = ..., rollout_s: _Optional[float] = ..., rewards_s: _Optional[float] = ..., rollout_digest: _Optional[str] = ..., published_changed: _Optional[float] = ..., published_payload_ratio: _Optional[float] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("step", "weight_version", "samples", "completions", "groups_trained", "tokens_generated", "phase")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    samples: int
    completions: int
    groups_trained: int
    tokens_generated: int
    phase: str
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., samples: _Optional[int] = ..., completions: _Optional[int] = ..., groups_trained: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("trainer_id", "job", "state", "steps_done", "target_steps", "weight_version", "resumed_from_step", "current", "steps", "error")
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    trainer_id: str
    job: str
    state: str
    steps_done: int
    target_steps: int
    weight_version: int
    resumed_from_step: int
    current: StepProgress
    steps: _containers.RepeatedCompositeFieldContainer[StepSummary]
    error: str
    def __init__(self, trainer_id: _Optional[str] = ..., job: _Optional[str] = ..., state: _Optional[str] = ..., steps_done: _Optional[int] = ..., target_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., resumed_from_step: _Optional[int] = ..., current: _Optional[_Union[StepProgress, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...
