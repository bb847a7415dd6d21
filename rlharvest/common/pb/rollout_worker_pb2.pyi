from rlharvest.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "generated_token_ids", "sampling", "weight_version", "handle", "job", "start_weights")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    START_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    weight_version: int
    handle: int
    job: str
    start_weights: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., weight_version: _Optional[int] = ..., handle: _Optional[int] = ..., job: _Optional[str] = ..., start_weights: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("add", "abort")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequest
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class EngineStepStats(_message.Message):
    __slots__ = ("batch_size", "duration_s", "decode_tokens", "prefill_tokens")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    duration_s: float
    decode_tokens: int
    prefill_tokens: int
    def __init__(self, batch_size: _Optional[int] = ..., duration_s: _Optional[float] = ..., decode_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("step", "batch", "load", "stats")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch: _common_pb2.DeltaBatch
    load: _common_pb2.Load
    stats: EngineStepStats
    def __init__(self, step: _Optional[int] = ..., batch: _Optional[_Union[_common_pb2.DeltaBatch, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.Load, _Mapping]] = ..., stats: _Optional[_Union[EngineStepStats, _Mapping]] = ...) -> None: ...

class CommandError(_message.Message):
    __slots__ = ("request_id", "code", "message", "handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    handle: int
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., handle: _Optional[int] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ("deadline_unix", "reason")
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    deadline_unix: float
    reason: str
    def __init__(self, deadline_unix: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class KeptRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("step", "load", "error", "draining", "kept")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    step: StepOutputs
    load: _common_pb2.Load
    error: CommandError
    draining: Draining
    kept: KeptRequests
    def __init__(self, step: _Optional[_Union[StepOutputs, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.Load, _Mapping]] = ..., error: _Optional[_Union[CommandError, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ..., kept: _Optional[_Union[KeptRequests, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "endpoint", "model", "kind", "capacity", "max_len", "vocab_size", "weight_version", "load", "draining", "job", "start_weights")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    START_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    model: str
    kind: _common_pb2.WorkerKind
    capacity: int
    max_len: int
    vocab_size: int
    weight_version: int
    load: _common_pb2.Load
    draining: bool
    job: str
    start_weights: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.WorkerKind, str]] = ..., capacity: _Optional[int] = ..., max_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., weight_version: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.Load, _Mapping]] = ..., draining: _Optional[bool] = ..., job: _Optional[str] = ..., start_weights: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("path", "version", "job")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    job: str
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "tensors_loaded")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_LOADED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    tensors_loaded: int
    def __init__(self, weight_version: _Optional[int] = ..., tensors_loaded: _Optional[int] = ...) -> None: ...
