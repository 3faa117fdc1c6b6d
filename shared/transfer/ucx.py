"""UCX (ucxx) behind the transfer service's Endpoint/Transport interface.

ucxx is imported lazily: a process that never opens the data plane does not need it. Defaults applied
before the first import unless the environment already sets them (see MEASURED.md):
``UCXPY_PROGRESS_MODE=blocking``, ``UCX_TLS=tcp`` (works everywhere, no GPU needed; on a GPU cluster set
e.g. ``UCX_TLS=rc,cuda_copy,cuda_ipc,tcp``), ``UCX_WARN_UNUSED_ENV_VARS=n``.

Progress. ucxx's own ``Endpoint.send/recv`` wait in ``wait_yield`` (``while not done: await sleep(0)``)
in blocking mode, and its blocking progress task arms the worker only once. A transfer service always
has a receive posted, so that spins the event loop: ~45% of a core per idle process here, and messages
that wait for the next accidental progress call (5–20 ms for 64 KiB). So ``UcxEndpoint`` posts tag
requests itself and ``_Progress`` completes them: the asyncio loop watches the UCX worker's epoll fd;
on every event, and right after posting a request, it progresses the worker, resolves the futures of
completed requests, and re-arms the worker (``ucp_worker_arm``), repeating while arming reports pending
events. A sweep progresses for at most ``SWEEP_BUDGET_S``, then yields to the loop and continues with
``call_soon``, so a streaming transfer never blocks the event loop for long. An idle process then uses
~0% CPU and a message is handled as soon as its bytes arrive. A slow safety sweep (``SAFETY_SWEEP_S``)
runs while requests are pending, in case an event is ever missed.
ucxx's blocking-mode progress task is created (ucxx expects it) but its reader is replaced and its
tasks cancelled, so only this class progresses the worker on this loop.

Tags: the same per-connection tags as ``ucxx.Endpoint.send/recv(tag=t)`` (``hash64bits(ep tag, hash(t))``).
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from typing import Any

from .endpoint import AcceptCallback, EndpointClosed

UCX_ENV_DEFAULTS = {
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_TLS": "tcp",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
SAFETY_SWEEP_S = 0.05
SWEEP_BUDGET_S = 0.0005  # progress at most this long per sweep before yielding to the event loop
SETTLE_S = 5.0  # at most this long, closing, for links still being set up


class UcxUnavailable(ImportError):
    pass


class UcxLinkError(ConnectionError):
    """A UCX operation on a live endpoint failed (peer gone, reset, truncated message)."""


def import_ucxx() -> Any:
    for k, v in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        import ucxx
    except ImportError as exc:
        raise UcxUnavailable(
            "the transfer service needs UCX through ucxx: `pip install ucxx-cu12` (Linux x86-64; it works "
            f"without a GPU over TCP). Import failed: {exc}") from exc
    return ucxx


def ucx_available() -> bool:
    try:
        import_ucxx()
    except UcxUnavailable:
        return False
    return True


class _Progress:
    """Completes tag requests of one UCX worker on one asyncio loop (see the module docstring)."""

    _instances: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Progress] = weakref.WeakKeyDictionary()

    @classmethod
    def get(cls, loop: asyncio.AbstractEventLoop) -> _Progress:
        prog = cls._instances.get(loop)
        if prog is None:
            prog = cls._instances[loop] = cls(loop)
        return prog

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        import ucxx.core

        ctx = ucxx.core._get_ctx()
        if ctx.progress_mode != "blocking":
            raise RuntimeError(f"the transfer service needs UCXPY_PROGRESS_MODE=blocking, not {ctx.progress_mode!r}")
        ctx.continuous_ucx_progress(loop)  # ucxx's own progress first, so that our reader replaces its reader
        # and its tasks stop: its once-a-second progress() would complete requests behind our back and
        # leave the worker unarmed (we would then only notice at the next safety sweep)
        from ucxx._lib_async.application_context import ProgressTasks

        theirs = ProgressTasks.get(loop)
        for task in getattr(theirs, "_tasks", ()):
            if task is not None:
                task.cancel()
        self.worker = ctx.worker
        self.loop = loop
        self.fd = self.worker.epoll_file_descriptor
        self.pending: dict[int, tuple[Any, asyncio.Future, Any, Any]] = {}
        self._next = 0
        self._safety: asyncio.TimerHandle | None = None
        self._again: asyncio.Handle | None = None
        loop.add_reader(self.fd, self.sweep)
        self.sweep()

    def submit(self, request: Any, buf: Any, owner: Any) -> tuple[int, asyncio.Future]:
        fut = self.loop.create_future()
        self._next += 1
        self.pending[self._next] = (request, fut, buf, owner)  # keep the buffer alive until completion
        self.sweep()
        return self._next, fut

    def sweep(self) -> None:
        if self._again is not None:  # called early (an fd event, a new request): one continuation at a time
            self._again.cancel()
            self._again = None
        deadline = time.perf_counter() + SWEEP_BUDGET_S
        while True:
            busy = False
            while self.worker.progress_once():
                if time.perf_counter() > deadline:
                    busy = True
                    break
            self._resolve()
            if busy:
                # A large transfer is streaming: continue after the loop's other ready callbacks and tasks
                # ran, so that it never blocks the event loop for more than about SWEEP_BUDGET_S at a time.
                self._again = self.loop.call_soon(self.sweep)
                break
            if self.worker.arm():
                break
        if self.pending and self._safety is None:
            self._safety = self.loop.call_later(SAFETY_SWEEP_S, self._safety_sweep)

    def _safety_sweep(self) -> None:
        self._safety = None
        self.sweep()

    def _resolve(self) -> None:
        done = [k for k, (req, fut, _, _) in self.pending.items() if req.completed or fut.done()]
        for k in done:
            req, fut, _, _ = self.pending.pop(k)
            if fut.done():
                continue
            try:
                req.check_error()
            except Exception as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def abandon(self, owner: Any, exc: BaseException) -> None:
        """Fail what ``owner`` still waits for (its endpoint closed and UCX did not complete the requests)."""
        self.sweep()
        for k in [k for k, v in self.pending.items() if v[3] is owner]:
            _, fut, _, _ = self.pending[k]
            if not fut.done():
                fut.set_exception(exc)
            # the entry stays until UCX completes (cancels) the request: its buffer must outlive it


class UcxEndpoint:
    def __init__(self, ep: Any, address: str) -> None:
        from ucxx._lib.arr import Array
        from ucxx._lib_async.utils import hash64bits
        from ucxx.types import Tag, TagMaskFull

        self._ep = ep
        self._address = address
        self._Array, self._Tag, self._mask, self._hash = Array, Tag, TagMaskFull, hash64bits
        self._progress = _Progress.get(asyncio.get_running_loop())
        self.closed = False

    @property
    def address(self) -> str:
        return self._address

    def _tag(self, which: str, tag: int) -> Any:
        return self._Tag(self._hash(self._ep._tags[which], hash(tag)))

    async def _wait(self, op: str, post: Any, buf: Any) -> None:
        if self.closed:
            raise EndpointClosed(f"UCX endpoint to {self._address} is closed")
        try:
            self._ep._ep.raise_on_error()
            arr = self._Array(buf)
            _, fut = self._progress.submit(post(arr), arr, self)
            await fut
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind = EndpointClosed if self.closed else UcxLinkError
            raise kind(f"UCX {op} to {self._address}: {type(exc).__name__}: {exc}") from exc

    async def send(self, buf: Any, tag: int) -> None:
        t = self._tag("msg_send", tag)
        await self._wait("send", lambda arr: self._ep._ep.tag_send(arr, t), buf)

    async def recv(self, buf: Any, tag: int) -> None:
        t = self._tag("msg_recv", tag)
        await self._wait("recv", lambda arr: self._ep._ep.tag_recv(arr, t, self._mask), buf)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._ep.abort(period=10**9)  # cancels outstanding requests; waits at most ~1 s per step
        finally:
            self._progress.abandon(self, EndpointClosed(f"UCX endpoint to {self._address} closed"))


class UcxTransport:
    def __init__(self) -> None:
        self._ucxx = import_ucxx()
        self._listener: Any = None
        self._tasks: set[asyncio.Task] = set()

    async def listen(self, port: int, on_accept: AcceptCallback) -> int:
        async def handler(ep: Any) -> None:
            # Run the acceptor as our own task: the service keeps the endpoint; the ucxx handler returns.
            task = asyncio.get_running_loop().create_task(on_accept(UcxEndpoint(ep, "incoming")))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._listener = self._ucxx.create_listener(handler, port=port)
        _Progress.get(asyncio.get_running_loop())
        return int(self._listener.port)

    async def connect(self, host: str, port: int, timeout: float) -> UcxEndpoint:
        _Progress.get(asyncio.get_running_loop())
        ep = await asyncio.wait_for(self._ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout)
        return UcxEndpoint(ep, f"{host}:{port}")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._tasks:
            # Handshakes of incoming links finish first (each is bounded by the connect timeout): an endpoint
            # abandoned in the middle of its set-up can crash the process inside UCX.
            await asyncio.wait(list(self._tasks), timeout=SETTLE_S)
        for t in list(self._tasks):
            t.cancel()
