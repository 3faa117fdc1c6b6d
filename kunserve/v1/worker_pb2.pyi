from kunserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class WorkerTokenEvent(_message.Message):
    __slots__ = ("request_id", "token_id", "index", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    index: int
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "model_name", "num_layers_model", "layer_start", "layer_end", "vocab_size", "max_model_len", "block_size", "kv_blocks_total", "device", "dtype")
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
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model_name: _Optional[str] = ..., num_layers_model: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...
