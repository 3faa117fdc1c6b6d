"""Runs an Engine on a dedicated daemon thread so the asyncio side (RPCs, stats, transfers) stays
responsive while a batch computes (torch releases the GIL inside ops).

Submissions and aborts are commands applied between iterations, so the engine itself needs no lock;
validation happens synchronously in the caller's thread so bad input is rejected at once. Events are
delivered through per-request callbacks *on the engine thread* (the worker hops them onto its event
loop with loop.call_soon_threadsafe). The thread sleeps on a condition variable when idle: no spin.

A failure computing one batch fails that batch's requests (an ERROR event each) and the loop goes on:
one bad request must not take the worker down. Only an engine that keeps failing (MAX_FAILED_STEPS
batches in a row) or a fault outside any batch stops the thread; ``error`` says why, and the worker
then reports NOT_SERVING so a supervisor restarts it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kunserve.shared.engine.api import EngineRequest, EngineStats, FinishReason, InvalidRequest, TokenEvent
from kunserve.shared.engine.engine import Engine, GroupBroken, NotServing
from kunserve.shared.log import get_logger

EventCallback = Callable[[TokenEvent], None]


# A failing batch fails its own requests and the engine goes on; this many failing in a row (no batch
# succeeding in between) means the engine itself is broken: the loop stops and the worker reports NOT_SERVING.
MAX_FAILED_STEPS = 8


class EngineBroken(RuntimeError):
    """Batches keep failing whatever they hold: the engine cannot continue."""


class EngineStopped(RuntimeError):
    """submit() after stop() or after the engine thread died; the worker answers UNAVAILABLE."""


class EngineLoop:
    """Thread-safe front of one Engine: submit / abort / stats from any thread."""

    def __init__(self, engine: Engine, num_threads: int = 1) -> None:
        self.engine = engine
        self.num_threads = max(1, int(num_threads))
        self._cv = threading.Condition()
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._callbacks: dict[str, EventCallback] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.error: BaseException | None = None  # what killed the engine thread, if anything
        self.log = get_logger()
        self._paused = False  # a layout transition holds the engine: commands run, iterations do not
        self._step_started: float | None = None  # time.monotonic() when the iteration in progress began
        self._group_broken: Callable[[Engine, GroupBroken], None] | None = None  # see on_group_broken

    # -- called from any thread --------------------------------------------------------------------------
    def submit(self, request: EngineRequest, on_event: EventCallback) -> None:
        """Queue a request. Raises InvalidRequest (naming the field) at once for bad input, EngineStopped
        when the loop no longer runs. on_event gets every TokenEvent; the last one has finished=True."""
        self.engine.validate(request)  # pure checks against the config and the KV capacity
        with self._cv:
            if self._stop:
                raise EngineStopped("engine is stopped" if self.error is None else f"engine failed: {self.error!r}")
            if request.request_id in self._callbacks:
                raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
            self._callbacks[request.request_id] = on_event
            self._commands.append(("add", request))
            self._cv.notify()
        if not request.offline:  # ConServe Algorithm 2: cut the offline rows of the iteration in flight if it would
            self.engine.online_arrived(len(request.prompt_token_ids), request.request_id)  # make it miss its TTFT SLO

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks (before the next iteration); its callback receives a final
        ABORTED event with token_id -1. False when the request is unknown or already finished."""
        with self._cv:
            if request_id not in self._callbacks:
                return False
            self._commands.append(("abort", request_id))
            self._cv.notify()
            return True

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two iterations (nothing computes meanwhile):
        how memory remaps (drop / restore) and other state changes reach the engine safely.
        The returned future holds fn's result or exception (await it with asyncio.wrap_future)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stop or self._thread is None:
                fut.set_exception(EngineStopped("engine is not running"))
                return fut
            self._commands.append(("call", (fn, fut)))
            self._cv.notify()
        return fut

    def on_group_broken(self, callback: Callable[[Engine, GroupBroken], None]) -> None:
        """callback(engine, exc) runs on the engine thread when a pipeline stage is lost (GroupBroken): the
        worker heals to a whole instance there; without one (or when it raises) the loop stops like on any
        crash."""
        self._group_broken = callback

    def register(self, request_id: str, on_event: EventCallback) -> None:
        """Receive the events of a request a transition installed directly in the engine."""
        with self._cv:
            self._callbacks[request_id] = on_event

    def forget(self, request_id: str) -> EventCallback | None:
        """Stop delivering a request's events, without a final one (a transition moved it away)."""
        with self._cv:
            return self._callbacks.pop(request_id, None)

    def pause(self) -> None:
        """Run no iteration until resume() (calls and commands still run): a transition's quiet point."""
        with self._cv:
            self._paused = True
            self._cv.notify()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def step_seconds(self) -> float:
        """How long the iteration in progress has been running (0 between iterations): a liveness signal for
        an engine that hangs without raising."""
        started = self._step_started
        return time.monotonic() - started if started is not None else 0.0

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest iteration (never blocks on a running step), with the requests
        submitted since and not yet taken by the engine counted as waiting: a report that left them out would let
        the router count a request it routed here as absorbed before the engine has seen it, and route the next one
        here as if this worker were still free."""
        snap = self._stats
        with self._cv:
            queued = [arg for kind, arg in self._commands if kind == "add"]
        return with_submitted(snap, queued) if queued else snap

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start() called twice")
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Abort everything (each open request gets an ABORTED event) and end the thread. Returns whether
        the thread exited within timeout (a step in progress is finished first)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is None:
            self._abort_all()  # never started: still answer every submitted request
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the engine thread -----------------------------------------------------------------------------------
    def emit(self, ev: TokenEvent) -> None:
        """Deliver an event produced outside step() (e.g. by a transition's drain); engine thread only."""
        self._emit(ev)

    def _emit(self, ev: TokenEvent) -> None:
        with self._cv:
            cb = self._callbacks.pop(ev.request_id, None) if ev.finished else self._callbacks.get(ev.request_id)
        if cb is not None:
            try:
                cb(ev)
            except Exception:  # a broken consumer must not kill the engine
                self.log.exception("event_callback_failed", request_id=ev.request_id)

    def _apply_commands(self) -> None:
        taken = False
        while True:
            with self._cv:
                if not self._commands:
                    break
                kind, arg = self._commands.popleft()
            if kind == "add":
                assert isinstance(arg, EngineRequest)
                taken = True
                try:
                    self.engine.add_request(arg)
                except NotServing:  # layers were dropped since submit: the dispatcher retries elsewhere
                    self._emit(TokenEvent(arg.request_id, -1, 0, FinishReason.LOST))
                except InvalidRequest:  # capacity shrank since submit: report it as an abort
                    self._emit(TokenEvent(arg.request_id, -1, 0, FinishReason.ABORTED))
                except Exception as exc:  # this request alone cannot be taken: it fails, the engine goes on
                    self.engine.abort(arg.request_id)
                    self._emit(TokenEvent(arg.request_id, -1, 0, FinishReason.ERROR,
                                          f"the engine could not take the request: {type(exc).__name__}: {exc}"))
            elif kind == "call":
                fn, fut = arg
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as exc:  # handed to the caller, the engine keeps running
                        fut.set_exception(exc)
                self._stats = self.engine.stats()
            elif kind == "abort":
                assert isinstance(arg, str)
                seq = self.engine.seqs.get(arg)
                if seq is not None and self.engine.abort(arg):
                    self._emit(TokenEvent(arg, -1, len(seq.generated), FinishReason.ABORTED))
        if taken:  # no longer queued (stats() counts those): a report during the coming iteration must show them
            self._stats = self.engine.stats()

    def _abort_all(self) -> None:
        """Every request still known gets a final ABORTED event; queued commands are dropped."""
        for rid in list(self.engine.seqs):
            seq = self.engine.seqs[rid]
            self.engine.abort(rid)
            self._emit(TokenEvent(rid, -1, len(seq.generated), FinishReason.ABORTED))
        with self._cv:
            pending = [arg for kind, arg in self._commands if kind == "add"]
            calls = [arg for kind, arg in self._commands if kind == "call"]
            self._commands.clear()
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineStopped("engine stopped before the call ran"))
        with self._cv:
            orphans = [rid for rid in self._callbacks if rid not in {r.request_id for r in pending}]
        for req in pending:
            self._emit(TokenEvent(req.request_id, -1, 0, FinishReason.ABORTED))
        for rid in orphans:  # e.g. an add that raced with a crash
            self._emit(TokenEvent(rid, -1, 0, FinishReason.ABORTED))
        self._stats = self.engine.stats()

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)  # this worker's share of the cores (oversubscription is slow)
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._commands and (self._paused or not self.engine.has_work()):
                        self._cv.wait()
                    if self._stop:
                        break
                self._apply_commands()
                if self._paused:
                    continue
                self._step_started = time.monotonic()
                try:
                    events = self.engine.step()
                except GroupBroken as exc:
                    for ev in exc.events:  # sampled before the break: the heal's recompute goes on after them
                        self._emit(ev)
                    if self._group_broken is None:
                        raise
                    self.log.error("pipeline_group_broken", error=str(exc))
                    self._group_broken(self.engine, exc)  # raises when healing fails: the loop stops
                    events = []
                self._step_started = None
                for ev in events:
                    if ev.finish_reason is FinishReason.ERROR:
                        self.log.error("request_failed", request_id=ev.request_id, error=ev.error)
                    self._emit(ev)
                self._stats = self.engine.stats()
                if self.engine.consecutive_failed_steps >= MAX_FAILED_STEPS:
                    raise EngineBroken(f"{MAX_FAILED_STEPS} batches in a row failed; the last failure: "
                                       f"{events[-1].error if events else 'unknown'}")
        except BaseException as exc:  # surface it: every waiting stream gets an ABORTED event below
            self.error = exc
            self.log.exception("engine_crashed")
            with self._cv:
                self._stop = True
        finally:
            self._abort_all()


def with_submitted(snap: EngineStats, submitted: list[EngineRequest]) -> EngineStats:
    """`snap` with `submitted` (requests not yet in the engine's scheduler) counted as waiting, their prompts as
    queued demand."""
    bs = max(snap.block_size, 1)
    blocks = [-(-len(r.prompt_token_ids) // bs) for r in submitted]
    offline = [b for r, b in zip(submitted, blocks, strict=True) if r.offline]
    arrivals = [r.arrival_time for r in submitted if r.arrival_time > 0]  # 0: not stamped (the scheduler's rule)
    online_arrivals = [r.arrival_time for r in submitted if not r.offline and r.arrival_time > 0]
    return dataclasses.replace(
        snap,
        num_waiting=snap.num_waiting + len(submitted),
        queued_demand_blocks=snap.queued_demand_blocks + sum(blocks),
        num_offline_waiting=snap.num_offline_waiting + len(offline),
        offline_queued_demand_blocks=snap.offline_queued_demand_blocks + sum(offline),
        oldest_waiting_arrival=min((a for a in (snap.oldest_waiting_arrival, *arrivals) if a is not None), default=None),
        oldest_online_waiting_arrival=min((a for a in (snap.oldest_online_waiting_arrival, *online_arrivals)
                                           if a is not None), default=None),
    )
