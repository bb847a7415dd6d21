from rlharvest.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutRequest(_message.Message):
    __slots__ = ("request_id", "group_id", "prompt_token_ids", "sampling", "resume_token_ids", "resume_logprobs", "trajectory_id", "turn", "last_turn")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    LAST_TURN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_logprobs: _containers.RepeatedScalarFieldContainer[float]
    trajectory_id: str
    turn: int
    last_turn: bool
    def __init__(self, request_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_logprobs: _Optional[_Iterable[float]] = ..., trajectory_id: _Optional[str] = ..., turn: _Optional[int] = ..., last_turn: _Optional[bool] = ...) -> None: ...

class SubmitStepRequest(_message.Message):
    __slots__ = ("step_id", "weight_version", "requests", "no_worker_deadline_s", "acceptance", "seed_window_s")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NO_WORKER_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    SEED_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    weight_version: int
    requests: _containers.RepeatedCompositeFieldContainer[RolloutRequest]
    no_worker_deadline_s: float
    acceptance: Acceptance
    seed_window_s: float
    def __init__(self, step_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RolloutRequest, _Mapping]]] = ..., no_worker_deadline_s: _Optional[float] = ..., acceptance: _Optional[_Union[Acceptance, _Mapping]] = ..., seed_window_s: _Optional[float] = ...) -> None: ...

class SeedWindowRequest(_message.Message):
    __slots__ = ("step_id", "window_s", "end")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    window_s: float
    end: bool
    def __init__(self, step_id: _Optional[str] = ..., window_s: _Optional[float] = ..., end: _Optional[bool] = ...) -> None: ...

class SeedWindowEvent(_message.Message):
    __slots__ = ("seed_worker_ids", "remote")
    SEED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    seed_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    remote: RemoteTimings
    def __init__(self, seed_worker_ids: _Optional[_Iterable[str]] = ..., remote: _Optional[_Union[RemoteTimings, _Mapping]] = ...) -> None: ...

class Acceptance(_message.Message):
    __slots__ = ("prompts", "responses")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    prompts: int
    responses: int
    def __init__(self, prompts: _Optional[int] = ..., responses: _Optional[int] = ...) -> None: ...

class GroupVerdict(_message.Message):
    __slots__ = ("group_id", "accepted")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    accepted: bool
    def __init__(self, group_id: _Optional[str] = ..., accepted: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request", "weight_version", "no_worker_deadline_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NO_WORKER_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    request: RolloutRequest
    weight_version: int
    no_worker_deadline_s: float
    def __init__(self, request: _Optional[_Union[RolloutRequest, _Mapping]] = ..., weight_version: _Optional[int] = ..., no_worker_deadline_s: _Optional[float] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "group_id", "token_ids", "logprobs", "weight_version", "finish_reason", "failed", "migrations", "cancelled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    finish_reason: str
    failed: bool
    migrations: int
    cancelled: bool
    def __init__(self, request_id: _Optional[str] = ..., group_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., finish_reason: _Optional[str] = ..., failed: _Optional[bool] = ..., migrations: _Optional[int] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("batch", "completions", "remote", "verdicts")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.DeltaBatch
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    remote: RemoteTimings
    verdicts: _containers.RepeatedCompositeFieldContainer[GroupVerdict]
    def __init__(self, batch: _Optional[_Union[_common_pb2.DeltaBatch, _Mapping]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., remote: _Optional[_Union[RemoteTimings, _Mapping]] = ..., verdicts: _Optional[_Iterable[_Union[GroupVerdict, _Mapping]]] = ...) -> None: ...

class RemoteTimings(_message.Message):
    __slots__ = ("t_remote", "t_remote_wait", "n_prem_mean", "n_prem_next", "instances", "n_available_next")
    T_REMOTE_FIELD_NUMBER: _ClassVar[int]
    T_REMOTE_WAIT_FIELD_NUMBER: _ClassVar[int]
    N_PREM_MEAN_FIELD_NUMBER: _ClassVar[int]
    N_PREM_NEXT_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    N_AVAILABLE_NEXT_FIELD_NUMBER: _ClassVar[int]
    t_remote: float
    t_remote_wait: float
    n_prem_mean: float
    n_prem_next: int
    instances: int
    n_available_next: int
    def __init__(self, t_remote: _Optional[float] = ..., t_remote_wait: _Optional[float] = ..., n_prem_mean: _Optional[float] = ..., n_prem_next: _Optional[int] = ..., instances: _Optional[int] = ..., n_available_next: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WithdrawRequest(_message.Message):
    __slots__ = ("request_ids", "max_requests", "running")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    max_requests: int
    running: bool
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., max_requests: _Optional[int] = ..., running: _Optional[bool] = ...) -> None: ...

class WithdrawReply(_message.Message):
    __slots__ = ("request_ids", "tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "endpoint", "kind", "weight_version", "state", "assigned", "load", "capacity")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    kind: str
    weight_version: int
    state: str
    assigned: int
    load: _common_pb2.Load
    capacity: int
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., kind: _Optional[str] = ..., weight_version: _Optional[int] = ..., state: _Optional[str] = ..., assigned: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.Load, _Mapping]] = ..., capacity: _Optional[int] = ...) -> None: ...

class ManagerStatus(_message.Message):
    __slots__ = ("workers", "in_flight", "waiting", "tokens_generated", "tokens_regenerated", "migrations", "completions", "failures", "last_step_remote")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REGENERATED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_REMOTE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    in_flight: int
    waiting: int
    tokens_generated: int
    tokens_regenerated: int
    migrations: int
    completions: int
    failures: int
    last_step_remote: RemoteTimings
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., in_flight: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., tokens_regenerated: _Optional[int] = ..., migrations: _Optional[int] = ..., completions: _Optional[int] = ..., failures: _Optional[int] = ..., last_step_remote: _Optional[_Union[RemoteTimings, _Mapping]] = ...) -> None: ...
