"""What the worker servicer's unit tests hand it in place of gRPC and the pooled instance."""

from __future__ import annotations

import grpc


class Aborted(Exception):
    """`context.abort` as a test sees it: the status and the message the servicer answered with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class Context:
    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        raise Aborted(code, details)


class Instance:
    """A whole one-layer instance with 64 KV blocks and no DRAM host copy."""

    host_copy = None

    def __init__(self, layers: tuple[int, int] = (0, 1)) -> None:
        self.layer_range = layers

    def capacity_for(self, start: int, end: int) -> int:
        return 64
