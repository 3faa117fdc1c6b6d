"""Transformation-aware routing (Gyges Algorithm 1) for requests longer than every routable instance's KV: the memory
manager answers where such a request goes, scaling co-located whole instances up into one TP2 / TP4 instance first
when that is what it takes (README "Elastic tensor parallelism (Gyges)").

    PlaceLongRequest{tokens}
      -> GetInfo of every member -> `placement_inputs` (the instances and their measured capacities)
      -> ElasticTPScheduler.route
           Route(rank 0)          -> ROUTE to it
           ScaleUp(members)       -> TransformTP's path (same lock), then ROUTE to the new rank 0 once it serves
           Wait / a drop running  -> WAIT (the dispatcher asks again within dispatcher.route_timeout_s)
           Refuse(max)            -> REFUSE naming the cluster's maximum

Capacities are measured, not modelled: every whole-model worker reports the KV tokens an instance of each degree
would hold with its pool as every member's (`WorkerInfo.kv_tokens_by_degree`, the pool layout's own rule on the
sharded config, `shared/model/tp_capacity.py`); the scheduler takes the smallest report per degree. The re-form is
cold, so the instances' requests are handed over and re-prefilled rather than moved with their KV: a merged
instance starts empty, and an instance is sized by its capacity (a worker queues what fits its capacity), so the
instances are given to the scheduler with no KV in use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kunserve.shared.log import get_logger
from kunserve.shared.policy.elastic_tp import (
    DEGREES,
    ElasticTPScheduler,
    IdleSplitPolicy,
    Refuse,
    Route,
    ScaleUp,
    TPInstance,
    TPMemory,
    Wait,
)
from kunserve.v1 import common_pb2, memory_manager_pb2, worker_pb2

from .orchestrator import OrchestrationError
from .tp_reform import TPReformer, ask_reachable

PlaceReply = memory_manager_pb2.PlaceLongRequestReply
INFO_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class MeasuredTPMemory(TPMemory):
    """TPMemory whose capacities are the workers' measured ones (`tokens_by_degree`) instead of the byte model; a
    degree is valid when some worker measured it."""

    tokens_by_degree: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, tokens_by_degree: Mapping[int, int], block_size: int) -> MeasuredTPMemory:
        return cls(
            pool_bytes=0,
            sharded_bytes=0,
            replicated_bytes=0,
            kv_bytes_per_token=1,
            num_kv_heads=1,
            block_size=max(1, block_size),
            tokens_by_degree=tuple(sorted(tokens_by_degree.items())),
        )

    def valid_degree(self, degree: int) -> bool:
        return degree in dict(self.tokens_by_degree)

    def check_degree(self, degree: int) -> None:
        if not self.valid_degree(degree):
            known = ", ".join(str(d) for d, _ in self.tokens_by_degree) or "none"
            raise ValueError(f"TP degree {degree}: no worker measured its capacity (measured: {known})")

    def capacity_tokens(self, degree: int) -> int:
        self.check_degree(degree)
        return dict(self.tokens_by_degree)[degree]


@dataclass(frozen=True)
class PlacementWorker:
    """One worker's GetInfo as placement reads it."""

    worker_id: str
    host: str
    serving: bool
    transitioning: bool
    whole: bool
    tp_members: tuple[str, ...]
    group_members: tuple[str, ...]
    block_size: int
    kv_tokens_by_degree: Mapping[int, int] = field(default_factory=dict)


def placement_worker(info: worker_pb2.WorkerInfo, host: str) -> PlacementWorker:
    return PlacementWorker(
        info.worker_id,
        host,
        info.serving,
        info.transitioning,
        (info.layer_start, info.layer_end) == (0, info.num_layers_model),
        tuple(info.tp_members) or (info.worker_id,),
        tuple(info.group_members) or (info.worker_id,),
        info.block_size,
        dict(info.kv_tokens_by_degree),
    )


def placement_inputs(workers: Sequence[PlacementWorker]) -> tuple[MeasuredTPMemory, list[TPInstance]] | None:
    """The scheduler's memory model and instances (one per rank 0; a follower is in its rank 0's members). An
    instance takes long requests, or merges, only as a serving whole instance outside any pipeline group; the others
    still count towards what a layout of their host could hold. None: no worker measured its TP1 capacity."""
    measured: dict[int, int] = {}
    for w in workers:
        for d, tokens in w.kv_tokens_by_degree.items():
            if d in DEGREES and tokens > 0:
                measured[d] = min(measured.get(d, tokens), tokens)
    if 1 not in measured:
        return None
    by_id = {w.worker_id: w for w in workers}
    instances = []
    for w in workers:
        if w.tp_members[0] != w.worker_id:
            continue
        members = tuple(m for m in w.tp_members if m in by_id) if len(w.tp_members) > 1 else (w.worker_id,)
        if len(members) not in measured:
            continue
        usable = w.serving and w.whole and not w.transitioning and len(w.group_members) == 1
        # A merged instance takes long requests but does not merge again: the re-form joins whole instances only
        # (a TP2 into a TP4 would have to split first), so offering it to a scale-up plans one that must fail.
        instances.append(TPInstance(members=members, host=w.host, serving=usable, reserved=len(members) > 1,
                                    used_tokens=0))
    block = min((w.block_size for w in workers if w.block_size > 0), default=1)
    return MeasuredTPMemory.of(measured, block), instances


def kv_tokens(tokens: int, block_size: int) -> int:
    """KV tokens a request of `tokens` whole-life tokens caches at most, in whole blocks (the last sampled token gets
    no KV: the worker's own check)."""
    need = max(1, tokens - 1)
    return -(-need // block_size) * block_size


class TPPlacer:
    """Serves PlaceLongRequest (module docstring). One placement decides at a time, so two long requests do not both
    plan a scale-up of the same workers."""

    def __init__(self, reformer: TPReformer, failure_cooldown_s: float | None = None, idle_split_s: float = 0.0) -> None:
        self.reformer = reformer
        self.idle_split = IdleSplitPolicy(idle_split_s)
        # In place a split costs the running requests nothing (they keep their KV), so an instance is split as
        # Algorithm 2 does, busy or not, once placement sent it nothing for idle_split_s: rank 0 refuses while its
        # requests would not fit the whole instances at their whole life, and it is asked again after as long.
        self.split_busy = reformer.mode == "in-place"
        self._lock = asyncio.Lock()
        self.log = get_logger()
        # members -> when a scale-up of exactly them last failed: not tried again for failure_cooldown_s, or every
        # waiting long request (each asks about once a second) would drain and re-execute the same workers again
        self.failure_cooldown_s = (reformer.timeout_s if failure_cooldown_s is None
                                   else failure_cooldown_s)
        self._failed: dict[tuple[str, ...], float] = {}

    async def place(self, req: memory_manager_pb2.PlaceLongRequestRequest) -> memory_manager_pb2.PlaceLongRequestReply:
        if req.tokens <= 0:
            raise OrchestrationError("INVALID_ARGUMENT", f"tokens: must be > 0, got {req.tokens}")
        # Shielded with the lock inside: a dispatcher that stops waiting cancels neither a re-form half way nor the
        # lock that keeps the next placement from planning around it.
        return await asyncio.shield(self._locked_place(req))

    async def _locked_place(self, req: memory_manager_pb2.PlaceLongRequestRequest) -> memory_manager_pb2.PlaceLongRequestReply:
        async with self._lock:
            return await self._place(req)

    async def _place(self, req: memory_manager_pb2.PlaceLongRequestRequest) -> memory_manager_pb2.PlaceLongRequestReply:
        workers = await self._workers()
        inputs = placement_inputs(workers)
        if inputs is None:
            return PlaceReply(action=PlaceReply.WAIT, reason="no whole instance has reported its KV capacity yet")
        memory, instances = inputs
        scheduler = ElasticTPScheduler(memory, max_degree=max(d for d, _ in memory.tokens_by_degree))
        need = kv_tokens(req.tokens, memory.block_size)
        decision = scheduler.route(need, instances)
        limit = scheduler.max_tokens(instances)
        self.log.info("tp_place", request_id=req.request_id, tokens=req.tokens, kv_tokens=need, decision=type(decision).__name__)
        if isinstance(decision, Route):
            self.idle_split.placed(decision.instance_id, time.monotonic())
            return PlaceReply(action=PlaceReply.ROUTE, worker_id=decision.instance_id, max_tokens=limit)
        if isinstance(decision, Refuse):
            missing = sorted(set(self.reformer.cluster.worker_ids) - {w.worker_id for w in workers})
            if missing:  # they may be restarting or re-forming: the maximum is not known until they answer
                return PlaceReply(
                    action=PlaceReply.WAIT, max_tokens=limit, reason=f"{decision.reason}; {', '.join(missing)} did not answer"
                )
            return PlaceReply(action=PlaceReply.REFUSE, max_tokens=decision.max_tokens, reason=decision.reason)
        if isinstance(decision, Wait):
            return PlaceReply(action=PlaceReply.WAIT, max_tokens=limit, reason=decision.reason)
        return await self._scale_up(req, decision, limit)

    async def _workers(self) -> list[PlacementWorker]:
        """Every reachable member as its GetInfo reports it now."""
        cluster = self.reformer.cluster
        infos = await ask_reachable(cluster, cluster.worker_ids,
                                    lambda stub: stub.GetInfo(common_pb2.Empty(), timeout=INFO_TIMEOUT_S))
        return [placement_worker(info, cluster.worker_host(w) or "") for w, info in infos.items()]

    async def _scale_up(self, req: memory_manager_pb2.PlaceLongRequestRequest, plan: ScaleUp, limit: int) -> PlaceReply:
        failed_at = self._failed.get(plan.members)
        if failed_at is not None and time.monotonic() - failed_at < self.failure_cooldown_s:
            return PlaceReply(action=PlaceReply.WAIT, max_tokens=limit,
                              reason=f"a scale-up of {', '.join(plan.members)} failed {time.monotonic() - failed_at:.0f} s "
                                     f"ago; not retried for {self.failure_cooldown_s:g} s")
        self.log.info("tp_place_scale_up", request_id=req.request_id, members=list(plan.members), degree=plan.degree)
        try:
            report = await self.reformer.transform(memory_manager_pb2.TransformTPRequest(worker_ids=list(plan.members), degree=plan.degree))
        except OrchestrationError as exc:  # a drop or another re-form holds the lock, or a member changed meanwhile
            return PlaceReply(action=PlaceReply.WAIT, max_tokens=limit, reason=f"scale-up of {', '.join(plan.members)}: {exc.code}: {exc}")
        if not report.completed:
            self._failed[plan.members] = time.monotonic()
            return PlaceReply(
                action=PlaceReply.WAIT,
                max_tokens=limit,
                scale_up=report,
                reason=f"scale-up of {', '.join(plan.members)} failed: {report.error}",
            )
        self._failed.pop(plan.members, None)
        self.idle_split.placed(plan.members[0], time.monotonic())
        return PlaceReply(action=PlaceReply.ROUTE, worker_id=plan.members[0], max_tokens=limit, scale_up=report)

    # -- going back to whole instances ---------------------------------------------------------------------------
    async def split_idle_forever(self, interval_s: float = 1.0) -> None:
        """memory_manager.tp_idle_split_s: split merged instances that stayed idle that long (IdleSplitPolicy)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.split_idle()
            except OrchestrationError as exc:  # a drop or a re-form holds the lock: next round
                self.log.info("tp_idle_split_deferred", code=exc.code, reason=str(exc))

    async def split_idle(self) -> list[str]:
        """One round: the instances split now (their rank 0s)."""
        cluster = self.reformer.cluster
        stats = await ask_reachable(cluster, cluster.worker_ids,
                                    lambda stub: stub.GetStats(common_pb2.Empty(), timeout=INFO_TIMEOUT_S))
        # rank 0 speaks for its instance; whole instances and followers are not split
        idle = {w: st.num_running == 0 and st.num_waiting == 0 for w, st in stats.items()}
        seen = [(w, len(st.tp_members), self.split_busy or idle[w])
                for w, st in stats.items() if len(st.tp_members) >= 2 and st.tp_members[0] == w]
        async with self._lock:  # no placement decides on an instance while it splits
            due = self.idle_split.observe(time.monotonic(), seen)
            for inst in due:
                self.log.info("tp_idle_split", instance=inst, idle_s=self.idle_split.idle_s)
                try:
                    # busy, an instance formed cold (its members hold their shards only) waits until it is idle
                    report = await self.reformer.split(memory_manager_pb2.SplitTPRequest(worker_id=inst),
                                                       cold_fallback=idle.get(inst, False))
                except OrchestrationError as exc:  # refused (its requests do not fit yet) or deferred: next spell
                    self.log.info("tp_idle_split_deferred", instance=inst, code=exc.code, reason=str(exc))
                    continue
                if not report.completed:
                    self.log.warning("tp_idle_split_failed", instance=inst, error=report.error)
        return due
