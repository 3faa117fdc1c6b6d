from kunserve.v1 import common_pb2 as _common_pb2
from kunserve.v1 import monitor_pb2 as _monitor_pb2
from kunserve.v1 import memory_manager_pb2 as _memory_manager_pb2
from kunserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRef(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class WorkerLayersRequest(_message.Message):
    __slots__ = ("worker_id", "layers", "source")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    source: str
    def __init__(self, worker_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., source: _Optional[str] = ...) -> None: ...

class AdminStatus(_message.Message):
    __slots__ = ("cluster", "layout", "monitor_error")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MONITOR_ERROR_FIELD_NUMBER: _ClassVar[int]
    cluster: _monitor_pb2.ClusterStatus
    layout: _memory_manager_pb2.ClusterLayout
    monitor_error: str
    def __init__(self, cluster: _Optional[_Union[_monitor_pb2.ClusterStatus, _Mapping]] = ..., layout: _Optional[_Union[_memory_manager_pb2.ClusterLayout, _Mapping]] = ..., monitor_error: _Optional[str] = ...) -> None: ...
