"""Busy / idle accounting of one execution stage (an engine, or one stage of a pipeline).

busy   = time spent computing batches;
idle   = every other second since the clock started;
bubble = the part of idle during which work was waiting for this stage (a request queued on an
         instance between iterations, or the next microbatch not yet arrived at a pipeline stage
         while the pipeline had work in flight). An idle worker with nothing to do has no bubble.

bubble_ratio = bubble / (busy + bubble): the fraction of the time the stage had work to do but did
not compute (KunServe §5.3 reports it for pipelined execution: 21.9% -> 8.3% with lookahead).

Single-writer: the stage's own thread calls the mutators; any thread may take a `snapshot()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BusyIdle:
    busy_s: float
    idle_s: float
    bubble_s: float

    @property
    def bubble_ratio(self) -> float:
        d = self.busy_s + self.bubble_s
        return self.bubble_s / d if d > 0 else 0.0

    @property
    def utilization(self) -> float:
        d = self.busy_s + self.idle_s
        return self.busy_s / d if d > 0 else 0.0


class BusyIdleClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._t0 = clock()
        self._busy = 0.0
        self._bubble = 0.0
        self._busy_since: float | None = None
        self._waiting_since: float | None = None  # work has been waiting (while not busy) since then

    def work_waiting(self, now: float | None = None) -> None:
        """Work is queued for this stage (idempotent): idle time from now on counts as bubble."""
        with self._lock:
            if self._waiting_since is None and self._busy_since is None:
                self._waiting_since = self._clock() if now is None else now

    def begin_busy(self, now: float | None = None) -> None:
        with self._lock:
            t = self._clock() if now is None else now
            if self._waiting_since is not None:
                self._bubble += max(0.0, t - self._waiting_since)
                self._waiting_since = None
            self._busy_since = t

    def end_busy(self, still_waiting: bool, now: float | None = None) -> None:
        """The batch is done; still_waiting: more work is already queued for this stage."""
        with self._lock:
            t = self._clock() if now is None else now
            if self._busy_since is not None:
                self._busy += max(0.0, t - self._busy_since)
                self._busy_since = None
            self._waiting_since = t if still_waiting else None

    def idle_turn(self, still_waiting: bool, now: float | None = None) -> None:
        """A turn that computed nothing (e.g. all work blocked on memory): keep counting bubble."""
        with self._lock:
            t = self._clock() if now is None else now
            if self._waiting_since is None and still_waiting:
                self._waiting_since = t
            elif self._waiting_since is not None and not still_waiting:
                self._bubble += max(0.0, t - self._waiting_since)
                self._waiting_since = None

    def snapshot(self, now: float | None = None) -> BusyIdle:
        with self._lock:
            t = self._clock() if now is None else now
            busy, bubble = self._busy, self._bubble
            if self._busy_since is not None:
                busy += max(0.0, t - self._busy_since)
            if self._waiting_since is not None:
                bubble += max(0.0, t - self._waiting_since)
            idle = max(0.0, (t - self._t0) - busy)
            return BusyIdle(busy, idle, min(bubble, idle))
