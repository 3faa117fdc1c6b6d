"""The worker data plane: tensors between workers over UCX with four priority classes (KunServe §4.2).

Public API: ``TransferService`` (service.py), the kinds ``ACTIVATION``, ``KV_EXCHANGE``, ``WEIGHTS``,
``CHECKPOINT``, ``CONTROL`` (framing.py), ``TransferConfig``, ``Received``, ``SendHandle``,
``TransferError``; the pure ``PriorityScheduler`` / ``ChunkSizer`` (scheduler.py); the ``Endpoint`` /
``Transport`` interface with an in-process ``MemoryTransport`` (endpoint.py) and UCX (ucx.py, lazy).
"""

from .chunk_scheduler import PRIORITY, Chunk, ChunkSizer, OutgoingMessage, PriorityScheduler
from .endpoint import Endpoint, EndpointClosed, MemoryEndpoint, MemoryTransport, Transport
from .framing import ACTIVATION, CHECKPOINT, CONTROL, KINDS, KV_EXCHANGE, WEIGHTS, FramingError, kind_name
from .service import Received, SendHandle, TraceEvent, TransferConfig, TransferError, TransferService

__all__ = [
    "ACTIVATION", "CHECKPOINT", "CONTROL", "KINDS", "KV_EXCHANGE", "WEIGHTS", "PRIORITY",
    "Chunk", "ChunkSizer", "Endpoint", "EndpointClosed", "FramingError", "MemoryEndpoint", "MemoryTransport",
    "OutgoingMessage", "PriorityScheduler", "Received", "SendHandle", "TraceEvent", "Transport",
    "TransferConfig", "TransferError", "TransferService", "kind_name",
]
