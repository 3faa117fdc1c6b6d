"""Runs an Engine on a dedicated thread so the asyncio side (RPCs, stats, transfers) stays responsive
while a batch computes (torch releases the GIL inside ops).

Submissions and aborts are commands applied between iterations; validation happens synchronously in
the caller's thread so bad input is rejected at once. Events are delivered through per-request
callbacks on the engine thread (the worker hops them onto its event loop).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

import torch

from kunserve.shared.engine.api import EngineRequest, EngineStats, FinishReason, InvalidRequest, TokenEvent
from kunserve.shared.engine.engine import Engine
from kunserve.shared.log import get_logger

EventCallback = Callable[[TokenEvent], None]


class EngineLoop:
    def __init__(self, engine: Engine, num_threads: int = 1) -> None:
        self.engine = engine
        self.num_threads = num_threads
        self._cv = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._callbacks: dict[str, EventCallback] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.error: BaseException | None = None
        self.log = get_logger()

    # -- called from any thread --------------------------------------------------------------------------
    def submit(self, request: EngineRequest, on_event: EventCallback) -> None:
        self.engine.validate(request)  # pure checks against config and capacity
        with self._cv:
            if self._stop:
                raise RuntimeError("engine is stopping")
            if request.request_id in self._callbacks:
                raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
            self._callbacks[request.request_id] = on_event
            self._commands.append(("add", request))
            self._cv.notify()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; its callback receives a final ABORTED event."""
        with self._cv:
            if request_id not in self._callbacks:
                return False
            self._commands.append(("abort", request_id))
            self._cv.notify()
            return True

    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        torch.set_num_threads(self.num_threads)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------------------
    def _emit(self, ev: TokenEvent) -> None:
        cb = self._callbacks.get(ev.request_id)
        if ev.finished:
            with self._cv:
                self._callbacks.pop(ev.request_id, None)
        if cb is not None:
            try:
                cb(ev)
            except Exception:  # a broken consumer must not kill the engine
                self.log.exception("event_callback_failed", request_id=ev.request_id)

    def _apply_commands(self) -> None:
        while True:
            with self._cv:
                if not self._commands:
                    return
                kind, arg = self._commands.popleft()
            if kind == "add":
                try:
                    self.engine.add_request(arg)
                except InvalidRequest:  # capacity changed since submit; report it as an abort
                    self._emit(TokenEvent(arg.request_id, -1, 0, FinishReason.ABORTED))
            elif kind == "abort":
                seq = self.engine.seqs.get(arg)
                if self.engine.abort(arg):
                    self._emit(TokenEvent(arg, -1, len(seq.generated), FinishReason.ABORTED))

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._commands and not self.engine.has_work():
                        self._cv.wait()
                    if self._stop:
                        break
                self._apply_commands()
                for ev in self.engine.step():
                    self._emit(ev)
                self._stats = self.engine.stats()
        except BaseException as exc:  # surface it: every waiting stream gets an ABORTED event below
            self.error = exc
            self.log.exception("engine_crashed")
        finally:
            for rid in list(self.engine.seqs):
                seq = self.engine.seqs[rid]
                self.engine.abort(rid)
                self._emit(TokenEvent(rid, -1, len(seq.generated), FinishReason.ABORTED))
            with self._cv:
                pending = [arg for kind, arg in self._commands if kind == "add"]
                self._commands.clear()
            for req in pending:
                self._emit(TokenEvent(req.request_id, -1, 0, FinishReason.ABORTED))
            self._stats = self.engine.stats()
