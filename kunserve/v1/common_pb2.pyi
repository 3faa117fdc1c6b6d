from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RequestClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_CLASS_ONLINE: _ClassVar[RequestClass]
    REQUEST_CLASS_OFFLINE: _ClassVar[RequestClass]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
REQUEST_CLASS_ONLINE: RequestClass
REQUEST_CLASS_OFFLINE: RequestClass
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORTED: FinishReason

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "stop", "logprobs", "min_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "address", "kv_blocks_total", "kv_blocks_used", "block_size", "num_running", "num_waiting", "queued_demand_blocks", "num_preemptions", "prompt_tokens_total", "generated_tokens_total", "timestamp_unix_s", "layer_start", "layer_end", "num_layers_model", "busy_seconds_total", "idle_seconds_total", "bubble_seconds_total", "bubble_ratio", "serving", "group_id", "group_members", "epoch", "transitioning", "kv_blocks_undropped", "oldest_waiting_age_s", "num_offline_running", "num_offline_waiting", "offline_kv_blocks_used", "offline_queued_demand_blocks", "oldest_online_waiting_age_s", "tp_degree", "tp_members", "reforming")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_DEMAND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_MODEL_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_RATIO_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_UNDROPPED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAITING_AGE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLINE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLINE_WAITING_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_QUEUED_DEMAND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_ONLINE_WAITING_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    TP_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REFORMING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    num_running: int
    num_waiting: int
    queued_demand_blocks: int
    num_preemptions: int
    prompt_tokens_total: int
    generated_tokens_total: int
    timestamp_unix_s: float
    layer_start: int
    layer_end: int
    num_layers_model: int
    busy_seconds_total: float
    idle_seconds_total: float
    bubble_seconds_total: float
    bubble_ratio: float
    serving: bool
    group_id: str
    group_members: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    transitioning: bool
    kv_blocks_undropped: int
    oldest_waiting_age_s: float
    num_offline_running: int
    num_offline_waiting: int
    offline_kv_blocks_used: int
    offline_queued_demand_blocks: int
    oldest_online_waiting_age_s: float
    tp_degree: int
    tp_members: _containers.RepeatedScalarFieldContainer[str]
    reforming: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., block_size: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_demand_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., timestamp_unix_s: _Optional[float] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers_model: _Optional[int] = ..., busy_seconds_total: _Optional[float] = ..., idle_seconds_total: _Optional[float] = ..., bubble_seconds_total: _Optional[float] = ..., bubble_ratio: _Optional[float] = ..., serving: _Optional[bool] = ..., group_id: _Optional[str] = ..., group_members: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., transitioning: _Optional[bool] = ..., kv_blocks_undropped: _Optional[int] = ..., oldest_waiting_age_s: _Optional[float] = ..., num_offline_running: _Optional[int] = ..., num_offline_waiting: _Optional[int] = ..., offline_kv_blocks_used: _Optional[int] = ..., offline_queued_demand_blocks: _Optional[int] = ..., oldest_online_waiting_age_s: _Optional[float] = ..., tp_degree: _Optional[int] = ..., tp_members: _Optional[_Iterable[str]] = ..., reforming: _Optional[bool] = ...) -> None: ...
