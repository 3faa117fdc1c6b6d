"""The results side of a pipeline link: the logits of microbatches coming back to the head, in the order
they were sent, or the news that the group broke.

Thread-safe: results arrive on another thread (the event loop for UCX, a stage thread in process) and the
head's engine thread takes them. Once the group is lost every later `take` raises GroupBroken with the
first reason, so the head never waits on a group that cannot answer.
"""

from __future__ import annotations

import queue
from typing import Any

import torch

from kunserve.shared.engine.engine import GroupBroken

_LOST = object()


class LinkResults:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._lost: str | None = None

    def deliver(self, mb_id: int, out: torch.Tensor) -> None:
        self._queue.put((mb_id, out))

    def lost(self, why: str) -> None:
        """The group broke (first reason wins); a head blocked in `take` wakes up with GroupBroken."""
        if self._lost is None:
            self._lost = why
        self._queue.put((_LOST, why))

    def take(self, mb_id: int, block: bool) -> torch.Tensor | None:
        """Microbatch `mb_id`'s output: the oldest in flight. None when not back yet and not `block`."""
        if self._lost is not None:
            raise GroupBroken(self._lost)
        try:
            got, value = self._queue.get(block=block, timeout=self.timeout_s if block else None)
        except queue.Empty:
            if block:
                raise GroupBroken(f"no result for microbatch {mb_id} within {self.timeout_s} s") from None
            return None
        if got is _LOST:
            raise GroupBroken(str(value))
        if got != mb_id:
            raise GroupBroken(f"results out of order: expected microbatch {mb_id}, got {got}")
        return value
