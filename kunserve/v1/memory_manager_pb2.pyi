from kunserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceLongRequestRequest(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: int
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class PlaceLongRequestReply(_message.Message):
    __slots__ = ("action", "worker_id", "max_tokens", "reason", "scale_up")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[PlaceLongRequestReply.Action]
        ROUTE: _ClassVar[PlaceLongRequestReply.Action]
        WAIT: _ClassVar[PlaceLongRequestReply.Action]
        REFUSE: _ClassVar[PlaceLongRequestReply.Action]
    ACTION_UNSPECIFIED: PlaceLongRequestReply.Action
    ROUTE: PlaceLongRequestReply.Action
    WAIT: PlaceLongRequestReply.Action
    REFUSE: PlaceLongRequestReply.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCALE_UP_FIELD_NUMBER: _ClassVar[int]
    action: PlaceLongRequestReply.Action
    worker_id: str
    max_tokens: int
    reason: str
    scale_up: TPReport
    def __init__(self, action: _Optional[_Union[PlaceLongRequestReply.Action, str]] = ..., worker_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., scale_up: _Optional[_Union[TPReport, _Mapping]] = ...) -> None: ...

class TransformTPRequest(_message.Message):
    __slots__ = ("worker_ids", "degree", "mode")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    DEGREE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    degree: int
    mode: str
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., degree: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class SplitTPRequest(_message.Message):
    __slots__ = ("worker_id", "mode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    mode: str
    def __init__(self, worker_id: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class TPInstance(_message.Message):
    __slots__ = ("members", "kv_blocks", "kv_tokens")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    kv_blocks: int
    kv_tokens: int
    def __init__(self, members: _Optional[_Iterable[str]] = ..., kv_blocks: _Optional[int] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class TPReport(_message.Message):
    __slots__ = ("op", "completed", "healed", "error", "members", "degree", "before", "after", "total_seconds", "epoch", "port", "handed_over", "mode")
    OP_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    HEALED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DEGREE_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    op: str
    completed: bool
    healed: bool
    error: str
    members: _containers.RepeatedScalarFieldContainer[str]
    degree: int
    before: _containers.RepeatedCompositeFieldContainer[TPInstance]
    after: _containers.RepeatedCompositeFieldContainer[TPInstance]
    total_seconds: float
    epoch: int
    port: int
    handed_over: int
    mode: str
    def __init__(self, op: _Optional[str] = ..., completed: _Optional[bool] = ..., healed: _Optional[bool] = ..., error: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., degree: _Optional[int] = ..., before: _Optional[_Iterable[_Union[TPInstance, _Mapping]]] = ..., after: _Optional[_Iterable[_Union[TPInstance, _Mapping]]] = ..., total_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., port: _Optional[int] = ..., handed_over: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class ModelFingerprint(_message.Message):
    __slots__ = ("model_name", "architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "max_model_len", "dtype", "checkpoint")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype: str
    checkpoint: str
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "model", "standby", "members_version", "kv_blocks_total", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model: ModelFingerprint
    standby: bool
    members_version: int
    kv_blocks_total: int
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., standby: _Optional[bool] = ..., members_version: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("seed", "members_version", "members", "heartbeat_s", "removed")
    SEED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    seed: bool
    members_version: int
    members: _containers.RepeatedScalarFieldContainer[str]
    heartbeat_s: float
    removed: bool
    def __init__(self, seed: _Optional[bool] = ..., members_version: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., heartbeat_s: _Optional[float] = ..., removed: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "reason", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("src_worker", "dst_worker", "blocks")
    SRC_WORKER_FIELD_NUMBER: _ClassVar[int]
    DST_WORKER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    src_worker: str
    dst_worker: str
    blocks: int
    def __init__(self, src_worker: _Optional[str] = ..., dst_worker: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class GroupMembers(_message.Message):
    __slots__ = ("worker_ids",)
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("required_blocks", "required_bytes", "groups", "reason")
    REQUIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    required_blocks: int
    required_bytes: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupMembers]
    reason: str
    def __init__(self, required_blocks: _Optional[int] = ..., required_bytes: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupMembers, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class PlannedGroup(_message.Message):
    __slots__ = ("group_id", "members", "changed")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    members: _containers.RepeatedCompositeFieldContainer[WorkerLayout]
    changed: bool
    def __init__(self, group_id: _Optional[str] = ..., members: _Optional[_Iterable[_Union[WorkerLayout, _Mapping]]] = ..., changed: _Optional[bool] = ...) -> None: ...

class DropPlanReply(_message.Message):
    __slots__ = ("met", "autoscale_needed", "fallback", "required_bytes", "freed_bytes", "freed_blocks", "groups", "epoch")
    MET_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_NEEDED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    met: bool
    autoscale_needed: bool
    fallback: str
    required_bytes: int
    freed_bytes: int
    freed_blocks: int
    groups: _containers.RepeatedCompositeFieldContainer[PlannedGroup]
    epoch: int
    def __init__(self, met: _Optional[bool] = ..., autoscale_needed: _Optional[bool] = ..., fallback: _Optional[str] = ..., required_bytes: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., freed_blocks: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[PlannedGroup, _Mapping]]] = ..., epoch: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class TransitionReport(_message.Message):
    __slots__ = ("op", "epoch", "completed", "rolled_back", "error", "groups", "requests_moved", "kv_bytes_moved", "plan_seconds", "prepare_seconds", "exchange_seconds", "remap_seconds", "total_seconds", "autoscale_needed", "kv_in_background", "weight_bytes_from_peers", "weight_bytes_from_host", "weight_bytes_from_checkpoint", "pause_seconds")
    OP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    PLAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REMAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_NEEDED_FIELD_NUMBER: _ClassVar[int]
    KV_IN_BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_PEERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_HOST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    op: str
    epoch: int
    completed: bool
    rolled_back: bool
    error: str
    groups: _containers.RepeatedCompositeFieldContainer[PlannedGroup]
    requests_moved: int
    kv_bytes_moved: int
    plan_seconds: float
    prepare_seconds: float
    exchange_seconds: float
    remap_seconds: float
    total_seconds: float
    autoscale_needed: bool
    kv_in_background: bool
    weight_bytes_from_peers: int
    weight_bytes_from_host: int
    weight_bytes_from_checkpoint: int
    pause_seconds: float
    def __init__(self, op: _Optional[str] = ..., epoch: _Optional[int] = ..., completed: _Optional[bool] = ..., rolled_back: _Optional[bool] = ..., error: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[PlannedGroup, _Mapping]]] = ..., requests_moved: _Optional[int] = ..., kv_bytes_moved: _Optional[int] = ..., plan_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ..., exchange_seconds: _Optional[float] = ..., remap_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., autoscale_needed: _Optional[bool] = ..., kv_in_background: _Optional[bool] = ..., weight_bytes_from_peers: _Optional[int] = ..., weight_bytes_from_host: _Optional[int] = ..., weight_bytes_from_checkpoint: _Optional[int] = ..., pause_seconds: _Optional[float] = ...) -> None: ...

class WorkerLayout(_message.Message):
    __slots__ = ("worker_id", "address", "layer_start", "layer_end", "group_id", "reachable", "transfer_address", "serving", "joined", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    layer_start: int
    layer_end: int
    group_id: str
    reachable: bool
    transfer_address: str
    serving: bool
    joined: bool
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., group_id: _Optional[str] = ..., reachable: _Optional[bool] = ..., transfer_address: _Optional[str] = ..., serving: _Optional[bool] = ..., joined: _Optional[bool] = ..., draining: _Optional[bool] = ...) -> None: ...

class StandbyWorker(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class AutoscaleState(_message.Message):
    __slots__ = ("scaler", "needed", "needed_for_s", "pending", "standby_available", "last_action", "last_error")
    SCALER_FIELD_NUMBER: _ClassVar[int]
    NEEDED_FIELD_NUMBER: _ClassVar[int]
    NEEDED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    STANDBY_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    scaler: str
    needed: bool
    needed_for_s: float
    pending: int
    standby_available: int
    last_action: str
    last_error: str
    def __init__(self, scaler: _Optional[str] = ..., needed: _Optional[bool] = ..., needed_for_s: _Optional[float] = ..., pending: _Optional[int] = ..., standby_available: _Optional[int] = ..., last_action: _Optional[str] = ..., last_error: _Optional[str] = ...) -> None: ...

class ClusterLayout(_message.Message):
    __slots__ = ("epoch", "num_layers_model", "workers", "members_version", "standby", "autoscale", "members_settled")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_SETTLED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_layers_model: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerLayout]
    members_version: int
    standby: _containers.RepeatedCompositeFieldContainer[StandbyWorker]
    autoscale: AutoscaleState
    members_settled: bool
    def __init__(self, epoch: _Optional[int] = ..., num_layers_model: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerLayout, _Mapping]]] = ..., members_version: _Optional[int] = ..., standby: _Optional[_Iterable[_Union[StandbyWorker, _Mapping]]] = ..., autoscale: _Optional[_Union[AutoscaleState, _Mapping]] = ..., members_settled: _Optional[bool] = ...) -> None: ...
