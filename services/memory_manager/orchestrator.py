"""Drives drop and restore plans through the workers (KunServe §4.1, §4.4): the memory manager's I/O half.

    drop:    refresh the layout from the workers -> plan (Fig. 6 greedy, or an explicit grouping)
             -> Prepare every member (pause, report requests + capacity in the new range)
             -> assign every request its new block table (shared/policy/transition_plan.py; refuse when it does not fit)
             -> Execute on every member (KV exchange over UCX, remap, install) -> refresh -> new epoch
    restore: the same with a group split back into whole instances (requests spread over them).

While it drives a transition it renews every member's lease (``RenewTransition``, every lease / 3): if
this process dies, each paused member aborts on its own once its lease runs out, and a restarted memory
manager aborts whatever transition it finds half done (``MemoryManager.abort_orphans``); either way every
worker ends up serving in a consistent layout.

One transition at a time (a second one gets ABORTED). A failure before Execute aborts every member
(nothing changed: the report says rolled back and the epoch stays). A failure during Execute makes the
members that finished heal back to whole instances as well (their requests re-prefill), so the cluster
always ends in a consistent layout whose epoch the report gives; no request is lost either way.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from kunserve.shared.policy import planner
from kunserve.shared.epochs import MAX_EPOCH
from kunserve.shared.faults import fault_armed, fault_point
from kunserve.shared.log import get_logger
from kunserve.shared.policy.cluster import Member, Unit
from kunserve.shared.policy.transition_plan import SeqMove, TransitionError, assign_restore_targets, assign_tables
from kunserve.shared.wire.transitions import planned_to_pb, unit_to_pb
from kunserve.v1 import common_pb2, memory_manager_pb2, worker_pb2


class OrchestrationError(Exception):
    """A request the orchestrator refuses before touching any worker; `code` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ClusterView:
    infos: dict[str, worker_pb2.WorkerInfo]
    units: list[Unit]
    num_layers: int

    def unit(self, unit_id: str) -> Unit | None:
        return next((u for u in self.units if u.unit_id == unit_id), None)


def group_id_for(worker_ids) -> str:
    return "+".join(worker_ids)


ME = "memory-manager"  # who this process is to fault_point


class Orchestrator:
    def __init__(self, mm, timeout_s: float, lease_s: float = 5.0) -> None:
        self.mm = mm  # services.memory_manager.servicer.MemoryManager: worker stubs + layout
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.lock = asyncio.Lock()
        self.running_epoch = 0
        self.started_epochs: set[int] = set()  # transitions this process began (the others are orphans)
        self.log = get_logger()
        self._model_cost: planner.ModelCost | None = None

    # -- the cluster as the workers report it ----------------------------------------------------------------
    async def view(self) -> ClusterView:
        ids = sorted(self.mm.worker_ids)

        async def info(wid: str):
            try:
                return wid, await self.mm.worker_stub(wid).GetInfo(common_pb2.Empty(), timeout=5.0, wait_for_ready=True)
            except grpc.aio.AioRpcError:
                return wid, None

        infos = {wid: i for wid, i in await asyncio.gather(*(info(w) for w in ids)) if i is not None}
        if not infos:
            raise OrchestrationError("UNAVAILABLE", "no worker is reachable")
        num_layers = max(i.num_layers_model for i in infos.values())
        units: list[Unit] = []
        seen: set[str] = set()
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
        return ClusterView(infos, units, num_layers)

    async def model_cost(self, view: ClusterView) -> planner.ModelCost:
        """Per-layer weight bytes and KV bytes per token, from one worker's memory map (cached)."""
        if self._model_cost is None or self._model_cost.num_layers != view.num_layers:
            whole = next((u.head for u in view.units if len(u.members) == 1), None) or next(iter(view.infos))
            m = await self.mm.worker_stub(whole).GetMemoryMap(common_pb2.Empty(), timeout=10.0)
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
        groups = view.units
        if req.required_bytes > 0:
            plan = planner.plan_drop(groups, cost, required_bytes=req.required_bytes, max_group_size=L)
        elif req.required_blocks > 0:
            plan = planner.plan_drop(groups, cost, required_blocks=req.required_blocks, max_group_size=L)
        else:  # no requirement: one merge of the two smallest units (what a manual `kunctl drop` means)
            plan = planner.plan_drop(groups, cost, required_bytes=1, max_group_size=L)
        old_units, new_units = [], []
        by_id = {u.unit_id: u for u in view.units}
        for g in plan.changed_units:
            olds = [by_id[x] for x in g.merged_from]
            if any(len(u.members) > 1 for u in olds):
                # Regrouping an existing group needs KV of three or more members to move at once: restore first.
                continue
            members = tuple(Member(a.worker_id, a.layer_start, a.layer_end, by_id[a.worker_id].members[0].transfer_address)
                            for a in g.members)
            old_units.extend(olds)
            new_units.append(Unit(group_id_for(m.worker_id for m in members), members))
        reply = memory_manager_pb2.DropPlanReply(
            met=plan.met, autoscale_needed=plan.autoscale_needed, fallback=plan.fallback or "",
            required_bytes=plan.required_bytes, freed_bytes=plan.freed_bytes,
            freed_blocks=cost.bytes_to_blocks(plan.freed_bytes), epoch=self.mm.layout.epoch,
            groups=[planned_to_pb(u) for u in new_units])
        return reply, view, old_units, new_units

    def _explicit(self, req, view: ClusterView):
        by_worker = {w: u for u in view.units for w in u.worker_ids}
        known = ", ".join(sorted(self.mm.worker_ids))
        old_units, new_units, used = [], [], set()
        for g in req.groups:
            ids = list(g.worker_ids)
            if len(ids) < 2:
                raise OrchestrationError("INVALID_ARGUMENT", f"group {ids}: a pipeline group needs at least 2 workers")
            for w in ids:
                if w not in self.mm.worker_ids:
                    raise OrchestrationError("NOT_FOUND", f"worker_ids: no worker {w!r} (known: {known})")
                if w not in by_worker:
                    raise OrchestrationError("UNAVAILABLE", f"worker {w} is not reachable")
                if w in used or ids.count(w) > 1:
                    raise OrchestrationError("INVALID_ARGUMENT", f"worker {w} is in two groups")
                if len(by_worker[w].members) > 1:
                    raise OrchestrationError("FAILED_PRECONDITION", f"worker {w} is already in group "
                                             f"{by_worker[w].unit_id}: restore it first")
                used.add(w)
            if len(ids) > view.num_layers:
                raise OrchestrationError("INVALID_ARGUMENT", f"group {ids}: {len(ids)} stages for a "
                                         f"{view.num_layers}-layer model")
            ranges = planner.balanced_split(view.num_layers, len(ids))
            members = tuple(Member(w, a, b, by_worker[w].members[0].transfer_address) for w, (a, b) in zip(ids, ranges))
            old_units.extend(by_worker[w] for w in ids)
            new_units.append(Unit(group_id_for(ids), members))
        reply = memory_manager_pb2.DropPlanReply(met=True, epoch=self.mm.layout.epoch,
                                                 groups=[planned_to_pb(u) for u in new_units])
        return reply, view, old_units, new_units

    # -- drop / restore ----------------------------------------------------------------------------------------
    async def drop(self, req: memory_manager_pb2.DropRequest) -> memory_manager_pb2.TransitionReport:
        async with self._exclusive():
            t0 = time.perf_counter()
            reply, view, old_units, new_units = await self.plan(req)
            plan_s = time.perf_counter() - t0
            if not new_units:
                return memory_manager_pb2.TransitionReport(
                    op="drop", epoch=self.mm.layout.epoch, completed=False, plan_seconds=plan_s,
                    autoscale_needed=True, error="no drop plan: every instance is already in a group (or the "
                    "planner found nothing to merge); handle the overload KV-centrically or add instances")
            report = await self._transition("drop", view, old_units, new_units, t0)
            report.plan_seconds = plan_s
            report.autoscale_needed = reply.autoscale_needed
            return report

    async def restore(self, req: memory_manager_pb2.RestoreRequest) -> memory_manager_pb2.TransitionReport:
        async with self._exclusive():
            t0 = time.perf_counter()
            view = await self.view()
            groups = [u for u in view.units if len(u.members) > 1]
            if req.group_id:
                u = view.unit(req.group_id)
                if u is None:
                    names = ", ".join(g.unit_id for g in groups) or "none"
                    raise OrchestrationError("NOT_FOUND", f"group_id: no group {req.group_id!r} (dropped groups: {names})")
                if len(u.members) == 1:
                    raise OrchestrationError("FAILED_PRECONDITION", f"group_id: {req.group_id} is a whole instance, "
                                             "not a dropped group")
                groups = [u]
            if not groups:
                return memory_manager_pb2.TransitionReport(op="restore", epoch=self.mm.layout.epoch, completed=True,
                                                           error="nothing to restore: no dropped group")
            new_units = [Unit(m.worker_id, (Member(m.worker_id, 0, view.num_layers, m.transfer_address),))
                         for g in groups for m in g.members]
            return await self._transition("restore", view, groups, new_units, t0)

    async def form_static_pairs(self, timeout_s: float) -> memory_manager_pb2.TransitionReport | None:
        """policy.overload = "static-pp": group the workers in pairs (in config order; an odd one out stays
        whole), retrying until every worker answers or timeout_s passes."""
        ids = [w for w in self.mm.worker_ids]
        pairs = [ids[i:i + 2] for i in range(0, len(ids) - 1, 2)]
        if not pairs:
            return None
        req = memory_manager_pb2.DropRequest(reason="static-pp", groups=[
            memory_manager_pb2.GroupMembers(worker_ids=p) for p in pairs])
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                view = await self.view()
                if all(w in view.infos for p in pairs for w in p):
                    if all(len(u.members) == 2 for u in view.units if u.head in {p[0] for p in pairs}):
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

    async def migrate(self, req: memory_manager_pb2.MigrateRequest) -> memory_manager_pb2.TransitionReport:
        async with self._exclusive():
            t0 = time.perf_counter()
            view = await self.view()
            units = []
            for wid in (req.src_worker, req.dst_worker):
                if wid not in self.mm.worker_ids:
                    raise OrchestrationError("NOT_FOUND", f"no worker {wid!r} (known: {', '.join(sorted(self.mm.worker_ids))})")
                u = next((u for u in view.units if wid in u.worker_ids), None)
                if u is None:
                    raise OrchestrationError("UNAVAILABLE", f"worker {wid} is not reachable")
                if len(u.members) != 1:
                    raise OrchestrationError("FAILED_PRECONDITION", f"worker {wid} is in group {u.unit_id}: "
                                             "migration moves requests between whole instances")
                units.append(u)
            if req.src_worker == req.dst_worker:
                raise OrchestrationError("INVALID_ARGUMENT", "src_worker and dst_worker must differ")
            if req.blocks <= 0:
                raise OrchestrationError("INVALID_ARGUMENT", "blocks: must be > 0")
            return await self._transition("migrate", view, units, units, t0,
                                          migrate=(req.src_worker, req.dst_worker, req.blocks))

    def _exclusive(self):
        orch = self

        class _Guard:
            async def __aenter__(self):
                if orch.lock.locked():
                    raise OrchestrationError("ABORTED", f"a drop / restore (epoch {orch.running_epoch}) is in "
                                             "progress; retry when it has finished")
                await orch.lock.acquire()

            async def __aexit__(self, *exc):
                orch.lock.release()

        return _Guard()

    async def _each(self, workers, call):
        """call(stub, wid) on every worker at once -> {wid: result or exception}."""
        async def one(wid):
            try:
                return wid, await call(self.mm.worker_stub(wid), wid)
            except Exception as exc:  # collected; the caller decides
                return wid, exc

        return dict(await asyncio.gather(*(one(w) for w in workers)))

    async def _renew_leases(self, workers: list[str], epoch: int) -> None:
        """Keep the members' leases alive while this process drives the transition (best effort: a member that
        cannot be reached fails its step anyway)."""
        ref = worker_pb2.TransitionRef(epoch=epoch)
        interval = self.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            await self._each(workers, lambda stub, _: stub.RenewTransition(ref, timeout=interval))

    async def _transition(self, op: str, view: ClusterView, old_units: list[Unit], new_units: list[Unit],
                          t0: float, migrate: tuple[str, str, int] | None = None) -> memory_manager_pb2.TransitionReport:
        epoch = max([self.mm.layout.epoch] + [i.epoch for i in view.infos.values()]) + 1
        if epoch >= MAX_EPOCH:  # refresh() never takes such an epoch from a worker; this is the last guard
            raise OrchestrationError("FAILED_PRECONDITION", f"layout epoch {epoch - 1} is at the limit 2**62; "
                                     "restart the cluster to reset it")
        self.running_epoch = epoch
        self.started_epochs.add(epoch)
        workers = sorted(w for u in old_units for w in u.worker_ids)
        renewing = asyncio.create_task(self._renew_leases(workers, epoch))
        try:
            return await self._drive(op, view, old_units, new_units, t0, migrate, epoch, workers)
        finally:
            renewing.cancel()

    async def _drive(self, op: str, view: ClusterView, old_units: list[Unit], new_units: list[Unit], t0: float,
                     migrate: tuple[str, str, int] | None, epoch: int,
                     workers: list[str]) -> memory_manager_pb2.TransitionReport:
        spec = worker_pb2.TransitionSpec(epoch=epoch, op=op, old_units=[unit_to_pb(u) for u in old_units],
                                         new_units=[unit_to_pb(u) for u in new_units], lease_s=self.lease_s)
        report = memory_manager_pb2.TransitionReport(op=op, epoch=self.mm.layout.epoch)
        self.log.info("transition_start", op=op, epoch=epoch, new_units=[u.unit_id for u in new_units])
        timeout = self.timeout_s

        # 1. prepare
        tp = time.perf_counter()
        prepared = await self._each(workers, lambda stub, _: stub.PrepareTransition(spec, timeout=timeout, wait_for_ready=True))
        report.prepare_seconds = time.perf_counter() - tp
        failed = {w: r for w, r in prepared.items() if isinstance(r, Exception)}
        if failed:
            return await self._rollback(report, epoch, workers, failed, "prepare", t0)
        fault_point("after_prepare", ME)

        # 2. block tables in the new units
        capacity = {u.unit_id: min(prepared[w].kv_blocks_after for w in u.worker_ids) for u in new_units}
        new_units = [Unit(u.unit_id, u.members, capacity[u.unit_id]) for u in new_units]
        seqs = [s for w in workers for s in prepared[w].seqs]
        unit_of_head = {w: u.unit_id for u in new_units for w in u.worker_ids}
        old_head = {u.unit_id: u.head for u in old_units}
        moves = [SeqMove(s.request_id, s.old_unit, unit_of_head[old_head[s.old_unit]], tuple(s.old_blocks))
                 for s in seqs]
        try:
            if op == "restore":
                moves = assign_restore_targets(moves, capacity)
            if migrate is not None:
                moves = self._choose_migrations(moves, seqs, capacity, *migrate)
                if not any(m.new_unit != m.old_unit for m in moves):
                    raise TransitionError(f"nothing to migrate: no running request on {migrate[0]} fits the free "
                                          f"KV of {migrate[1]}")
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
        executing = asyncio.ensure_future(self._each(workers, lambda stub, _: stub.ExecuteTransition(spec,
                                                                                                    timeout=timeout)))
        if fault_armed("in_execute", ME):  # die while the members execute (their RPCs are cancelled)
            await asyncio.sleep(0.05)
            fault_point("in_execute", ME)
        done = await executing
        failed = {w: r for w, r in done.items() if isinstance(r, Exception)}
        if not failed:  # 4. commit: every member resumes, moved streams are handed over
            fault_point("after_execute", ME)
            ref = worker_pb2.TransitionRef(epoch=epoch)
            if fault_armed("in_commit", ME):  # die with one member committed and the others still paused
                await self._each(workers[:1], lambda stub, _: stub.CommitTransition(ref, timeout=timeout))
                fault_point("in_commit", ME)
            committed = await self._each(workers, lambda stub, _: stub.CommitTransition(ref, timeout=timeout))
            failed = {w: r for w, r in committed.items() if isinstance(r, Exception)}
        if failed:
            # Members that executed (or committed) heal too, so no half-formed group remains.
            await self._each(workers, lambda stub, _: stub.AbortTransition(worker_pb2.TransitionRef(epoch=epoch),
                                                                           timeout=timeout))
            await self.mm.refresh()
            report.epoch = self.mm.layout.epoch
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
        await self.mm.refresh()
        self.mm.layout.epoch = max(self.mm.layout.epoch, epoch)
        report.epoch = self.mm.layout.epoch
        report.groups.extend(planned_to_pb(u) for u in new_units)
        report.total_seconds = time.perf_counter() - t0
        self.log.info("transition_done", op=op, epoch=epoch, requests=len(seqs), kv_bytes=report.kv_bytes_moved,
                      ms=round(report.total_seconds * 1e3, 1))
        return report

    @staticmethod
    def _choose_migrations(moves: list[SeqMove], seqs, capacity: dict[str, int], src: str, dst: str,
                           blocks: int) -> list[SeqMove]:
        """Llumnix-like choice: src's running requests, most recently arrived first, until `blocks` are freed,
        as long as they fit beside what dst already holds."""
        age = {s.request_id: s.age_s for s in seqs}
        dst_free = capacity[dst] - sum(len(m.old_blocks) for m in moves if m.old_unit == dst)
        chosen: set[str] = set()
        freed = 0
        for m in sorted((m for m in moves if m.old_unit == src and m.old_blocks), key=lambda m: age[m.request_id]):
            if freed >= blocks:
                break
            if len(m.old_blocks) <= dst_free:
                chosen.add(m.request_id)
                dst_free -= len(m.old_blocks)
                freed += len(m.old_blocks)
        return [SeqMove(m.request_id, m.old_unit, dst if m.request_id in chosen else m.new_unit, m.old_blocks)
                for m in moves]

    async def _rollback(self, report, epoch, workers, failed, step, t0):
        await self._each(workers, lambda stub, _: stub.AbortTransition(worker_pb2.TransitionRef(epoch=epoch),
                                                                       timeout=self.timeout_s))
        report.rolled_back = True
        report.error = self._errors(failed, step)
        report.total_seconds = time.perf_counter() - t0
        self.log.warning("transition_rolled_back", epoch=epoch, step=step, error=report.error)
        return report

    @staticmethod
    def _errors(failed: dict, step: str) -> str:
        parts = []
        for w, exc in sorted(failed.items()):
            msg = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            parts.append(f"{w}: {code}: {msg}")
        return f"{step} failed: " + "; ".join(parts)
