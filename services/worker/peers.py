"""Transfer links from this worker to the other workers of a transition (KV exchange, activations, pings).

Links are opened ahead of any transition (ConnectPeers) and checked again at each Prepare. One connect per
peer at a time, never cancelled half way: the RPC that asked for it may be cancelled (its memory manager
died), but abandoning UCX's endpoint set-up in the middle can crash the process; the connect is bounded by
its own timeout.
"""

from __future__ import annotations

import asyncio
import functools

from kunserve.shared.policy.cluster import Unit
from kunserve.shared.transfer.service import TransferService


class PeerUnreachable(RuntimeError):
    """A peer's link cannot be opened; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerLinks:
    def __init__(self, worker_id: str, svc: TransferService) -> None:
        self.worker_id = worker_id
        self.svc = svc
        self._connecting: dict[str, asyncio.Task] = {}  # links being opened, by peer

    async def link_members(self, units: list[Unit], timeout_s: float) -> None:
        """Links to every other member of `units`; usually already open (connect)."""
        want = {m.worker_id: m.transfer_address for u in units for m in u.members if m.worker_id != self.worker_id}
        for wid, addr in sorted(want.items()):
            await self.link(wid, addr, timeout_s)

    async def connect(self, peers: dict[str, str], timeout_s: float) -> dict[str, str]:
        """Open links to `peers` (worker id -> transfer address) concurrently; returns why each failed one
        failed. Serving goes on meanwhile: nothing is paused."""
        async def one(wid: str, addr: str) -> tuple[str, str]:
            try:
                await self.link(wid, addr, timeout_s)
                return wid, ""
            except PeerUnreachable as exc:
                return wid, str(exc)

        tried = await asyncio.gather(*(one(w, a) for w, a in sorted(peers.items()) if w != self.worker_id))
        return {wid: why for wid, why in tried if why}

    async def link(self, wid: str, addr: str, timeout_s: float) -> None:
        if wid in self.svc.peers:
            return
        if not addr:
            raise PeerUnreachable("INVALID_ARGUMENT", f"no transfer address for worker {wid}")
        host, _, port = addr.rpartition(":")
        if (wid == self.worker_id or addr == self.svc.address or not host or not port.isdigit()
                or not 0 < int(port) < 65536):
            raise PeerUnreachable("INVALID_ARGUMENT", f"transfer address {addr!r} of worker {wid!r}: expected "
                                  "host:port of another worker")
        task = self._connecting.get(wid)
        if task is None:
            # expect=wid: a listener with another name is refused before its link is registered
            task = asyncio.ensure_future(self.svc.connect(host, int(port), timeout=timeout_s, expect=wid))
            self._connecting[wid] = task
            task.add_done_callback(functools.partial(self._connected, wid))
        try:
            await asyncio.shield(task)
        except Exception as exc:  # (a cancelled RPC raises CancelledError, a BaseException: it passes through)
            raise PeerUnreachable("UNAVAILABLE", f"cannot reach worker {wid} at {addr}: {exc}") from None

    async def settle(self, timeout_s: float) -> None:
        """Let links still being opened finish (bounded) before the transfer service closes: an endpoint
        abandoned in the middle of its set-up can crash the process inside UCX."""
        if self._connecting:
            await asyncio.wait(list(self._connecting.values()), timeout=timeout_s)

    def _connected(self, wid: str, task: asyncio.Task) -> None:
        if self._connecting.get(wid) is task:
            del self._connecting[wid]
        if not task.cancelled():
            task.exception()  # its outcome reached whoever awaited it; nobody may have (the RPC went away)
