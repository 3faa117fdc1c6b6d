"""Memory manager: keeps the cluster layout (rebuilt from the workers) and its membership, and serves the admin port.

The config's workers are the seeds; workers that join at run time register here (``RegisterWorker``), are checked
against the cluster's model and become whole instances of their own; the layout every other service polls
(``GetLayout``) is how the dispatcher and the monitor learn who joined and who left (README "Discovery and
autoscaling"). kunctl talks only to this service; it proxies cluster status from the monitor so that one admin
port is enough (compose publishes it on localhost only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry

from kunserve.shared.config import ClusterConfig
from kunserve.shared.epochs import MAX_EPOCH
from kunserve.shared.log import get_logger
from kunserve.shared.metrics import Lazy, new_registry
from kunserve.shared.policy.cluster_layout import LayoutState
from kunserve.shared.policy.membership import Accepted, Fingerprint, Membership, Refused, Registration
from kunserve.shared.rpc import channel
from kunserve.shared.wire.cluster_state import layout_entry_from_info, layout_to_pb
from kunserve.shared.wire.membership import registration_from_pb
from kunserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    memory_manager_pb2,
    memory_manager_pb2_grpc,
    monitor_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

from .autoscaler import Autoscaler
from .metrics import AutoscaleMetrics, DropClock, TransitionMetrics, layout_families
from .orchestrator import OrchestrationError, Orchestrator
from .tp_placement import TPPlacer
from .tp_reform import TPReformer

LINK_RETRY_S = 10.0  # how long a worker whose transfer links failed is left alone before it is asked again
CHANNEL_CLOSE_GRACE_S = 5.0  # how long the calls on a departed worker's channel may still run before it closes


def missing_links(infos: dict[str, worker_pb2.WorkerInfo]) -> dict[str, dict[str, str]]:
    """The transfer links still to open, by the worker that should open each: of a pair, the one with the
    smaller id (one link per pair; a link carries both directions). Workers without a transfer service
    (no address) are left out."""
    ids = sorted(w for w, i in infos.items() if i.transfer_address)
    out: dict[str, dict[str, str]] = {}
    for i, a in enumerate(ids):
        linked = set(infos[a].transfer_peers)
        for b in ids[i + 1:]:
            if b not in linked and a not in infos[b].transfer_peers:
                out.setdefault(a, {})[b] = infos[b].transfer_address
    return out


class MembershipObserver(Protocol):
    """Told when workers join, leave and first serve (the autoscaler)."""

    def joined(self, worker_id: str) -> None: ...

    def left(self, worker_id: str) -> None: ...

    def serving(self, worker_id: str) -> None: ...


class MemoryManager:
    """Owns the layout and the membership; refreshes the layout from the members' GetInfo. Its metrics (the layout,
    the transitions) are in `registry`."""

    def __init__(self, cfg: ClusterConfig, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.started = clock()
        self.layout = LayoutState()
        self.log = get_logger()
        # The membership version starts at this start's wall time in milliseconds: a successor started later begins
        # above every version this one hands out (unless it changed more than once per millisecond), so a worker
        # that still reports a predecessor's version never counts as having applied one of its lists.
        self.membership = Membership({w.id: w.address for w in cfg.workers},
                                     member_timeout_s=cfg.memory_manager.member_timeout_s,
                                     version=int(wall_clock() * 1000))
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}  # worker id -> (address, channel)
        self._closing: set[asyncio.Task] = set()
        self.observers: list[MembershipObserver] = []
        self._served: set[str] = set()  # joined workers seen serving (told to the observers once)
        self.autoscaler: Autoscaler | None = None  # set when autoscale.scaler is not "none"
        self._refreshing: asyncio.Task | None = None
        self.monitor_channel = channel(cfg.monitor.address)
        self.orchestrator = Orchestrator(self, cfg.memory_manager.transition_timeout_s,
                                         cfg.memory_manager.transition_lease_s,
                                         background_kv=cfg.memory_manager.coordinated_exchange)
        self.tp = TPReformer(self, self.orchestrator, cfg.memory_manager.transition_timeout_s, cfg.memory_manager.tp_mode)
        self.tp_placer = TPPlacer(self.tp, idle_split_s=cfg.memory_manager.tp_idle_split_s if cfg.dispatcher.elastic_tp else 0.0)
        self._infos: dict[str, worker_pb2.WorkerInfo] = {}  # the latest GetInfo of each reachable worker
        self._linking: asyncio.Task | None = None
        self._link_retry_at: dict[str, float] = {}  # a worker whose links failed is asked again after this
        self.registry = registry if registry is not None else new_registry()
        self.orchestrator.observers.append(TransitionMetrics(self.registry))
        self.autoscale_metrics = AutoscaleMetrics(self.registry)  # zeros while autoscale.scaler = "none"
        self.drop_clock = DropClock()
        self.registry.register(Lazy(lambda: layout_families(
            self.layout.epoch, self._infos, len(cfg.workers), self.drop_clock.seconds(),
            self.orchestrator.lock.locked(), joined=sum(1 for w in self.membership.ids if self.membership.joined(w)),
            standby=len(self.membership.standby))))

    @property
    def infos(self) -> dict[str, worker_pb2.WorkerInfo]:
        """The latest GetInfo of each reachable member."""
        return self._infos

    def member_ids(self) -> list[str]:
        """Every member: seeds, then the joined workers (draining ones too)."""
        return self.membership.ids

    @property
    def members_settled(self) -> bool:
        """Up for member_timeout_s: every live joined worker has registered since this process started (they
        register every member_timeout_s / 4), so the membership no longer misses one that is alive."""
        return self.clock() - self.started >= self.membership.member_timeout_s

    def standby_ids(self) -> list[str]:
        """Standby workers that offered themselves, oldest offer first (the local scaler activates these)."""
        return [w for w, _ in sorted(self.membership.standby.items(), key=lambda kv: (kv[1].since, kv[0]))]

    @property
    def worker_ids(self) -> list[str]:
        """The members a transition may include: seeds, and joined workers every live member knows of (their
        transfer links are accepted), never one that is draining."""
        now = self.clock()
        return [w for w in self.membership.ids if self.membership.plannable(w, now)]

    def worker_stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub | None:
        """A stub for the worker (a member or a standby worker); None when no such worker is known."""
        ch = self._channel(worker_id)
        return worker_pb2_grpc.WorkerStub(ch) if ch is not None else None

    def worker_host(self, worker_id: str) -> str | None:
        """The host of a member's address (tensor-parallel members must share one)."""
        address = self.membership.address(worker_id)
        return address.rsplit(":", 1)[0] if address else None

    def model_shape(self) -> Fingerprint | None:
        """The cluster's model as the seeds registered it."""
        return self.membership.reference

    def _channel(self, worker_id: str) -> grpc.aio.Channel | None:
        address = self.membership.address(worker_id)
        if address is None:
            return None
        known = self._channels.get(worker_id)
        if known is not None and known[0] == address:
            return known[1]
        if known is not None:  # the worker came back at another address
            self._close_later(known[1])
        ch = channel(address)
        self._channels[worker_id] = (address, ch)
        return ch

    def _stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        stub = self.worker_stub(worker_id)
        if stub is None:
            raise KeyError(worker_id)
        return stub

    def _close_later(self, ch: grpc.aio.Channel) -> None:
        """Close the channel of a worker that left or moved once the calls on it end (a bounded grace): a refresh
        still asking it must get its answer or its timeout, not a cancellation."""
        task = asyncio.ensure_future(ch.close(grace=CHANNEL_CLOSE_GRACE_S))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def connected(self, worker_id: str, timeout: float) -> bool:
        """Wait (bounded) until the channel to a worker is connected. The layout refresh starts before the
        workers listen, so a channel can sit in reconnect backoff for up to a second after a worker came up;
        a fail-fast call in that window would report a healthy worker as unreachable."""
        ch = self._channel(worker_id)
        if ch is None:
            return False
        try:
            await asyncio.wait_for(ch.channel_ready(), timeout)
            return True
        except TimeoutError:
            return False

    # -- membership ----------------------------------------------------------------------------------------------
    def register(self, reg: Registration) -> Accepted | Refused:
        """A worker's RegisterWorker: a seed's model, a join, a heartbeat or a standby worker's offer."""
        verdict = self.membership.register(reg, self.clock())
        if isinstance(verdict, Refused):
            self.log.warning("worker_refused", worker=reg.worker_id, address=reg.address, code=verdict.code,
                             reason=verdict.message)
        elif verdict.joined:
            self.log.info("worker_joined", worker=reg.worker_id, address=reg.address,
                          members_version=verdict.version, members=list(verdict.members))
            for observer in self.observers:
                observer.joined(reg.worker_id)
            self._refresh_soon()  # into the layout now, not at the next periodic refresh
        self.sync_layout()
        return verdict

    def _refresh_soon(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh())

    def deregister(self, worker_id: str, incarnation: str, reason: str) -> bool:
        changed = self.membership.deregister(worker_id, incarnation)
        if changed:
            self.log.info("worker_deregistered", worker=worker_id, reason=reason or "-")
        self.sync_layout()
        return changed

    def sync_layout(self) -> None:
        """Take workers that are no longer members out of the layout, their infos and their channels."""
        members = set(self.membership.ids)
        for wid in [w for w in self.layout.workers if w not in members]:
            del self.layout.workers[wid]
            self.layout.epoch += 1
            self._infos.pop(wid, None)
            self._served.discard(wid)
            self.log.info("worker_left", worker=wid, epoch=self.layout.epoch)
            for observer in self.observers:
                observer.left(wid)
        for wid in [w for w in self._channels if self.membership.address(w) is None]:
            self._close_later(self._channels.pop(wid)[1])

    def layout_pb(self) -> memory_manager_pb2.ClusterLayout:
        """The layout with the membership: joined and draining workers, the standby pool, the membership version."""
        out = layout_to_pb(self.layout)
        for w in out.workers:
            w.joined = self.membership.joined(w.worker_id)
            w.draining = self.membership.draining(w.worker_id)
        out.members_version = self.membership.version
        out.members_settled = self.members_settled
        out.standby.extend(memory_manager_pb2.StandbyWorker(worker_id=s.worker_id, address=s.address)
                           for _, s in sorted(self.membership.standby.items()))
        if self.autoscaler is not None:
            out.autoscale.CopyFrom(self.autoscaler.state_pb())
        else:
            out.autoscale.scaler = "none"
        return out

    async def refresh(self, timeout: float = 1.0) -> None:
        async def one(worker_id: str) -> None:
            stub = self.worker_stub(worker_id)
            if stub is None:
                return  # it left: an overlapping refresh expired it, or it deregistered
            try:
                info = await stub.GetInfo(common_pb2.Empty(), timeout=timeout)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the refresh itself is cancelled
                return  # its channel was closed past the grace under the call: the worker left meanwhile
            except grpc.aio.AioRpcError:
                self.layout.mark_unreachable(worker_id)
                self._infos.pop(worker_id, None)
                return
            if info.worker_id != worker_id:  # another process at that address
                self.log.error("worker_identity_mismatch", worker=worker_id, answered=info.worker_id)
                self.layout.mark_unreachable(worker_id)
                self._infos.pop(worker_id, None)
                return
            if info.epoch >= MAX_EPOCH:  # not acted on: the next epoch would overflow (shared/epochs.py)
                self.log.error("worker_epoch_out_of_range", worker=worker_id, epoch=info.epoch)
                self._infos.pop(worker_id, None)
                return
            if worker_id not in self.membership.members:
                return  # it left while we asked
            self.membership.heard(worker_id, self.clock())
            self._infos[worker_id] = info
            try:
                if self.layout.observe(layout_entry_from_info(info), info.num_layers_model):
                    self.log.info("layout_changed", worker=worker_id, layers=[info.layer_start, info.layer_end],
                                  group=info.group_id, epoch=self.layout.epoch)
            except ValueError as exc:
                self.log.error("layout_inconsistent", worker=worker_id, error=str(exc))
            if info.serving and self.membership.joined(worker_id) and worker_id not in self._served:
                self._served.add(worker_id)
                for observer in self.observers:
                    observer.serving(worker_id)

        await asyncio.gather(*(one(w) for w in self.membership.ids))
        for wid in self.tp.reforming:  # re-executing: silent for a while, not gone
            self.membership.heard(wid, self.clock())
        gone, idle = self.membership.expire(self.clock())
        for wid in gone:
            self.log.warning("worker_expired", worker=wid, member_timeout_s=self.membership.member_timeout_s)
        for wid in idle:
            self.log.info("standby_worker_expired", worker=wid)
        self.sync_layout()
        self.drop_clock.observe(any(len(i.group_members) > 1 for i in self._infos.values()))
        await self.abort_orphans()
        if self.cfg.memory_manager.preconnect and (self._linking is None or self._linking.done()):
            now = time.monotonic()
            plannable = set(self.worker_ids)
            infos = {w: i for w, i in self._infos.items() if w in plannable}
            missing = {w: p for w, p in missing_links(infos).items() if self._link_retry_at.get(w, 0.0) <= now}
            if missing:
                self._linking = asyncio.create_task(self._link(missing))

    async def abort_orphans(self) -> None:
        """Roll back transitions that no live memory manager drives: a worker still paused for an epoch this
        process never started was left by a predecessor that died mid-transition. Its members would abort on
        their own when their leases run out; this does it at once (and for a member whose lease is long)."""
        orchestrator = self.orchestrator
        orphans = {w: i.transition_epoch for w, i in self._infos.items()
                   if i.transitioning and i.transition_epoch and i.transition_epoch not in orchestrator.started_epochs}
        if not orphans or orchestrator.lock.locked():
            return
        async with orchestrator.lock:
            for worker_id, epoch in sorted(orphans.items()):
                self.log.warning("orphaned_transition_aborting", worker=worker_id, epoch=epoch)
                try:
                    await self._stub(worker_id).AbortTransition(worker_pb2.TransitionRef(epoch=epoch),
                                                                timeout=orchestrator.timeout_s)
                except grpc.aio.AioRpcError as exc:
                    self.log.warning("orphaned_transition_abort_failed", worker=worker_id, epoch=epoch,
                                     code=exc.code().name, error=exc.details())

    async def _link(self, missing: dict[str, dict[str, str]]) -> None:
        """Ask workers to open the transfer links a drop would otherwise open while requests wait. Best effort:
        a link that fails is tried again after the next refresh, and a transition opens what is still missing."""
        async def one(worker_id: str, peers: dict[str, str]) -> None:
            request = worker_pb2.PeerAddresses(peers=[worker_pb2.PeerAddress(worker_id=w, transfer_address=a)
                                                      for w, a in sorted(peers.items())])
            try:
                reply = await self._stub(worker_id).ConnectPeers(request, timeout=10.0)
                failed = dict(reply.failed)
            except grpc.aio.AioRpcError as exc:
                failed = {"*": f"{exc.code().name}: {exc.details()}"}
            if failed:
                self._link_retry_at[worker_id] = time.monotonic() + LINK_RETRY_S
                self.log.warning("transfer_links_failed", worker=worker_id, failed=failed, retry_in_s=LINK_RETRY_S)
            else:
                self.log.info("transfer_links_open", worker=worker_id, peers=list(reply.linked))

        await asyncio.gather(*(one(w, p) for w, p in missing.items()))

    async def refresh_forever(self, interval_s: float = 1.0) -> None:
        """Refresh until cancelled; a refresh that fails is logged and the next one runs (the layout, the expiry of
        members and the dispatcher's view all depend on this loop going on)."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - one failed refresh must not end the loop
                self.log.exception("layout_refresh_failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        if self._linking is not None:
            self._linking.cancel()
        if self._refreshing is not None:
            self._refreshing.cancel()
        for _, ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.monitor_channel.close()


class MemoryManagerServicer(memory_manager_pb2_grpc.MemoryManagerServicer):
    def __init__(self, mm: MemoryManager) -> None:
        self.mm = mm

    async def GetLayout(self, request, context):
        return self.mm.layout_pb()

    async def RegisterWorker(self, request, context):
        verdict = self.mm.register(registration_from_pb(request))
        if isinstance(verdict, Refused):
            await context.abort(getattr(grpc.StatusCode, verdict.code), verdict.message)
        assert isinstance(verdict, Accepted)
        return memory_manager_pb2.RegisterWorkerReply(
            seed=verdict.seed, members_version=verdict.version, members=list(verdict.members),
            heartbeat_s=self.mm.membership.member_timeout_s / 4, removed=verdict.removed)

    async def DeregisterWorker(self, request, context):
        if not request.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: must not be empty")
        self.mm.deregister(request.worker_id, request.incarnation, request.reason)
        return common_pb2.Empty()

    async def _orchestrate(self, context, coro):
        try:
            return await coro
        except OrchestrationError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except ValueError as exc:  # the planner's argument checks
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    @staticmethod
    async def _check_requirement(request, context) -> None:
        if request.required_blocks < 0 or request.required_bytes < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "required_blocks / required_bytes: must be >= 0")
        if request.required_blocks and request.required_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give required_blocks or required_bytes, not both")

    async def PlanDrop(self, request, context):
        await self._check_requirement(request, context)

        async def plan():
            reply, *_ = await self.mm.orchestrator.plan(request)
            return reply

        return await self._orchestrate(context, plan())

    async def Drop(self, request, context):
        await self._check_requirement(request, context)
        return await self._orchestrate(context, self.mm.orchestrator.drop(request))

    async def Restore(self, request, context):
        return await self._orchestrate(context, self.mm.orchestrator.restore(request))

    async def Migrate(self, request, context):
        return await self._orchestrate(context, self.mm.orchestrator.migrate(request))

    async def TransformTP(self, request, context):
        return await self._orchestrate(context, self.mm.tp.transform(request))

    async def SplitTP(self, request, context):
        return await self._orchestrate(context, self.mm.tp.split(request))

    async def PlaceLongRequest(self, request, context):
        return await self._orchestrate(context, self.mm.tp_placer.place(request))


class AdminServicer(admin_pb2_grpc.AdminServicer):
    CONNECT_TIMEOUT_S = 3.0

    def __init__(self, mm: MemoryManager) -> None:
        self.mm = mm

    async def GetStatus(self, request, context):
        out = admin_pb2.AdminStatus(layout=self.mm.layout_pb())
        try:
            out.cluster.CopyFrom(await monitor_pb2_grpc.MonitorStub(self.mm.monitor_channel).GetClusterStatus(
                common_pb2.Empty(), timeout=2.0, wait_for_ready=True))  # not fail-fast: see MemoryManager.connected
        except grpc.aio.AioRpcError as exc:
            out.monitor_error = f"monitor at {self.mm.cfg.monitor.address} unreachable: {exc.code().name}"
        return out

    async def _worker(self, worker_id: str, context) -> worker_pb2_grpc.WorkerStub:
        stub = self.mm.worker_stub(worker_id)
        if stub is None:
            known = ", ".join(sorted(self.mm.membership.ids)) or "none"
            return await context.abort(grpc.StatusCode.NOT_FOUND,
                                       f"worker_id: no worker {worker_id!r} (known: {known})")
        if not await self.mm.connected(worker_id, self.CONNECT_TIMEOUT_S):
            address = self.mm.membership.address(worker_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {worker_id}: no connection to {address} "
                                                             f"within {self.CONNECT_TIMEOUT_S:.0f}s")
        return stub

    async def _proxy(self, worker_id: str, call, context):
        """Forward to the worker; its status and message reach kunctl unchanged."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"worker {worker_id}: {exc.details()}")

    async def GetWorkerMemory(self, request, context):
        stub = await self._worker(request.worker_id, context)
        return await self._proxy(request.worker_id, stub.GetMemoryMap(common_pb2.Empty(), timeout=10.0), context)

    async def DropWorkerLayers(self, request, context):
        stub = await self._worker(request.worker_id, context)
        out = await self._proxy(request.worker_id, stub.DropLayers(
            worker_pb2.DropLayersRequest(layers=request.layers), timeout=60.0), context)
        await self.mm.refresh()
        return out

    async def RestoreWorkerLayers(self, request, context):
        stub = await self._worker(request.worker_id, context)
        out = await self._proxy(request.worker_id, stub.RestoreLayers(
            worker_pb2.RestoreLayersRequest(layers=request.layers, source=request.source), timeout=300.0), context)
        await self.mm.refresh()
        return out
