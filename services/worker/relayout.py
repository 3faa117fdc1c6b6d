"""A worker's side of a layout transition (drop: merge into a pipeline group; restore: split back).

Driven by the memory manager (services/memory_manager/orchestrator.py) in two steps over gRPC:

1. **Prepare**: stop taking requests (Generate answers FAILED_PRECONDITION, the dispatcher waits), let the
   microbatches in flight finish, pause the engine between iterations, and report the requests this worker
   owns (if it heads its unit) and the KV blocks it will have in its new layer range. Nothing changed yet:
   Abort resumes exactly as before.
2. **Execute** (the spec now carries every request's new unit and block table): copy out the KV blocks
   that move (per layer, per request; ``shared/transition.kv_flows`` says which go where), send them to
   their new holders on the KV-exchange class of the transfer service, remap memory to the new layer range
   (drop: weights' pages become KV; restore: KV pages go back to weights, refilled from the host copy),
   write the local and the received blocks at their new ids, then install the requests at the new head:
   streams of requests that moved end with ``moved_to`` and the dispatcher re-attaches at the new head.

If Execute fails after anything changed, the worker heals to a whole instance and keeps the requests it
owned as recompute preemptions (prompt + generated tokens re-prefilled: the same greedy tokens), so
nothing is lost; the memory manager then reports the transition as rolled back.

A transition cannot be orphaned: from Prepare on, the worker holds a *lease* (``TransitionSpec.lease_s``)
that every step and every ``RenewTransition`` of the memory manager extends. A worker that hears nothing
for that long (its memory manager died, or hangs) aborts on its own exactly as ``AbortTransition`` would:
before Execute it resumes unchanged, after it it heals to a whole instance and tells the members of the
unit it had joined that it left, so a member that did commit breaks its group at once. Steps (prepare,
execute, commit, abort, the lease's own abort) run one at a time.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kunserve.shared.engine.api import EngineRequest
from kunserve.shared.engine.api import SeqSnapshot
from kunserve.shared.engine.engine import Engine, GroupBroken
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.faults import fault_point
from kunserve.shared.log import get_logger
from kunserve.shared.transfer.framing import CONTROL, KV_EXCHANGE
from kunserve.shared.transfer.service import TransferError, TransferService
from kunserve.shared.policy.cluster import Member, Unit
from kunserve.shared.policy.transition_plan import Flow, SeqMove, TransitionError, kv_flows, unit_of
from kunserve.shared.wire.transitions import snapshot_from_pb, snapshot_to_pb, units_from_pb
from kunserve.v1 import worker_pb2

from .group import GroupRole, StageRunner, UcxPipelineLink


PING = "ping"
LEAVE = "leave"
DEFAULT_LEASE_S = 10.0  # a spec without lease_s: how long a paused worker waits for its memory manager
MAX_LEASE_S = 3600.0


class TransitionRefused(RuntimeError):
    """Bad or conflicting transition request; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Moved:
    """Pushed into a request's stream queue: it now lives on another worker."""

    worker_id: str


@dataclass
class _Prepared:
    spec: worker_pb2.TransitionSpec
    snapshot: list[SeqSnapshot]
    executed: bool = False
    moved_out: dict[str, str] = field(default_factory=dict)  # request id -> the worker it went to (at commit)
    moved_in: list[str] = field(default_factory=list)


@dataclass
class TransitionStats:
    gather_s: float = 0.0
    exchange_s: float = 0.0
    remap_s: float = 0.0
    scatter_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class TransitionRunner:
    def __init__(self, worker_id: str, engine_loop: EngineLoop, instance: PooledInstance, svc: TransferService,
                 streams, timeout_s: float = 60.0) -> None:
        self.worker_id = worker_id
        self.engine_loop = engine_loop
        self.instance = instance
        self.svc = svc
        self.streams = streams  # StreamRegistry of the worker servicer
        self.timeout_s = timeout_s
        self.epoch = 0
        self.role: GroupRole | None = None  # None: a whole instance of its own
        self.prepared: _Prepared | None = None
        self.moved_in: dict[str, asyncio.Queue] = {}  # streams waiting for the dispatcher's attach
        self.on_event: Callable[[str], Callable] | None = None  # request id -> engine event callback
        self.log = get_logger()
        self.stage = StageRunner(svc, engine_loop, instance.cfg.torch_dtype, self._stage_failed)
        self.loop: asyncio.AbstractEventLoop | None = None
        engine_loop.on_group_broken = self._heal_on_engine_thread
        svc.on_peer_lost(self._peer_lost)
        svc.on_message(CONTROL, self._on_control)  # liveness pings (arriving is all they do) and "leave"
        self._watchdog: asyncio.Task | None = None
        self._steps = asyncio.Lock()  # one step at a time (the lease's abort included)
        self._lease_s = DEFAULT_LEASE_S
        self._lease_until = 0.0  # time.monotonic() after which a prepared, idle transition aborts itself
        self._lease_watch: asyncio.Task | None = None  # held so the task is not garbage-collected mid-wait
        self._connecting: dict[str, asyncio.Task] = {}  # transfer links being opened, by peer

    # -- state ------------------------------------------------------------------------------------------
    @property
    def transitioning(self) -> bool:
        return self.prepared is not None

    @property
    def unit_id(self) -> str:
        return self.role.unit.unit_id if self.role is not None else self.worker_id

    @property
    def members(self) -> list[str]:
        return list(self.role.members) if self.role is not None else [self.worker_id]

    @property
    def transition_epoch(self) -> int:
        """The epoch being prepared or executed (0 when none): what a memory manager would abort."""
        return self.prepared.spec.epoch if self.prepared is not None else 0

    # -- the lease --------------------------------------------------------------------------------------
    def _extend_lease(self) -> None:
        self._lease_until = time.monotonic() + self._lease_s

    def renew(self, epoch: int) -> worker_pb2.TransitionLease:
        if self.prepared is None or self.prepared.spec.epoch != epoch:
            raise TransitionRefused("FAILED_PRECONDITION", f"no transition {epoch} in progress here")
        self._extend_lease()
        return worker_pb2.TransitionLease(epoch=epoch, expires_in_s=self._lease_s)

    async def _watch_lease(self, epoch: int) -> None:
        """Abort the prepared transition `epoch` once its lease ran out while no step was running."""
        while self.prepared is not None and self.prepared.spec.epoch == epoch:
            left = self._lease_until - time.monotonic()
            if left > 0 or self._steps.locked():
                await asyncio.sleep(min(max(left, 0.05), 1.0))
                continue
            async with self._steps:
                p = self.prepared
                if p is None or p.spec.epoch != epoch or time.monotonic() < self._lease_until:
                    continue  # a step or a renewal came in meanwhile
                self.log.error("transition_lease_expired", epoch=epoch, lease_s=self._lease_s, executed=p.executed,
                               action="healing to a whole instance" if p.executed else "resuming the old layout")
                try:
                    await self._abort(epoch)
                except Exception as exc:  # never stay paused: resume as is (a broken engine reports NOT_SERVING)
                    self.log.exception("transition_lease_abort_failed", epoch=epoch, error=repr(exc))
                    if self.prepared is p:
                        self.prepared = None
                        self.engine_loop.resume()
            return

    # -- gRPC steps -------------------------------------------------------------------------------------
    async def prepare(self, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionPrepared:
        async with self._steps:
            reply = await self._prepare(spec)
            self._lease_s = spec.lease_s or DEFAULT_LEASE_S
            self._extend_lease()
            self._lease_watch = asyncio.get_running_loop().create_task(self._watch_lease(spec.epoch))
            return reply

    async def execute(self, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionDone:
        async with self._steps:
            try:
                return await self._execute_step(spec)
            finally:
                self._extend_lease()

    async def commit(self, epoch: int) -> worker_pb2.TransitionDone:
        async with self._steps:
            return self._commit(epoch)

    async def abort(self, epoch: int) -> worker_pb2.TransitionDone:
        async with self._steps:
            return await self._abort(epoch)

    async def _prepare(self, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionPrepared:
        self.loop = asyncio.get_running_loop()
        if not (0.0 <= spec.lease_s <= MAX_LEASE_S) or math.isnan(spec.lease_s):
            raise TransitionRefused("INVALID_ARGUMENT", f"lease_s: must be in [0, {MAX_LEASE_S:.0f}] s, "
                                    f"got {spec.lease_s}")
        if self.prepared is not None:
            if self.prepared.spec.epoch == spec.epoch:
                raise TransitionRefused("ALREADY_EXISTS", f"transition {spec.epoch} is already prepared")
            raise TransitionRefused("ABORTED", f"transition {self.prepared.spec.epoch} is in progress")
        if spec.epoch <= self.epoch:
            raise TransitionRefused("FAILED_PRECONDITION",
                                    f"epoch {spec.epoch} is not newer than this worker's epoch {self.epoch}")
        old_units, new_units = units_from_pb(spec.old_units), units_from_pb(spec.new_units)
        try:
            old = unit_of(old_units, self.worker_id).member(self.worker_id)
            new = unit_of(new_units, self.worker_id).member(self.worker_id)
        except TransitionError as exc:
            raise TransitionRefused("INVALID_ARGUMENT", str(exc)) from None
        assert old is not None and new is not None
        if old.range != self.instance.layer_range:
            raise TransitionRefused("FAILED_PRECONDITION", f"worker {self.worker_id} holds "
                                    f"{list(self.instance.layer_range)}, the spec says {list(old.range)}")
        if unit_of(old_units, self.worker_id).unit_id != self.unit_id:
            raise TransitionRefused("FAILED_PRECONDITION", f"worker {self.worker_id} is in unit {self.unit_id}, "
                                    f"the spec says {unit_of(old_units, self.worker_id).unit_id}")
        await self._connect_peers(old_units + new_units)
        self.prepared = _Prepared(spec, [])  # from here on Generate refuses new requests
        self.engine_loop.pause()
        try:
            def quiesce(engine: Engine) -> tuple[list[SeqSnapshot], int]:
                for ev in engine.drain_inflight():
                    self.engine_loop.emit(ev)
                return engine.snapshot(), self.instance.capacity_for(*new.range)

            snap, after = await self._on_engine(quiesce)
        except BaseException:
            self.prepared = None
            self.engine_loop.resume()
            raise
        self.prepared.snapshot = snap
        now = time.monotonic()
        owned = snap if self.role is None or self.role.is_head else []
        return worker_pb2.TransitionPrepared(
            worker_id=self.worker_id, seqs=[snapshot_to_pb(s, self.unit_id, now) for s in owned],
            kv_blocks_after=after, kv_blocks_now=self.engine_loop.stats().kv_blocks_total)

    async def _abort(self, epoch: int) -> worker_pb2.TransitionDone:
        """Before Execute: resume the old layout unchanged. After Execute (not committed: another member
        failed): heal to a whole instance keeping this worker's own requests (re-prefilled). After a
        commit into a group: leave the group the same way."""
        p = self.prepared
        joined = self.role  # after Execute or a commit: the group this worker is leaving
        if p is not None and p.spec.epoch == epoch:
            if p.executed:
                self.log.warning("transition_undone_healing", epoch=epoch)
                await self._undo(p)
                self.epoch = max(self.epoch, epoch)
            else:
                joined = None  # nothing changed: no group was joined
                self.log.info("transition_aborted", epoch=epoch)
            self.prepared = None
            self.engine_loop.resume()
        elif p is None and self.epoch == epoch and self.role is not None:
            self.log.warning("transition_undone_healing", epoch=epoch)
            await self._on_engine(lambda engine: self._heal(engine))
        else:
            joined = None
        if joined is not None:  # a member that did commit (or is still executing) must not wait for us
            self._tell_members_we_left(joined)
        return self._done(epoch, TransitionStats())

    async def _undo(self, p: _Prepared) -> None:
        """Forget the requests that arrived, heal to a whole instance, keep the ones owned before."""
        for rid in p.moved_in:
            self.moved_in.pop(rid, None)
            self.engine_loop.forget(rid)
            self.streams.close(rid)
        await self._on_engine(lambda engine: self._heal(engine, p.snapshot))

    async def _execute_step(self, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionDone:
        p = self.prepared
        if p is None or p.spec.epoch != spec.epoch:
            raise TransitionRefused("FAILED_PRECONDITION", f"transition {spec.epoch} was not prepared here")
        if p.executed:
            raise TransitionRefused("ALREADY_EXISTS", f"transition {spec.epoch} was executed already")
        p.executed = True
        stats = TransitionStats()
        try:
            await self._execute(spec, p, stats)
        except BaseException as exc:
            self.log.error("transition_failed_healing", epoch=spec.epoch, error=f"{type(exc).__name__}: {exc}")
            await self._undo(p)
            self.epoch = spec.epoch
            self.prepared = None
            self.engine_loop.resume()
            raise
        return self._done(spec.epoch, stats)

    def _commit(self, epoch: int) -> worker_pb2.TransitionDone:
        """Every member executed: resume in the new layout; streams of requests that left end with moved_to
        (their new head registered them during its Execute, so the dispatcher's attach finds them)."""
        p = self.prepared
        if p is None or p.spec.epoch != epoch or not p.executed:
            raise TransitionRefused("FAILED_PRECONDITION", f"transition {epoch} was not executed here")
        for rid, target in p.moved_out.items():
            self.engine_loop.forget(rid)
            self.streams._put(rid, Moved(target))
        self.epoch = epoch
        self.prepared = None
        self.engine_loop.resume()
        if self.role is not None and (self._watchdog is None or self._watchdog.done()):
            self._watchdog = asyncio.get_running_loop().create_task(self._ping_members())
        return self._done(epoch, TransitionStats())

    # -- the exchange -------------------------------------------------------------------------------------
    async def _execute(self, spec: worker_pb2.TransitionSpec, p: _Prepared, stats: TransitionStats) -> None:
        me = self.worker_id
        old_units, new_units = units_from_pb(spec.old_units), units_from_pb(spec.new_units)
        moves = [SeqMove(s.request_id, s.old_unit, s.new_unit, tuple(s.old_blocks), tuple(s.new_blocks))
                 for s in spec.seqs]
        flows = kv_flows(old_units, new_units, moves)
        new_unit = unit_of(new_units, me)
        new_member = new_unit.member(me)
        assert new_member is not None
        outgoing = {k: f for k, f in flows.items() if f.src == me}
        incoming = {k: f for k, f in flows.items() if f.dst == me and f.src != me}

        # 1. copy out every block that moves or is renumbered, then forget the requests (their state is in
        #    the spec) so the memory can be remapped
        t0 = time.perf_counter()
        slabs: dict[str, torch.Tensor] = await self._on_engine(lambda engine: self._gather(engine, outgoing))
        stats.gather_s = time.perf_counter() - t0

        # 2. send on the KV-exchange class (activations of other groups still overtake it between chunks)
        t0 = time.perf_counter()
        handles = []
        for (src, dst), flow in outgoing.items():
            if dst == me:
                continue
            data = slabs[dst]
            handles.append(self.svc.submit(dst, KV_EXCHANGE, data, request_ids=[pt.request_id for pt in flow.parts],
                                           epoch=spec.epoch, name=f"kv:{spec.epoch}"))
            stats.bytes_sent += data.numel() * data.element_size()

        fault_point("die_in_exchange", me)

        # 3. remap to the new layer range (overlaps the sends on the wire)
        t1 = time.perf_counter()
        await self._on_engine(lambda engine: self.instance.to_range(*new_member.range))
        stats.remap_s = time.perf_counter() - t1

        # 4. receive what comes here
        received: dict[str, torch.Tensor] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(received) < len(incoming):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(f.src for f in incoming.values() if f.src not in received)
                raise TimeoutError(f"KV exchange: nothing from {', '.join(missing)} within {self.timeout_s} s")
            msg = await self.svc.recv(KV_EXCHANGE, timeout=left)
            if msg.header.epoch != spec.epoch or (msg.peer, me) not in incoming:
                self.log.warning("stale_kv_message_dropped", peer=msg.peer, epoch=msg.header.epoch)
                continue
            received[msg.peer] = msg.data
            stats.bytes_received += msg.data.numel() * msg.data.element_size()
        for h in handles:
            await h.wait(self.timeout_s)
        stats.exchange_s = time.perf_counter() - t0

        # 5. write the blocks at their new ids, 6. take over the requests of the new unit
        t0 = time.perf_counter()
        local = outgoing.get((me, me))
        if local is not None:
            received[me] = slabs[me]
            incoming[(me, me)] = local
        role = GroupRole(spec.epoch, new_unit, new_unit.worker_ids.index(me))
        now = time.monotonic()
        mine = [snapshot_from_pb(s, now) for s in spec.seqs if s.new_unit == new_unit.unit_id] if role.is_head else []
        old_owned = {s.request.request_id for s in p.snapshot}

        def finish(engine: Engine) -> None:
            for (src, _), flow in incoming.items():
                self._scatter(engine, flow, received[src])
            self._install(engine, role, mine)

        await self._on_engine(finish)
        stats.scatter_s = time.perf_counter() - t0
        self._switch_streams(p, old_owned, {s.request.request_id for s in mine}, spec, new_units)
        self.log.info("transition_done", epoch=spec.epoch, op=spec.op, unit=new_unit.unit_id,
                      layers=list(new_member.range), requests=len(mine), sent=stats.bytes_sent,
                      received=stats.bytes_received, remap_ms=round(stats.remap_s * 1e3, 2))

    @torch.inference_mode()  # the KV views may be inference tensors (made during a forward)
    def _gather(self, engine: Engine, outgoing: dict[tuple[str, str], Flow]) -> dict[str, torch.Tensor]:
        out = {}
        for (_, dst), flow in outgoing.items():
            parts = []
            for part in flow.parts:
                ids = torch.tensor(part.old_blocks, dtype=torch.long, device=engine.device)
                for layer in range(part.layer_start, part.layer_end):
                    parts.append(engine.kv.layer_cache(layer).index_select(0, ids).cpu())
            out[dst] = torch.cat(parts).contiguous()
        engine.clear()
        return out

    @staticmethod
    @torch.inference_mode()
    def _scatter(engine: Engine, flow: Flow, data: torch.Tensor) -> None:
        at = 0
        for part in flow.parts:
            n = len(part.new_blocks)
            ids = torch.tensor(part.new_blocks, dtype=torch.long, device=engine.device)
            for layer in range(part.layer_start, part.layer_end):
                cache = engine.kv.layer_cache(layer)
                slab = data[at:at + n]
                if tuple(slab.shape[1:]) != tuple(cache.shape[1:]) or slab.shape[0] != n:
                    raise ValueError(f"KV exchange: got a slab {tuple(slab.shape)} for {n} blocks of "
                                     f"{tuple(cache.shape[1:])}")
                cache.index_copy_(0, ids, slab.to(cache.device, cache.dtype))
                at += n
        if at != data.shape[0]:
            raise ValueError(f"KV exchange: {data.shape[0]} blocks received, {at} expected")

    def _install(self, engine: Engine, role: GroupRole, seqs: list[SeqSnapshot]) -> None:
        """Become what the new unit needs: a whole instance, a group head (link to the later stages, block
        space capped at the unit's kv_blocks), or a later stage (no requests of its own)."""
        multi = len(role.unit.members) > 1
        link = None
        if role.is_head and multi:
            assert self.loop is not None
            link = UcxPipelineLink(self.svc, self.loop, role, self.timeout_s)
        engine.link = link
        engine.kv_limit = role.unit.kv_blocks if (multi and role.is_head) else None
        engine.clear()
        engine.allocator = type(engine.allocator)(
            engine.kv.num_blocks if engine.kv_limit is None else min(engine.kv.num_blocks, engine.kv_limit))
        engine.scheduler.allocator = engine.allocator
        engine.install(seqs)
        self.stage.link = link
        self.stage.role = role if multi else None
        self.role = role if multi else None

    def _switch_streams(self, p: _Prepared, old_owned: set[str], now_owned: set[str], spec,
                        new_units: list[Unit]) -> None:
        """Requests that arrived get a buffered stream and an engine callback until the dispatcher attaches;
        requests that left are noted for the commit, which ends their streams with moved_to."""
        new_unit_of = {s.request_id: s.new_unit for s in spec.seqs}
        heads = {u.unit_id: u.head for u in new_units}
        for rid in old_owned - now_owned:
            p.moved_out[rid] = heads.get(new_unit_of.get(rid, ""), "")
        for rid in now_owned - old_owned:
            q = self.streams.open(rid) if rid not in self.streams else None
            if q is not None:
                p.moved_in.append(rid)
                self.moved_in[rid] = q
                self.engine_loop.register(rid, lambda ev, rid=rid: self.streams.put_threadsafe(rid, ev))
                asyncio.get_running_loop().call_later(self.timeout_s, self._expire_unattached, rid)

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

    def _expire_unattached(self, rid: str) -> None:
        """Nobody attached to a request that moved here (its client is gone): free it."""
        if self.moved_in.pop(rid, None) is not None:
            self.log.warning("moved_request_never_attached", request_id=rid)
            self.engine_loop.abort(rid)
            self.streams.close(rid)

    # -- failures -----------------------------------------------------------------------------------------
    def _heal(self, engine: Engine, keep: list[SeqSnapshot] | None = None) -> None:
        """Back to a whole instance from the host copy (or the checkpoint). Requests whose KV cannot be
        trusted any more are re-prefilled (recompute preemption): their greedy tokens stay the same."""
        engine.preempt_all()
        if keep is not None:  # a failed transition: the requests this worker owned before, as recompute
            engine.clear()
            engine.install([SeqSnapshot(s.request, s.generated, 0, [], s.generator_state, s.num_preemptions + 1)
                            for s in keep])
        engine.link = None
        engine.kv_limit = None
        self.stage.link = None
        self.stage.role = None
        self.role = None
        if self.instance.layer_range != (0, self.instance.cfg.num_layers):
            self.instance.to_range(0, self.instance.cfg.num_layers)
        engine.sync_kv_capacity()

    def _heal_on_engine_thread(self, engine: Engine, exc: GroupBroken) -> None:
        role = self.role
        self._heal(engine)
        self.log.warning("healed_to_whole_instance", reason=str(exc), requests=len(engine.seqs))
        if role is not None and self.loop is not None:  # tell the stages, which may be alive (a timeout)
            self.loop.call_soon_threadsafe(self._tell_members_we_left, role)

    def _tell_members_we_left(self, role: GroupRole) -> None:
        for peer in role.members:
            if peer != self.worker_id:
                try:
                    self.svc.submit(peer, CONTROL, torch.zeros(1, dtype=torch.uint8), name=LEAVE, epoch=role.epoch)
                except (TransferError, RuntimeError):
                    pass  # gone already

    def _on_control(self, msg) -> None:
        role = self.role
        if msg.header.name == LEAVE and role is not None and msg.header.epoch == role.epoch and msg.peer in role.members:
            self._peer_lost(msg.peer, "it left the group")

    def _peer_lost(self, peer: str, error) -> None:
        role = self.role
        if role is None or peer not in role.members:
            return
        why = f"group member {peer} lost ({error or 'closed'})"
        if role.is_head and self.stage.link is not None:
            link = self.stage.link
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
        self.stage.role = None
        self.engine_loop.call(lambda engine: self._heal(engine))
        self._tell_members_we_left(role)

    # -- helpers ------------------------------------------------------------------------------------------
    async def _connect_peers(self, units: list[Unit]) -> None:
        """Links to every other member of the old and new units; usually already open (connect_peers)."""
        want = {m.worker_id: m.transfer_address for u in units for m in u.members if m.worker_id != self.worker_id}
        for wid, addr in sorted(want.items()):
            await self._link(wid, addr, self.timeout_s)

    async def connect_peers(self, peers: dict[str, str], timeout_s: float) -> dict[str, str]:
        """Open links to `peers` (worker id -> transfer address) ahead of any transition, concurrently;
        returns why each failed one failed. Serving goes on meanwhile: nothing is paused."""
        async def one(wid: str, addr: str) -> tuple[str, str]:
            try:
                await self._link(wid, addr, timeout_s)
                return wid, ""
            except TransitionRefused as exc:
                return wid, str(exc)

        tried = await asyncio.gather(*(one(w, a) for w, a in sorted(peers.items()) if w != self.worker_id))
        return {wid: why for wid, why in tried if why}

    async def _link(self, wid: str, addr: str, timeout_s: float) -> None:
        if wid in self.svc.peers:
            return
        if not addr:
            raise TransitionRefused("INVALID_ARGUMENT", f"no transfer address for worker {wid}")
        host, _, port = addr.rpartition(":")
        if (wid == self.worker_id or addr == self.svc.address or not host or not port.isdigit()
                or not 0 < int(port) < 65536):
            raise TransitionRefused("INVALID_ARGUMENT", f"transfer address {addr!r} of worker {wid!r}: expected "
                                    "host:port of another worker")
        # One connect per peer at a time, and never cancelled half way: the RPC that asked for it may be cancelled
        # (its memory manager died), but abandoning UCX's endpoint set-up in the middle can crash the process. The
        # connect is bounded by timeout_s on its own.
        task = self._connecting.get(wid)
        if task is None:
            # expect=wid: a listener with another name is refused before its link is registered
            task = asyncio.ensure_future(self.svc.connect(host, int(port), timeout=timeout_s, expect=wid))
            self._connecting[wid] = task
            task.add_done_callback(lambda t, wid=wid: self._connected(wid, t))
        try:
            await asyncio.shield(task)
        except Exception as exc:  # (a cancelled RPC raises CancelledError, a BaseException: it passes through)
            raise TransitionRefused("UNAVAILABLE", f"cannot reach worker {wid} at {addr}: {exc}") from None

    def _connected(self, wid: str, task: asyncio.Task) -> None:
        if self._connecting.get(wid) is task:
            del self._connecting[wid]
        if not task.cancelled():
            task.exception()  # its outcome reached whoever awaited it; nobody may have (the RPC went away)

    async def _on_engine(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self.engine_loop.call(fn)), self.timeout_s)

    def _done(self, epoch: int, stats: TransitionStats) -> worker_pb2.TransitionDone:
        start, end = self.instance.layer_range
        owned = len(self.engine_loop.engine.seqs) if self.role is None or self.role.is_head else 0
        return worker_pb2.TransitionDone(
            worker_id=self.worker_id, epoch=epoch, layer_start=start, layer_end=end,
            kv_blocks=self.engine_loop.stats().kv_blocks_total, bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received, gather_seconds=stats.gather_s, exchange_seconds=stats.exchange_s,
            remap_seconds=stats.remap_s, scatter_seconds=stats.scatter_s, requests_owned=owned)
