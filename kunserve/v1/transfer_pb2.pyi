from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_KIND_UNSPECIFIED: _ClassVar[TransferKind]
    TRANSFER_KIND_ACTIVATION: _ClassVar[TransferKind]
    TRANSFER_KIND_KV_EXCHANGE: _ClassVar[TransferKind]
    TRANSFER_KIND_WEIGHTS: _ClassVar[TransferKind]
    TRANSFER_KIND_CHECKPOINT: _ClassVar[TransferKind]
    TRANSFER_KIND_CONTROL: _ClassVar[TransferKind]
TRANSFER_KIND_UNSPECIFIED: TransferKind
TRANSFER_KIND_ACTIVATION: TransferKind
TRANSFER_KIND_KV_EXCHANGE: TransferKind
TRANSFER_KIND_WEIGHTS: TransferKind
TRANSFER_KIND_CHECKPOINT: TransferKind
TRANSFER_KIND_CONTROL: TransferKind

class TransferHeader(_message.Message):
    __slots__ = ("kind", "message_id", "chunk_index", "chunk_count", "offset", "chunk_bytes", "total_bytes", "payload_inline", "dtype", "shape", "request_ids", "layer_start", "layer_end", "epoch", "name", "source", "auth_nonce", "auth_mac")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_INLINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_NONCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_MAC_FIELD_NUMBER: _ClassVar[int]
    kind: TransferKind
    message_id: int
    chunk_index: int
    chunk_count: int
    offset: int
    chunk_bytes: int
    total_bytes: int
    payload_inline: bool
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    layer_start: int
    layer_end: int
    epoch: int
    name: str
    source: str
    auth_nonce: bytes
    auth_mac: bytes
    def __init__(self, kind: _Optional[_Union[TransferKind, str]] = ..., message_id: _Optional[int] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., offset: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., payload_inline: _Optional[bool] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., request_ids: _Optional[_Iterable[str]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., epoch: _Optional[int] = ..., name: _Optional[str] = ..., source: _Optional[str] = ..., auth_nonce: _Optional[bytes] = ..., auth_mac: _Optional[bytes] = ...) -> None: ...
