from kunserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerLayout(_message.Message):
    __slots__ = ("worker_id", "address", "layer_start", "layer_end", "group_id", "reachable")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    layer_start: int
    layer_end: int
    group_id: str
    reachable: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., group_id: _Optional[str] = ..., reachable: _Optional[bool] = ...) -> None: ...

class ClusterLayout(_message.Message):
    __slots__ = ("epoch", "num_layers_model", "workers")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_layers_model: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerLayout]
    def __init__(self, epoch: _Optional[int] = ..., num_layers_model: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerLayout, _Mapping]]] = ...) -> None: ...
