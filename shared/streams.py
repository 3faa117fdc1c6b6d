"""Bridges between producer threads/tasks and gRPC streaming handlers.

A `StreamRegistry` holds one asyncio.Queue per in-flight stream so that shutdown can end every
stream with a clear status instead of leaving clients hanging.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Shutdown:
    """Pushed into every open stream's queue when the service stops."""

    message: str


class StreamRegistry(Generic[T]):
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, key: str) -> asyncio.Queue[Any]:
        if key in self._queues:
            raise KeyError(key)
        self._loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[key] = q
        return q

    def close(self, key: str, queue: asyncio.Queue[Any] | None = None) -> None:
        """Forget `key`'s stream; with `queue`, only while it is still that one (a stream that ended early must not
        close the next stream of the same key)."""
        if queue is None or self._queues.get(key) is queue:
            self._queues.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def keys(self) -> list[str]:
        return list(self._queues)

    def put_threadsafe(self, key: str, item: Any) -> None:
        """Called from the engine thread: hand an item to the stream's queue on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self.put, key, item)

    def put(self, key: str, item: Any) -> None:
        """On the event loop: hand an item to the stream's queue (nothing when the stream is gone)."""
        q = self._queues.get(key)
        if q is not None:
            q.put_nowait(item)

    def shutdown_all(self, message: str) -> None:
        for q in self._queues.values():
            q.put_nowait(Shutdown(message))
