"""Priority chunk scheduling for one peer link: pure, no I/O, no clock.

UCX has no priorities: a small message posted behind a large send waits for all of it. So the transfer
service never posts a large payload at once. Every message is cut into chunks, and one sender task per
peer asks ``PriorityScheduler.next_chunk()`` for the next chunk to put on the wire, sends it, reports
``complete(chunk, seconds)``, and asks again. The scheduler always answers with the head message of the
highest non-empty class, so an activation that arrives while a KV exchange is being sent waits for at
most the one chunk already on the wire (KunServe §4.2). Within a class, messages go in FIFO order and a
message's chunks are consecutive: a class's head message is finished before the next one starts.

Chunk size adapts so that one chunk takes about ``target_s`` on the wire (about one pipeline stage's
execution time): ``ChunkSizer`` keeps an EWMA of the measured throughput and answers
``throughput × target_s``. With per-chunk latency ``lat`` the measured throughput of a chunk ``c`` is
``c / (lat + c/B)``, whose fixed point is ``c = B·(target_s − lat)``: a chunk takes ``target_s``.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from .framing import ACTIVATION, CHECKPOINT, CONTROL, KV_EXCHANGE, WEIGHTS, Kind, kind_name

# Priority class per kind, 0 = highest. Control messages are small and ride with activations.
PRIORITY: dict[Kind, int] = {ACTIVATION: 0, CONTROL: 0, KV_EXCHANGE: 1, WEIGHTS: 2, CHECKPOINT: 3}
NUM_CLASSES = 4
CLASS_NAMES = ("activation", "kv_exchange", "weights", "checkpoint")

KiB = 1024
MiB = 1024 * KiB


@dataclass
class ChunkSizer:
    """Chunk size that makes one chunk take about ``target_s``, from an EWMA of measured throughput."""

    target_s: float = 0.005
    min_bytes: int = 64 * KiB
    max_bytes: int = 64 * MiB
    alpha: float = 0.3             # EWMA weight of the newest sample
    initial_bps: float = 1e9       # before the first measurement
    align: int = 4 * KiB
    bps: float = field(init=False)
    samples: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.target_s <= 0 or self.min_bytes <= 0 or self.max_bytes < self.min_bytes:
            raise ValueError(f"bad chunk sizer settings: target_s={self.target_s}, min_bytes={self.min_bytes}, "
                             f"max_bytes={self.max_bytes}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        self.bps = float(self.initial_bps)

    def chunk_bytes(self) -> int:
        want = self.bps * self.target_s
        if self.align > 1:
            want = (want // self.align) * self.align
        return int(min(self.max_bytes, max(self.min_bytes, want)))

    def observe(self, nbytes: int, seconds: float, requested: int | None = None) -> bool:
        """Feed one chunk's wire time. Only chunks of at least half the size asked for are samples:
        small messages (an activation, a message's short tail) measure latency, not throughput.
        Returns whether the sample was used."""
        requested = self.chunk_bytes() if requested is None else requested
        if seconds <= 0 or nbytes <= 0 or nbytes < requested // 2:
            return False
        sample = nbytes / seconds
        self.bps = sample if self.samples == 0 else self.alpha * sample + (1 - self.alpha) * self.bps
        self.samples += 1
        return True


@dataclass(eq=False)
class OutgoingMessage:
    """One message waiting to be sent. ``payload``/``meta`` are opaque to the scheduler."""

    kind: Kind
    total_bytes: int
    message_id: int = 0
    payload: Any = None
    meta: Any = None
    sent_bytes: int = 0            # bytes handed out in chunks so far
    chunks_issued: int = 0
    chunks_done: int = 0

    def __post_init__(self) -> None:
        if self.kind not in PRIORITY:
            raise ValueError(f"unknown transfer kind {self.kind}")
        if self.total_bytes < 0:
            raise ValueError("total_bytes must be >= 0")

    @property
    def priority(self) -> int:
        return PRIORITY[self.kind]

    @property
    def remaining(self) -> int:
        return self.total_bytes - self.sent_bytes


@dataclass(frozen=True)
class Chunk:
    message: OutgoingMessage
    index: int
    offset: int
    nbytes: int
    count: int                     # chunk count estimate at issue time; exact when ``last``
    last: bool
    requested: int                 # the chunk size the sizer asked for


class PriorityScheduler:
    """Four FIFO classes, highest first; hands out one chunk at a time (one chunk in flight)."""

    def __init__(self, sizer: ChunkSizer | None = None) -> None:
        self.sizer = sizer or ChunkSizer()
        self._queues: list[collections.deque[OutgoingMessage]] = [collections.deque() for _ in range(NUM_CLASSES)]
        self._in_flight: Chunk | None = None

    def enqueue(self, msg: OutgoingMessage) -> None:
        if msg.sent_bytes or msg.chunks_issued:
            raise ValueError("message already (partly) sent")
        self._queues[msg.priority].append(msg)

    def next_chunk(self) -> Chunk | None:
        """The next chunk to put on the wire, or None when nothing waits."""
        if self._in_flight is not None:
            raise RuntimeError("a chunk is still in flight: call complete() first (one sender per peer)")
        for q in self._queues:
            if q:
                msg = q[0]
                break
        else:
            return None
        size = self.sizer.chunk_bytes()
        n = min(size, msg.remaining)
        last = n == msg.remaining
        count = msg.chunks_issued + 1 + (0 if last else math.ceil((msg.remaining - n) / size))
        chunk = Chunk(msg, msg.chunks_issued, msg.sent_bytes, n, count, last, size)
        msg.sent_bytes += n
        msg.chunks_issued += 1
        if last:
            q.popleft()
        self._in_flight = chunk
        return chunk

    def complete(self, chunk: Chunk, seconds: float) -> bool:
        """The chunk is on the wire after ``seconds``; returns whether its message is now fully sent."""
        if chunk is not self._in_flight:
            raise RuntimeError("complete() for a chunk that is not in flight")
        self._in_flight = None
        chunk.message.chunks_done += 1
        self.sizer.observe(chunk.nbytes, seconds, chunk.requested)
        return chunk.last

    def remove(self, msg: OutgoingMessage) -> bool:
        """Drop a message that has not started; a started one cannot be withdrawn mid-way."""
        if msg.chunks_issued:
            return False
        try:
            self._queues[msg.priority].remove(msg)
        except ValueError:
            return False
        return True

    def drain(self) -> list[OutgoingMessage]:
        """Remove and return every queued message (on peer failure or close)."""
        out = [m for q in self._queues for m in q]
        for q in self._queues:
            q.clear()
        return out

    @property
    def in_flight(self) -> Chunk | None:
        return self._in_flight

    def queued(self) -> dict[str, int]:
        return {CLASS_NAMES[i]: len(q) for i, q in enumerate(self._queues)}

    def queued_bytes(self) -> int:
        return sum(m.remaining for q in self._queues for m in q)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def describe(self, msg: OutgoingMessage) -> str:
        return f"{kind_name(msg.kind)} message {msg.message_id} ({msg.total_bytes} bytes)"
