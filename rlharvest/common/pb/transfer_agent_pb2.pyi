from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishHeader(_message.Message):
    __slots__ = ("job", "version", "manifest_json", "tp_rank", "tp_size", "dp_rank", "dp_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    version: int
    manifest_json: str
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    def __init__(self, job: _Optional[str] = ..., version: _Optional[int] = ..., manifest_json: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    chunk: BucketChunk
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., chunk: _Optional[_Union[BucketChunk, _Mapping]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("version", "held_versions", "evicted_versions", "shards_missing")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_MISSING_FIELD_NUMBER: _ClassVar[int]
    version: int
    held_versions: _containers.RepeatedScalarFieldContainer[int]
    evicted_versions: _containers.RepeatedScalarFieldContainer[int]
    shards_missing: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., held_versions: _Optional[_Iterable[int]] = ..., evicted_versions: _Optional[_Iterable[int]] = ..., shards_missing: _Optional[_Iterable[int]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("job", "version", "has_holding", "holding", "tp_rank", "tp_size", "names", "requester_cluster", "inline_max_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_HOLDING_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    version: int
    has_holding: bool
    holding: int
    tp_rank: int
    tp_size: int
    names: _containers.RepeatedScalarFieldContainer[str]
    requester_cluster: str
    inline_max_bytes: int
    def __init__(self, job: _Optional[str] = ..., version: _Optional[int] = ..., has_holding: _Optional[bool] = ..., holding: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., requester_cluster: _Optional[str] = ..., inline_max_bytes: _Optional[int] = ...) -> None: ...

class PullPlan(_message.Message):
    __slots__ = ("manifest_json", "version", "note", "payload_bytes", "dense_bytes", "delta_tensors", "plan_id", "inline_buckets")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DENSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    INLINE_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    version: int
    note: str
    payload_bytes: int
    dense_bytes: int
    delta_tensors: int
    plan_id: int
    inline_buckets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, manifest_json: _Optional[str] = ..., version: _Optional[int] = ..., note: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., dense_bytes: _Optional[int] = ..., delta_tensors: _Optional[int] = ..., plan_id: _Optional[int] = ..., inline_buckets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BucketsRequest(_message.Message):
    __slots__ = ("pull", "buckets", "plan_id")
    PULL_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    buckets: _containers.RepeatedScalarFieldContainer[int]
    plan_id: int
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., buckets: _Optional[_Iterable[int]] = ..., plan_id: _Optional[int] = ...) -> None: ...

class BucketChunk(_message.Message):
    __slots__ = ("bucket", "offset", "data")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    offset: int
    data: bytes
    def __init__(self, bucket: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobVersions(_message.Message):
    __slots__ = ("job", "held_versions", "latest", "held_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    held_versions: _containers.RepeatedScalarFieldContainer[int]
    latest: int
    held_bytes: int
    def __init__(self, job: _Optional[str] = ..., held_versions: _Optional[_Iterable[int]] = ..., latest: _Optional[int] = ..., held_bytes: _Optional[int] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("agent_id", "node", "cluster", "jobs")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    node: str
    cluster: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobVersions]
    def __init__(self, agent_id: _Optional[str] = ..., node: _Optional[str] = ..., cluster: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobVersions, _Mapping]]] = ...) -> None: ...
