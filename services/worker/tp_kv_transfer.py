"""An in-place TP change's KV moves over the transfer service's KV-exchange class (Gyges §4.3 moves the heads' KV
between the members over the same channel KunServe's drops use), instead of the instance's gloo group.

`tp_transform.run_moves` calls the exchange from the engine thread once per layer and phase, on every member, with a
tag unique within the change. The members go in lockstep, as gloo's matched sends and receives kept them: each call
submits one message to every other member (the sub-blocks it sends there, staged in host memory, or nothing), named
``<change>:<tag>``, and waits, on the worker's event loop, for one message from every other member under the same
tag, copying those it expects into their receive buffers; so no member runs more than one phase ahead of another
and a member holds at most one phase of its peers' sub-blocks beyond its own staging. A message that comes before
its call (its sender one phase ahead) is kept for it. A message of another change (an earlier change's, or a drop's
KV) is dropped: the change's name carries rank 0's nonce (tp_in_place.py), and a drop's KV lands only outside an
in-place change (the memory manager's transition lock; a member refuses to change while a transition's KV is still
landing). A peer that sends nothing within the timeout, whose link is lost, or that sends the wrong size raises
InstanceBroken, which the transform heals as it does a gloo failure. The sends must stay alive until they are on the
wire: the call returns only once they are.
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

LINK_CHECK_S = 0.25  # how often a wait for the peers' messages looks at their links


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

    def named(self, change: str) -> TransferSubBlocks:
        """The same exchange for the change named `change` (fresh: nothing kept early)."""
        return TransferSubBlocks(self.svc, self.loop, self.members, self.rank, change, self.timeout_s)

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
        peers = [r for r in range(len(self.members)) if r != self.rank]
        nothing = torch.empty(0, dtype=torch.uint8)
        handles = [self.svc.submit(self.members[r], KV_EXCHANGE, sends.get(r, nothing), name=name) for r in peers]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in sends.values())
        want = {self.members[r]: r for r in peers}
        for peer in list(want):
            early = self._early.pop((peer, tag), None)
            if early is not None:
                self._take(recvs.get(want.pop(peer)), early, peer)
        deadline = time.monotonic() + self.timeout_s
        while want:
            lost = [p for p in want if p not in self.svc.peers]
            if lost:
                raise TimeoutError(f"the transfer link to {', '.join(sorted(lost))} is lost")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no sub-blocks from {', '.join(sorted(want))} within {self.timeout_s} s")
            try:  # a short wait, so a lost link is seen within it
                msg = await self.svc.recv(KV_EXCHANGE, timeout=min(left, LINK_CHECK_S))
            except TimeoutError:
                continue
            change, _, got = msg.header.name.rpartition(":")
            if (change != self.change or not got.isdigit() or msg.peer not in self.members
                    or msg.peer not in want and int(got) <= tag):
                get_logger().warning("stale_kv_message_dropped", peer=msg.peer, name=msg.header.name)
            elif int(got) == tag:
                self._take(recvs.get(want.pop(msg.peer)), msg.data, msg.peer)
            else:  # its sender is one phase ahead
                self._early[(msg.peer, int(got))] = msg.data
                self.kept_early += 1
        for h in handles:  # the staged sends must outlive their chunks on the wire
            await h.wait(self.timeout_s)

    def _take(self, into: torch.Tensor | None, data: torch.Tensor, peer: str) -> None:
        """Copy a peer's message into its buffer; a peer this member expects nothing from sends nothing."""
        if into is None:
            if data.numel():
                raise ValueError(f"{peer} sent {data.numel()} elements where nothing was expected")
            return
        if data.dtype != into.dtype or data.numel() != into.numel():
            raise ValueError(f"{peer} sent {data.numel()} {data.dtype} elements, {into.numel()} {into.dtype} expected")
        with torch.inference_mode():  # the buffers were made under the engine thread's inference mode
            into.copy_(data.reshape(into.shape))
        self.received_bytes += into.numel() * into.element_size()
