"""The KV exchange of a transition: each flow (``shared/policy/transition_plan.kv_flows``) as one message on
the transfer service's KV-exchange class.

A flow's message is its parts' blocks in order, each part as ``Engine.export_blocks`` lays it out (layer-major
over the part's layers); the receiver computes the same flows from the same spec, so it knows which messages
to wait for and how to slice them (``import_flow``; ``landing_slices`` when the KV lands while the engine
serves). The engine copies the bytes; this module only packs, sends, receives and unpacks.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Iterator

import torch

from kunserve.shared.engine.engine import Engine
from kunserve.shared.log import get_logger
from kunserve.shared.policy.transition_plan import Flow, FlowPart
from kunserve.shared.transfer.framing import KV_EXCHANGE
from kunserve.shared.transfer.service import SendHandle, TransferService

Pair = tuple[str, str]  # (source worker, destination worker)


class ExportStaging:
    """Memory for the KV a transition copies out, allocated and faulted in while the engine still serves (at
    Prepare), so the copy inside the pause runs at memory bandwidth: on a VM of this project's kind the page
    faults of a fresh allocation cost ~20x the copy itself (128 MiB: ~200 ms against ~8 ms). Views are handed
    out in order; a message that does not fit any more gets a fresh allocation."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(max(0, nbytes), dtype=torch.uint8)
        self.buf.fill_(0)  # touch every page now
        self.used = 0

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    def reset(self) -> None:
        """Hand out views from the start again: only once nothing uses the previous ones (sent and landed)."""
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        n = math.prod(shape) * dtype.itemsize
        if self.used + n > self.buf.numel():
            return None
        view = self.buf[self.used:self.used + n].view(dtype).view(shape)
        self.used += -(-n // self.ALIGN) * self.ALIGN
        return view


class StagingReserve:
    """The export staging kept between transitions and grown while the engine serves, so a drop decided under
    a burst finds its staging already faulted in: allocating it at Prepare costs the decision ~1.5 ms per MiB of
    KV on this project's VM (the page faults), which is what made the decision -> first queued token grow with
    the KV moved.

    The reserve holds at most one idle buffer. A transition borrows it (``lend``) and gives it back once nothing
    uses its views any more (every send done, everything landed); a transition that failed half-way keeps it
    (a send may still read it) and the next one allocates afresh. ``grow`` sizes the idle buffer to the next
    quarter of the upper bound (every held layer's whole KV) above the KV in use, so it reallocates at most
    four times as a burst fills memory. The price is host memory: up to the peak KV in use of this worker,
    never more than its whole KV (README, "Limits")."""

    STEPS = 4

    def __init__(self) -> None:
        self.idle: ExportStaging | None = None
        self.lent = False  # a transition holds a buffer: growing now would only add a second one
        self.allocations = 0

    @classmethod
    def target(cls, needed: int, upper: int) -> int:
        """The size to hold for `needed` bytes: the next multiple of upper / STEPS at or above it (at most
        `upper`, at least `needed`)."""
        if upper <= 0:
            return max(0, needed)
        step = -(-upper // cls.STEPS)
        return max(needed, min(upper, -(-needed // step) * step))

    def lend(self, nbytes: int) -> ExportStaging | None:
        """The idle buffer, emptied, when it holds `nbytes`; else None (the caller allocates one, cold)."""
        self.lent = True
        s = self.idle
        if s is None or s.capacity < nbytes:
            self.idle = None  # too small: the cold allocation replaces it
            return None
        self.idle = None
        s.reset()
        return s

    def give_back(self, staging: ExportStaging) -> None:
        """Nothing uses `staging`'s views any more: keep it idle unless the idle one is larger."""
        self.lent = False
        self.stock(staging)

    def stock(self, staging: ExportStaging) -> None:
        """Keep `staging` (unused) idle unless the idle one is larger."""
        if self.idle is None or self.idle.capacity < staging.capacity:
            self.idle = staging

    def lost(self) -> None:
        """The transition that borrowed a buffer failed half-way: it stays with that transition's sends."""
        self.lent = False

    def allocate(self, nbytes: int) -> ExportStaging:
        """A new buffer of `nbytes`, faulted in (call it off the event loop: it takes ~1.5 ms per MiB)."""
        self.allocations += 1
        return ExportStaging(nbytes)

    def wants(self, needed: int, upper: int) -> int:
        """Bytes to allocate now so that the idle buffer covers `needed` (0: it does, or one is lent out)."""
        if self.lent:
            return 0
        have = self.idle.capacity if self.idle is not None else 0
        want = self.target(needed, upper)
        return want if want > have else 0


def export_flow(engine: Engine, flow: Flow, staging: ExportStaging | None = None) -> torch.Tensor:
    """The flow's message: the KV of every part's old blocks, parts in order (engine thread), in `staging`
    when it has room."""
    slab, dtype = engine.kv_slab()
    shape = (flow.num_block_layers(), *slab)
    out = staging.take(shape, dtype) if staging is not None else None
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    at = 0
    for p in flow.parts:
        n = p.num_layers * len(p.old_blocks)
        engine.export_blocks(p.old_blocks, p.layer_start, p.layer_end, out=out[at:at + n])
        at += n
    return out


def import_flow(engine: Engine, flow: Flow, data: torch.Tensor) -> None:
    """Write a flow's message at every part's new blocks (engine thread); checks its length first."""
    for p, blocks in _split(flow, data):
        engine.import_blocks(p.new_blocks, p.layer_start, p.layer_end, blocks)


def _split(flow: Flow, data: torch.Tensor) -> Iterator[tuple[FlowPart, torch.Tensor]]:
    """Every part of a flow with its slice of the message (ValueError first when the length is wrong)."""
    if data.shape[0] != flow.num_block_layers():
        raise ValueError(f"KV exchange: {data.shape[0]} blocks received from {flow.src}, "
                         f"{flow.num_block_layers()} expected")
    at = 0
    for p in flow.parts:
        n = p.num_layers * len(p.new_blocks)
        yield p, data[at:at + n]
        at += n


def send_flows(svc: TransferService, outgoing: dict[Pair, Flow], messages: dict[str, torch.Tensor],
               epoch: int) -> tuple[list[SendHandle], int]:
    """Submit every outgoing flow's message to its destination (a local one stays); returns the handles and
    the bytes submitted."""
    handles, sent = [], 0
    for (src, dst), flow in outgoing.items():
        if dst == src:
            continue
        data = messages[dst]
        handles.append(svc.submit(dst, KV_EXCHANGE, data, request_ids=[pt.request_id for pt in flow.parts],
                                  epoch=epoch, name=f"kv:{epoch}"))
        sent += data.numel() * data.element_size()
    return handles, sent


async def arrivals(svc: TransferService, incoming: dict[Pair, Flow], me: str, epoch: int, timeout_s: float,
                   wanted: Callable[[], bool] = lambda: True) -> AsyncIterator[tuple[Flow, torch.Tensor]]:
    """Every incoming flow with its message, in the order they arrive; messages of another epoch or from a
    worker that sends this one nothing are dropped. Stops early once `wanted()` turns false (checked at
    least every 0.25 s: the layout the KV was meant for is gone). TimeoutError names who did not send in
    time."""
    by_src = {f.src: f for (src, dst), f in incoming.items() if dst == me and src != me}
    deadline = time.monotonic() + timeout_s
    while by_src and wanted():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"KV exchange: nothing from {', '.join(sorted(by_src))} within {timeout_s} s")
        try:
            msg = await svc.recv(KV_EXCHANGE, timeout=min(left, 0.25))
        except TimeoutError:
            continue
        if msg.header.epoch != epoch or msg.peer not in by_src:
            get_logger().warning("stale_kv_message_dropped", peer=msg.peer, epoch=msg.header.epoch)
            continue
        yield by_src.pop(msg.peer), msg.data


async def receive_flows(svc: TransferService, incoming: dict[Pair, Flow], me: str, epoch: int,
                        timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
    """The message of every incoming flow, by source, and the bytes received (see ``arrivals``)."""
    received: dict[str, torch.Tensor] = {}
    nbytes = 0
    async for flow, data in arrivals(svc, incoming, me, epoch, timeout_s):
        received[flow.src] = data
        nbytes += data.numel() * data.element_size()
    return received, nbytes


def landing_slices(flow: Flow, data: torch.Tensor, max_bytes: int) -> Iterator[list[tuple[FlowPart, torch.Tensor]]]:
    """A flow's parts with their slices of its message, grouped so each group's KV is about `max_bytes` (at least
    one part): what one write between two engine iterations lands while the engine serves (§4.2: the exchange
    yields to the computation in chunks of about a stage's step)."""
    row = data[0].numel() * data.element_size() if data.shape[0] else 0
    group: list[tuple[FlowPart, torch.Tensor]] = []
    size = 0
    for p, blocks in _split(flow, data):
        if group and size + blocks.shape[0] * row > max_bytes:
            yield group
            group, size = [], 0
        group.append((p, blocks))
        size += blocks.shape[0] * row
    if group:
        yield group
