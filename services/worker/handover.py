"""Handing request streams over between workers when a transition moves requests.

A request that arrives with a transition gets a buffered stream and an engine callback here until the
dispatcher re-attaches to it (``attach``; nobody attaching within the timeout frees it); the stream of a
request that left ends with ``Moved`` (the worker answers ``moved_to``, and the dispatcher re-attaches at
the new head). Streams are ended only at the commit, so an aborted transition leaves them untouched.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from dataclasses import dataclass

from kunserve.shared.engine.api import FinishReason, TokenEvent
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.log import get_logger
from kunserve.shared.streams import StreamRegistry


@dataclass(frozen=True)
class Moved:
    """Pushed into a request's stream queue: it now lives on another worker."""

    worker_id: str


class StreamHandover:
    """The streams of requests that moved here (waiting for the dispatcher) and away (ended at a commit)."""

    def __init__(self, streams: StreamRegistry[TokenEvent], engine_loop: EngineLoop, timeout_s: float) -> None:
        self.streams = streams
        self.engine_loop = engine_loop
        self.timeout_s = timeout_s
        self._unattached: dict[str, asyncio.Queue] = {}

    def attach(self, request_id: str) -> asyncio.Queue | None:
        """The stream of a request that moved here, once (None: unknown, or attached already)."""
        return self._unattached.pop(request_id, None)

    def receive(self, request_ids: Iterable[str]) -> list[str]:
        """Buffered streams for requests that arrived (their events flow from now on); returns the ones opened
        here (a request whose stream this worker still has keeps it)."""
        opened = []
        for rid in request_ids:
            if rid in self.streams:
                continue
            self._unattached[rid] = self.streams.open(rid)
            opened.append(rid)
            self.engine_loop.register(rid, functools.partial(self.streams.put_threadsafe, rid))
            asyncio.get_running_loop().call_later(self.timeout_s, self._expire_unattached, rid)
        return opened

    def give_back(self, request_ids: Iterable[str]) -> None:
        """Forget requests that arrived with a transition that is being undone (their old owner keeps them)."""
        for rid in request_ids:
            self._unattached.pop(rid, None)
            self.engine_loop.forget(rid)
            self.streams.close(rid)

    def hand_over(self, moved: dict[str, str]) -> None:
        """End the streams of requests that left (request id -> their new head) with Moved."""
        for rid, target in moved.items():
            self.engine_loop.forget(rid)
            self.streams.put(rid, Moved(target))

    def lose(self, request_ids: Iterable[str], why: str) -> None:
        """End the streams of requests that left but could not be handed over (a change failed after its commit)
        as lost: the dispatcher resumes each elsewhere (it re-prefills)."""
        for rid in request_ids:
            self.engine_loop.forget(rid)
            self.streams.put(rid, TokenEvent(rid, -1, 0, FinishReason.LOST, error=why))

    def drop(self, request_ids: Iterable[str]) -> None:
        """Requests that arrived with a change that then failed: stop them here (their old owner ends their streams
        as lost) and forget their buffered streams."""
        ids = list(request_ids)
        for rid in ids:
            self.engine_loop.abort(rid)
        self.give_back(ids)

    def _expire_unattached(self, rid: str) -> None:
        """Nobody attached to a request that moved here (its client is gone): free it."""
        if self._unattached.pop(rid, None) is not None:
            get_logger().warning("moved_request_never_attached", request_id=rid)
            self.engine_loop.abort(rid)
            self.streams.close(rid)
