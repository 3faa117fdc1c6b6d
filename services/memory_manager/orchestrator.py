"""Drives drop and restore plans through the workers (KunServe §4.1, §4.4): the memory manager's I/O half.

    drop:    refresh the layout from the workers -> plan (Fig. 6 greedy, or an explicit grouping; merges of
             whole instances and of existing groups alike: pairs -> a quad)
             -> Prepare every member (pause, report requests + capacity in the new range)
             -> assign every request its new block table (shared/policy/transition_plan.py; refuse when it does not fit)
             -> Execute on every member (KV sent over UCX, remap, install) -> Commit (resume) -> refresh -> new epoch;
             with memory_manager.coordinated_exchange the moved KV lands after the Commit while the new units
             serve (services/worker/relayout.py), otherwise Execute waits for it
    restore: the same with a group split back (requests spread over the parts): one group undoes its last
             merge (a quad into pairs, a pair into whole instances); every group at once goes back to whole.
    migrate: the same between two whole instances that stay whole, moving the requests the Llumnix-like
             choice picks (shared/policy/migration.py).

While it drives a transition it renews every member's lease (``RenewTransition``, every lease / 3): if
this process dies, each paused member aborts on its own once its lease runs out, and a restarted memory
manager aborts whatever transition it finds half done (``MemoryManager.abort_orphans``); either way every
worker ends up serving in a consistent layout.

One transition at a time (a second one gets ABORTED). A failure before Execute aborts every member
(nothing changed: the report says rolled back and the epoch stays). A failure during Execute makes the
members that finished heal back to whole instances as well (their requests re-prefill), so the cluster
always ends in a consistent layout whose epoch the report gives; no request is lost either way.

What it needs from the memory manager is `ClusterAccess`; the decisions (which units to form, which block
tables, which requests migrate) are pure policies under shared/policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from kunserve.shared.epochs import MAX_EPOCH
from kunserve.shared.faults import fault_armed, fault_point
from kunserve.shared.log import get_logger
from kunserve.shared.policy import planner
from kunserve.shared.policy.cluster import Member, Unit, units_by_id
from kunserve.shared.policy.migration import RunningRequest, choose_migrations
from kunserve.shared.policy.transition_plan import SeqMove, TransitionError, assign_restore_targets, assign_tables
from kunserve.shared.wire.transitions import planned_to_pb, unit_to_pb
from kunserve.v1 import common_pb2, memory_manager_pb2, worker_pb2, worker_pb2_grpc

T = TypeVar("T")
R = TypeVar("R")


class LayoutEpoch(Protocol):
    """The memory manager's layout, as far as the orchestrator reads and advances it."""

    epoch: int

    def committed(self, epoch: int) -> int: ...


class ClusterAccess(Protocol):
    """What the orchestrator needs from the memory manager (``servicer.MemoryManager``; a fake in tests)."""

    @property
    def worker_ids(self) -> Sequence[str]:
        """The members a transition may include: the configured workers in config order, then the workers that
        joined at run time and every member knows of (none that is draining)."""
        ...

    @property
    def layout(self) -> LayoutEpoch: ...

    def worker_stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub | None:
        """The stub of a member (None for an unknown id)."""
        ...

    async def refresh(self) -> None:
        """Rebuild the layout from the workers' reports."""
        ...


class OrchestrationError(Exception):
    """A request the orchestrator refuses before touching any worker; `code` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class TransitionObserver(Protocol):
    """Told how every drop, restore and migration ended (the memory manager's Prometheus metrics)."""

    def reported(self, report: memory_manager_pb2.TransitionReport) -> None: ...

    def refused(self, op: str, code: str) -> None: ...


def _observed(op: str) -> Callable[[Callable[[Orchestrator, R], Awaitable[memory_manager_pb2.TransitionReport]]],
                                   Callable[[Orchestrator, R], Awaitable[memory_manager_pb2.TransitionReport]]]:
    """Tell the orchestrator's observers the report of a transition, or the status it was refused with."""
    def wrap(fn: Callable[[Orchestrator, R], Awaitable[memory_manager_pb2.TransitionReport]]
             ) -> Callable[[Orchestrator, R], Awaitable[memory_manager_pb2.TransitionReport]]:
        @functools.wraps(fn)
        async def run(self: Orchestrator, req: R) -> memory_manager_pb2.TransitionReport:
            try:
                report = await fn(self, req)
            except (OrchestrationError, ValueError) as exc:
                code = exc.code if isinstance(exc, OrchestrationError) else "INVALID_ARGUMENT"
                for observer in self.observers:
                    observer.refused(op, code)
                raise
            for observer in self.observers:
                observer.reported(report)
            return report
        return run
    return wrap


@dataclass(frozen=True)
class ClusterView:
    """The orchestrator's snapshot of the cluster, taken from the workers' own reports (GetInfo) before it
    plans: the units they form (a group only when every member answered: one with an unreachable member is
    not plannable now, it heals itself), the layout epoch each reachable worker reports, and the model's
    layer count."""

    units: tuple[Unit, ...]
    epochs: dict[str, int]  # every reachable worker -> the layout epoch of its latest transition
    num_layers: int
    # members of tensor-parallel instances -> their instance's members (rank order): in no unit, since the parameter
    # drop, restore and migration are not supported on them
    tensor_parallel: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def refuse_tensor_parallel(self, worker_id: str) -> None:
        members = self.tensor_parallel.get(worker_id)
        if members is not None:
            raise OrchestrationError("FAILED_PRECONDITION", f"worker {worker_id} is a member of tensor-parallel instance "
                                     f"{members[0]} (TP{len(members)}: {', '.join(members)}); the parameter drop, "
                                     "restore and migration are not supported on tensor-parallel instances")

    def reachable(self, worker_id: str) -> bool:
        return worker_id in self.epochs

    @property
    def groups(self) -> list[Unit]:
        return [u for u in self.units if u.is_group]

    def unit(self, unit_id: str) -> Unit | None:
        return next((u for u in self.units if u.unit_id == unit_id), None)

    def unit_of(self, worker_id: str) -> Unit | None:
        return next((u for u in self.units if worker_id in u.worker_ids), None)

    def member(self, worker_id: str) -> Member:
        """The worker's place in its unit (KeyError when it is in none)."""
        u = self.unit_of(worker_id)
        m = u.member(worker_id) if u is not None else None
        if m is None:
            raise KeyError(worker_id)
        return m


ME = "memory-manager"  # who this process is to fault_point


class Orchestrator:
    def __init__(self, cluster: ClusterAccess, timeout_s: float, lease_s: float = 5.0, *,
                 background_kv: bool = True) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.background_kv = background_kv  # memory_manager.coordinated_exchange
        self.lock = asyncio.Lock()
        self.running_epoch = 0
        self.running_what = ""  # a tensor-parallel re-form under way (services/memory_manager/tp_reform.py)
        self.started_epochs: set[int] = set()  # transitions this process began (the others are orphans)
        self.observers: list[TransitionObserver] = []
        self.log = get_logger()
        self._model_cost: planner.ModelCost | None = None

    def _stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        stub = self.cluster.worker_stub(worker_id)
        if stub is None:  # every id asked for comes from worker_ids
            raise OrchestrationError("NOT_FOUND", f"no worker {worker_id!r}")
        return stub

    # -- the cluster as the workers report it ----------------------------------------------------------------
    async def view(self) -> ClusterView:
        ids = sorted(self.cluster.worker_ids)

        async def info(wid: str) -> tuple[str, worker_pb2.WorkerInfo | None]:
            try:
                return wid, await self._stub(wid).GetInfo(common_pb2.Empty(), timeout=5.0, wait_for_ready=True)
            except grpc.aio.AioRpcError:
                return wid, None

        infos = {wid: i for wid, i in await asyncio.gather(*(info(w) for w in ids)) if i is not None}
        if not infos:
            raise OrchestrationError("UNAVAILABLE", "no worker is reachable")
        units: list[Unit] = []
        tensor_parallel = {wid: tuple(i.tp_members) for wid, i in infos.items() if len(i.tp_members) > 1}
        seen: set[str] = set(tensor_parallel)
        for wid in sorted(infos):
            if wid in seen:
                continue
            i = infos[wid]
            members = list(i.group_members) or [wid]
            if any(m not in infos for m in members):
                continue  # a group with an unreachable member: not plannable now (it heals itself)
            seen.update(members)
            units.append(Unit(i.group_id or wid, tuple(
                Member(m, infos[m].layer_start, infos[m].layer_end, infos[m].transfer_address) for m in members)))
        return ClusterView(tuple(units), {wid: i.epoch for wid, i in infos.items()},
                           max(i.num_layers_model for i in infos.values()), tensor_parallel)

    async def model_cost(self, view: ClusterView) -> planner.ModelCost:
        """Per-layer weight bytes and KV bytes per token, from one worker's memory map (cached)."""
        if self._model_cost is None or self._model_cost.num_layers != view.num_layers:
            whole = next((u.head for u in view.units if not u.is_group), None) or next(iter(view.epochs))
            m = await self._stub(whole).GetMemoryMap(common_pb2.Empty(), timeout=10.0)
            per_layer = {x.layer: x.weight_bytes for x in m.layers}
            avg = sum(per_layer.values()) // max(1, len(per_layer))
            self._model_cost = planner.ModelCost(
                view.num_layers, tuple(per_layer.get(layer, avg) for layer in range(view.num_layers)),
                kv_bytes_per_token=max(1, m.block_bytes // max(1, m.block_size)), block_size=m.block_size or 16)
        return self._model_cost

    # -- planning ----------------------------------------------------------------------------------------------
    async def plan(self, req: memory_manager_pb2.DropRequest) -> tuple[memory_manager_pb2.DropPlanReply, ClusterView,
                                                                          list[Unit], list[Unit]]:
        """(reply, view, old units that change, the new units they become)."""
        view = await self.view()
        L = view.num_layers
        if req.groups:
            return self._explicit(req, view)
        cost = await self.model_cost(view)
        if req.required_bytes > 0:
            plan = planner.plan_drop(view.units, cost, required_bytes=req.required_bytes, max_group_size=L)
        elif req.required_blocks > 0:
            plan = planner.plan_drop(view.units, cost, required_blocks=req.required_blocks, max_group_size=L)
        else:  # no requirement: one merge of the two smallest units (what a manual `kunctl drop` means)
            plan = planner.plan_drop(view.units, cost, required_bytes=1, max_group_size=L)
        old_units: list[Unit] = []
        new_units: list[Unit] = []
        by_id = units_by_id(view.units)
        for g in plan.changed_units:  # merges of whole instances and of existing groups alike (§5.6)
            olds = [by_id[x] for x in g.merged_from]
            members = tuple(Member(a.worker_id, a.layer_start, a.layer_end, view.member(a.worker_id).transfer_address)
                            for a in g.members)
            old_units.extend(olds)
            new_units.append(Unit(planner.unit_id_for(m.worker_id for m in members), members))
        reply = memory_manager_pb2.DropPlanReply(
            met=plan.met, autoscale_needed=plan.autoscale_needed, fallback=plan.fallback or "",
            required_bytes=plan.required_bytes, freed_bytes=plan.freed_bytes,
            freed_blocks=cost.bytes_to_blocks(plan.freed_bytes), epoch=self.cluster.layout.epoch,
            groups=[planned_to_pb(u) for u in new_units])
        return reply, view, old_units, new_units

    def _explicit(self, req: memory_manager_pb2.DropRequest, view: ClusterView) -> tuple[
            memory_manager_pb2.DropPlanReply, ClusterView, list[Unit], list[Unit]]:
        """The groups the request names. A group of whole instances is split evenly in the order given (head
        first). A group that names every member of existing groups merges them (a second drop): its members
        are laid out as the planner lays out a merge (``planner.merged_members``), each keeping part of the
        range it holds, so nothing is fetched; the order given does not matter then."""
        configured = self.cluster.worker_ids
        known = ", ".join(sorted(configured))
        old_units: list[Unit] = []
        new_units: list[Unit] = []
        used: set[str] = set()
        for g in req.groups:
            ids = list(g.worker_ids)
            olds: list[Unit] = []
            if len(ids) < 2:
                raise OrchestrationError("INVALID_ARGUMENT", f"group {ids}: a pipeline group needs at least 2 workers")
            for w in ids:
                if w not in configured:
                    raise OrchestrationError("NOT_FOUND", f"worker_ids: no worker {w!r} (known: {known})")
                view.refuse_tensor_parallel(w)
                unit = view.unit_of(w)
                if unit is None:
                    raise OrchestrationError("UNAVAILABLE", f"worker {w} is not reachable")
                if w in used or ids.count(w) > 1:
                    raise OrchestrationError("INVALID_ARGUMENT", f"worker {w} is in two groups")
                left_out = [m for m in unit.worker_ids if m not in ids]
                if left_out:
                    raise OrchestrationError("FAILED_PRECONDITION", f"worker {w} is already in group {unit.unit_id}: "
                                             f"name {', '.join(left_out)} too to merge the group, or restore it first")
                used.add(w)
                if unit not in olds:
                    olds.append(unit)
            if len(olds) == 1:
                raise OrchestrationError("FAILED_PRECONDITION", f"group {ids}: these workers already form group "
                                         f"{olds[0].unit_id}")
            if len(ids) > view.num_layers:
                raise OrchestrationError("INVALID_ARGUMENT", f"group {ids}: {len(ids)} stages for a "
                                         f"{view.num_layers}-layer model")
            if any(u.is_group for u in olds):
                members = planner.merged_members([view.member(w) for w in ids], view.num_layers)
            else:
                ranges = planner.balanced_split(view.num_layers, len(ids))
                members = tuple(Member(w, a, b, view.member(w).transfer_address) for w, (a, b) in zip(ids, ranges))
            old_units.extend(olds)
            new_units.append(Unit(planner.unit_id_for(m.worker_id for m in members), members))
        reply = memory_manager_pb2.DropPlanReply(met=True, epoch=self.cluster.layout.epoch,
                                                 groups=[planned_to_pb(u) for u in new_units])
        return reply, view, old_units, new_units

    # -- drop / restore / migrate ------------------------------------------------------------------------------
    @_observed("drop")
    async def drop(self, req: memory_manager_pb2.DropRequest) -> memory_manager_pb2.TransitionReport:
        async with self._exclusive():
            t0 = time.perf_counter()
            reply, view, old_units, new_units = await self.plan(req)
            plan_s = time.perf_counter() - t0
            if not new_units:
                return memory_manager_pb2.TransitionReport(
                    op="drop", epoch=self.cluster.layout.epoch, completed=False, plan_seconds=plan_s,
                    autoscale_needed=True, error="no drop plan: nothing left to merge (one group holds "
                    "every worker, or a merge would need more stages than the model has layers); handle the "
                    "overload KV-centrically or add instances")
            report = await self._transition("drop", view, old_units, new_units, t0)
            report.plan_seconds = plan_s
            report.autoscale_needed = reply.autoscale_needed
            return report

    @_observed("restore")
    async def restore(self, req: memory_manager_pb2.RestoreRequest) -> memory_manager_pb2.TransitionReport:
        async with self._exclusive():
            t0 = time.perf_counter()
            view = await self.view()
            groups = view.groups
            if req.group_id:
                u = view.unit(req.group_id)
                if u is None:
                    names = ", ".join(g.unit_id for g in groups) or "none"
                    raise OrchestrationError("NOT_FOUND", f"group_id: no group {req.group_id!r} (dropped groups: {names})")
                if not u.is_group:
                    raise OrchestrationError("FAILED_PRECONDITION", f"group_id: {req.group_id} is a whole instance, "
                                             "not a dropped group")
                groups = [u]
            if not groups:
                return memory_manager_pb2.TransitionReport(op="restore", epoch=self.cluster.layout.epoch,
                                                           completed=True, error="nothing to restore: no dropped group")
            # One group: undo its last merge (a quad splits into pairs, a pair into whole instances), so a
            # restore after two drops gives the memory back in the steps it was taken. Every group: whole.
            new_units = [u for g in groups for u in planner.plan_split(g, view.num_layers,
                                                                       2 if req.group_id else g.size)]
            return await self._transition("restore", view, groups, new_units, t0)

    async def form_static_pairs(self, timeout_s: float) -> memory_manager_pb2.TransitionReport | None:
        """policy.overload = "static-pp": group the workers in pairs (in config order; an odd one out stays
        whole), retrying until every worker answers or timeout_s passes."""
        ids = list(self.cluster.worker_ids)
        pairs = [ids[i:i + 2] for i in range(0, len(ids) - 1, 2)]
        if not pairs:
            return None
        req = memory_manager_pb2.DropRequest(reason="static-pp", groups=[
            memory_manager_pb2.GroupMembers(worker_ids=p) for p in pairs])
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                view = await self.view()
                if all(view.reachable(w) for p in pairs for w in p):
                    if all(u.size == 2 for u in view.units if u.head in {p[0] for p in pairs}):
                        return None  # already paired (a memory-manager restart)
                    rep = await self.drop(req)
                    if rep.completed:
                        self.log.info("static_pairs_formed", groups=[list(p) for p in pairs], epoch=rep.epoch)
                        return rep
                    self.log.warning("static_pairs_failed", error=rep.error)
            except OrchestrationError as exc:
                self.log.warning("static_pairs_waiting", error=str(exc))
            if time.monotonic() > deadline:
                self.log.error("static_pairs_gave_up", timeout_s=timeout_s)
                return None
            await asyncio.sleep(0.5)

    @_observed("migrate")
    async def migrate(self, req: memory_manager_pb2.MigrateRequest) -> memory_manager_pb2.TransitionReport:
        async with self._exclusive():
            t0 = time.perf_counter()
            view = await self.view()
            configured = self.cluster.worker_ids
            units = []
            for wid in (req.src_worker, req.dst_worker):
                if wid not in configured:
                    raise OrchestrationError("NOT_FOUND", f"no worker {wid!r} (known: {', '.join(sorted(configured))})")
                view.refuse_tensor_parallel(wid)
                u = view.unit_of(wid)
                if u is None:
                    raise OrchestrationError("UNAVAILABLE", f"worker {wid} is not reachable")
                if u.is_group:
                    raise OrchestrationError("FAILED_PRECONDITION", f"worker {wid} is in group {u.unit_id}: "
                                             "migration moves requests between whole instances")
                units.append(u)
            if req.src_worker == req.dst_worker:
                raise OrchestrationError("INVALID_ARGUMENT", "src_worker and dst_worker must differ")
            if req.blocks <= 0:
                raise OrchestrationError("INVALID_ARGUMENT", "blocks: must be > 0")
            return await self._transition("migrate", view, units, units, t0,
                                          migrate=(units[0].unit_id, units[1].unit_id, req.blocks))

    @contextlib.asynccontextmanager
    async def _exclusive(self, what: str = "") -> AsyncIterator[None]:
        """One transition of any kind at a time (a drop, restore or migration, or a tensor-parallel re-form `what`):
        a second one gets ABORTED."""
        if self.lock.locked():
            running = self.running_what or f"drop / restore (epoch {self.running_epoch})"
            raise OrchestrationError("ABORTED", f"a {running} is in progress; retry when it has finished")
        async with self.lock:
            self.running_what = what
            try:
                yield
            finally:
                self.running_what = ""

    async def _each(self, workers: Iterable[str], call: Callable[[worker_pb2_grpc.WorkerStub], Awaitable[T]]
                    ) -> tuple[dict[str, T], dict[str, Exception]]:
        """call(stub) on every worker at once -> (replies, failures), each by worker id."""
        async def one(wid: str) -> tuple[str, T | Exception]:
            try:
                return wid, await call(self._stub(wid))
            except Exception as exc:  # collected; the caller decides
                return wid, exc

        replies: dict[str, T] = {}
        failed: dict[str, Exception] = {}
        for wid, r in await asyncio.gather(*(one(w) for w in workers)):
            if isinstance(r, Exception):
                failed[wid] = r
            else:
                replies[wid] = r
        return replies, failed

    async def _renew_leases(self, workers: list[str], epoch: int) -> None:
        """Keep the members' leases alive while this process drives the transition (best effort: a member that
        cannot be reached fails its step anyway)."""
        ref = worker_pb2.TransitionRef(epoch=epoch)
        interval = self.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            await self._each(workers, lambda stub: stub.RenewTransition(ref, timeout=interval))

    async def _transition(self, op: str, view: ClusterView, old_units: list[Unit], new_units: list[Unit],
                          t0: float, migrate: tuple[str, str, int] | None = None) -> memory_manager_pb2.TransitionReport:
        """migrate: (source unit, destination unit, blocks to free) for op "migrate"."""
        epoch = max([self.cluster.layout.epoch, *view.epochs.values()]) + 1
        if epoch >= MAX_EPOCH:  # refresh() never takes such an epoch from a worker; this is the last guard
            raise OrchestrationError("FAILED_PRECONDITION", f"layout epoch {epoch - 1} is at the limit 2**62; "
                                     "restart the cluster to reset it")
        self.running_epoch = epoch
        self.started_epochs.add(epoch)
        workers = sorted(w for u in old_units for w in u.worker_ids)
        renewing = asyncio.create_task(self._renew_leases(workers, epoch))
        try:
            return await self._drive(op, old_units, new_units, t0, migrate, epoch, workers)
        finally:
            renewing.cancel()

    async def _drive(self, op: str, old_units: list[Unit], new_units: list[Unit], t0: float,
                     migrate: tuple[str, str, int] | None, epoch: int,
                     workers: list[str]) -> memory_manager_pb2.TransitionReport:
        spec = worker_pb2.TransitionSpec(epoch=epoch, op=op, old_units=[unit_to_pb(u) for u in old_units],
                                         new_units=[unit_to_pb(u) for u in new_units], lease_s=self.lease_s,
                                         background_kv=self.background_kv)
        report = memory_manager_pb2.TransitionReport(op=op, epoch=self.cluster.layout.epoch)
        self.log.info("transition_start", op=op, epoch=epoch, new_units=[u.unit_id for u in new_units])
        timeout = self.timeout_s
        ref = worker_pb2.TransitionRef(epoch=epoch)

        # 1. prepare
        tp = time.perf_counter()
        prepared, failed = await self._each(
            workers, lambda stub: stub.PrepareTransition(spec, timeout=timeout, wait_for_ready=True))
        report.prepare_seconds = time.perf_counter() - tp
        if failed:
            return await self._rollback(report, epoch, workers, failed, "prepare", t0)
        fault_point("after_prepare", ME)

        # 2. block tables in the new units
        capacity = {u.unit_id: min(prepared[w].kv_blocks_after for w in u.worker_ids) for u in new_units}
        new_units = [dataclasses.replace(u, kv_blocks=capacity[u.unit_id]) for u in new_units]
        seqs = [s for w in workers for s in prepared[w].seqs]
        unit_of_head = {w: u.unit_id for u in new_units for w in u.worker_ids}
        old_head = {u.unit_id: u.head for u in old_units}
        moves = [SeqMove(s.request_id, s.old_unit, unit_of_head[old_head[s.old_unit]], tuple(s.old_blocks))
                 for s in seqs]
        try:
            if op == "restore":
                moves = assign_restore_targets(moves, capacity)
            if migrate is not None:
                src, dst, blocks = migrate
                chosen = set(choose_migrations(
                    [RunningRequest(s.request_id, s.old_unit, len(s.old_blocks), s.age_s) for s in seqs],
                    src, dst, capacity[dst], blocks))
                if not chosen:
                    raise TransitionError(f"nothing to migrate: no running request on {src} fits the free "
                                          f"KV of {dst}")
                moves = [dataclasses.replace(m, new_unit=dst) if m.request_id in chosen else m for m in moves]
            moves = assign_tables(moves, new_units, old_heads=old_head)
        except TransitionError as exc:
            return await self._rollback(report, epoch, workers, {"planner": exc}, "plan", t0)
        by_rid = {m.request_id: m for m in moves}
        for s in seqs:
            m = by_rid[s.request_id]
            s.new_unit = m.new_unit
            s.new_blocks[:] = list(m.new_blocks)
        spec.ClearField("new_units")
        spec.new_units.extend(unit_to_pb(u) for u in new_units)
        spec.seqs.extend(seqs)

        # 3. execute
        executing = asyncio.ensure_future(self._each(workers, lambda stub: stub.ExecuteTransition(spec,
                                                                                                 timeout=timeout)))
        if fault_armed("in_execute", ME):  # die while the members execute (their RPCs are cancelled)
            await asyncio.sleep(0.05)
            fault_point("in_execute", ME)
        done, failed = await executing
        if not failed:  # 4. commit: every member resumes, moved streams are handed over
            fault_point("after_execute", ME)
            if fault_armed("in_commit", ME):  # die with one member committed and the others still paused
                await self._each(workers[:1], lambda stub: stub.CommitTransition(ref, timeout=timeout))
                fault_point("in_commit", ME)
            committed, failed = await self._each(workers, lambda stub: stub.CommitTransition(ref, timeout=timeout))
        if failed:
            # Members that executed (or committed) heal too, so no half-formed group remains.
            await self._each(workers, lambda stub: stub.AbortTransition(ref, timeout=timeout))
            await self.cluster.refresh()
            report.epoch = self.cluster.layout.epoch
            report.rolled_back = True
            report.error = self._errors(failed, "execute")
            report.total_seconds = time.perf_counter() - t0
            self.log.error("transition_failed", op=op, epoch=epoch, error=report.error)
            return report
        ok = [done[w] for w in workers]
        report.completed = True
        report.requests_moved = sum(1 for s in seqs if s.new_unit != s.old_unit or op != "migrate")
        report.kv_bytes_moved = sum(d.bytes_sent for d in ok)
        report.exchange_seconds = max(d.exchange_seconds for d in ok)
        report.remap_seconds = max(d.remap_seconds for d in ok)
        report.kv_in_background = spec.background_kv
        report.pause_seconds = max(c.paused_seconds for c in committed.values())
        report.weight_bytes_from_peers = sum(d.weight_bytes_from_peers for d in ok)
        report.weight_bytes_from_host = sum(d.weight_bytes_from_host for d in ok)
        report.weight_bytes_from_checkpoint = sum(d.weight_bytes_from_checkpoint for d in ok)
        await self.cluster.refresh()
        report.epoch = self.cluster.layout.committed(epoch)
        report.groups.extend(planned_to_pb(u) for u in new_units)
        report.total_seconds = time.perf_counter() - t0
        self.log.info("transition_done", op=op, epoch=epoch, requests=len(seqs), kv_bytes=report.kv_bytes_moved,
                      ms=round(report.total_seconds * 1e3, 1))
        return report

    async def _rollback(self, report: memory_manager_pb2.TransitionReport, epoch: int, workers: list[str],
                        failed: Mapping[str, Exception], step: str, t0: float) -> memory_manager_pb2.TransitionReport:
        ref = worker_pb2.TransitionRef(epoch=epoch)
        await self._each(workers, lambda stub: stub.AbortTransition(ref, timeout=self.timeout_s))
        report.rolled_back = True
        report.error = self._errors(failed, step)
        report.total_seconds = time.perf_counter() - t0
        self.log.warning("transition_rolled_back", epoch=epoch, step=step, error=report.error)
        return report

    @staticmethod
    def _errors(failed: Mapping[str, Exception], step: str) -> str:
        parts = []
        for w, exc in sorted(failed.items()):
            msg = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            parts.append(f"{w}: {code}: {msg}")
        return f"{step} failed: " + "; ".join(parts)
