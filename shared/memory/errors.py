"""Errors raised by the memory pool and the layer layout.

Every error carries `grpc_code`, the name of the gRPC status an RPC handler should answer with
(`INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `RESOURCE_EXHAUSTED`, `UNAVAILABLE`). The names are plain
strings so this module does not import grpc: the services map them with
`grpc.StatusCode[err.grpc_code]`.

Every operation that raises one of these leaves the pool and the layout exactly as they were
(validation happens before the first mapping changes), except where a docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable


class MemoryPoolError(Exception):
    """Base class of all memory-pool errors."""

    grpc_code: str = "FAILED_PRECONDITION"


class BackendUnavailable(MemoryPoolError, RuntimeError):
    """The requested backend cannot run here (no CUDA driver, no cuda-python, no memfd)."""

    grpc_code = "UNAVAILABLE"


class OutOfPagesError(MemoryPoolError):
    """Not enough free physical pages for the request (weights + at least one KV block per layer)."""

    grpc_code = "RESOURCE_EXHAUSTED"


class ViewStillAliveError(MemoryPoolError, RuntimeError):
    """A tensor view over pages that are about to be unmapped is still referenced somewhere.

    Touching such a view after the unmap would kill the process with SIGSEGV (host backend) or an
    illegal-address fault (CUDA), so the pool refuses the remap instead. Drop every reference to the
    tensors handed out for the affected layers (model parameters, cached KV tensors, numpy views,
    slices — anything sharing their storage) and retry. `ranges` names the virtual ranges concerned.
    """

    grpc_code = "FAILED_PRECONDITION"

    def __init__(self, message: str, ranges: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.ranges = tuple(ranges)


class LayerRangeError(MemoryPoolError, ValueError):
    """A drop or restore names layers that do not fit the held range; `layers` lists them.

    `grpc_code` is INVALID_ARGUMENT for requests that are wrong whatever the state (layers outside
    the model, duplicates, a non-contiguous set) and FAILED_PRECONDITION for requests that are wrong
    for the current state (dropping a layer not held, dropping every layer, restoring a held layer).
    """

    def __init__(self, message: str, layers: Iterable[int], grpc_code: str = "INVALID_ARGUMENT") -> None:
        self.layers = tuple(sorted(set(int(x) for x in layers)))
        super().__init__(f"{message} (layers {list(self.layers)})")
        self.grpc_code = grpc_code


class KVCapacityError(MemoryPoolError):
    """Restoring would shrink the KV cache below blocks that are still in use.

    `needs_compaction` is True when the used blocks would fit in the smaller cache but some sit
    beyond its end: call `plan_compaction` / `apply_compaction`, rewrite the block tables, and retry.
    It is False when more blocks are in use than the smaller cache has at all: free (or swap out,
    or exchange away) KV first.
    """

    grpc_code = "FAILED_PRECONDITION"

    def __init__(self, message: str, *, used_blocks: int, new_num_blocks: int, needs_compaction: bool) -> None:
        super().__init__(message)
        self.used_blocks = used_blocks
        self.new_num_blocks = new_num_blocks
        self.needs_compaction = needs_compaction


class WeightSourceError(MemoryPoolError, ValueError):
    """The weight source lacks a tensor or returned one of the wrong shape; `name` names it."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
