"""A worker's part in a pipeline group (KunServe §3, §4.2): the head's link to its later stages, and the
stage side that runs its layers on microbatches arriving over UCX.

Activations travel on the transfer service's highest class (ACTIVATION): the head sends stage 1 one
message per microbatch ("mb": metadata + hidden states, shared/engine/stage_wire.py); stage i runs its
layers on its engine thread (EngineLoop.call: strictly in arrival order, so a request's chunks reach every
stage's KV cache in order) and forwards to stage i+1; the last stage sends the logits back ("out:<mb>").
Several microbatches are in flight at once (max_inflight = number of stages), so every stage computes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kunserve.shared.engine import stage_wire
from kunserve.shared.engine.link_results import LinkResults
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.stage_wire import StageBatch
from kunserve.shared.log import get_logger
from kunserve.shared.policy.cluster import Unit
from kunserve.shared.transfer.framing import ACTIVATION
from kunserve.shared.transfer.service import Received, TransferError, TransferService

MB = "mb"
OUT = "out"


@dataclass(frozen=True)
class GroupRole:
    """Where this worker sits in its unit after a transition."""

    epoch: int
    unit: Unit
    index: int  # 0 = head

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.unit.members) - 1

    @property
    def members(self) -> tuple[str, ...]:
        return self.unit.worker_ids




class UcxPipelineLink:
    """The head engine's PipelineLink: send runs on the engine thread and hops to the event loop;
    results arrive on the event loop and wait in a thread-safe queue for the engine thread."""

    def __init__(self, svc: TransferService, loop: asyncio.AbstractEventLoop, role: GroupRole,
                 timeout_s: float) -> None:
        self.svc = svc
        self.loop = loop
        self.role = role
        self.next_stage = role.unit.members[1].worker_id
        self.max_inflight = len(role.unit.members)
        self.timeout_s = timeout_s
        self._results = LinkResults(timeout_s)

    def send(self, batch: StageBatch, hidden: torch.Tensor) -> None:
        data = stage_wire.encode(batch, hidden)
        self.loop.call_soon_threadsafe(self._submit, data)

    def _submit(self, data: torch.Tensor) -> None:
        try:
            self.svc.submit(self.next_stage, ACTIVATION, data, name=MB, epoch=self.role.epoch)
        except (TransferError, RuntimeError) as exc:
            self.lost(f"cannot send to stage {self.next_stage}: {exc}")

    def deliver(self, mb_id: int, logits: torch.Tensor) -> None:
        self._results.deliver(mb_id, logits)

    def lost(self, why: str) -> None:
        self._results.lost(why)

    def result(self, mb_id: int, block: bool) -> torch.Tensor | None:
        return self._results.take(mb_id, block)


class StageRunner:
    """Handles ACTIVATION messages for this worker: microbatches to run as a later stage, and results
    coming back to this worker as a head. Messages from another epoch (a group that no longer exists),
    and messages from anyone but the stage that feeds this one (the previous member for a microbatch,
    the last member for a result), are dropped: a linked worker outside the group cannot inject them."""

    def __init__(self, svc: TransferService, engine_loop: EngineLoop, dtype: torch.dtype,
                 on_failure: Callable[[str], None]) -> None:
        self.svc = svc
        self.engine_loop = engine_loop
        self.dtype = dtype
        self.role: GroupRole | None = None
        self.link: UcxPipelineLink | None = None
        self.on_failure = on_failure
        self.log = get_logger()
        svc.on_message(ACTIVATION, self._on_message)

    def join(self, role: GroupRole, link: UcxPipelineLink | None) -> None:
        """Take this worker's place in a group: as its head (results come back through link), or a later stage."""
        self.role = role
        self.link = link

    def leave(self) -> None:
        """No group any more: every activation that still arrives is stale."""
        self.role = None
        self.link = None

    def _on_message(self, msg: Received) -> None:
        role = self.role
        if role is None or msg.header.epoch != role.epoch:
            self.log.warning("stale_activation_dropped", name=msg.header.name, epoch=msg.header.epoch,
                             peer=msg.peer)
            return
        name = msg.header.name
        members = role.members
        if name.startswith(OUT + ":") and self.link is not None and msg.peer == members[-1]:
            try:
                mb_id = int(name.split(":", 1)[1])
            except ValueError:
                self.log.warning("unexpected_activation", name=name, peer=msg.peer)
                return
            self.link.deliver(mb_id, msg.data)
        elif name == MB and not role.is_head and msg.peer == members[role.index - 1]:
            batch, hidden = stage_wire.decode(msg.data, self.dtype)
            fut = self.engine_loop.call(lambda engine: engine.forward_stage(batch, hidden))
            loop = asyncio.get_running_loop()
            fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._forward_done, role, batch, f))
        else:
            self.log.warning("unexpected_activation", name=name, peer=msg.peer)

    def _forward_done(self, role: GroupRole, batch: StageBatch, fut) -> None:
        if role is not self.role:
            return  # the group changed meanwhile
        try:
            out = fut.result()
            if role.is_last:
                self.svc.submit(role.members[0], ACTIVATION, out, name=f"{OUT}:{batch.mb_id}", epoch=role.epoch)
            else:
                self.svc.submit(role.members[role.index + 1], ACTIVATION, stage_wire.encode(batch, out), name=MB,
                                epoch=role.epoch)
        except Exception as exc:  # a stage that cannot go on breaks the group: the head heals, so do we
            self.log.error("stage_failed", error=f"{type(exc).__name__}: {exc}", mb=batch.mb_id)
            self.on_failure(f"stage {role.index} failed: {exc}")
