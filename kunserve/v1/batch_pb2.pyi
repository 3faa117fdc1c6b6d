from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateBatchChunk(_message.Message):
    __slots__ = ("endpoint", "completion_window", "metadata", "filename", "data")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    completion_window: str
    metadata: _containers.ScalarMap[str, str]
    filename: str
    data: bytes
    def __init__(self, endpoint: _Optional[str] = ..., completion_window: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., filename: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class BatchRef(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class BatchRequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "status", "endpoint", "completion_window", "input_file_id", "output_file_id", "error_file_id", "request_counts", "metadata", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "expired_at", "cancelling_at", "cancelled_at")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    INPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    FINALIZING_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_AT_FIELD_NUMBER: _ClassVar[int]
    CANCELLING_AT_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: str
    endpoint: str
    completion_window: str
    input_file_id: str
    output_file_id: str
    error_file_id: str
    request_counts: BatchRequestCounts
    metadata: _containers.ScalarMap[str, str]
    created_at: int
    in_progress_at: int
    expires_at: int
    finalizing_at: int
    completed_at: int
    expired_at: int
    cancelling_at: int
    cancelled_at: int
    def __init__(self, id: _Optional[str] = ..., status: _Optional[str] = ..., endpoint: _Optional[str] = ..., completion_window: _Optional[str] = ..., input_file_id: _Optional[str] = ..., output_file_id: _Optional[str] = ..., error_file_id: _Optional[str] = ..., request_counts: _Optional[_Union[BatchRequestCounts, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[int] = ..., in_progress_at: _Optional[int] = ..., expires_at: _Optional[int] = ..., finalizing_at: _Optional[int] = ..., completed_at: _Optional[int] = ..., expired_at: _Optional[int] = ..., cancelling_at: _Optional[int] = ..., cancelled_at: _Optional[int] = ...) -> None: ...

class ListBatchesRequest(_message.Message):
    __slots__ = ("limit", "after")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    limit: int
    after: str
    def __init__(self, limit: _Optional[int] = ..., after: _Optional[str] = ...) -> None: ...

class BatchList(_message.Message):
    __slots__ = ("batches", "has_more")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    has_more: bool
    def __init__(self, batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., has_more: _Optional[bool] = ...) -> None: ...

class BatchResultsRequest(_message.Message):
    __slots__ = ("batch_id", "start_index", "limit")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    start_index: int
    limit: int
    def __init__(self, batch_id: _Optional[str] = ..., start_index: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class BatchResultLine(_message.Message):
    __slots__ = ("index", "custom_id", "ok", "line")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    index: int
    custom_id: str
    ok: bool
    line: str
    def __init__(self, index: _Optional[int] = ..., custom_id: _Optional[str] = ..., ok: _Optional[bool] = ..., line: _Optional[str] = ...) -> None: ...
