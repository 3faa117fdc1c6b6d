"""Which pipeline group this worker belongs to, and leaving it the moment it breaks.

A transition gives the worker its role (``take``): a whole instance, the head of a group (its engine reaches
the later stages through a UCX link) or a later stage. From then on nothing may wait on a dead member:
members ping each other over the transfer service (a crashed peer is noticed on the next send), a member
that leaves says so (``leave`` on the CONTROL class), and a lost peer, a stage that fails or a head whose
engine raised GroupBroken heals this worker to a whole instance (``PooledInstance.heal``) and tells the
others, so every member of a broken group heals at once instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio

import torch

from kunserve.shared.engine.api import SeqSnapshot
from kunserve.shared.engine.engine import Engine, GroupBroken
from kunserve.shared.engine.kv_landing import KVLanding
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.log import get_logger
from kunserve.shared.transfer.framing import CONTROL
from kunserve.shared.transfer.service import Received, TransferError, TransferService

from .group import GroupRole, StageRunner, UcxPipelineLink

PING = "ping"
LEAVE = "leave"
LANDED = "kv-landed"  # a member wrote its share of these requests' KV (header.request_ids) of transition header.epoch


class GroupMembership:
    """This worker's role in its unit (None: a whole instance of its own) and the group's health checks."""

    def __init__(self, worker_id: str, engine_loop: EngineLoop, instance: PooledInstance, svc: TransferService,
                 timeout_s: float) -> None:
        self.worker_id = worker_id
        self.engine_loop = engine_loop
        self.instance = instance
        self.svc = svc
        self.timeout_s = timeout_s
        self.role: GroupRole | None = None
        self.stage = StageRunner(svc, engine_loop, instance.cfg.torch_dtype, self._stage_failed)
        self.log = get_logger()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pings: asyncio.Task | None = None
        engine_loop.on_group_broken(self._heal_on_engine_thread)
        svc.on_peer_lost(self._peer_lost)
        svc.on_message(CONTROL, self._on_control)  # liveness pings (arriving is all they do) and "leave"

    # -- taking a role (engine thread) ------------------------------------------------------------------------
    def take(self, engine: Engine, role: GroupRole, seqs: list[SeqSnapshot], loop: asyncio.AbstractEventLoop,
             landing: KVLanding | None = None) -> None:
        """Become what the new unit needs: a whole instance, a group head (link to the later stages, block
        space capped at the unit's kv_blocks), or a later stage (no requests of its own). `landing`: the
        transition's KV lands after the commit (the requests it waits for are held until then)."""
        self._loop = loop
        if len(role.unit.members) == 1:
            engine.become_whole(seqs, landing=landing)
            self.stage.leave()
            self.role = None
            return
        link = UcxPipelineLink(self.svc, loop, role, self.timeout_s) if role.is_head else None
        if link is not None:
            engine.become_head(link, role.unit.kv_blocks, seqs, landing)
        else:
            engine.become_stage(landing)
        self.stage.join(role, link)
        self.role = role

    def heal(self, keep: list[SeqSnapshot] | None = None) -> None:
        """Back to a whole instance (engine thread). Requests whose KV cannot be trusted any more are
        re-prefilled (recompute preemption): their greedy tokens stay the same. With `keep` (a failed
        transition) exactly the requests this worker owned before."""
        self.stage.leave()
        self.role = None
        self.instance.heal(keep)

    def start_pings(self) -> None:
        """While in a group, keep pinging its other members (call on the event loop after a commit)."""
        if self.role is not None and (self._pings is None or self._pings.done()):
            self._pings = asyncio.get_running_loop().create_task(self._ping_members())

    async def _ping_members(self, interval_s: float = 0.5) -> None:
        """While in a group, ping every other member over UCX: a crashed peer is noticed on the next send
        (a receive alone may wait forever), which breaks the group and heals this worker."""
        beat = torch.zeros(1, dtype=torch.uint8)
        while self.role is not None:
            role = self.role
            for peer in role.members:
                if peer == self.worker_id:
                    continue
                try:
                    self.svc.submit(peer, CONTROL, beat, name=PING, epoch=role.epoch)
                except (TransferError, RuntimeError) as exc:
                    self._peer_lost(peer, exc)
            await asyncio.sleep(interval_s)

    # -- failures -----------------------------------------------------------------------------------------
    def _heal_on_engine_thread(self, engine: Engine, exc: GroupBroken) -> None:
        role = self.role
        self.heal()
        self.log.warning("healed_to_whole_instance", reason=str(exc), requests=len(engine.seqs))
        if role is not None and self._loop is not None:  # tell the stages, which may be alive (a timeout)
            self._loop.call_soon_threadsafe(self.tell_members_we_left, role)

    def tell_members_we_left(self, role: GroupRole) -> None:
        for peer in role.members:
            if peer != self.worker_id:
                try:
                    self.svc.submit(peer, CONTROL, torch.zeros(1, dtype=torch.uint8), name=LEAVE, epoch=role.epoch)
                except (TransferError, RuntimeError):
                    pass  # gone already

    def _on_control(self, msg: Received) -> None:
        role = self.role
        if role is None or msg.header.epoch != role.epoch or msg.peer not in role.members:
            return
        if msg.header.name == LEAVE:
            self._peer_lost(msg.peer, "it left the group")
        elif msg.header.name == LANDED and role.is_head:
            epoch, peer, rids = role.epoch, msg.peer, list(msg.header.request_ids)
            self.engine_loop.call(lambda engine: engine.kv_landed(epoch, peer, rids))

    def break_group(self, epoch: int, why: str) -> None:
        """Leave the group of transition `epoch` (if this worker is still in it) as if a member had been lost:
        every member heals and the requests re-prefill."""
        role = self.role
        if role is None or role.epoch != epoch:
            return
        other = next(m for m in role.members if m != self.worker_id)
        self._peer_lost(other, why)

    def _peer_lost(self, peer: str, error: object) -> None:
        role = self.role
        if role is None or peer not in role.members:
            return
        why = f"group member {peer} lost ({error or 'closed'})"
        link = self.stage.link
        if role.is_head and link is not None:
            link.lost(why)  # a stepping engine thread raises GroupBroken and heals...

            def heal_if_idle(engine: Engine) -> None:  # ...an idle one would only notice at its next request
                if engine.link is link:
                    self._heal_on_engine_thread(engine, GroupBroken(why))

            self.engine_loop.call(heal_if_idle)
        else:
            self._stage_failed(why)

    def _stage_failed(self, why: str) -> None:
        """A later stage heals itself (it owns no requests) and tells the other members, so its head breaks
        the group at once instead of waiting for a result that will never come."""
        if self.role is None or self.role.is_head:
            return
        self.log.warning("stage_leaving_group", reason=why)
        role = self.role
        self.role = None
        self.stage.leave()
        self.engine_loop.call(lambda engine: self.heal())
        self.tell_members_we_left(role)
