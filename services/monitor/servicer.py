"""Monitor: receives every worker's stats stream, serves the cluster status, and (with ``monitor.auto_drop``)
runs the overload policy: drop on overload, restore on underload, through the memory manager (KunServe §4).
Drops stack: overload that outlasts a drop asks for another, which merges groups (pairs into a quad); each
restore of a group undoes one merge (a quad into pairs, a pair into whole instances).

Workers that join at run time are heard as soon as they stream their stats; a worker that leaves (drained, or
dead past the memory manager's member timeout) is forgotten once the memory manager's settled layout no longer lists
it (``follow_layout_forever``), so its last report never counts as capacity again (README "Discovery and
autoscaling"). A memory manager that just restarted lists the joined workers again only as they re-register: until
its layout is settled (``members_settled``) a joined worker it does not list is kept."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Protocol

import grpc

from kunserve.shared.log import get_logger
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.policy.overload import DROP, NONE, RESTORE, Decision, OverloadConfig, OverloadPolicy, UnitLoad
from kunserve.shared.policy.units import build_units
from kunserve.shared.rpc import channel
from kunserve.shared.wire.cluster_state import report_from_pb, status_to_pb
from kunserve.v1 import common_pb2, memory_manager_pb2, memory_manager_pb2_grpc, monitor_pb2_grpc


class MonitorServicer(monitor_pb2_grpc.MonitorServicer):
    def __init__(self, stale_after_s: float, max_head_wait_s: float = math.inf,
                 seeds: Collection[str] = ()) -> None:
        # max_head_wait_s: the TTFT SLO; a worker whose oldest waiting request waited longer is overloaded
        self.load = ClusterLoad(stale_after_s=stale_after_s, max_head_wait_s=max_head_wait_s)
        self.log = get_logger()
        self.seeds = frozenset(seeds)  # the config's workers: members for good
        self.departed: set[str] = set()  # joined workers the layout stopped listing: their reports are ignored
        self._layout_error = ""

    def apply_layout(self, layout: memory_manager_pb2.ClusterLayout) -> None:
        """Forget the joined workers the memory manager's settled layout no longer lists (they left), and hear
        again those it lists (a worker that rejoined)."""
        listed = {w.worker_id for w in layout.workers}
        self.departed -= listed
        if not layout.members_settled:
            return
        known = {w.report.worker_id for w in self.load.status(time.monotonic(), time.time()).workers}
        for wid in sorted(known - listed - self.seeds):
            self.load.forget(wid)
            self.departed.add(wid)
            self.log.info("worker_forgotten", worker=wid, members_version=layout.members_version,
                          reason="the memory manager's layout no longer lists it")

    async def follow_layout_forever(self, memory_manager: str, interval_s: float = 1.0) -> None:
        async with channel(memory_manager) as ch:
            stub = memory_manager_pb2_grpc.MemoryManagerStub(ch)
            while True:
                try:
                    self.apply_layout(await stub.GetLayout(common_pb2.Empty(), timeout=2.0))
                    self._layout_error = ""
                except grpc.aio.AioRpcError as exc:
                    error = f"{exc.code().name}: {exc.details()}"
                    if error != self._layout_error:
                        self.log.warning("layout_unavailable", memory_manager=memory_manager, error=error)
                    self._layout_error = error
                await asyncio.sleep(interval_s)

    async def ReportStats(self, request_iterator, context: grpc.aio.ServicerContext):
        worker_id = None
        async for stats in request_iterator:
            if not stats.worker_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: must not be empty")
            if stats.kv_blocks_total < 0 or stats.kv_blocks_used < 0 or stats.kv_blocks_used > stats.kv_blocks_total:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"kv_blocks_used/kv_blocks_total: inconsistent ({stats.kv_blocks_used}/{stats.kv_blocks_total})")
            if worker_id is None:
                worker_id = stats.worker_id
                self.log.info("worker_stream_opened", worker=worker_id, address=stats.address)
            if stats.worker_id in self.departed:
                continue  # it left the cluster (a drained worker's last reports)
            self.load.observe(report_from_pb(stats), time.monotonic())
        self.log.info("worker_stream_closed", worker=worker_id)
        return common_pb2.Empty()

    async def GetClusterStatus(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        # ClusterStatus has no fields for the policy's counters: they are in the monitor's log
        # (events policy_drop / policy_restore / policy_action_failed, each with the counters).
        return status_to_pb(self.load.status(time.monotonic(), time.time()))


# --- the overload policy loop -------------------------------------------------------------------------------


class MemoryManagerActions(Protocol):
    """What the policy loop needs from the memory manager (a fake in tests)."""

    async def drop(self, required_blocks: int, reason: str) -> memory_manager_pb2.TransitionReport: ...

    async def restore(self, group_id: str) -> memory_manager_pb2.TransitionReport: ...

    async def migrate(self, src: str, dst: str, blocks: int) -> memory_manager_pb2.TransitionReport: ...

    async def close(self) -> None: ...


class GrpcMemoryManager:
    """MemoryManager.Drop / Restore over gRPC. Errors propagate as grpc.aio.AioRpcError."""

    def __init__(self, address: str, *, drop_timeout_s: float = 120.0, restore_timeout_s: float = 300.0) -> None:
        self.address = address
        self.drop_timeout_s = drop_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: memory_manager_pb2_grpc.MemoryManagerStub | None = None

    def _get_stub(self) -> memory_manager_pb2_grpc.MemoryManagerStub:
        if self._stub is None:
            self._channel = channel(self.address)
            self._stub = memory_manager_pb2_grpc.MemoryManagerStub(self._channel)
        return self._stub

    async def drop(self, required_blocks: int, reason: str) -> memory_manager_pb2.TransitionReport:
        return await self._get_stub().Drop(
            memory_manager_pb2.DropRequest(required_blocks=required_blocks, reason=reason),
            timeout=self.drop_timeout_s)

    async def restore(self, group_id: str) -> memory_manager_pb2.TransitionReport:
        return await self._get_stub().Restore(memory_manager_pb2.RestoreRequest(group_id=group_id),
                                              timeout=self.restore_timeout_s)

    async def migrate(self, src: str, dst: str, blocks: int) -> memory_manager_pb2.TransitionReport:
        return await self._get_stub().Migrate(
            memory_manager_pb2.MigrateRequest(src_worker=src, dst_worker=dst, blocks=blocks),
            timeout=self.drop_timeout_s)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


@dataclass
class PolicyCounters:
    drops: int = 0              # drops that completed
    restores: int = 0           # groups restored
    failures: int = 0           # actions that failed: not completed, rolled back, or an RPC error
    autoscale_needed: int = 0   # reports saying no drop plan can meet the requirement
    ticks: int = 0
    tick_errors: int = 0        # exceptions caught in the loop itself


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class OverloadController:
    """Every ``interval_s``: units from the fresh reports -> OverloadPolicy.observe -> Drop / Restore.

    One action at a time, awaited inline (the policy waits for it anyway). After an action that changed the
    layout, decisions wait until every fresh worker has reported again at the new epoch (or
    ``settle_timeout_s`` passed), so a stale pre-drop snapshot never triggers a second drop. After a failed
    action the loop backs off exponentially (``backoff_s`` doubling up to ``max_backoff_s``).
    """

    def __init__(self, load: ClusterLoad, mm: MemoryManagerActions, config: OverloadConfig | None = None, *,
                 interval_s: float = 0.2, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 settle_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 mode: str = "drop") -> None:
        self.load = load
        self.mm = mm
        # "drop": KunServe (drop on overload, restore on underload); "migrate": the Llumnix-like baseline
        # (on overload, move requests with their KV from the overloaded instance to the freest one)
        self.mode = mode
        self.policy = OverloadPolicy(config or OverloadConfig())
        self.interval_s = interval_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.settle_timeout_s = settle_timeout_s if settle_timeout_s is not None else max(2.0, 2 * load.stale_after_s)
        self.clock = clock
        self.counters = PolicyCounters()
        self.log = get_logger().bind(component="overload_policy")
        self._fail_streak = 0
        self._backoff_until = -float("inf")
        # after a layout change: (changed at, its epoch, the workers it involved, give up at)
        self._settle: tuple[float, int, frozenset[str], float] | None = None
        self._last_skipped: dict[str, str] = {}
        self._last_reason = ""
        self._task: asyncio.Task | None = None

    # -- lifecycle --

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run_forever(), name="overload-policy")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # pragma: no cover - run_forever catches everything
                self.log.error("policy_task_failed", error=_describe_error(exc))
        try:
            await self.mm.close()
        except Exception as exc:  # closing must not break shutdown
            self.log.warning("policy_close_failed", error=_describe_error(exc))
        self.log.info("policy_stopped", **asdict(self.counters))

    async def run_forever(self) -> None:
        self.log.info("policy_started", interval_s=self.interval_s, config=asdict(self.policy.config))
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the loop die: log and go on
                self.counters.tick_errors += 1
                self.log.exception("policy_tick_error", error=_describe_error(exc))
            await asyncio.sleep(self.interval_s)

    # -- one step --

    async def tick(self) -> Decision | None:
        """Observe once and carry out the decision. Returns the decision, None when the tick was skipped."""
        now = self.clock()
        self.counters.ticks += 1
        if now < self._backoff_until:
            return None
        if self._settle is not None:
            changed_at, min_epoch, involved, give_up_at = self._settle
            if not self.load.reported_since(changed_at, now, min_epoch, involved) and now < give_up_at:
                return None
            self._settle = None
        units = build_units(self.load.fresh_reports(now))
        if units.skipped != self._last_skipped:
            if units.skipped:
                self.log.info("policy_units_skipped", skipped=units.skipped)
            self._last_skipped = dict(units.skipped)
        if units.transitioning:
            return None  # a transition (ours or a forced one) is under way: its numbers are about to change
        decision = self.policy.observe(now, units.loads)
        if decision.action == NONE:
            if decision.reason and decision.reason != self._last_reason:
                self.log.debug("policy_waiting", reason=decision.reason, units=list(decision.units))
            self._last_reason = decision.reason
            return decision
        self._last_reason = ""
        try:
            await self._act(decision, {u.unit_id: u.load for u in units.units})
        except BaseException:
            if self.policy.pending is not None:  # never leave the policy waiting for a completion
                self.policy.complete(self.clock(), ok=False)
            raise
        return decision

    async def _act(self, decision: Decision, loads: dict) -> None:
        if decision.action == DROP:
            self.log.info("policy_drop_decided", required_blocks=decision.required_blocks,
                          overloaded=list(decision.units), reason=decision.reason,
                          loads={uid: _load_fields(loads[uid]) for uid in decision.units if uid in loads})
            if self.mode == "migrate":
                await self._migrate(decision, loads)
            else:
                await self._drop(decision)
        elif decision.action == RESTORE:
            self.log.info("policy_restore_decided", groups=list(decision.units), reason=decision.reason,
                          loads={uid: (loads[uid].usage, loads[uid].undropped_total)
                                 for uid in decision.units if uid in loads})
            await self._restore(decision)

    async def _migrate(self, decision: Decision, loads: dict) -> None:
        free = {uid: u.total_blocks - u.used_blocks - u.queued_demand_blocks for uid, u in loads.items()
                if u.members == 1 and uid not in decision.units}
        dst = max(sorted(free), key=lambda uid: free[uid]) if free else None
        if dst is None or free[dst] <= 0:
            self._failed("migrate", "no instance with free KV to migrate to", overloaded=list(decision.units))
            return
        src = decision.units[0]
        try:
            rep = await self.mm.migrate(src, dst, min(decision.required_blocks, free[dst]))
        except Exception as exc:
            self._failed("migrate", _describe_error(exc))
            return
        if not rep.completed:
            self._failed("migrate", rep.error or "not completed", rolled_back=rep.rolled_back, epoch=rep.epoch)
            return
        self.counters.drops += 1
        self._succeeded(rep.epoch, {src, dst})
        self.log.info("policy_migrate", src=src, dst=dst, epoch=rep.epoch, requests_moved=rep.requests_moved,
                      kv_bytes_moved=rep.kv_bytes_moved, total_seconds=rep.total_seconds)

    async def _drop(self, decision: Decision) -> None:
        try:
            rep = await self.mm.drop(decision.required_blocks, "overload")
        except Exception as exc:  # an RPC error (or anything else) is a failed action
            self._failed("drop", _describe_error(exc))
            return
        if rep.autoscale_needed:
            self.counters.autoscale_needed += 1
            self.log.warning("policy_autoscale_needed", required_blocks=decision.required_blocks,
                             completed=rep.completed, error=rep.error)
        if not rep.completed:
            self._failed("drop", rep.error or "not completed", rolled_back=rep.rolled_back, epoch=rep.epoch)
            return
        self.counters.drops += 1
        self._succeeded(rep.epoch, _changed_workers(rep))
        self.log.info("policy_drop", epoch=rep.epoch,
                      groups={g.group_id: [m.worker_id for m in g.members] for g in rep.groups if len(g.members) > 1},
                      requests_moved=rep.requests_moved, kv_bytes_moved=rep.kv_bytes_moved,
                      total_seconds=rep.total_seconds, counters=asdict(self.counters))

    async def _restore(self, decision: Decision) -> None:
        done: list[str] = []
        into: dict[str, list[str]] = {}  # group -> the units it became (a quad: two pairs; a pair: instances)
        errors: dict[str, str] = {}
        epoch = 0
        involved: set[str] = set()
        for gid in decision.units:
            try:
                rep = await self.mm.restore(gid)
            except Exception as exc:
                errors[gid] = _describe_error(exc)
                continue
            if rep.completed:
                done.append(gid)
                into[gid] = [g.group_id for g in rep.groups]
                epoch = max(epoch, rep.epoch)
                involved |= _changed_workers(rep)
                self.counters.restores += 1
            else:
                errors[gid] = rep.error or "not completed"
        if errors:
            self._failed("restore", "; ".join(f"{g}: {e}" for g, e in errors.items()), restored=done)
            if done:  # the layout did change: wait for fresh stats all the same
                self._settle = (self.clock(), epoch, frozenset(involved), self.clock() + self.settle_timeout_s)
            return
        self._succeeded(epoch, involved)
        self.log.info("policy_restore", epoch=epoch, groups=done, into=into, counters=asdict(self.counters))

    def _succeeded(self, epoch: int, involved: set[str] | frozenset[str]) -> None:
        now = self.clock()
        self.policy.complete(now, ok=True)
        self._fail_streak = 0
        self._backoff_until = -float("inf")
        self._settle = (now, epoch, frozenset(involved), now + self.settle_timeout_s)

    def _failed(self, action: str, error: str, **extra) -> None:
        now = self.clock()
        self.policy.complete(now, ok=False)
        self.counters.failures += 1
        self._fail_streak += 1
        backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (self._fail_streak - 1))
        self._backoff_until = now + backoff
        self.log.warning("policy_action_failed", action=action, error=error, retry_in_s=backoff,
                         counters=asdict(self.counters), **extra)


def _load_fields(u: UnitLoad) -> dict[str, int]:
    """A unit's KV numbers for the decision's log line: every class, and the offline share the policy left out."""
    return {"used": u.used_blocks, "queued": u.queued_demand_blocks, "total": u.total_blocks,
            "offline_used": u.offline_used_blocks, "offline_queued": u.offline_queued_demand_blocks}


def _changed_workers(rep: memory_manager_pb2.TransitionReport) -> set[str]:
    """The workers a transition moved to its epoch: the members of the units it changed (all units it lists
    when none is marked changed)."""
    groups = [g for g in rep.groups if g.changed] or list(rep.groups)
    return {m.worker_id for g in groups for m in g.members}


def overload_config_from(section, max_head_wait_s: float = math.inf) -> OverloadConfig:
    """OverloadConfig from the config file's [monitor] section; ``max_head_wait_s`` is the TTFT SLO (slo.ttft_ms):
    a unit whose oldest waiting request queued longer is overloaded."""
    return OverloadConfig(overload_hold_s=section.overload_hold_s, restore_threshold=section.restore_threshold,
                          restore_hold_s=section.restore_hold_s, restore_cooldown_s=section.restore_cooldown_s,
                          action_timeout_s=600.0,  # actions are awaited inline and always completed
                          max_head_wait_s=max_head_wait_s)
