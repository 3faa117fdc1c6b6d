"""Elastic tensor parallelism in the simulated cluster (`dispatcher.elastic_tp`, README "Elastic tensor parallelism
(Gyges)"): the dispatcher's long-request routing and throttling, the memory manager's placement, and the cold re-form
that merges co-located whole instances into one TP2 / TP4 instance and splits it back.

Every decision is the product's own code over what the simulated workers report:

* the dispatcher (services/dispatcher/servicer.py ``_route``): ``long_requests.split_by_fit`` keeps a request off
  the units too small for its whole life; when no routable unit holds it, it asks placement (at most once per
  ``PLACE_RETRY_S``, within ``dispatcher.route_timeout_s``); a short request avoids the merged units holding no long
  request (``is_long``, ``throttled_units``, ``choose_unthrottled``), counted per request as the dispatcher counts
  them per stream;
* placement (services/memory_manager/tp_placement.py ``TPPlacer._place``): every worker's ``GetInfo`` (the simulated
  stub's, with ``kv_tokens_by_degree`` from ``shared/model/tp_capacity.py``, the rule a real worker reports)
  through ``placement_worker`` / ``placement_inputs`` to ``ElasticTPScheduler.route``; a scale-up is checked by the
  re-form's own ``check_transform``, a split by ``check_split``, and both hold the orchestrator's transition lock
  (``Orchestrator._exclusive``), so a re-form and a drop never overlap (a drop meanwhile is ABORTED, as in the
  product), and one placement decides at a time (a long request asking while a re-form runs waits for it);
* idle splits: ``IdleSplitPolicy`` every second (``TPPlacer.split_idle_forever``) over each merged instance's rank 0.

What the simulation does instead of the services' I/O is the re-form itself, as the cold re-form does it: the members
stop taking requests, finish the step in flight, hand every request they hold back to the dispatcher (it routes each
again and the new worker re-prefills prompt + emitted tokens; their KV is lost), then serve nothing for the re-form's
time, ``tp_reform_s`` (a process re-execution, its CUDA context and runtime start) plus loading the member's weight
shard from host memory at the host-to-device bandwidth (a split: the whole model), and come back as the new
instance: rank 0 with the degree's KV capacity and step times, the followers not serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kunserve.services.dispatcher.servicer import PLACE_RETRY_S
from kunserve.services.memory_manager.orchestrator import OrchestrationError
from kunserve.services.memory_manager.tp_placement import kv_tokens, placement_inputs, placement_worker
from kunserve.services.memory_manager.tp_reform import check_split, check_transform, tp_worker
from kunserve.shared.model.tp_capacity import kv_tokens_by_degree
from kunserve.shared.policy import long_requests
from kunserve.shared.policy.elastic_tp import ElasticTPScheduler, IdleSplitPolicy, Refuse, Route, ScaleUp
from kunserve.sim.control import TransitionRecord

if TYPE_CHECKING:
    from kunserve.sim.cluster import SimRequest, Simulation

TP_REFORM_S = 15.0  # a member's cold re-form before its weights load: process re-exec, CUDA context, runtime start
GPUS_PER_HOST = 8  # the co-location domain of a TP instance (an 8-GPU server)
SPLIT_CHECK_S = 1.0  # TPPlacer.split_idle_forever's interval


class ElasticTP:
    """The dispatcher's long-request routing, the memory manager's placement and re-forms, over the simulated
    workers (module docstring)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        setup = sim.setup
        cfg = sim.cfg
        shape = sim.shape
        page = sim.memory.page_size
        device = "cuda" if setup.time.source.startswith("roofline") else "cpu"
        self.tokens_by_degree = kv_tokens_by_degree(
            shape.config, num_pages=sim.memory.pool_bytes // page, page_size=page, block_size=shape.block_size, device_type=device
        )
        self.hosts = {wid: f"host-{i // setup.gpus_per_host}" for i, wid in enumerate(sim.workers)}
        self.idle_split = IdleSplitPolicy(cfg.memory_manager.tp_idle_split_s)
        self.tp_members: dict[str, tuple[str, ...]] = {}  # the dispatcher's view: worker -> its instance, rank order
        self.long_held = long_requests.LongHeld()  # the dispatcher's count of long requests per unit
        self.long_on: dict[str, str] = {}  # request -> the unit its long count is on
        self.asked_at: dict[str, float] = {}  # request -> when it last asked placement
        self.placing = False  # TPPlacer's lock: a re-form or a split is under way
        self.lock_waiters: list[SimRequest] = []  # long requests that asked while it was held
        self.waiting_on: dict[str, list[SimRequest]] = {}  # new rank 0 -> the long requests its scale-up is for
        self.parked_ids: set[str] = set()  # the requests of those two: placement answers them, no retry
        self.counters: dict[str, int] = {"scale_ups": 0, "splits": 0, "handed_over": 0, "long_routed": 0, "long_refused": 0}

    def start(self) -> None:
        if self.idle_split.idle_s > 0:
            self.sim.control.vloop.loop.create_task(self._split_idle_forever())

    # -- the dispatcher ------------------------------------------------------------------------------------------------
    def observe(self, worker_id: str, tp_members: Sequence[str]) -> None:
        """A poll's tp_members (the dispatcher's pool.tp_members)."""
        self.tp_members[worker_id] = tuple(tp_members) or (worker_id,)

    def choose(self, req: SimRequest) -> str | None:
        """DispatcherServicer._route with dispatcher.elastic_tp: the unit to send `req` to now, or None (it waits:
        the caller retries, or placement holds it, or it failed)."""
        sim = self.sim
        router = sim.router
        whole_life = req.prompt_tokens + req.output_tokens
        fits, small = long_requests.split_by_fit(router, whole_life)
        if small and not fits:
            if sim.now - self.asked_at.get(req.request_id, -PLACE_RETRY_S) >= PLACE_RETRY_S:
                self.asked_at[req.request_id] = sim.now
                return self._place(req, whole_life)
            return None
        throttled: frozenset[str] = frozenset()
        if not long_requests.is_long(router, self.tp_members, whole_life):
            throttled = self.long_held.throttled(router, self.tp_members)
        tokens = req.prompt_tokens + req.emitted + 1
        return long_requests.choose_unthrottled(router, offline=req.offline, tokens=tokens, throttled=throttled, exclude=set(small))

    def routed(self, req: SimRequest, worker_id: str) -> None:
        """The dispatcher counts a long request on the unit it streams from."""
        if long_requests.is_long(self.sim.router, self.tp_members, req.prompt_tokens + req.output_tokens):
            self.long_held.add(worker_id)
            self.long_on[req.request_id] = worker_id

    def released(self, req: SimRequest) -> None:
        """Its stream ended (finished, failed, handed over)."""
        if req.done:
            self.asked_at.pop(req.request_id, None)
        wid = self.long_on.pop(req.request_id, None)
        if wid is not None:
            self.long_held.release(wid)

    # -- placement (TPPlacer._place) ---------------------------------------------------------------------------------
    def _infos(self) -> dict[str, Any]:
        access = self.sim.control.access
        return {w: access.worker_stub(w).info() for w in access.worker_ids}

    def _place(self, req: SimRequest, whole_life: int) -> str | None:
        sim = self.sim
        if self.placing:
            self.lock_waiters.append(req)
            self.parked_ids.add(req.request_id)
            return None
        infos = self._infos()
        inputs = placement_inputs([placement_worker(i, self.hosts[w]) for w, i in infos.items()])
        if inputs is None:
            return None
        memory, instances = inputs
        scheduler = ElasticTPScheduler(memory, max_degree=max(d for d, _ in memory.tokens_by_degree))
        decision = scheduler.route(kv_tokens(whole_life, memory.block_size), instances)
        if isinstance(decision, Route):
            self.idle_split.placed(decision.instance_id, sim.now)
            sim.refresh_one(decision.instance_id)
            if sim.router.routable(decision.instance_id):
                self.counters["long_routed"] += 1
                return decision.instance_id
            return None
        if isinstance(decision, Refuse):
            self.counters["long_refused"] += 1
            sim.fail(
                req,
                f"INVALID_ARGUMENT: prompt + max_tokens = {whole_life} tokens: {decision.reason} (the cluster's "
                f"maximum: {decision.max_tokens} KV tokens, i.e. prompt + max_tokens <= {decision.max_tokens + 1})",
            )
            return None
        if isinstance(decision, ScaleUp):
            self._scale_up(req, decision, infos)
        return None

    def _scale_up(self, req: SimRequest, plan: ScaleUp, infos: dict[str, Any]) -> None:
        control = self.sim.control
        if control.orchestrator.lock.locked():
            return  # a drop / restore holds the transition lock: the re-form would be ABORTED; asks again later
        found = {w: tp_worker(infos[w], self.hosts[w]) for w in plan.members}
        try:
            degree = check_transform(plan.members, plan.degree, list(infos), found, None)
        except OrchestrationError:
            return
        self.placing = True
        self.waiting_on.setdefault(plan.members[0], []).append(req)
        self.parked_ids.add(req.request_id)
        control.vloop.loop.create_task(self._reform("tp", plan.members, [plan.members], degree))
        self.sim.control_dirty = True

    # -- the cold re-form (TPReformer.transform / split) --------------------------------------------------------------
    def reform_s(self, degree: int) -> float:
        """A member's time out of service: the restart constant plus loading its shard (the layers' weights split
        `degree` ways, embeddings and head whole) from host memory."""
        shape = self.sim.shape
        load = sum(shape.layer_bytes) / degree + shape.group_bytes
        return self.sim.setup.tp_reform_s + load / self.sim.time.links.host

    async def _reform(self, op: str, members: Sequence[str], instances: Sequence[Sequence[str]], degree: int) -> None:
        sim = self.sim
        control = sim.control
        self.placing = True
        started = sim.now
        handed: list[SimRequest] = []
        try:
            async with control.orchestrator._exclusive("tensor-parallel re-form" if op == "tp" else "tensor-parallel split"):
                quiet = []
                for wid in members:
                    worker = sim.workers[wid]
                    worker.reforming = True
                    quiet.append(self._quiet(wid))
                    sim.refresh_one(wid)
                await asyncio.gather(*quiet)
                for wid in members:
                    handed += sim.workers[wid].hand_over()
                for req in handed:
                    sim.handed_over(req)
                await asyncio.sleep(self.reform_s(degree))
                for inst in instances:
                    members_t = tuple(inst)
                    whole = len(members_t) == 1
                    blocks = sim.memory.undropped_blocks if whole else self.tokens_by_degree[len(members_t)] // sim.shape.block_size
                    for wid in members_t:
                        sim.workers[wid].take_tp_role(members_t, blocks, sim.setup.time_for(len(members_t)))
                        sim.refresh_one(wid)
                await control.access.refresh()
        except OrchestrationError:  # a drop took the transition lock first: the re-form is refused (ABORTED)
            self._unpark(self.waiting_on.pop(members[0], []))
            return
        finally:
            self.placing = False
        self.counters["scale_ups" if op == "tp" else "splits"] += 1
        self.counters["handed_over"] += len(handed)
        control.records.append(
            TransitionRecord(op, control.access.layout.epoch, started, sim.now, True, [list(i) for i in instances], len(handed), 0)
        )
        for rank0, reqs in list(self.waiting_on.items()):
            if sim.router.routable(rank0):
                del self.waiting_on[rank0]
                self.idle_split.placed(rank0, sim.now)
                for req in reqs:
                    self.parked_ids.discard(req.request_id)
                    if not req.done:
                        self.counters["long_routed"] += 1
                        sim.send(req, rank0)
        self._unpark([])

    def _unpark(self, requests: Sequence[SimRequest]) -> None:
        """`requests` and the long requests that waited for placement's lock route again now (they ask anew)."""
        sim = self.sim
        waiters, self.lock_waiters = self.lock_waiters, []
        for req in [*requests, *waiters]:
            self.parked_ids.discard(req.request_id)
            self.asked_at.pop(req.request_id, None)
            sim.at(sim.now, sim.route, req)

    def parked(self, req: SimRequest) -> bool:
        """Placement holds the request (a scale-up for it, or its lock): it is answered when that ends."""
        return req.request_id in self.parked_ids

    def _quiet(self, worker_id: str) -> asyncio.Future[None]:
        """Pause the worker; the future resolves once its step in flight has ended."""
        done: asyncio.Future[None] = self.sim.control.vloop.loop.create_future()

        def on_quiet() -> None:
            if not done.done():
                done.set_result(None)
            self.sim.control_dirty = True

        self.sim.workers[worker_id].pause(on_quiet)
        return done

    # -- idle splits (TPPlacer.split_idle) -------------------------------------------------------------------------
    async def _split_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(SPLIT_CHECK_S)
            if not self.placing:
                try:
                    await self._split_idle()
                except OrchestrationError:  # TPPlacer.split_idle_forever: deferred to the next round
                    continue

    async def _split_idle(self) -> None:
        sim = self.sim
        seen = []
        for wid, w in sim.workers.items():
            if w.tp_degree >= 2 and w.tp_members[0] == wid and not w.reforming:
                r = w.report()
                seen.append((wid, w.tp_degree, r.num_running == 0 and r.num_waiting == 0))
        for inst in self.idle_split.observe(sim.now, seen):
            if sim.control.orchestrator.lock.locked():
                return  # the split would be ABORTED (TPPlacer logs it deferred; the idle spell starts again)
            infos = self._infos()
            found = {w: tp_worker(i, self.hosts[w]) for w, i in infos.items()}
            members = check_split(inst, list(infos), found)
            await self._reform("tp-split", members, [[m] for m in members], 1)


__all__ = ["GPUS_PER_HOST", "TP_REFORM_S", "ElasticTP"]
