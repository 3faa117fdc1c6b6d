"""The lease that keeps a prepared transition from being orphaned.

From Prepare on, a worker holds a lease (``TransitionSpec.lease_s``) that every step and every
``RenewTransition`` of the memory manager extends. A worker that hears nothing for that long (its memory
manager died, or hangs) aborts on its own, exactly as ``AbortTransition`` would; never while a step runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

DEFAULT_LEASE_S = 10.0  # a spec without lease_s: how long a paused worker waits for its memory manager
MAX_LEASE_S = 3600.0


class TransitionLease:
    """Expires `lease_s` after the latest extend(); then calls the expiry, holding the steps' lock."""

    def __init__(self, steps: asyncio.Lock) -> None:
        self.steps = steps  # one transition step at a time: the expiry waits for a running one
        self.lease_s = DEFAULT_LEASE_S
        self._until = 0.0  # time.monotonic() after which an idle, still held transition expires
        self._watch: asyncio.Task | None = None  # held so the task is not garbage-collected mid-wait

    def begin(self, lease_s: float, held: Callable[[], bool], expire: Callable[[], Awaitable[None]]) -> None:
        """Start the lease of a prepared transition: `expire()` runs once it ran out while `held()` (the
        transition is still the one prepared) and no step was running."""
        self.lease_s = lease_s or DEFAULT_LEASE_S
        self.extend()
        self._watch = asyncio.get_running_loop().create_task(self._watch_until_expired(held, expire))

    def extend(self) -> None:
        self._until = time.monotonic() + self.lease_s

    async def _watch_until_expired(self, held: Callable[[], bool], expire: Callable[[], Awaitable[None]]) -> None:
        while held():
            left = self._until - time.monotonic()
            if left > 0 or self.steps.locked():
                await asyncio.sleep(min(max(left, 0.05), 1.0))
                continue
            async with self.steps:
                if not held() or time.monotonic() < self._until:
                    continue  # a step or a renewal came in meanwhile
                await expire()
            return
