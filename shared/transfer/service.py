"""The transfer service of one worker process: tensors to and from peers with four priority classes.

    svc = TransferService("w0", secret=cluster_secret)  # UCX by default (ucxx, imported lazily)
    port = await svc.start()                       # listen; peers connect to host:port
    peer = await svc.connect("10.0.0.2", 7001, expect="w1")  # -> "w1", after an authenticated handshake
    await svc.send(peer, ACTIVATION, hidden, request_ids=[...], layer_start=16, layer_end=32, epoch=3)
    h = svc.submit(peer, KV_EXCHANGE, kv_block)    # queue without waiting; await h.wait() later
    msg = await svc.recv(ACTIVATION, timeout=1.0)  # Received(peer, header, data: torch.Tensor)
    await svc.close()

Per peer link: one sender task takes chunks from a ``PriorityScheduler`` (activations/control > KV
exchange > weight restore > checkpoints; FIFO within a class; a waiting higher class goes next, between
two chunks of a lower one) and puts each on the wire as a header frame + payload (``framing.py``).
One receiver task per endpoint reassembles chunks straight into a preallocated tensor (``set_allocator``
lets a worker receive KV straight into its cache) and delivers whole messages to a per-kind queue or a
callback. Waits are bounded (connect, each chunk, close); failures surface as ``TransferError`` naming
the peer. A clean close sends CONTROL "bye" so the other side tells a close from a crash.

Handshake (the listener port is reachable by anyone who can reach the host, so nothing is registered
before it ends): the connector C sends CONTROL "hello" with its name and a fresh nonce Nc; the listener L
checks the name (not its own, one of ``members``) and answers "hello" with its name, a nonce Nl and
MAC(listener, C, L, Nc, Nl); C checks that MAC (and that L is the worker it meant to reach) and sends
"auth" with MAC(connector, C, L, Nc, Nl); L checks it and sends "welcome". MAC = HMAC-SHA256 keyed with the
cluster secret, so both sides prove they hold it; fresh nonces on both sides make a recorded handshake
useless, and the role in the MAC keeps one side's answer from being reflected as the other's. A peer
that fails any step is closed and never registered. The secret proves membership of the cluster, not
which member: any holder can claim any member's name (see the README's security limits).

If both sides connect to each other, the first link registered sends; the other only receives, and its
failure ends only that link: a second link under a live peer's name never replaces the first.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import itertools
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from kunserve.shared.log import get_logger
from kunserve.v1 import transfer_pb2

from .chunk_scheduler import Chunk, ChunkSizer, KiB, MiB, OutgoingMessage, PriorityScheduler
from .endpoint import Endpoint, Transport
from .framing import (
    CONTROL,
    FRAME_MAX,
    INLINE_MAX,
    KINDS,
    TAG_HEADER,
    TAG_PAYLOAD,
    FramingError,
    Kind,
    byte_view,
    decode_frame,
    encode_frame,
    kind_name,
    tensor_meta,
    torch_dtype,
    validate_chunk,
    validate_first_chunk,
)

HELLO = "__hello__"
AUTH = "__auth__"
WELCOME = "__welcome__"
REFUSED = "__refused__"  # the side that refuses a handshake says so, so the other does not wait for a timeout
BYE = "__bye__"
NONCE_BYTES = 32
MAC_DOMAIN = b"kunserve-transfer-link-v1"

Allocator = Callable[[str, transfer_pb2.TransferHeader], "torch.Tensor | np.ndarray | None"]


class TransferError(RuntimeError):
    """A transfer to or from ``peer`` failed, or the peer is not (or no longer) connected."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer


@dataclass
class TransferConfig:
    target_chunk_s: float = 0.005      # about one pipeline stage's execution time
    min_chunk_bytes: int = 64 * KiB
    max_chunk_bytes: int = 64 * MiB
    initial_bps: float = 5e8           # throughput guess before the first measurement (TCP-ish: start small)
    ewma_alpha: float = 0.3
    connect_timeout_s: float = 10.0
    chunk_timeout_s: float = 30.0      # one chunk on the wire longer than this = the link is dead
    close_timeout_s: float = 5.0
    trace_len: int = 0                 # keep the last N TraceEvents (tests, benchmarks); 0 = off
    inline_max_bytes: int = 64 * KiB   # chunks up to this size ride in the header frame (one message)

    def __post_init__(self) -> None:
        if not 0 <= self.inline_max_bytes <= INLINE_MAX:
            raise ValueError(f"inline_max_bytes must be in [0, {INLINE_MAX}]")

    def sizer(self) -> ChunkSizer:
        return ChunkSizer(target_s=self.target_chunk_s, min_bytes=self.min_chunk_bytes,
                          max_bytes=self.max_chunk_bytes, alpha=self.ewma_alpha, initial_bps=self.initial_bps)


@dataclass(frozen=True)
class TraceEvent:
    t: float                           # time.perf_counter() (CLOCK_MONOTONIC: comparable across processes)
    op: str                            # "submit", "send" (chunk on the wire), "recv" (chunk arrived)
    peer: str
    kind: Kind
    message_id: int
    chunk_index: int
    nbytes: int
    last: bool


@dataclass
class Received:
    peer: str
    header: transfer_pb2.TransferHeader   # the first chunk's header: dtype, shape, request ids, layers, ...
    data: Any                             # torch.Tensor (or what the kind's allocator returned)

    @property
    def kind(self) -> Kind:
        return self.header.kind

    @property
    def message_id(self) -> int:
        return self.header.message_id


class SendHandle:
    """A submitted message; ``await wait()`` returns when its last chunk is on the wire."""

    def __init__(self, peer: str, kind: Kind, message_id: int, total_bytes: int) -> None:
        self.peer, self.kind, self.message_id, self.total_bytes = peer, kind, message_id, total_bytes
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.chunks_done = 0
        self._progress = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> int:
        try:
            return await asyncio.wait_for(asyncio.shield(self.done), timeout)
        except TimeoutError:
            raise TimeoutError(f"{kind_name(self.kind)} message {self.message_id} to peer {self.peer} not sent "
                               f"within {timeout} s") from None

    async def wait_chunks(self, n: int, timeout: float | None = None) -> None:
        """Until at least n chunks are on the wire (or the message finished or failed)."""
        async with asyncio.timeout(timeout):
            while self.chunks_done < n and not self.done.done():
                self._progress.clear()
                await self._progress.wait()
        if self.done.done() and (exc := self.done.exception()) is not None:
            raise exc

    def _chunk_done(self) -> None:
        self.chunks_done += 1
        self._progress.set()

    def _finish(self, exc: BaseException | None = None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(self.message_id)
            else:
                self.done.set_exception(exc)
                self.done.exception()  # mark retrieved: nobody may be waiting
        self._progress.set()


@dataclass
class _Inbound:
    header: transfer_pb2.TransferHeader
    data: Any
    view: Any
    received: int = 0


@dataclass(eq=False)
class _Peer:
    name: str
    endpoint: Endpoint
    scheduler: PriorityScheduler
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    endpoints: list[Endpoint] = field(default_factory=list)
    sender: asyncio.Task | None = None
    receivers: list[asyncio.Task] = field(default_factory=list)
    closing: bool = False
    error: TransferError | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


def _copy_into(view: Any, offset: int, data: memoryview) -> None:
    if not len(data):
        return
    if isinstance(view, np.ndarray):
        view[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
    else:  # a CUDA byte view
        view[offset:offset + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))


class HandshakeRefused(FramingError):
    """The other side of a new link did not prove it holds the cluster secret, or is not who it must be."""


def handshake_mac(secret: bytes, role: str, connector: str, listener: str, nonce_c: bytes, nonce_l: bytes) -> bytes:
    """HMAC-SHA256 over the role and both names and nonces, each length-prefixed (no ambiguous joins)."""
    parts = [MAC_DOMAIN, role.encode(), connector.encode(), listener.encode(), nonce_c, nonce_l]
    return hmac.new(secret, b"".join(len(x).to_bytes(4, "big") + x for x in parts), hashlib.sha256).digest()


class TransferService:
    def __init__(self, name: str, transport: Transport | None = None, config: TransferConfig | None = None,
                 host: str = "127.0.0.1", *, secret: bytes, members: Collection[str] | None = None) -> None:
        """``secret``: the cluster secret both sides of every link must hold. ``members``: the only names a
        connecting peer may claim (the cluster's worker ids); None = any name but our own."""
        if not name or name in (HELLO, AUTH, WELCOME, REFUSED, BYE):
            raise ValueError(f"bad transfer service name {name!r}")
        if not secret:
            raise ValueError("the transfer service needs the cluster secret")
        self.name = name
        self.host = host
        self._secret = bytes(secret)
        self.members = frozenset(members) if members is not None else None
        self.config = config or TransferConfig()
        self._transport = transport
        self._port: int | None = None
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(1)
        self._queues: dict[Kind, asyncio.Queue[Received]] = {}
        self._callbacks: dict[Kind, Callable[[Received], Any]] = {}
        self._allocators: dict[Kind, Allocator] = {}
        self._peer_lost: list[Callable[[str, TransferError | None], Any]] = []
        self._peer_joined = asyncio.Event()
        self._closed = False
        self._bg: set[asyncio.Task] = set()
        self.trace: collections.deque[TraceEvent] = collections.deque(maxlen=max(1, self.config.trace_len))
        self._log = get_logger().bind(transfer=name)

    # ------------------------------------------------------------------ setup

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            from .ucx import UcxTransport

            self._transport = UcxTransport()
        return self._transport

    async def start(self, port: int = 0) -> int:
        """Listen for peers; returns the port."""
        self._port = await self.transport.listen(port, self._on_accept)
        self._log.info("transfer_listening", port=self._port)
        return self._port

    @property
    def address(self) -> str:
        if self._port is None:
            raise RuntimeError("transfer service not started")
        return f"{self.host}:{self._port}"

    @property
    def peers(self) -> list[str]:
        return sorted(n for n, p in self._peers.items() if not p.closing)

    async def connect(self, host: str, port: int, timeout: float | None = None, expect: str | None = None) -> str:
        """Open a link to the service listening at host:port; returns its name. ``expect``: the name it
        must have (the worker id the memory manager gave for that address); another name is refused
        before anything is registered."""
        if self._closed:
            raise RuntimeError("transfer service closed")
        timeout = self.config.connect_timeout_s if timeout is None else timeout
        where = f"{host}:{port}"
        try:
            ep = await self.transport.connect(host, port, timeout)
        except Exception as exc:
            raise TransferError(where, f"cannot connect: {type(exc).__name__}: {exc}") from exc
        try:
            async with asyncio.timeout(timeout):
                name = await self._handshake_as_connector(ep, expect)
        except asyncio.CancelledError:  # the caller went away (an RPC cancelled): the endpoint must not leak
            await self._close_endpoint(ep)
            raise
        except Exception as exc:
            await self._refuse(ep, exc)
            await self._close_endpoint(ep)
            if isinstance(exc, TimeoutError):
                raise TransferError(where, f"handshake not finished within {timeout} s") from None
            raise TransferError(where, f"handshake failed: {type(exc).__name__}: {exc}") from exc
        if self._closed:
            await self._close_endpoint(ep)
            raise RuntimeError("transfer service closed")
        self._register(name, ep)
        return name

    async def _handshake_as_connector(self, ep: Endpoint, expect: str | None) -> str:
        buf = np.empty(FRAME_MAX, np.uint8)
        nonce_c = os.urandom(NONCE_BYTES)
        await self._send_control(ep, HELLO, nonce=nonce_c)
        h = await self._expect(ep, buf, HELLO)
        listener = h.source
        if not listener or listener == self.name:
            raise HandshakeRefused(f"the listener calls itself {listener!r}")
        if expect is not None and listener != expect:
            raise HandshakeRefused(f"the listener is {listener!r}, not {expect!r}")
        if len(h.auth_nonce) != NONCE_BYTES or h.auth_nonce == nonce_c:
            raise HandshakeRefused("the listener's hello has no valid nonce")
        nonce_l = bytes(h.auth_nonce)
        want = handshake_mac(self._secret, "listener", self.name, listener, nonce_c, nonce_l)
        if not hmac.compare_digest(want, h.auth_mac):
            raise HandshakeRefused(f"{listener!r} did not prove it holds the cluster secret")
        await self._send_control(ep, AUTH, mac=handshake_mac(self._secret, "connector", self.name, listener,
                                                               nonce_c, nonce_l))
        await self._expect(ep, buf, WELCOME)
        return listener

    async def _handshake_as_listener(self, ep: Endpoint) -> str:
        buf = np.empty(FRAME_MAX, np.uint8)
        h = await self._expect(ep, buf, HELLO)
        connector = h.source
        if not connector or connector == self.name or connector in (HELLO, AUTH, WELCOME, REFUSED, BYE):
            raise HandshakeRefused(f"a peer may not call itself {connector!r}")
        if self.members is not None and connector not in self.members:
            raise HandshakeRefused(f"{connector!r} is not a member of this cluster")
        if len(h.auth_nonce) != NONCE_BYTES:
            raise HandshakeRefused(f"{connector!r} sent no valid nonce")
        nonce_c, nonce_l = bytes(h.auth_nonce), os.urandom(NONCE_BYTES)
        await self._send_control(ep, HELLO, nonce=nonce_l,
                                 mac=handshake_mac(self._secret, "listener", connector, self.name, nonce_c, nonce_l))
        a = await self._expect(ep, buf, AUTH)
        want = handshake_mac(self._secret, "connector", connector, self.name, nonce_c, nonce_l)
        if a.source != connector or not hmac.compare_digest(want, a.auth_mac):
            raise HandshakeRefused(f"{connector!r} did not prove it holds the cluster secret")
        await self._send_control(ep, WELCOME)
        return connector

    async def _refuse(self, ep: Endpoint, why: BaseException) -> None:
        """Tell the other side of a handshake we refused it (no reason: it may be an attacker; our log has
        it). Best effort and short: a closed endpoint is not always noticed by the peer's pending receive."""
        if not isinstance(why, HandshakeRefused) or str(why).startswith("the peer refused"):
            return
        try:
            async with asyncio.timeout(1.0):
                await self._send_control(ep, REFUSED)
        except Exception:
            pass

    async def _expect(self, ep: Endpoint, buf: np.ndarray, verb: str) -> transfer_pb2.TransferHeader:
        h, _ = await self._recv_frame(ep, buf)
        if h.kind == CONTROL and h.name == REFUSED:
            raise HandshakeRefused(f"the peer refused the link (while we waited for {verb}; see its log)")
        if h.kind != CONTROL or h.name != verb or h.chunk_index != 0 or h.total_bytes != 0:
            raise HandshakeRefused(f"expected {verb}, got {kind_name(h.kind)} {h.name!r}")
        return h

    async def wait_for_peer(self, name: str, timeout: float) -> None:
        """Until ``name`` has connected to us (bounded)."""
        async with asyncio.timeout(timeout):
            while name not in self.peers:
                self._peer_joined.clear()
                await self._peer_joined.wait()

    async def _on_accept(self, ep: Endpoint) -> None:
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                name = await self._handshake_as_listener(ep)
        except asyncio.CancelledError:  # the transport closed meanwhile
            await self._close_endpoint(ep)
            raise
        except Exception as exc:  # a bad or unauthenticated client must not take the listener down
            self._log.warning("transfer_handshake_refused", address=ep.address, error=f"{type(exc).__name__}: {exc}")
            await self._refuse(ep, exc)
            await self._close_endpoint(ep)
            return
        if self._closed:
            await self._close_endpoint(ep)
            return
        self._register(name, ep)

    def _register(self, name: str, ep: Endpoint) -> None:
        p = self._peers.get(name)
        if p is None or p.closing:
            p = _Peer(name, ep, PriorityScheduler(self.config.sizer()))
            self._peers[name] = p
            p.sender = self._spawn(self._send_loop(p))
            self._log.info("transfer_peer_connected", peer=name, address=ep.address)
        p.endpoints.append(ep)
        p.receivers.append(self._spawn(self._recv_loop(p, ep)))
        self._peer_joined.set()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    # ------------------------------------------------------------------ receiving API

    def set_allocator(self, kind: Kind, allocator: Allocator | None) -> None:
        """``allocator(peer, first_header)`` returns the contiguous tensor/array of exactly total_bytes that a
        message of this kind is received into (e.g. KV cache blocks), or None for a fresh torch.empty."""
        self._allocators.pop(kind, None) if allocator is None else self._allocators.__setitem__(kind, allocator)

    def on_message(self, kind: Kind, callback: Callable[[Received], Any] | None) -> None:
        """Deliver messages of ``kind`` to ``callback`` (called on the event loop; must not block) instead of
        the queue that ``recv`` reads."""
        self._callbacks.pop(kind, None) if callback is None else self._callbacks.__setitem__(kind, callback)

    def on_peer_lost(self, callback: Callable[[str, TransferError | None], Any]) -> None:
        """``callback(peer, error)`` when a link ends; error is None for a clean close by the peer."""
        self._peer_lost.append(callback)

    def _queue(self, kind: Kind) -> asyncio.Queue[Received]:
        if kind not in KINDS:
            raise ValueError(f"unknown transfer kind {kind}")
        q = self._queues.get(kind)
        if q is None:
            q = self._queues[kind] = asyncio.Queue()
        return q

    async def recv(self, kind: Kind, timeout: float | None = None) -> Received:
        """The next whole message of ``kind`` from any peer."""
        try:
            return await asyncio.wait_for(self._queue(kind).get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no {kind_name(kind)} message within {timeout} s") from None

    def recv_nowait(self, kind: Kind) -> Received | None:
        try:
            return self._queue(kind).get_nowait()
        except asyncio.QueueEmpty:
            return None

    # ------------------------------------------------------------------ sending API

    def submit(self, peer: str, kind: Kind, data: Any, *, request_ids: Any = (), layer_start: int = 0,
               layer_end: int = 0, epoch: int = 0, name: str = "") -> SendHandle:
        """Queue ``data`` (contiguous torch.Tensor, numpy array, or bytes) for ``peer``. The data must stay
        alive and unchanged until the handle is done."""
        p = self._peers.get(peer)
        if p is None or p.closing:
            err = p.error if p is not None and p.error is not None else None
            raise err or TransferError(peer, "not connected")
        if kind not in KINDS:
            raise ValueError(f"unknown transfer kind {kind}")
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = np.frombuffer(data, dtype=np.uint8)
        dtype, shape, nbytes = tensor_meta(data)
        payload = byte_view(data)
        mid = next(self._ids)
        header = transfer_pb2.TransferHeader(
            kind=cast("transfer_pb2.TransferKind", kind), message_id=mid, total_bytes=nbytes, dtype=dtype, shape=shape,
            request_ids=[str(r) for r in request_ids], layer_start=layer_start, layer_end=layer_end, epoch=epoch,
            name=name, source=self.name)
        encode_frame(header)  # fail now, in the caller, if the metadata does not fit a frame
        handle = SendHandle(peer, kind, mid, nbytes)
        p.scheduler.enqueue(OutgoingMessage(kind, nbytes, mid, payload=payload, meta=(header, handle)))
        self._trace("submit", peer, kind, mid, 0, nbytes, False)
        p.wake.set()
        return handle

    async def send(self, peer: str, kind: Kind, data: Any, *, timeout: float | None = None, **meta: Any) -> int:
        """Submit and wait until the whole message is on the wire; returns its message id."""
        return await self.submit(peer, kind, data, **meta).wait(timeout)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {n: {"throughput_bps": p.scheduler.sizer.bps, "chunk_bytes": p.scheduler.sizer.chunk_bytes(),
                    "queued": p.scheduler.queued(), "queued_bytes": p.scheduler.queued_bytes(),
                    "bytes_sent": p.bytes_sent, "bytes_received": p.bytes_received,
                    "messages_sent": p.messages_sent, "messages_received": p.messages_received}
                for n, p in sorted(self._peers.items())}

    # ------------------------------------------------------------------ the loops

    def _trace(self, op: str, peer: str, kind: Kind, mid: int, idx: int, nbytes: int, last: bool) -> None:
        if self.config.trace_len:
            self.trace.append(TraceEvent(time.perf_counter(), op, peer, kind, mid, idx, nbytes, last))

    async def _send_control(self, ep: Endpoint, verb: str, nonce: bytes = b"", mac: bytes = b"") -> None:
        h = transfer_pb2.TransferHeader(kind=CONTROL, message_id=next(self._ids), chunk_count=1, dtype="uint8",
                                        shape=[0], name=verb, source=self.name, auth_nonce=nonce, auth_mac=mac)
        await ep.send(np.frombuffer(encode_frame(h), np.uint8), TAG_HEADER)

    @staticmethod
    async def _recv_frame(ep: Endpoint, buf: np.ndarray) -> tuple[transfer_pb2.TransferHeader, memoryview | None]:
        await ep.recv(buf, TAG_HEADER)
        return decode_frame(buf)

    async def _send_loop(self, p: _Peer) -> None:
        sched = p.scheduler
        try:
            while True:
                chunk = sched.next_chunk()
                if chunk is None:
                    p.wake.clear()
                    await p.wake.wait()
                    continue
                await self._send_chunk(p, chunk)
                del chunk  # a payload over pool pages (weights sent from a live arena) must not stay pinned here
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail_peer(p, exc.with_traceback(None), "send")

    async def _send_chunk(self, p: _Peer, chunk: Chunk) -> None:
        sched = p.scheduler
        msg = chunk.message
        template, handle = msg.meta
        if chunk.index == 0:
            h = transfer_pb2.TransferHeader()
            h.CopyFrom(template)
        else:
            h = transfer_pb2.TransferHeader(kind=cast("transfer_pb2.TransferKind", msg.kind), message_id=msg.message_id,
                                            total_bytes=msg.total_bytes)
        h.chunk_index, h.chunk_count = chunk.index, chunk.count
        h.offset, h.chunk_bytes = chunk.offset, chunk.nbytes
        part = msg.payload[chunk.offset:chunk.offset + chunk.nbytes] if chunk.nbytes else None
        inline = part is not None and chunk.nbytes <= self.config.inline_max_bytes and isinstance(part, np.ndarray)
        frame = np.frombuffer(encode_frame(h, part if inline else None), np.uint8)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.chunk_timeout_s):
                await p.endpoint.send(frame, TAG_HEADER)
                if part is not None and not inline:
                    await p.endpoint.send(part, TAG_PAYLOAD)
        except TimeoutError:
            raise TransferError(p.name, f"{kind_name(msg.kind)} chunk {chunk.index} of message "
                                        f"{msg.message_id} not sent within {self.config.chunk_timeout_s} s") from None
        finished = sched.complete(chunk, time.perf_counter() - t0)
        p.bytes_sent += chunk.nbytes
        self._trace("send", p.name, msg.kind, msg.message_id, chunk.index, chunk.nbytes, finished)
        handle._chunk_done()
        if finished:
            p.messages_sent += 1
            handle._finish()

    async def _recv_loop(self, p: _Peer, ep: Endpoint) -> None:
        buf = np.empty(FRAME_MAX, np.uint8)
        inbound: dict[int, _Inbound] = {}
        try:
            while True:
                h, inline = await self._recv_frame(ep, buf)
                if h.chunk_index == 0:
                    if h.kind == CONTROL and h.name == BYE and h.total_bytes == 0:
                        if ep is not p.endpoint:
                            self._end_extra_link(p, ep, "bye")
                            return
                        self._log.info("transfer_peer_closed", peer=p.name, partial_messages=len(inbound))
                        self._spawn(self._drop_peer(p, None))
                        return
                    if h.message_id in inbound:
                        raise FramingError(f"message {h.message_id} started twice")
                    validate_first_chunk(h)
                    data = self._allocate(p.name, h)
                    state = _Inbound(h, data, byte_view(data))
                    inbound[h.message_id] = state
                    del data
                else:
                    known = inbound.get(h.message_id)
                    if known is None or h.kind != known.header.kind:
                        raise FramingError(f"chunk {h.chunk_index} of unknown message {h.message_id}")
                    state = known
                    del known
                total = state.header.total_bytes
                validate_chunk(h, total, state.received)
                if h.chunk_bytes == 0 and total > 0:
                    raise FramingError(f"message {h.message_id}: empty chunk {h.chunk_index}")
                if inline is not None:
                    _copy_into(state.view, h.offset, inline)
                elif h.chunk_bytes:
                    await ep.recv(state.view[h.offset:h.offset + h.chunk_bytes], TAG_PAYLOAD)
                state.received += h.chunk_bytes
                p.bytes_received += h.chunk_bytes
                done = state.received == total
                self._trace("recv", p.name, h.kind, h.message_id, h.chunk_index, h.chunk_bytes, done)
                if done:
                    del inbound[h.message_id]
                    p.messages_received += 1
                    self._deliver(Received(p.name, state.header, state.data))
                del state  # a message received into pool pages (an allocator's view) must not stay pinned here
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if p.closing:
                return
            if ep is not p.endpoint:
                self._end_extra_link(p, ep, f"{type(exc).__name__}: {exc}")
                return
            self._fail_peer(p, exc.with_traceback(None), "receive")

    def _end_extra_link(self, p: _Peer, ep: Endpoint, why: str) -> None:
        """A second link under a peer's name (both sides connected at once, or another holder of the secret
        claiming the name) ends alone: the link the peer was registered with stays."""
        self._log.warning("transfer_extra_link_ended", peer=p.name, reason=why)
        if ep in p.endpoints:
            p.endpoints.remove(ep)
        self._spawn(self._close_endpoint(ep))

    def _allocate(self, peer: str, h: transfer_pb2.TransferHeader) -> Any:
        alloc = self._allocators.get(h.kind)
        data = alloc(peer, h) if alloc is not None else None
        if data is None:
            return torch.empty(list(h.shape), dtype=torch_dtype(h.dtype))
        _, _, nbytes = tensor_meta(data)
        if nbytes != h.total_bytes:
            raise FramingError(f"allocator for {kind_name(h.kind)} returned {nbytes} bytes for message "
                               f"{h.message_id} of {h.total_bytes} bytes")
        return data

    def _deliver(self, msg: Received) -> None:
        cb = self._callbacks.get(msg.kind)
        if cb is not None:
            try:
                cb(msg)
            except Exception as exc:
                self._log.error("transfer_callback_failed", kind=kind_name(msg.kind), peer=msg.peer,
                                error=f"{type(exc).__name__}: {exc}")
        else:
            self._queue(msg.kind).put_nowait(msg)

    # ------------------------------------------------------------------ failure and close

    def _fail_peer(self, p: _Peer, exc: BaseException, where: str) -> None:
        if p.closing:
            return
        err = exc if isinstance(exc, TransferError) else TransferError(
            p.name, f"{where} failed: {type(exc).__name__}: {exc}")
        self._log.warning("transfer_peer_failed", peer=p.name, error=str(err))
        p.error = err
        self._spawn(self._drop_peer(p, err))

    async def _drop_peer(self, p: _Peer, err: TransferError | None) -> None:
        if p.closing:
            return
        p.closing = True
        fail = err or TransferError(p.name, "the peer closed the link")
        self._fail_queued(p, fail)
        await self._stop_peer_tasks(p)
        if self._peers.get(p.name) is p:
            del self._peers[p.name]
        for cb in self._peer_lost:
            try:
                cb(p.name, err)
            except Exception as exc:
                self._log.error("transfer_peer_lost_callback_failed", peer=p.name, error=repr(exc))

    @staticmethod
    def _fail_queued(p: _Peer, err: BaseException) -> None:
        in_flight = p.scheduler.in_flight
        msgs = p.scheduler.drain() + ([in_flight.message] if in_flight is not None else [])
        for m in msgs:
            m.meta[1]._finish(err)

    async def _stop_peer_tasks(self, p: _Peer) -> None:
        me = asyncio.current_task()
        tasks = [t for t in [p.sender, *p.receivers] if t is not None and t is not me]
        for ep in p.endpoints:
            await self._close_endpoint(ep)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.close_timeout_s)

    async def _close_endpoint(self, ep: Endpoint) -> None:
        try:
            await asyncio.wait_for(ep.close(), self.config.close_timeout_s)
        except Exception as exc:
            self._log.debug("transfer_endpoint_close_failed", address=ep.address, error=repr(exc))

    async def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Close every link (after the queued messages are sent when ``drain``) and stop listening.
        Messages still queued fail with TransferError. Bounded by ``timeout`` (config.close_timeout_s)."""
        if self._closed:
            return
        self._closed = True
        timeout = self.config.close_timeout_s if timeout is None else timeout
        if self._transport is not None:
            await self._transport.close()
        peers = list(self._peers.values())
        if drain:
            pending = [m.meta[1].done for p in peers for m in self._queued_messages(p)]
            if pending:
                await asyncio.wait(pending, timeout=timeout)
        byes = []
        for p in peers:
            if p.closing:
                continue
            self._fail_queued_not_in_flight(p, TransferError(p.name, "the transfer service is closing"))
            try:
                byes.append(self.submit(p.name, CONTROL, b"", name=BYE).done)
            except TransferError:
                pass
        if byes:
            await asyncio.wait(byes, timeout=timeout)
        for p in peers:
            if not p.closing:
                p.closing = True
                self._fail_queued(p, TransferError(p.name, "the transfer service closed"))
                await self._stop_peer_tasks(p)
        self._peers.clear()
        rest = [t for t in self._bg if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.wait(rest, timeout=timeout)
        self._log.info("transfer_closed")

    @staticmethod
    def _queued_messages(p: _Peer) -> list[OutgoingMessage]:
        return [m for q in p.scheduler._queues for m in q]

    @staticmethod
    def _fail_queued_not_in_flight(p: _Peer, err: BaseException) -> None:
        # A message whose chunk is on the wire finishes that chunk; the peer drops partial messages on bye.
        for m in p.scheduler.drain():
            m.meta[1]._finish(err)

    async def __aenter__(self) -> TransferService:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
