"""UCX (ucxx) behind the transfer service's Endpoint/Transport interface.

ucxx is imported lazily: a process that never opens the data plane does not need it. Defaults applied
before the first import unless the environment already sets them (see MEASURED.md):
``UCXPY_PROGRESS_MODE=blocking`` (best latency; ``thread-polling`` starves a 2-core machine),
``UCX_TLS=tcp`` (works everywhere, no GPU needed; set e.g. ``UCX_TLS=rc,cuda_copy,cuda_ipc,tcp`` on a GPU
cluster), ``UCX_WARN_UNUSED_ENV_VARS=n``.

One UCX context per process, progressed by the asyncio loop that first uses it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from .endpoint import AcceptCallback, EndpointClosed

UCX_ENV_DEFAULTS = {
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_TLS": "tcp",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


class UcxUnavailable(ImportError):
    pass


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


class UcxLinkError(ConnectionError):
    """A UCX operation on a live endpoint failed (peer gone, reset, truncated message)."""


class UcxEndpoint:
    def __init__(self, ep: Any, address: str) -> None:
        self._ep = ep
        self._address = address
        self.closed = False

    @property
    def address(self) -> str:
        return self._address

    async def send(self, buf: Any, tag: int) -> None:
        if self.closed:
            raise EndpointClosed(f"UCX endpoint to {self._address} is closed")
        try:
            await self._ep.send(buf, tag=tag)
        except Exception as exc:
            kind = EndpointClosed if self.closed else UcxLinkError
            raise kind(f"UCX send to {self._address}: {type(exc).__name__}: {exc}") from exc

    async def recv(self, buf: Any, tag: int) -> None:
        if self.closed:
            raise EndpointClosed(f"UCX endpoint to {self._address} is closed")
        try:
            await self._ep.recv(buf, tag=tag)
        except Exception as exc:
            kind = EndpointClosed if self.closed else UcxLinkError
            raise kind(f"UCX recv to {self._address}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self._ep.close(period=10**9)  # at most ~1 s per internal step
        except Exception:
            self._ep.abort(period=10**9)


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
        return int(self._listener.port)

    async def connect(self, host: str, port: int, timeout: float) -> UcxEndpoint:
        ep = await asyncio.wait_for(
            self._ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout)
        return UcxEndpoint(ep, f"{host}:{port}")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for t in list(self._tasks):
            t.cancel()
