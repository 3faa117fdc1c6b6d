"""A worker's side of a layout transition (drop: merge into a pipeline group; restore: split back).

Nothing here depends on the shape of the old or the new unit: a whole instance joining a pair, a pair's
member joining a quad (its range halves, the KV of the layers it gives up goes to their new holder) and a
quad's member going back to a pair (its range grows with layers a quad member sends it) all run the same
steps below.

Driven by the memory manager (services/memory_manager/orchestrator.py) in three steps over gRPC:

1. **Prepare**: (coordinated, ``spec.background_kv``) first, while still serving, send the peers the layers
   they gain and receive the ones this worker gains into DRAM buffers (a restore's weights, §4.4; nothing for
   a drop); then stop taking requests (Generate answers FAILED_PRECONDITION, the dispatcher waits), let the
   microbatches in flight finish, pause the engine between iterations, and report the requests this worker
   owns (if it heads its unit) and the KV blocks it will have in its new layer range. Nothing changed yet:
   Abort resumes exactly as before.
2. **Execute** (the spec now carries every request's new unit and block table): the engine exports the KV
   blocks that move (``kv_exchange``: ``shared/policy/transition_plan.kv_flows`` says which go where), they
   go on the wire to their new holders on the KV-exchange class of the transfer service, the pool remaps to
   the new layer range (drop: weights' pages become KV; restore: KV pages go back to weights, filled from the
   pulled buffers or, not coordinated, from what the member of the old unit holding those layers sends on the
   weights class now, ``weight_exchange``; the host copy or the checkpoint fills what no peer delivers), and
   the engine takes its role in the new unit (``membership``). Not coordinated, Execute also waits for the
   whole KV exchange and writes every block at its new id first.
3. **Commit**: resume; streams of requests that moved end with ``moved_to`` and the dispatcher re-attaches at
   the new head (``handover``). Coordinated (§4.2), the KV exchange lands only now, while the new unit
   serves: each member writes what it receives in slices between iterations and tells the head which
   requests' KV has landed; the head keeps exactly those requests out of its scheduler until every member
   has, so queued and new requests run on the freed memory at once and the pause does not grow with the KV
   that moves. A flow that never lands (its sender died) breaks the group: every member heals and the held
   requests re-prefill (a whole instance re-prefills the requests it held). The next transition's Prepare
   waits until everything has landed.

If Execute fails after anything changed, the worker heals to a whole instance and keeps the requests it
owned as recompute preemptions (prompt + generated tokens re-prefilled: the same greedy tokens), so
nothing is lost; the memory manager then reports the transition as rolled back.

A transition cannot be orphaned (``lease``): a worker that hears nothing from its memory manager for the
lease aborts on its own exactly as ``AbortTransition`` would: before Execute it resumes unchanged, after it
it heals to a whole instance and tells the members of the unit it had joined that it left, so a member that
did commit breaks its group at once. Steps (prepare, execute, commit, abort, the lease's own abort) run one
at a time. This module only orchestrates: the engine and the pool own every change to their state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kunserve.shared.engine.api import SeqSnapshot, TokenEvent
from kunserve.shared.engine.engine import Engine, GroupBroken
from kunserve.shared.engine.kv_landing import KVLanding
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.faults import fault_delay, fault_point
from kunserve.shared.log import get_logger
from kunserve.shared.policy.cluster import Unit
from kunserve.shared.policy.transition_plan import Flow, SeqMove, TransitionError, kv_flows, unit_of, weight_pieces
from kunserve.shared.streams import StreamRegistry
from kunserve.shared.transfer.framing import CONTROL
from kunserve.shared.transfer.service import SendHandle, TransferError, TransferService
from kunserve.shared.wire.transitions import snapshot_from_pb, snapshot_to_pb, units_from_pb
from kunserve.v1 import worker_pb2

from .group import GroupRole
from .handover import StreamHandover
from .kv_exchange import ExportStaging, StagingReserve, arrivals, export_flow, import_flow, landing_slices, receive_flows, send_flows
from .lease import MAX_LEASE_S, TransitionLease
from .membership import LANDED, GroupMembership
from .peers import PeerLinks, PeerUnreachable
from .weight_exchange import WeightReceiver, export_weights, send_weights

LANDING_CHUNK_BYTES = 4 << 20  # KV written per engine-thread call while landing: about one stage step's copy
STAGING_WARM_S = 0.5  # how often the idle export staging is checked against the KV in use


class TransitionRefused(RuntimeError):
    """Bad or conflicting transition request; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Landing:
    """The KV exchange of a coordinated transition, landed after the commit (§4.2): the flows into this worker
    (the local renumbering included, whose message is already here), the sends still on the wire, and whom
    to tell which requests' KV has landed here."""

    epoch: int
    head: str                       # the new unit's head, which releases each request once all of its KV is in
    incoming: dict[tuple[str, str], Flow]
    local: torch.Tensor | None      # the message of the local flow, if any
    sends: list[SendHandle]
    staging: ExportStaging | None   # what the outgoing messages are views of: back to the reserve once sent


@dataclass
class _Prepared:
    spec: worker_pb2.TransitionSpec
    snapshot: list[SeqSnapshot]
    executed: bool = False
    moved_out: dict[str, str] = field(default_factory=dict)  # request id -> the worker it went to (at commit)
    moved_in: list[str] = field(default_factory=list)
    landing: _Landing | None = None  # set by a coordinated Execute, started at the commit
    weights: WeightReceiver | None = None  # the gained layers, pulled while still serving (coordinated)
    staging: ExportStaging | None = None  # where Execute copies the outgoing KV (faulted in before the pause)
    paused_at: float = 0.0  # perf_counter when the engine paused
    weight_bytes_sent: int = 0


@dataclass
class TransitionStats:
    gather_s: float = 0.0
    exchange_s: float = 0.0
    remap_s: float = 0.0
    scatter_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    weight_bytes_sent: int = 0
    weight_bytes: dict[str, int] = field(default_factory=dict)  # restored weights by source: peer / host / checkpoint


class TransitionRunner:
    def __init__(self, worker_id: str, engine_loop: EngineLoop, instance: PooledInstance, svc: TransferService,
                 streams: StreamRegistry[TokenEvent], timeout_s: float = 60.0,
                 handover: StreamHandover | None = None) -> None:
        self.worker_id = worker_id
        self.engine_loop = engine_loop
        self.instance = instance
        self.svc = svc
        self.timeout_s = timeout_s
        self.epoch = 0
        self.prepared: _Prepared | None = None
        self.membership = GroupMembership(worker_id, engine_loop, instance, svc, timeout_s)
        self.handover = handover or StreamHandover(streams, engine_loop, timeout_s)  # the worker's: one per process
        self.peers = PeerLinks(worker_id, svc)
        self.log = get_logger()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._steps = asyncio.Lock()  # one step at a time (the lease's abort included)
        self.lease = TransitionLease(self._steps)
        self._landing_task: asyncio.Task | None = None
        self.landing_chunk_bytes = LANDING_CHUNK_BYTES
        self.staging = StagingReserve()

    # -- state ------------------------------------------------------------------------------------------
    @property
    def transitioning(self) -> bool:
        return self.prepared is not None

    @property
    def role(self) -> GroupRole | None:
        """This worker's place in its pipeline group; None: a whole instance of its own."""
        return self.membership.role

    @property
    def unit_id(self) -> str:
        role = self.role
        return role.unit.unit_id if role is not None else self.worker_id

    @property
    def members(self) -> list[str]:
        role = self.role
        return list(role.members) if role is not None else [self.worker_id]

    @property
    def transition_epoch(self) -> int:
        """The epoch being prepared or executed (0 when none): what a memory manager would abort."""
        return self.prepared.spec.epoch if self.prepared is not None else 0

    # -- the lease --------------------------------------------------------------------------------------
    def renew(self, epoch: int) -> worker_pb2.TransitionLease:
        if self.prepared is None or self.prepared.spec.epoch != epoch:
            raise TransitionRefused("FAILED_PRECONDITION", f"no transition {epoch} in progress here")
        self.lease.extend()
        return worker_pb2.TransitionLease(epoch=epoch, expires_in_s=self.lease.lease_s)

    async def _lease_expired(self, epoch: int) -> None:
        """Abort the prepared transition `epoch` (its lease ran out while no step was running)."""
        p = self.prepared
        assert p is not None
        self.log.error("transition_lease_expired", epoch=epoch, lease_s=self.lease.lease_s, executed=p.executed,
                       action="healing to a whole instance" if p.executed else "resuming the old layout")
        try:
            await self._abort(epoch)
        except Exception as exc:  # never stay paused: resume as is (a broken engine reports NOT_SERVING)
            self.log.exception("transition_lease_abort_failed", epoch=epoch, error=repr(exc))
            if self.prepared is p:
                self.prepared = None
                self.engine_loop.resume()

    # -- gRPC steps -------------------------------------------------------------------------------------
    async def prepare(self, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionPrepared:
        async with self._steps:
            reply = await self._prepare(spec)
            epoch = spec.epoch
            self.lease.begin(spec.lease_s, lambda: self.prepared is not None and self.prepared.spec.epoch == epoch,
                             lambda: self._lease_expired(epoch))
            return reply

    async def execute(self, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionDone:
        async with self._steps:
            try:
                return await self._execute_step(spec)
            finally:
                self.lease.extend()

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
        try:
            await self.peers.link_members(old_units + new_units, self.timeout_s)
        except PeerUnreachable as exc:
            raise TransitionRefused(exc.code, str(exc)) from None
        await self._settle_landing()
        pulled, sent = (await self._pull_weights(spec, old_units, new_units)) if spec.background_kv else (None, 0)
        # from here on Generate refuses new requests. The one wait for the engine: its iteration in flight ends
        # (every other engine-thread call here would add up to one more iteration to the decision's latency)
        self.prepared = _Prepared(spec, [], weights=pulled, weight_bytes_sent=sent, paused_at=time.perf_counter())
        self.engine_loop.pause()
        try:
            def quiesce(engine: Engine) -> tuple[list[SeqSnapshot], int, int]:
                try:
                    drained = engine.drain_inflight()
                except GroupBroken as exc:  # the tokens sampled before the break are delivered all the same
                    for ev in exc.events:
                        self.engine_loop.emit(ev)
                    raise
                for ev in drained:
                    self.engine_loop.emit(ev)
                return engine.snapshot(), self.instance.capacity_for(*new.range), self._staging_bytes(engine)

            snap, after, nbytes = await self._on_engine(quiesce)
            self.prepared.staging = await self._export_staging(nbytes)
        except BaseException:
            if self.prepared is not None and self.prepared.staging is not None:
                self.staging.give_back(self.prepared.staging)
            else:  # the cold allocation raised or was cancelled: nothing is lent, and nothing may stay so
                self.staging.lost()
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
                self.staging.lost()
                await self._undo(p)
                self.epoch = max(self.epoch, epoch)
            else:
                joined = None  # nothing changed: no group was joined
                self.log.info("transition_aborted", epoch=epoch)
                if p.staging is not None:
                    self.staging.give_back(p.staging)
            self.prepared = None
            self.engine_loop.resume()
        elif p is None and self.epoch == epoch and self.role is not None:
            self.log.warning("transition_undone_healing", epoch=epoch)
            await self._on_engine(lambda engine: self.membership.heal())
        else:
            joined = None
        if joined is not None:  # a member that did commit (or is still executing) must not wait for us
            self.membership.tell_members_we_left(joined)
        return self._done(epoch, TransitionStats())

    async def _undo(self, p: _Prepared) -> None:
        """Forget the requests that arrived, heal to a whole instance, keep the ones owned before."""
        self.handover.give_back(p.moved_in)
        await self._on_engine(lambda engine: self.membership.heal(p.snapshot))

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
            self.staging.lost()
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
        self.handover.hand_over(p.moved_out)
        self.epoch = epoch
        self.prepared = None
        self.engine_loop.resume()
        paused = time.perf_counter() - p.paused_at
        self.membership.start_pings()
        if p.landing is not None:
            self._landing_task = asyncio.get_running_loop().create_task(self._land(p.landing))
        done = self._done(epoch, TransitionStats())
        done.paused_seconds = paused
        return done

    # -- the exchange -------------------------------------------------------------------------------------
    async def _execute(self, spec: worker_pb2.TransitionSpec, p: _Prepared, stats: TransitionStats) -> None:
        me = self.worker_id
        old_units, new_units = units_from_pb(spec.old_units), units_from_pb(spec.new_units)
        moves = [SeqMove(s.request_id, s.old_unit, s.new_unit, tuple(s.old_blocks), tuple(s.new_blocks))
                 for s in spec.seqs]
        flows = kv_flows(old_units, new_units, moves)
        new_unit = unit_of(new_units, me)
        new_member = new_unit.member(me)
        assert new_member is not None and self.loop is not None
        outgoing = {k: f for k, f in flows.items() if f.src == me}
        incoming = {k: f for k, f in flows.items() if f.dst == me and f.src != me}
        pieces = weight_pieces(old_units, new_units)
        pulled = p.weights
        weights_in = pulled or WeightReceiver.expecting(self.svc, self.instance, me, spec.epoch, pieces, old_units,
                                                        new_units)

        # 1. copy out every block that moves or is renumbered, then forget the requests (their state is in
        #    the spec) so the memory can be remapped; take the weights this worker sends its peers
        t0 = time.perf_counter()

        def copy_out(engine: Engine) -> tuple[dict[str, Any], list[tuple[str, str, Any]]]:
            messages = {dst: export_flow(engine, flow, p.staging) for (_, dst), flow in outgoing.items()}
            weights_out = export_weights(self.instance, me, pieces, old_units, new_units) if pulled is None else []
            engine.clear()
            return messages, weights_out

        messages, weights_out = await self._on_engine(copy_out)
        stats.gather_s = time.perf_counter() - t0

        # 2. send on the KV-exchange class (activations of other groups still overtake it between chunks), and
        #    the weights the peers gain on the weights class below it
        t0 = time.perf_counter()
        handles, stats.bytes_sent = send_flows(self.svc, outgoing, messages, spec.epoch)
        stats.weight_bytes_sent = send_weights(self.svc, weights_out, spec.epoch) + p.weight_bytes_sent
        del weights_out

        fault_point("die_in_exchange", me)

        # 3. remap to the new layer range (overlaps the sends on the wire); the layers gained stay unfilled
        #    until their weights land (or the fallback fills them)
        t1 = time.perf_counter()
        await self._on_engine(lambda engine: self.instance.to_range(*new_member.range, fill=False))
        stats.remap_s = time.perf_counter() - t1

        # 4. receive what comes here: the KV (unless it lands after the commit), then the weights, straight into
        #    the restored arenas (a layer computes nothing before its weights are in)
        background = spec.background_kv
        received: dict[str, torch.Tensor] = {}
        if pulled is None:
            weights_in.install()
        try:
            if not background:
                received, stats.bytes_received = await receive_flows(self.svc, incoming, me, spec.epoch,
                                                                     self.timeout_s)
                for h in handles:
                    await h.wait(self.timeout_s)
            if pulled is None:
                await weights_in.receive(self.timeout_s)
        finally:
            weights_in.uninstall()
            await self._on_engine(lambda engine: weights_in.finish())
        stats.weight_bytes = dict(weights_in.bytes_by_source)
        stats.exchange_s = time.perf_counter() - t0

        # 5. write the blocks at their new ids (or, coordinated, after the commit while the new unit serves:
        #    its requests whose KV moves wait for it), 6. take over the requests of the new unit
        t0 = time.perf_counter()
        local = outgoing.get((me, me))
        if local is not None:
            received[me] = messages[me]
            incoming[(me, me)] = local
        role = GroupRole(spec.epoch, new_unit, new_unit.worker_ids.index(me))
        now = time.monotonic()
        mine = [snapshot_from_pb(s, now) for s in spec.seqs if s.new_unit == new_unit.unit_id] if role.is_head else []
        old_owned = {s.request.request_id for s in p.snapshot}
        loop = self.loop
        landing: KVLanding | None = None
        if background:
            p.landing = _Landing(spec.epoch, new_unit.head, incoming, messages.get(me), handles, p.staging)
            mine_ids = {s.request.request_id for s in mine}
            landing = KVLanding.expecting(spec.epoch, {rid: ws for rid, ws in _receivers(flows).items()
                                                       if rid in mine_ids})

        def finish(engine: Engine) -> None:
            if not background:
                for (src, _), flow in incoming.items():
                    import_flow(engine, flow, received[src])
            self.membership.take(engine, role, mine, loop, landing)

        await self._on_engine(finish)
        stats.scatter_s = time.perf_counter() - t0
        if not background and p.staging is not None:  # every send done, every message written
            self.staging.give_back(p.staging)
        self._switch_streams(p, old_owned, {s.request.request_id for s in mine}, spec, new_units)
        self.log.info("transition_done", epoch=spec.epoch, op=spec.op, unit=new_unit.unit_id,
                      layers=list(new_member.range), requests=len(mine), sent=stats.bytes_sent,
                      received=stats.bytes_received, remap_ms=round(stats.remap_s * 1e3, 2),
                      weights_sent=stats.weight_bytes_sent, weights_by_source=stats.weight_bytes)

    def _switch_streams(self, p: _Prepared, old_owned: set[str], now_owned: set[str],
                        spec: worker_pb2.TransitionSpec, new_units: list[Unit]) -> None:
        """Requests that arrived get a buffered stream until the dispatcher attaches; requests that left are
        noted for the commit, which ends their streams with moved_to."""
        new_unit_of = {s.request_id: s.new_unit for s in spec.seqs}
        heads = {u.unit_id: u.head for u in new_units}
        for rid in old_owned - now_owned:
            p.moved_out[rid] = heads.get(new_unit_of.get(rid, ""), "")
        p.moved_in.extend(self.handover.receive(now_owned - old_owned))

    # -- the coordinated exchange: weights pulled before the pause (§4.4), KV landed after the commit (§4.2) --
    async def _pull_weights(self, spec: worker_pb2.TransitionSpec, old_units: list[Unit],
                            new_units: list[Unit]) -> tuple[WeightReceiver, int]:
        """While the old unit still serves: send the peers the layers they gain (read from the live pages, which
        serving never changes) and receive the layers this worker gains into DRAM buffers; Execute then only
        copies them into the pages its remap takes back. Returns the receiver and the bytes sent. What does not
        arrive in time (a sender died) is filled from the host copy or the checkpoint at Execute."""
        me = self.worker_id
        pieces = weight_pieces(old_units, new_units)
        receiver = WeightReceiver.expecting(self.svc, self.instance, me, spec.epoch, pieces, old_units, new_units)
        if not pieces:
            return receiver, 0
        out = await self._on_engine(lambda engine: export_weights(self.instance, me, pieces, old_units, new_units))
        sent = send_weights(self.svc, out, spec.epoch)
        del out
        t0 = time.perf_counter()
        await receiver.receive(self.timeout_s)
        if receiver.source_of:
            self.log.info("weights_pulled_while_serving", epoch=spec.epoch, arenas=len(receiver.arrived),
                          missing=len(receiver.missing), ms=round((time.perf_counter() - t0) * 1e3, 1))
        return receiver, sent

    async def _land(self, landing: _Landing) -> None:
        """Write the KV that comes here while the engine serves, a slice of about ``landing_chunk_bytes``
        between two iterations, and tell the head which requests' KV has landed here. A flow that never comes
        (its sender died) breaks the group: its members heal and the held requests re-prefill (a whole instance,
        after a restore, re-prefills only the requests it held)."""
        me = self.worker_id
        fault_point("die_in_landing", me)
        await asyncio.sleep(fault_delay("slow_landing", me))
        t0 = time.perf_counter()
        left = _receivers_here(landing.incoming)  # request id -> flows into this worker still to land
        nbytes = 0
        stale = False

        async def write(flow: Flow, data: torch.Tensor) -> bool:
            for group in landing_slices(flow, data, self.landing_chunk_bytes):
                def put(engine: Engine, group: list = group) -> bool:
                    return all(engine.land_blocks(landing.epoch, p.new_blocks, p.layer_start, p.layer_end, d)
                               for p, d in group)

                if not await self._on_engine(put):
                    return False
            done = []
            for rid in {p.request_id for p in flow.parts}:
                left[rid] -= 1
                if not left[rid]:
                    done.append(rid)
            await self._report_landed(landing, sorted(done))
            return True

        try:
            local = landing.incoming.get((me, me))
            if local is not None and landing.local is not None:
                stale = not await write(local, landing.local)
            if not stale:
                async for flow, data in arrivals(self.svc, landing.incoming, me, landing.epoch, self.timeout_s,
                                                 wanted=lambda: self.engine_loop.engine.landing_epoch == landing.epoch):
                    nbytes += data.numel() * data.element_size()
                    if not await write(flow, data):
                        stale = True
                        break
            for h in landing.sends:
                await h.wait(self.timeout_s)
        except (TimeoutError, TransferError, RuntimeError, ValueError) as exc:
            self.log.error("kv_landing_failed", epoch=landing.epoch, error=f"{type(exc).__name__}: {exc}")
            self.staging.lost()
            if self.role is None:  # a whole instance (a restore): no group to break, its held requests re-prefill
                await self._on_engine(lambda engine: engine.abandon_landing(landing.epoch))
            else:
                self.membership.break_group(landing.epoch, f"the KV exchange of transition {landing.epoch} failed: {exc}")
            return
        if landing.staging is not None:
            self.staging.give_back(landing.staging)
        self.log.info("kv_landed", epoch=landing.epoch, received=nbytes, stale=stale,
                      ms=round((time.perf_counter() - t0) * 1e3, 1))

    async def _report_landed(self, landing: _Landing, request_ids: list[str]) -> None:
        if not request_ids:
            return
        if landing.head == self.worker_id:
            await self._on_engine(lambda engine: engine.kv_landed(landing.epoch, self.worker_id, request_ids))
        else:
            self.svc.submit(landing.head, CONTROL, torch.zeros(1, dtype=torch.uint8), name=LANDED,
                            epoch=landing.epoch, request_ids=request_ids)

    async def _export_staging(self, nbytes: int) -> ExportStaging:
        """Memory for the `nbytes` of KV Execute may copy out: the reserve's idle buffer when it is large enough
        (the usual case: ``keep_staging_warm`` grew it ahead of the KV in use), else allocated and faulted in
        now, inside the pause (engine.warm_staging = false, or a burst that outgrew the reserve)."""
        warm = self.staging.lend(nbytes)
        if warm is not None:
            return warm
        t0 = time.perf_counter()
        cold = await asyncio.to_thread(self.staging.allocate, nbytes)
        self.log.info("export_staging_cold", mib=round(nbytes / 2**20, 1), ms=round((time.perf_counter() - t0) * 1e3, 1))
        return cold

    @staticmethod
    def _staging_bytes(engine: Engine) -> int:
        """The most Execute may copy out: every held layer of the blocks in use (engine thread, paused)."""
        return engine.kv_blocks_in_use() * _kv_row_bytes(engine)

    @staticmethod
    def _staging_wanted(engine: Engine) -> tuple[int, int]:
        """(what a drop decided now would copy out, with room for the requests to grow until it pauses; the
        most it ever can: every held layer's whole KV) in bytes (engine thread)."""
        row = _kv_row_bytes(engine)
        upper = engine.allocator.num_blocks * row
        return min(upper, int(engine.kv_blocks_in_use() * 1.25 + 4) * row), upper

    async def keep_staging_warm(self, interval_s: float = STAGING_WARM_S) -> None:
        """Grow the idle export staging ahead of the KV in use while nothing transitions (StagingReserve), so
        the Prepare of a drop decided under a burst does not wait for page faults. Runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            if self.prepared is not None or self._landing_pending() or not self.engine_loop.running:
                continue
            try:
                needed, upper = await self._on_engine(self._staging_wanted)
            except (TimeoutError, RuntimeError):
                continue
            nbytes = self.staging.wants(needed, upper)
            if nbytes:
                self.staging.stock(await asyncio.to_thread(self.staging.allocate, nbytes))
                self.log.info("export_staging_grown", mib=round(nbytes / 2**20, 1))

    def _landing_pending(self) -> bool:
        return self._landing_task is not None and not self._landing_task.done()

    async def _settle_landing(self) -> None:
        """Before the next transition: the previous one's KV has landed everywhere (a snapshot must not take
        blocks whose KV is still on the wire). UNAVAILABLE when it does not within the timeout."""
        deadline = time.monotonic() + self.timeout_s
        task = self._landing_task
        if task is not None and not task.done():
            await asyncio.wait([task], timeout=self.timeout_s)
        while self.engine_loop.engine.kv_landing:  # read, not an engine-thread call: that waits for an iteration
            if time.monotonic() > deadline:
                raise TransitionRefused("UNAVAILABLE", "the KV of the previous transition is still landing; "
                                        "retry when it has")
            await asyncio.sleep(0.02)

    # -- helpers ------------------------------------------------------------------------------------------
    async def _on_engine(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self.engine_loop.call(fn)), self.timeout_s)

    def _done(self, epoch: int, stats: TransitionStats) -> worker_pb2.TransitionDone:
        start, end = self.instance.layer_range
        owned = len(self.engine_loop.engine.seqs) if self.role is None or self.role.is_head else 0
        return worker_pb2.TransitionDone(
            worker_id=self.worker_id, epoch=epoch, layer_start=start, layer_end=end,
            kv_blocks=self.engine_loop.stats().kv_blocks_total, bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received, gather_seconds=stats.gather_s, exchange_seconds=stats.exchange_s,
            remap_seconds=stats.remap_s, scatter_seconds=stats.scatter_s, requests_owned=owned,
            weight_bytes_sent=stats.weight_bytes_sent, weight_bytes_from_peers=stats.weight_bytes.get("peer", 0),
            weight_bytes_from_host=stats.weight_bytes.get("host", 0),
            weight_bytes_from_checkpoint=stats.weight_bytes.get("checkpoint", 0))


def _kv_row_bytes(engine: Engine) -> int:
    """Bytes of one block's KV over every layer the engine holds."""
    slab, dtype = engine.kv_slab()
    return math.prod(slab) * dtype.itemsize * (engine.runner.end - engine.runner.start)


def _receivers(flows: dict[tuple[str, str], Flow]) -> dict[str, set[str]]:
    """request id -> every worker that receives part of its KV in these flows."""
    out: dict[str, set[str]] = {}
    for (_, dst), f in flows.items():
        for p in f.parts:
            out.setdefault(p.request_id, set()).add(dst)
    return out


def _receivers_here(incoming: dict[tuple[str, str], Flow]) -> dict[str, int]:
    """request id -> how many of these flows carry part of its KV."""
    out: dict[str, int] = {}
    for f in incoming.values():
        for rid in {p.request_id for p in f.parts}:
            out[rid] = out.get(rid, 0) + 1
    return out
