"""Wire framing for the transfer service: pure, no I/O.

A message is sent as one or more chunks. Each chunk is one or two UCX messages on one endpoint:

1. a frame on ``TAG_HEADER``: ``b"KTX1"`` + uint32 little-endian length ``n`` + ``n`` bytes of a serialized
   ``kunserve.v1.TransferHeader`` (at most ``HEADER_MAX``), followed, when ``payload_inline`` is set, by the
   chunk's ``chunk_bytes`` payload bytes. Frames are at most ``FRAME_MAX`` bytes; the receiver posts one
   buffer of that size and reads the lengths from the frame (UCX accepts a shorter message). Inlining
   saves a message (and a rendezvous) for small chunks such as activations; the receiver copies the
   inline bytes into the destination.
2. when ``chunk_bytes > 0`` and not inline: exactly ``chunk_bytes`` raw payload bytes on ``TAG_PAYLOAD``,
   received straight into the destination tensor at byte ``offset`` (no intermediate copy).

Tensors travel as raw bytes described by the header (dtype name, shape); nothing is ever unpickled.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from kunserve.v1 import transfer_pb2

MAGIC = b"KTX1"
_PREFIX = struct.Struct("<4sI")
HEADER_MAX = 64 * 1024             # serialized header
INLINE_MAX = 256 * 1024            # the most payload a frame can carry inline
FRAME_MAX = _PREFIX.size + HEADER_MAX + INLINE_MAX
TAG_HEADER = 1
TAG_PAYLOAD = 2

Kind = int  # a transfer_pb2.TransferKind value
ACTIVATION = transfer_pb2.TRANSFER_KIND_ACTIVATION
KV_EXCHANGE = transfer_pb2.TRANSFER_KIND_KV_EXCHANGE
WEIGHTS = transfer_pb2.TRANSFER_KIND_WEIGHTS
CHECKPOINT = transfer_pb2.TRANSFER_KIND_CHECKPOINT
CONTROL = transfer_pb2.TRANSFER_KIND_CONTROL
KINDS = (ACTIVATION, KV_EXCHANGE, WEIGHTS, CHECKPOINT, CONTROL)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class FramingError(ValueError):
    """A header frame or a header's contents are malformed."""


def kind_name(kind: Kind) -> str:
    return transfer_pb2.TransferKind.Name(kind).removeprefix("TRANSFER_KIND_")


def dtype_name(dtype: torch.dtype | np.dtype | str) -> str:
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise FramingError(f"unsupported dtype {dtype!r}")
        return name
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise FramingError(f"unsupported dtype {dtype}")
        return _DTYPE_NAMES[dtype]
    return dtype_name(np.dtype(dtype).name)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FramingError(f"unsupported dtype {name!r}") from None


def itemsize(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


def encode_frame(header: transfer_pb2.TransferHeader, inline: Any = None) -> bytearray:
    """The frame for ``header``; with ``inline`` (a uint8 buffer of chunk_bytes) the payload rides along
    and ``payload_inline`` is set."""
    if inline is not None:
        header.payload_inline = True
    body = header.SerializeToString()
    if len(body) > HEADER_MAX:
        raise FramingError(f"transfer header is {len(body)} bytes, more than {HEADER_MAX} "
                           f"(too many request ids in one message?)")
    n_inline = 0 if inline is None else len(memoryview(inline).cast("B"))
    if inline is not None and (n_inline != header.chunk_bytes or n_inline > INLINE_MAX):
        raise FramingError(f"inline payload of {n_inline} bytes for a chunk of {header.chunk_bytes} "
                           f"(at most {INLINE_MAX} inline)")
    frame = bytearray(_PREFIX.size + len(body) + n_inline)
    _PREFIX.pack_into(frame, 0, MAGIC, len(body))
    frame[_PREFIX.size:_PREFIX.size + len(body)] = body
    if n_inline:
        frame[_PREFIX.size + len(body):] = memoryview(inline).cast("B")
    return frame


def decode_frame(buf: Any) -> tuple[transfer_pb2.TransferHeader, memoryview | None]:
    """Parse a frame from a buffer that may be longer than the frame (the posted receive buffer).
    Returns the header and, when the payload is inline, a view of it inside ``buf``."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _PREFIX.size:
        raise FramingError("frame shorter than its prefix")
    magic, n = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FramingError(f"bad frame magic {bytes(magic)!r}")
    if n > HEADER_MAX or _PREFIX.size + n > len(mv):
        raise FramingError(f"header length {n} exceeds the frame")
    header = transfer_pb2.TransferHeader()
    try:
        header.ParseFromString(bytes(mv[_PREFIX.size:_PREFIX.size + n]))
    except Exception as exc:  # protobuf's DecodeError
        raise FramingError(f"undecodable transfer header: {exc}") from None
    if not header.payload_inline:
        return header, None
    start = _PREFIX.size + n
    if header.chunk_bytes > INLINE_MAX or start + header.chunk_bytes > len(mv):
        raise FramingError(f"inline payload of {header.chunk_bytes} bytes exceeds the frame")
    return header, mv[start:start + header.chunk_bytes]


def validate_first_chunk(header: transfer_pb2.TransferHeader) -> None:
    """Check a message's metadata (chunk 0): a known kind and dtype, and a shape matching total_bytes."""
    if header.kind not in KINDS:
        raise FramingError(f"unknown transfer kind {header.kind}")
    if any(d < 0 for d in header.shape):
        raise FramingError(f"negative dimension in shape {list(header.shape)}")
    expected = math.prod(header.shape) * itemsize(header.dtype)
    if expected != header.total_bytes:
        raise FramingError(f"shape {list(header.shape)} of {header.dtype} is {expected} bytes, header says "
                           f"{header.total_bytes}")


def validate_chunk(header: transfer_pb2.TransferHeader, total_bytes: int, received: int) -> None:
    """A chunk must continue its message exactly where the previous chunk ended."""
    if header.offset != received:
        raise FramingError(f"message {header.message_id}: chunk {header.chunk_index} at offset {header.offset}, "
                           f"expected {received}")
    if header.offset + header.chunk_bytes > total_bytes:
        raise FramingError(f"message {header.message_id}: chunk {header.chunk_index} overruns the message "
                           f"({header.offset}+{header.chunk_bytes} > {total_bytes})")


def byte_view(data: torch.Tensor | np.ndarray) -> Any:
    """A flat uint8 view of a contiguous tensor/array, sharing memory; what the endpoint sends or fills.

    CPU tensors become numpy arrays (ucxx takes the buffer protocol, not torch tensors); CUDA tensors stay
    torch tensors (ucxx reads ``__cuda_array_interface__``).
    """
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("transfer needs a C-contiguous array")
        return data.reshape(-1).view(np.uint8)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(data).__name__}")
    if not data.is_contiguous():
        raise ValueError("transfer needs a contiguous tensor (call .contiguous() first)")
    flat = data.reshape(-1)
    flat = flat.view(torch.uint8)
    if flat.is_cuda:
        return flat
    return flat.numpy()


def tensor_meta(data: torch.Tensor | np.ndarray) -> tuple[str, list[int], int]:
    """(dtype name, shape, nbytes) of what will be sent."""
    if isinstance(data, np.ndarray):
        return dtype_name(data.dtype), list(data.shape), int(data.nbytes)
    return dtype_name(data.dtype), list(data.shape), data.numel() * data.element_size()
