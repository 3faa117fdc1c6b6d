"""The small interface the transfer service needs from a network library, and an in-process version.

``Endpoint``: a connected, reliable, message-oriented link to one peer. ``send(buf, tag)`` sends one
message of exactly ``len(buf)`` bytes; ``recv(buf, tag)`` receives the next message sent with that tag
into ``buf`` (which may be longer than the message; a longer message is an error). Messages with the
same tag arrive in the order they were sent. ``Transport``: listen on a port / connect to host:port.

``shared/transfer/ucx.py`` implements both over UCX (ucxx); ``MemoryTransport`` here implements them in
one process with asyncio queues (optionally at a simulated bandwidth), so the service and its priority
behaviour are testable without UCX.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import numpy as np


class EndpointClosed(ConnectionError):
    """The endpoint was closed (locally or by the peer) while an operation waited on it."""


class Endpoint(Protocol):
    @property
    def address(self) -> str: ...

    async def send(self, buf: Any, tag: int) -> None: ...

    async def recv(self, buf: Any, tag: int) -> None: ...

    async def close(self) -> None: ...


AcceptCallback = Callable[[Endpoint], Coroutine[Any, Any, None]]


class Transport(Protocol):
    async def listen(self, port: int, on_accept: AcceptCallback) -> int: ...

    async def connect(self, host: str, port: int, timeout: float) -> Endpoint: ...

    async def close(self) -> None: ...


def _as_bytes(buf: Any) -> memoryview:
    if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray):  # a CPU torch tensor
        buf = buf.numpy()
    return memoryview(buf).cast("B")


class MemoryEndpoint:
    """One end of an in-process link. ``bandwidth_bps`` simulates a wire: a send of n bytes takes
    ``latency_s + n / bandwidth_bps`` and the link carries one message at a time per direction."""

    def __init__(self, address: str, bandwidth_bps: float | None = None, latency_s: float = 0.0) -> None:
        self._address = address
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self._inbox: dict[int, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._arrived: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self._wire = asyncio.Lock()
        self.peer: MemoryEndpoint | None = None
        self.closed = False
        self.sent_log: list[tuple[int, int]] = []  # (tag, nbytes) in wire order

    @property
    def address(self) -> str:
        return self._address

    @classmethod
    def pair(cls, bandwidth_bps: float | None = None, latency_s: float = 0.0,
             names: tuple[str, str] = ("mem-a", "mem-b")) -> tuple[MemoryEndpoint, MemoryEndpoint]:
        a, b = cls(names[1], bandwidth_bps, latency_s), cls(names[0], bandwidth_bps, latency_s)
        a.peer, b.peer = b, a
        return a, b

    def _check(self) -> None:
        if self.closed or self.peer is None or self.peer.closed:
            raise EndpointClosed(f"memory endpoint to {self._address} is closed")

    async def send(self, buf: Any, tag: int) -> None:
        self._check()
        data = bytes(_as_bytes(buf))
        async with self._wire:
            delay = self.latency_s + (len(data) / self.bandwidth_bps if self.bandwidth_bps else 0.0)
            await asyncio.sleep(delay)
            self._check()
            self.sent_log.append((tag, len(data)))
            peer = self.peer
            assert peer is not None, "_check() passed, so the pair is connected"
            peer._inbox[tag].append(data)
            peer._arrived[tag].set()

    async def recv(self, buf: Any, tag: int) -> None:
        while not self._inbox[tag]:
            self._check()
            ev = self._arrived[tag]
            ev.clear()
            await ev.wait()
        data = self._inbox[tag].popleft()
        out = _as_bytes(buf)
        if len(data) > len(out):
            raise ValueError(f"message of {len(data)} bytes truncated into a {len(out)}-byte buffer")
        out[:len(data)] = data

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for ev in list(self._arrived.values()):
            ev.set()
        if self.peer is not None:
            for ev in list(self.peer._arrived.values()):
                ev.set()


class MemoryTransport:
    """In-process listeners, found by port number in a registry shared by the transports of one test."""

    def __init__(self, registry: dict[int, MemoryTransport] | None = None,
                 bandwidth_bps: float | None = None, latency_s: float = 0.0) -> None:
        self.registry = {} if registry is None else registry
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self._on_accept: AcceptCallback | None = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task] = set()

    _ports = itertools.count(40000)

    async def listen(self, port: int, on_accept: AcceptCallback) -> int:
        port = port or next(self._ports)
        if port in self.registry:
            raise OSError(f"memory port {port} in use")
        self.registry[port] = self
        self._on_accept, self._port = on_accept, port
        return port

    async def connect(self, host: str, port: int, timeout: float) -> Endpoint:
        server = self.registry.get(port)
        if server is None or server._on_accept is None:
            raise ConnectionRefusedError(f"nothing listens on memory port {host}:{port}")
        mine, theirs = MemoryEndpoint.pair(self.bandwidth_bps, self.latency_s,
                                           names=(f"mem:{self._port}", f"mem:{port}"))
        task = asyncio.get_running_loop().create_task(server._on_accept(theirs))
        server._tasks.add(task)
        task.add_done_callback(server._tasks.discard)
        return mine

    async def close(self) -> None:
        if self._port is not None:
            self.registry.pop(self._port, None)
            self._port = None
        self._on_accept = None
        for t in list(self._tasks):
            t.cancel()
