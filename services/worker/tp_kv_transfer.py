"""An in-place TP change's KV moves over the transfer service's KV-exchange class (Gyges §4.3 moves the heads' KV
between the members over the same channel KunServe's drops use), instead of the instance's gloo group.

`tp_transform.run_moves` calls the exchange from the engine thread once per layer and phase, with a tag unique within
the change. Each call submits one message per peer it sends to (the sub-blocks it read, staged in host memory, named
``<change>:<tag>``) and waits, on the worker's event loop, for one message from every peer it expects under the
same tag, copying each into its receive buffer. A peer ahead of this member may already send a later tag's message:
it is kept until that call. A message of another change (a stale one, or a drop's KV) is dropped; only one change
of either kind runs at a time (the memory manager's transition lock). A peer that sends nothing within the timeout,
a lost link or a message of the wrong size raises InstanceBroken, which the transform heals as it does a gloo
failure. The sends must stay alive until they are on the wire: the call returns only once they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from kunserve.shared.engine.engine import InstanceBroken
from kunserve.shared.log import get_logger
from kunserve.shared.transfer.framing import KV_EXCHANGE
from kunserve.shared.transfer.service import TransferService


class TransferSubBlocks:
    """A `tp_transform.Exchange` between the members `members` (worker ids by rank) over `svc`, for the change named
    `change` (the same on every member)."""

    def __init__(self, svc: TransferService, loop: asyncio.AbstractEventLoop, members: Sequence[str], rank: int,
                 change: str, timeout_s: float) -> None:
        self.svc = svc
        self.loop = loop
        self.members = members
        self.rank = rank
        self.change = change
        self.timeout_s = timeout_s
        self._early: dict[tuple[str, int], torch.Tensor] = {}  # (peer, tag) -> a message that came before its call
        self.sent_bytes = self.received_bytes = self.kept_early = 0

    @classmethod
    def between(cls, svc: TransferService | None, loop: asyncio.AbstractEventLoop, members: Sequence[str], rank: int,
                change: str, timeout_s: float) -> TransferSubBlocks | None:
        """The exchange when this worker has a transfer link to every other member; None (gloo, logged) when not."""
        missing = [m for r, m in enumerate(members) if r != rank and (svc is None or m not in svc.peers)]
        if missing:
            get_logger().info("tp_kv_over_gloo", change=change,
                              reason="no transfer service" if svc is None else f"no transfer link to {missing}")
            return None
        assert svc is not None
        return cls(svc, loop, members, rank, change, timeout_s)

    def __call__(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int) -> None:
        """Engine thread: the exchange of one phase (module docstring)."""
        fut = asyncio.run_coroutine_threadsafe(self._exchange(sends, recvs, tag), self.loop)
        try:
            fut.result(self.timeout_s + 5.0)  # the coroutine times out first and says who did not send
        except Exception as exc:  # noqa: BLE001 - every failure of a phase breaks the change alike
            if not fut.done():  # the event loop never ran it to the end
                fut.cancel()
                raise InstanceBroken(f"in-place TP KV exchange {self.change}:{tag}: no answer within "
                                     f"{self.timeout_s} s") from None
            raise InstanceBroken(f"in-place TP KV exchange {self.change}:{tag} failed: {exc}") from None

    async def _exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int) -> None:
        name = f"{self.change}:{tag}"
        handles = [self.svc.submit(self.members[r], KV_EXCHANGE, t, name=name) for r, t in sorted(sends.items())]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in sends.values())
        want = {self.members[r]: r for r in recvs}
        for peer in list(want):
            early = self._early.pop((peer, tag), None)
            if early is not None:
                self._take(recvs[want.pop(peer)], early, peer)
        deadline = time.monotonic() + self.timeout_s
        while want:
            try:
                msg = await self.svc.recv(KV_EXCHANGE, timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"no sub-blocks from {', '.join(sorted(want))} within {self.timeout_s} s") from None
            change, _, got = msg.header.name.rpartition(":")
            if change != self.change or not got.isdigit() or msg.peer not in self.members:
                get_logger().warning("stale_kv_message_dropped", peer=msg.peer, name=msg.header.name)
                continue
            if int(got) == tag and msg.peer in want:
                self._take(recvs[want.pop(msg.peer)], msg.data, msg.peer)
            elif int(got) > tag:
                self._early[(msg.peer, int(got))] = msg.data
                self.kept_early += 1
            else:
                get_logger().warning("stale_kv_message_dropped", peer=msg.peer, name=msg.header.name)
        for h in handles:  # the staged sends must outlive their chunks on the wire
            await h.wait(max(0.1, deadline - time.monotonic()))

    def _take(self, into: torch.Tensor, data: torch.Tensor, peer: str) -> None:
        nbytes = into.numel() * into.element_size()
        if data.dtype != into.dtype or data.numel() != into.numel():
            raise ValueError(f"{peer} sent {data.numel()} {data.dtype} elements, {into.numel()} {into.dtype} expected")
        with torch.inference_mode():  # the buffers were made under the engine thread's inference mode
            into.copy_(data.reshape(into.shape))
        self.received_bytes += nbytes
