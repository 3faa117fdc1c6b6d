from kunserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReformTPRequest(_message.Message):
    __slots__ = ("members", "rank", "port", "host", "rendezvous_timeout_s", "drain_timeout_s", "in_place", "transfer_addresses")
    class TransferAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    port: int
    host: str
    rendezvous_timeout_s: float
    drain_timeout_s: float
    in_place: bool
    transfer_addresses: _containers.ScalarMap[str, str]
    def __init__(self, members: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ..., port: _Optional[int] = ..., host: _Optional[str] = ..., rendezvous_timeout_s: _Optional[float] = ..., drain_timeout_s: _Optional[float] = ..., in_place: _Optional[bool] = ..., transfer_addresses: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReformTPReply(_message.Message):
    __slots__ = ("worker_id", "reforming", "port", "host", "finished", "handed_over")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REFORMING_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reforming: bool
    port: int
    host: str
    finished: int
    handed_over: int
    def __init__(self, worker_id: _Optional[str] = ..., reforming: _Optional[bool] = ..., port: _Optional[int] = ..., host: _Optional[str] = ..., finished: _Optional[int] = ..., handed_over: _Optional[int] = ...) -> None: ...

class ActivateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ActivateReply(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s", "to_standby")
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TO_STANDBY_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    to_standby: bool
    def __init__(self, timeout_s: _Optional[float] = ..., to_standby: _Optional[bool] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("finished", "handed_over", "seconds")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    finished: int
    handed_over: int
    seconds: float
    def __init__(self, finished: _Optional[int] = ..., handed_over: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class UnitMember(_message.Message):
    __slots__ = ("worker_id", "transfer_address", "layer_start", "layer_end")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transfer_address: str
    layer_start: int
    layer_end: int
    def __init__(self, worker_id: _Optional[str] = ..., transfer_address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class Unit(_message.Message):
    __slots__ = ("unit_id", "members", "kv_blocks")
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    unit_id: str
    members: _containers.RepeatedCompositeFieldContainer[UnitMember]
    kv_blocks: int
    def __init__(self, unit_id: _Optional[str] = ..., members: _Optional[_Iterable[_Union[UnitMember, _Mapping]]] = ..., kv_blocks: _Optional[int] = ...) -> None: ...

class SeqState(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "generated_token_ids", "num_computed", "sampling", "generator_state", "num_preemptions", "age_s", "old_blocks", "new_blocks", "old_unit", "new_unit", "request_class")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    OLD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OLD_UNIT_FIELD_NUMBER: _ClassVar[int]
    NEW_UNIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed: int
    sampling: _common_pb2.SamplingParams
    generator_state: bytes
    num_preemptions: int
    age_s: float
    old_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_blocks: _containers.RepeatedScalarFieldContainer[int]
    old_unit: str
    new_unit: str
    request_class: _common_pb2.RequestClass
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., num_computed: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., generator_state: _Optional[bytes] = ..., num_preemptions: _Optional[int] = ..., age_s: _Optional[float] = ..., old_blocks: _Optional[_Iterable[int]] = ..., new_blocks: _Optional[_Iterable[int]] = ..., old_unit: _Optional[str] = ..., new_unit: _Optional[str] = ..., request_class: _Optional[_Union[_common_pb2.RequestClass, str]] = ...) -> None: ...

class TransitionSpec(_message.Message):
    __slots__ = ("epoch", "op", "old_units", "new_units", "seqs", "lease_s", "background_kv")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    OLD_UNITS_FIELD_NUMBER: _ClassVar[int]
    NEW_UNITS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_KV_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    op: str
    old_units: _containers.RepeatedCompositeFieldContainer[Unit]
    new_units: _containers.RepeatedCompositeFieldContainer[Unit]
    seqs: _containers.RepeatedCompositeFieldContainer[SeqState]
    lease_s: float
    background_kv: bool
    def __init__(self, epoch: _Optional[int] = ..., op: _Optional[str] = ..., old_units: _Optional[_Iterable[_Union[Unit, _Mapping]]] = ..., new_units: _Optional[_Iterable[_Union[Unit, _Mapping]]] = ..., seqs: _Optional[_Iterable[_Union[SeqState, _Mapping]]] = ..., lease_s: _Optional[float] = ..., background_kv: _Optional[bool] = ...) -> None: ...

class TransitionRef(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class TransitionLease(_message.Message):
    __slots__ = ("epoch", "expires_in_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    expires_in_s: float
    def __init__(self, epoch: _Optional[int] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class TransitionPrepared(_message.Message):
    __slots__ = ("worker_id", "seqs", "kv_blocks_after", "kv_blocks_now")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_NOW_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seqs: _containers.RepeatedCompositeFieldContainer[SeqState]
    kv_blocks_after: int
    kv_blocks_now: int
    def __init__(self, worker_id: _Optional[str] = ..., seqs: _Optional[_Iterable[_Union[SeqState, _Mapping]]] = ..., kv_blocks_after: _Optional[int] = ..., kv_blocks_now: _Optional[int] = ...) -> None: ...

class TransitionDone(_message.Message):
    __slots__ = ("worker_id", "epoch", "layer_start", "layer_end", "kv_blocks", "bytes_sent", "bytes_received", "gather_seconds", "exchange_seconds", "remap_seconds", "scatter_seconds", "requests_owned", "weight_bytes_sent", "weight_bytes_from_peers", "weight_bytes_from_host", "weight_bytes_from_checkpoint", "paused_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GATHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REMAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCATTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_OWNED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_PEERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_HOST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    layer_start: int
    layer_end: int
    kv_blocks: int
    bytes_sent: int
    bytes_received: int
    gather_seconds: float
    exchange_seconds: float
    remap_seconds: float
    scatter_seconds: float
    requests_owned: int
    weight_bytes_sent: int
    weight_bytes_from_peers: int
    weight_bytes_from_host: int
    weight_bytes_from_checkpoint: int
    paused_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., gather_seconds: _Optional[float] = ..., exchange_seconds: _Optional[float] = ..., remap_seconds: _Optional[float] = ..., scatter_seconds: _Optional[float] = ..., requests_owned: _Optional[int] = ..., weight_bytes_sent: _Optional[int] = ..., weight_bytes_from_peers: _Optional[int] = ..., weight_bytes_from_host: _Optional[int] = ..., weight_bytes_from_checkpoint: _Optional[int] = ..., paused_seconds: _Optional[float] = ...) -> None: ...

class DropLayersRequest(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[_Iterable[int]] = ...) -> None: ...

class RestoreLayersRequest(_message.Message):
    __slots__ = ("layers", "source")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    source: str
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., source: _Optional[str] = ...) -> None: ...

class LayerChange(_message.Message):
    __slots__ = ("op", "layers", "layer_start", "layer_end", "kv_blocks_before", "kv_blocks_after", "pages_unmapped", "pages_mapped", "compaction_moves", "remap_seconds", "fill_seconds", "weight_source", "generation")
    OP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    PAGES_UNMAPPED_FIELD_NUMBER: _ClassVar[int]
    PAGES_MAPPED_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_MOVES_FIELD_NUMBER: _ClassVar[int]
    REMAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    op: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    kv_blocks_before: int
    kv_blocks_after: int
    pages_unmapped: int
    pages_mapped: int
    compaction_moves: int
    remap_seconds: float
    fill_seconds: float
    weight_source: str
    generation: int
    def __init__(self, op: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_blocks_before: _Optional[int] = ..., kv_blocks_after: _Optional[int] = ..., pages_unmapped: _Optional[int] = ..., pages_mapped: _Optional[int] = ..., compaction_moves: _Optional[int] = ..., remap_seconds: _Optional[float] = ..., fill_seconds: _Optional[float] = ..., weight_source: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class LayerMemory(_message.Message):
    __slots__ = ("layer", "weight_pages", "weight_bytes", "kv_pages", "kv_blocks")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    weight_pages: int
    weight_bytes: int
    kv_pages: int
    kv_blocks: int
    def __init__(self, layer: _Optional[int] = ..., weight_pages: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_pages: _Optional[int] = ..., kv_blocks: _Optional[int] = ...) -> None: ...

class WeightGroupMemory(_message.Message):
    __slots__ = ("name", "pages", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    pages: int
    bytes: int
    def __init__(self, name: _Optional[str] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PageRun(_message.Message):
    __slots__ = ("first_page", "count", "owner")
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    first_page: int
    count: int
    owner: str
    def __init__(self, first_page: _Optional[int] = ..., count: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class MemoryMap(_message.Message):
    __slots__ = ("worker_id", "backend", "device", "page_size", "num_pages", "free_pages", "layer_start", "layer_end", "num_layers_model", "weight_pages", "weight_bytes", "block_size", "block_bytes", "kv_pages_per_layer", "kv_blocks", "kv_blocks_used", "kv_capacity_tokens", "kv_capacity_bytes", "layers", "groups", "page_runs", "host_copy_bytes", "generation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PAGE_RUNS_FIELD_NUMBER: _ClassVar[int]
    HOST_COPY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    backend: str
    device: str
    page_size: int
    num_pages: int
    free_pages: int
    layer_start: int
    layer_end: int
    num_layers_model: int
    weight_pages: int
    weight_bytes: int
    block_size: int
    block_bytes: int
    kv_pages_per_layer: int
    kv_blocks: int
    kv_blocks_used: int
    kv_capacity_tokens: int
    kv_capacity_bytes: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerMemory]
    groups: _containers.RepeatedCompositeFieldContainer[WeightGroupMemory]
    page_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    host_copy_bytes: int
    generation: int
    def __init__(self, worker_id: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers_model: _Optional[int] = ..., weight_pages: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., kv_pages_per_layer: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerMemory, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[WeightGroupMemory, _Mapping]]] = ..., page_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., host_copy_bytes: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "attach", "request_class")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    attach: bool
    request_class: _common_pb2.RequestClass
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., attach: _Optional[bool] = ..., request_class: _Optional[_Union[_common_pb2.RequestClass, str]] = ...) -> None: ...

class WorkerTokenEvent(_message.Message):
    __slots__ = ("request_id", "token_id", "index", "finish_reason", "moved_to", "logprob", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MOVED_TO_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    index: int
    finish_reason: _common_pb2.FinishReason
    moved_to: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., moved_to: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "model_name", "num_layers_model", "layer_start", "layer_end", "vocab_size", "max_model_len", "block_size", "kv_blocks_total", "device", "dtype", "transfer_address", "group_id", "group_members", "epoch", "serving", "transitioning", "transfer_peers", "transition_epoch", "tp_degree", "tp_members", "kv_tokens_by_degree")
    class KvTokensByDegreeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PEERS_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    TP_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_BY_DEGREE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model_name: str
    num_layers_model: int
    layer_start: int
    layer_end: int
    vocab_size: int
    max_model_len: int
    block_size: int
    kv_blocks_total: int
    device: str
    dtype: str
    transfer_address: str
    group_id: str
    group_members: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    serving: bool
    transitioning: bool
    transfer_peers: _containers.RepeatedScalarFieldContainer[str]
    transition_epoch: int
    tp_degree: int
    tp_members: _containers.RepeatedScalarFieldContainer[str]
    kv_tokens_by_degree: _containers.ScalarMap[int, int]
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model_name: _Optional[str] = ..., num_layers_model: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., transfer_address: _Optional[str] = ..., group_id: _Optional[str] = ..., group_members: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., serving: _Optional[bool] = ..., transitioning: _Optional[bool] = ..., transfer_peers: _Optional[_Iterable[str]] = ..., transition_epoch: _Optional[int] = ..., tp_degree: _Optional[int] = ..., tp_members: _Optional[_Iterable[str]] = ..., kv_tokens_by_degree: _Optional[_Mapping[int, int]] = ...) -> None: ...

class PeerAddress(_message.Message):
    __slots__ = ("worker_id", "transfer_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transfer_address: str
    def __init__(self, worker_id: _Optional[str] = ..., transfer_address: _Optional[str] = ...) -> None: ...

class PeerAddresses(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerAddress]
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerAddress, _Mapping]]] = ...) -> None: ...

class PeerLinks(_message.Message):
    __slots__ = ("linked", "failed")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LINKED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    linked: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.ScalarMap[str, str]
    def __init__(self, linked: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, str]] = ...) -> None: ...
