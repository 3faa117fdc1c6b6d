"""The memory manager's autoscaler: the I/O half of shared/policy/autoscale.py (README "Discovery and autoscaling").

Every second it gathers the signals (the open "autoscale needed" episode the drop reports opened, how long a
pipeline group has held, the members, what the scaler can add, the cluster's KV usage from the monitor, the added
workers that could go), asks the policy, and carries the decision out:

* scale up: the scaler adds instances (a standby worker activated, or a StatefulSet's replicas raised); each
  registers as a member when it is up, the dispatcher routes to it once the layout lists it serving, and the time
  from the need to that moment is measured. One that does not serve within ``autoscale.scale_up_timeout_s`` is
  logged and given up on; the cluster goes on with what it has.
* scale down: the worker is marked draining (no new request, no transition includes it), then drained
  (``Worker.Drain``: its running requests finish, for up to ``autoscale.drain_timeout_s``, and the rest resume
  elsewhere), it deregisters and goes back to standby, and the scaler takes the capacity back. A drain that fails
  with no answer from the worker (unreachable, the deadline, a cancelled call) leaves its outcome unknown: the
  worker's GetInfo decides, now and at every later tick until it is known. A worker that still serves never got the
  drain (or refused it) and loses its draining mark; one that does not serve is draining on its own (the worker
  finishes a drain whatever becomes of the call) and leaves when it deregisters, or expires if it died.
* give back: a standby worker a scale-down left over (the scaler refused to take it back) is given back again
  while the cluster is calm.

A scaler that is unreachable or refuses is logged with its reason and counted; nothing else changes. The layout's
``last_error`` says what failed last until an action succeeds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from kunserve.shared.config import AutoscaleSection
from kunserve.shared.log import get_logger
from kunserve.shared.policy.autoscale import (
    GIVE_BACK,
    SCALE_DOWN,
    SCALE_UP,
    AutoscaleConfig,
    AutoscalePolicy,
    Candidate,
    ClusterSignals,
    ScaleDecision,
)
from kunserve.shared.rpc import channel
from kunserve.v1 import common_pb2, memory_manager_pb2, monitor_pb2_grpc, worker_pb2, worker_pb2_grpc

from .scalers import Scaler, ScalerError

if TYPE_CHECKING:
    from .servicer import MemoryManager

DRAIN_RPC_MARGIN_S = 15.0  # beyond drain_timeout_s: the handed-over streams closing, the deregistration
INFO_TIMEOUT_S = 2.0


def policy_config(a: AutoscaleSection, max_workers: int | None = None) -> AutoscaleConfig:
    return AutoscaleConfig(
        hold_s=a.hold_s,
        scale_down_hold_s=a.scale_down_hold_s,
        scale_down_usage=a.scale_down_usage,
        cooldown_s=a.cooldown_s,
        scale_up_timeout_s=a.scale_up_timeout_s,
        max_workers=a.max_workers if max_workers is None else max_workers,
    )


class Autoscaler:
    def __init__(
        self,
        mm: MemoryManager,
        scaler: Scaler,
        section: AutoscaleSection,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mm = mm
        self.scaler = scaler
        self.section = section
        self.clock = clock
        self.policy = AutoscalePolicy(policy_config(section))
        self.metrics = mm.autoscale_metrics
        self.log = get_logger().bind(component="autoscaler", scaler=scaler.name)
        self.needed_since: float | None = None  # the open "autoscale needed" episode
        self.last_action = ""
        self.last_error = ""
        self.available: int | None = None
        self._last_reason = ""
        self.unsettled: set[str] = set()  # marked draining, the drain's outcome unknown (no answer from the worker)
        mm.observers.append(self)
        mm.orchestrator.observers.append(self)

    # -- what it is told -------------------------------------------------------------------------------------------
    def reported(self, report: memory_manager_pb2.TransitionReport) -> None:
        """A transition ended: a drop saying no plan meets the requirement opens an autoscale-needed episode; one
        that met it, or a completed restore, closes it."""
        if report.op == "drop" and report.autoscale_needed:
            if self.needed_since is None:
                self.needed_since = self.clock()
                self.log.warning("autoscale_needed", epoch=report.epoch, completed=report.completed)
        elif (report.op == "drop" and report.completed) or (report.op == "restore" and report.completed and not report.error):
            self.needed_since = None

    def refused(self, op: str, code: str) -> None:
        pass

    def joined(self, worker_id: str) -> None:
        pass

    def left(self, worker_id: str) -> None:
        pass

    def serving(self, worker_id: str) -> None:
        """A joined worker serves: the need it answered is met."""
        now = self.clock()
        since = self.policy.served(now)
        self.needed_since = None
        if since is not None:
            self.metrics.scale_ups.labels("served").inc()
            self.metrics.time_to_serving.observe(now - since)
            self.log.info("autoscale_instance_serving", worker=worker_id, seconds_since_need=round(now - since, 3))
        self.metrics.pending.set(self.policy.pending)

    # -- one step ---------------------------------------------------------------------------------------------------
    async def signals(self) -> ClusterSignals:
        mm = self.mm
        now = self.clock()
        used: int | None = None
        total = 0
        overloaded = False
        try:
            status = await monitor_pb2_grpc.MonitorStub(mm.monitor_channel).GetClusterStatus(common_pb2.Empty(), timeout=2.0)
            used, total, overloaded = status.kv_blocks_used, status.kv_blocks_total, status.overloaded
        except grpc.aio.AioRpcError:
            pass  # no figure: no scale-down
        try:
            self.available = await self.scaler.available()
        except ScalerError:
            self.available = None
        membership = mm.membership
        joined = [w for w in reversed(membership.ids) if membership.joined(w) and not membership.draining(w)]
        whole = []
        for wid in joined:
            info = mm.infos.get(wid)
            if info is not None and info.serving and list(info.group_members) in ([], [wid]):
                whole.append(wid)
        allowed = await self.scaler.removable(whole) if whole else []
        try:
            left_over = tuple(await self.scaler.left_over())
        except ScalerError:
            left_over = ()
        removable = tuple(
            Candidate(w, membership.members[w].kv_blocks or mm.infos[w].kv_blocks_total)
            for w in allowed
            if w in membership.members and w in mm.infos
        )
        return ClusterSignals(
            now=now,
            autoscale_needed=self.needed_since is not None,
            needed_since=self.needed_since,
            dropped_since=mm.drop_clock.since,
            members=len(membership.live(now)),
            available=self.available,
            kv_used_blocks=used,
            kv_total_blocks=total,
            overloaded=overloaded,
            removable=removable,
            left_over=left_over,
        )

    async def tick(self) -> ScaleDecision:
        await self._settle_drains()
        decision = self.policy.decide(await self.signals())
        if decision.expired:
            self.metrics.scale_ups.labels("timed_out").inc(decision.expired)
            self.last_error = (
                f"{decision.expired} instance(s) asked for did not serve within "
                f"autoscale.scale_up_timeout_s = {self.section.scale_up_timeout_s:g} s"
            )
            self.log.error("autoscale_scale_up_timed_out", instances=decision.expired, timeout_s=self.section.scale_up_timeout_s)
        if decision.action == SCALE_UP:
            await self._scale_up(decision)
        elif decision.action == SCALE_DOWN:
            await self._scale_down(decision)
        elif decision.action == GIVE_BACK:
            await self._give_back(decision)
        elif decision.reason and decision.reason != self._last_reason:
            self.log.info("autoscale_waiting", reason=decision.reason)
        self._last_reason = decision.reason
        self.metrics.pending.set(self.policy.pending)
        return decision

    async def _scale_up(self, d: ScaleDecision) -> None:
        self.log.warning("autoscale_scale_up", instances=d.count, reason=d.reason, members=len(self.mm.membership.ids))
        try:
            did = await self.scaler.scale_up(d.count)
        except ScalerError as exc:
            self.policy.failed(d.count)
            self.metrics.scale_ups.labels("failed").inc(d.count)
            self.last_error = f"scale up: {exc.code}: {exc}"
            self.log.error("autoscale_scale_up_failed", code=exc.code, error=str(exc))
            return
        self.metrics.scale_ups.labels("requested").inc(d.count)
        self.last_action = f"scale_up {d.count} ({d.reason}): {', '.join(did)}"
        self.last_error = ""
        self.log.info("autoscale_scale_up_requested", did=did)

    async def _scale_down(self, d: ScaleDecision) -> None:
        mm, wid = self.mm, d.worker_id
        lock = mm.orchestrator.lock
        if lock.locked():
            return  # a transition is running: the next tick decides again
        async with lock:  # no transition starts while it is marked draining
            info = mm.infos.get(wid)
            if info is None or list(info.group_members) not in ([], [wid]) or not mm.membership.drain(wid):
                return
        self.log.warning("autoscale_scale_down", worker=wid, reason=d.reason)
        address = mm.membership.address(wid)
        timeout = self.section.drain_timeout_s
        try:
            if address is None:
                raise ScalerError("NOT_FOUND", f"{wid} is no longer known")
            # A channel of its own: the worker deregisters before the drain answers, and the memory manager closes
            # the channels of workers that left.
            async with channel(address) as ch:
                reply = await worker_pb2_grpc.WorkerStub(ch).Drain(
                    worker_pb2.DrainRequest(timeout_s=timeout, to_standby=True), timeout=timeout + DRAIN_RPC_MARGIN_S
                )
            self.log.info(
                "autoscale_drained", worker=wid, finished=reply.finished, handed_over=reply.handed_over, seconds=round(reply.seconds, 3)
            )
            did = await self.scaler.scale_down(wid)
        except (grpc.aio.AioRpcError, ScalerError) as exc:
            message = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else f"{exc.code}: {exc}"
            self.metrics.scale_downs.labels("failed").inc()
            self.last_error = f"scale down {wid}: {message}"
            self.log.error("autoscale_scale_down_failed", worker=wid, error=message)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                mm.membership.undrain(wid)  # it refused to drain (it joined a group meanwhile): it stays
            elif isinstance(exc, grpc.aio.AioRpcError) and mm.membership.draining(wid):
                self.unsettled.add(wid)  # no answer: whether it drains is the worker's to say
                await self._settle_drains()
            return
        finally:
            mm.sync_layout()
        self.metrics.scale_downs.labels("completed").inc()
        self.last_action = f"scale_down {wid} ({d.reason}): {did}"
        self.last_error = ""
        self.log.info("autoscale_scale_down_done", worker=wid, did=did)

    async def _settle_drains(self) -> None:
        """For each worker whose drain got no answer: still serving (it never drained) clears its draining mark;
        not serving (draining on its own) or not answering keeps it, to be asked again at the next tick; no longer a
        member (it deregistered, or expired) ends the question."""
        mm = self.mm
        for wid in sorted(self.unsettled):
            if not mm.membership.draining(wid):
                self.unsettled.discard(wid)  # it left (or the mark went otherwise)
                continue
            stub = mm.worker_stub(wid)
            if stub is None:
                self.unsettled.discard(wid)
                continue
            try:
                info = await stub.GetInfo(common_pb2.Empty(), timeout=INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue  # dead (it expires) or briefly unreachable: asked again
            if info.worker_id == wid and info.serving and mm.membership.draining(wid):
                mm.membership.undrain(wid)
                self.unsettled.discard(wid)
                self.log.warning("autoscale_drain_not_taken", worker=wid, reason="it still serves: the draining mark is cleared")
                mm.sync_layout()

    async def _give_back(self, d: ScaleDecision) -> None:
        """A standby worker an earlier scale-down drained, whose capacity the scaler kept: ask it again."""
        wid = d.worker_id
        try:
            did = await self.scaler.scale_down(wid)
        except ScalerError as exc:
            self.metrics.scale_downs.labels("failed").inc()
            self.last_error = f"give back {wid}: {exc.code}: {exc}"
            self.log.error("autoscale_give_back_failed", worker=wid, code=exc.code, error=str(exc))
            return
        self.metrics.scale_downs.labels("completed").inc()
        self.last_action = f"give_back {wid} ({d.reason}): {did}"
        self.last_error = ""
        self.log.info("autoscale_give_back_done", worker=wid, did=did)

    async def run_forever(self, interval_s: float = 1.0) -> None:
        self.log.info("autoscaler_started", config=self.policy.config.__dict__)
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the loop die: log and go on
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.log.exception("autoscale_tick_error", error=self.last_error)
            await asyncio.sleep(interval_s)

    def state_pb(self) -> memory_manager_pb2.AutoscaleState:
        now = self.clock()
        return memory_manager_pb2.AutoscaleState(
            scaler=self.scaler.name,
            needed=self.needed_since is not None,
            needed_for_s=now - self.needed_since if self.needed_since is not None else 0.0,
            pending=self.policy.pending,
            standby_available=-1 if self.available is None else self.available,
            last_action=self.last_action,
            last_error=self.last_error,
        )
