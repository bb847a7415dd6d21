from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[JobPhase]
    PHASE_ROLLOUT: _ClassVar[JobPhase]
    PHASE_TRAIN: _ClassVar[JobPhase]
PHASE_UNSPECIFIED: JobPhase
PHASE_ROLLOUT: JobPhase
PHASE_TRAIN: JobPhase

class PlacementJobSpec(_message.Message):
    __slots__ = ("job_id", "t_roll_s", "t_train_s", "slo", "rollout_nodes", "train_nodes", "rollout_mem_gb", "train_mem_gb", "profile", "train_state_sharded")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    T_ROLL_S_FIELD_NUMBER: _ClassVar[int]
    T_TRAIN_S_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_NODES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_NODES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_MEM_GB_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MEM_GB_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STATE_SHARDED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    t_roll_s: float
    t_train_s: float
    slo: float
    rollout_nodes: int
    train_nodes: int
    rollout_mem_gb: float
    train_mem_gb: float
    profile: PlacementJobProfile
    train_state_sharded: bool
    def __init__(self, job_id: _Optional[str] = ..., t_roll_s: _Optional[float] = ..., t_train_s: _Optional[float] = ..., slo: _Optional[float] = ..., rollout_nodes: _Optional[int] = ..., train_nodes: _Optional[int] = ..., rollout_mem_gb: _Optional[float] = ..., train_mem_gb: _Optional[float] = ..., profile: _Optional[_Union[PlacementJobProfile, _Mapping]] = ..., train_state_sharded: _Optional[bool] = ...) -> None: ...

class PlacementJobProfile(_message.Message):
    __slots__ = ("batch_size", "prompt_tokens", "max_response_tokens", "decode_s_per_token", "prefill_s", "train_tokens_per_s", "turns", "env_s_per_turn", "sync_s")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    ENV_S_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    SYNC_S_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    prompt_tokens: int
    max_response_tokens: int
    decode_s_per_token: float
    prefill_s: float
    train_tokens_per_s: float
    turns: int
    env_s_per_turn: float
    sync_s: float
    def __init__(self, batch_size: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., max_response_tokens: _Optional[int] = ..., decode_s_per_token: _Optional[float] = ..., prefill_s: _Optional[float] = ..., train_tokens_per_s: _Optional[float] = ..., turns: _Optional[int] = ..., env_s_per_turn: _Optional[float] = ..., sync_s: _Optional[float] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job", "lease_id", "start_iteration")
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    job: PlacementJobSpec
    lease_id: int
    start_iteration: int
    def __init__(self, job: _Optional[_Union[PlacementJobSpec, _Mapping]] = ..., lease_id: _Optional[int] = ..., start_iteration: _Optional[int] = ...) -> None: ...

class JobPlacement(_message.Message):
    __slots__ = ("job_id", "group_id", "strategy", "rollout_node_ids", "train_node_ids", "marginal_cost_per_hour", "predicted_iteration_s", "t_roll_s", "t_train_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MARGINAL_COST_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    T_ROLL_S_FIELD_NUMBER: _ClassVar[int]
    T_TRAIN_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    strategy: str
    rollout_node_ids: _containers.RepeatedScalarFieldContainer[str]
    train_node_ids: _containers.RepeatedScalarFieldContainer[str]
    marginal_cost_per_hour: float
    predicted_iteration_s: float
    t_roll_s: float
    t_train_s: float
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., strategy: _Optional[str] = ..., rollout_node_ids: _Optional[_Iterable[str]] = ..., train_node_ids: _Optional[_Iterable[str]] = ..., marginal_cost_per_hour: _Optional[float] = ..., predicted_iteration_s: _Optional[float] = ..., t_roll_s: _Optional[float] = ..., t_train_s: _Optional[float] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobReply(_message.Message):
    __slots__ = ("released_node_ids",)
    RELEASED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    released_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, released_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class AcquirePermitRequest(_message.Message):
    __slots__ = ("job_id", "phase", "iteration", "wait_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: JobPhase
    iteration: int
    wait_s: float
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[_Union[JobPhase, str]] = ..., iteration: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PhasePermit(_message.Message):
    __slots__ = ("job_id", "phase", "iteration", "node_ids", "pending_node_ids", "granted_at_unix")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: JobPhase
    iteration: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    pending_node_ids: _containers.RepeatedScalarFieldContainer[str]
    granted_at_unix: float
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[_Union[JobPhase, str]] = ..., iteration: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., pending_node_ids: _Optional[_Iterable[str]] = ..., granted_at_unix: _Optional[float] = ...) -> None: ...

class PermitReply(_message.Message):
    __slots__ = ("granted", "permit", "waiting_for")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    PERMIT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    permit: PhasePermit
    waiting_for: str
    def __init__(self, granted: _Optional[bool] = ..., permit: _Optional[_Union[PhasePermit, _Mapping]] = ..., waiting_for: _Optional[str] = ...) -> None: ...

class ReleasePermitRequest(_message.Message):
    __slots__ = ("job_id", "phase", "iteration", "wait_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: JobPhase
    iteration: int
    wait_s: float
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[_Union[JobPhase, str]] = ..., iteration: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ReleasePermitReply(_message.Message):
    __slots__ = ("released", "already_released", "evicted", "message")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_RELEASED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    released: bool
    already_released: bool
    evicted: bool
    message: str
    def __init__(self, released: _Optional[bool] = ..., already_released: _Optional[bool] = ..., evicted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class NodeOpenRequests(_message.Message):
    __slots__ = ("node_id", "unfinished")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    unfinished: int
    def __init__(self, node_id: _Optional[str] = ..., unfinished: _Optional[int] = ...) -> None: ...

class RolloutProgressReport(_message.Message):
    __slots__ = ("job_id", "iteration", "total_responses", "finished_responses", "unfinished_by_node", "requests_per_node")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RESPONSES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_RESPONSES_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    iteration: int
    total_responses: int
    finished_responses: int
    unfinished_by_node: _containers.RepeatedCompositeFieldContainer[NodeOpenRequests]
    requests_per_node: int
    def __init__(self, job_id: _Optional[str] = ..., iteration: _Optional[int] = ..., total_responses: _Optional[int] = ..., finished_responses: _Optional[int] = ..., unfinished_by_node: _Optional[_Iterable[_Union[NodeOpenRequests, _Mapping]]] = ..., requests_per_node: _Optional[int] = ...) -> None: ...

class TailRequestMove(_message.Message):
    __slots__ = ("from_node_id", "to_node_id", "requests")
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    from_node_id: str
    to_node_id: str
    requests: int
    def __init__(self, from_node_id: _Optional[str] = ..., to_node_id: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...

class TailMigration(_message.Message):
    __slots__ = ("keep_node_ids", "freed_node_ids", "moves")
    KEEP_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    FREED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    keep_node_ids: _containers.RepeatedScalarFieldContainer[str]
    freed_node_ids: _containers.RepeatedScalarFieldContainer[str]
    moves: _containers.RepeatedCompositeFieldContainer[TailRequestMove]
    def __init__(self, keep_node_ids: _Optional[_Iterable[str]] = ..., freed_node_ids: _Optional[_Iterable[str]] = ..., moves: _Optional[_Iterable[_Union[TailRequestMove, _Mapping]]] = ...) -> None: ...

class RolloutProgressReply(_message.Message):
    __slots__ = ("migrate", "migration")
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    migrate: bool
    migration: TailMigration
    def __init__(self, migrate: _Optional[bool] = ..., migration: _Optional[_Union[TailMigration, _Mapping]] = ...) -> None: ...

class ListPlacementStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoExecGroup(_message.Message):
    __slots__ = ("group_id", "job_ids", "rollout_node_ids", "train_node_ids", "t_cycle_s", "t_load_s", "saturated", "cost_per_hour")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    T_CYCLE_S_FIELD_NUMBER: _ClassVar[int]
    T_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    SATURATED_FIELD_NUMBER: _ClassVar[int]
    COST_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    rollout_node_ids: _containers.RepeatedScalarFieldContainer[str]
    train_node_ids: _containers.RepeatedScalarFieldContainer[str]
    t_cycle_s: float
    t_load_s: float
    saturated: bool
    cost_per_hour: float
    def __init__(self, group_id: _Optional[str] = ..., job_ids: _Optional[_Iterable[str]] = ..., rollout_node_ids: _Optional[_Iterable[str]] = ..., train_node_ids: _Optional[_Iterable[str]] = ..., t_cycle_s: _Optional[float] = ..., t_load_s: _Optional[float] = ..., saturated: _Optional[bool] = ..., cost_per_hour: _Optional[float] = ...) -> None: ...

class PlacedJob(_message.Message):
    __slots__ = ("job_id", "group_id", "rollout_node_ids", "train_node_ids", "next_phase", "iteration", "status", "held_node_ids", "iterations_done", "slo_attainment")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PHASE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HELD_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_DONE_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    rollout_node_ids: _containers.RepeatedScalarFieldContainer[str]
    train_node_ids: _containers.RepeatedScalarFieldContainer[str]
    next_phase: JobPhase
    iteration: int
    status: str
    held_node_ids: _containers.RepeatedScalarFieldContainer[str]
    iterations_done: int
    slo_attainment: float
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., rollout_node_ids: _Optional[_Iterable[str]] = ..., train_node_ids: _Optional[_Iterable[str]] = ..., next_phase: _Optional[_Union[JobPhase, str]] = ..., iteration: _Optional[int] = ..., status: _Optional[str] = ..., held_node_ids: _Optional[_Iterable[str]] = ..., iterations_done: _Optional[int] = ..., slo_attainment: _Optional[float] = ...) -> None: ...

class NodePhaseQueue(_message.Message):
    __slots__ = ("node_id", "pool", "group_id", "job_ids", "turn", "holder")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    pool: str
    group_id: str
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    turn: str
    holder: str
    def __init__(self, node_id: _Optional[str] = ..., pool: _Optional[str] = ..., group_id: _Optional[str] = ..., job_ids: _Optional[_Iterable[str]] = ..., turn: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class PoolUtilisation(_message.Message):
    __slots__ = ("pool", "gpu", "nodes", "allocated", "busy")
    POOL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    pool: str
    gpu: str
    nodes: int
    allocated: int
    busy: int
    def __init__(self, pool: _Optional[str] = ..., gpu: _Optional[str] = ..., nodes: _Optional[int] = ..., allocated: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class PlacementState(_message.Message):
    __slots__ = ("groups", "jobs", "queues", "pools", "cost_per_hour", "tail_migrations", "bubble_node_seconds_reclaimed", "slo_attainment", "leader", "consolidation_moves")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    TAIL_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_NODE_SECONDS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    CONSOLIDATION_MOVES_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[CoExecGroup]
    jobs: _containers.RepeatedCompositeFieldContainer[PlacedJob]
    queues: _containers.RepeatedCompositeFieldContainer[NodePhaseQueue]
    pools: _containers.RepeatedCompositeFieldContainer[PoolUtilisation]
    cost_per_hour: float
    tail_migrations: int
    bubble_node_seconds_reclaimed: float
    slo_attainment: float
    leader: str
    consolidation_moves: int
    def __init__(self, groups: _Optional[_Iterable[_Union[CoExecGroup, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[PlacedJob, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[NodePhaseQueue, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolUtilisation, _Mapping]]] = ..., cost_per_hour: _Optional[float] = ..., tail_migrations: _Optional[int] = ..., bubble_node_seconds_reclaimed: _Optional[float] = ..., slo_attainment: _Optional[float] = ..., leader: _Optional[str] = ..., consolidation_moves: _Optional[int] = ...) -> None: ...
