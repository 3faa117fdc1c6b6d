from kunserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(_message.Message):
    __slots__ = ("stats", "healthy", "last_report_age_s", "kv_usage", "prompt_tokens_per_s", "generated_tokens_per_s")
    STATS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    stats: _common_pb2.WorkerStats
    healthy: bool
    last_report_age_s: float
    kv_usage: float
    prompt_tokens_per_s: float
    generated_tokens_per_s: float
    def __init__(self, stats: _Optional[_Union[_common_pb2.WorkerStats, _Mapping]] = ..., healthy: _Optional[bool] = ..., last_report_age_s: _Optional[float] = ..., kv_usage: _Optional[float] = ..., prompt_tokens_per_s: _Optional[float] = ..., generated_tokens_per_s: _Optional[float] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "kv_blocks_total", "kv_blocks_used", "queued_demand_blocks", "overloaded", "timestamp_unix_s")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_DEMAND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OVERLOADED_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    kv_blocks_total: int
    kv_blocks_used: int
    queued_demand_blocks: int
    overloaded: bool
    timestamp_unix_s: float
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., queued_demand_blocks: _Optional[int] = ..., overloaded: _Optional[bool] = ..., timestamp_unix_s: _Optional[float] = ...) -> None: ...
