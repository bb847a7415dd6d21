from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_KIND_UNSPECIFIED: _ClassVar[WorkerKind]
    WORKER_KIND_DEDICATED: _ClassVar[WorkerKind]
    WORKER_KIND_SPOT: _ClassVar[WorkerKind]
    WORKER_KIND_SEED: _ClassVar[WorkerKind]
    WORKER_KIND_SERVING: _ClassVar[WorkerKind]
WORKER_KIND_UNSPECIFIED: WorkerKind
WORKER_KIND_DEDICATED: WorkerKind
WORKER_KIND_SPOT: WorkerKind
WORKER_KIND_SEED: WorkerKind
WORKER_KIND_SERVING: WorkerKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class DeltaBatch(_message.Message):
    __slots__ = ("requests", "positions", "counts", "token_ids", "logprobs", "weight_version", "ends", "job")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    requests: bytes
    positions: bytes
    counts: bytes
    token_ids: bytes
    logprobs: bytes
    weight_version: int
    ends: _containers.RepeatedCompositeFieldContainer[RowEnd]
    job: str
    def __init__(self, requests: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., counts: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., weight_version: _Optional[int] = ..., ends: _Optional[_Iterable[_Union[RowEnd, _Mapping]]] = ..., job: _Optional[str] = ...) -> None: ...

class RowEnd(_message.Message):
    __slots__ = ("row", "reason")
    ROW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    row: int
    reason: str
    def __init__(self, row: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("pending", "executing", "kv_used_tokens", "kv_capacity_tokens", "weight_version", "tokens_per_second", "preemptions")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    EXECUTING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    pending: int
    executing: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    weight_version: int
    tokens_per_second: float
    preemptions: int
    def __init__(self, pending: _Optional[int] = ..., executing: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., weight_version: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., preemptions: _Optional[int] = ...) -> None: ...
