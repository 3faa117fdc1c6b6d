"""Elastic tensor parallelism (README "Elastic tensor parallelism (Gyges)"): the memory manager turns co-located whole
instances into one TP2/TP4 instance (`transform`) and splits one back (`split`), in place or by cold re-form (`mode`,
default memory_manager.tp_mode).

In place, the workers change their running processes (services/worker/tp_in_place.py; the requests keep their KV):
ReformTP{in_place} to rank 0 (it answers with the rendezvous port at once), then to the followers, then the same wait
as below; a split is asked of rank 0 alone (it takes the followers with it) and falls back to the cold split for an
instance formed cold or one that does not end in time. Cold:

    transform: check the group (known, reachable, free, on one host, a degree the model divides by)
               -> ReformTP to rank 0 (it picks the rendezvous port on its host and answers it)
               -> ReformTP to the followers with that port
               -> every member hands its running requests to the dispatcher (they resume once the new instance
                  serves), re-executes itself with the new membership and meets the others
               -> wait (transition_timeout_s) until rank 0 serves at the new degree and every member reports it
    split:     ReformTP as a whole instance to rank 0 (it stops the followers), then to the followers; wait until
               every member serves on its own.

A re-form that does not finish in time, or that a member refuses or fails, heals: every member is re-formed as a whole
instance (a member still waiting at the rendezvous gives up after the same timeout and comes back whole by itself),
and the report says what failed. A cold re-form is not Gyges' in-place transformation (§4.3): no KV survives it (the
requests re-prefill on the new instance) and every member reloads its weights.

It runs under the orchestrator's transition lock, so a re-form and a drop / restore never overlap (ABORTED). The
checks are pure functions over `TPWorker`, the part of a worker's GetInfo they read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from kunserve.shared.log import get_logger
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.tp_degree import degree_error
from kunserve.shared.policy.elastic_tp import DEGREES
from kunserve.shared.policy.membership import Fingerprint
from kunserve.v1 import common_pb2, memory_manager_pb2, worker_pb2, worker_pb2_grpc

from .orchestrator import ClusterAccess, OrchestrationError, Orchestrator

POLL_S = 0.25
MODES = ("cold", "in-place")


class TPClusterAccess(ClusterAccess, Protocol):
    """What a re-form needs from the memory manager beyond the orchestrator's access."""

    def worker_host(self, worker_id: str) -> str | None:
        """The host a member's address names (None: unknown)."""
        ...

    def model_shape(self) -> Fingerprint | None:
        """The cluster's model as the seeds registered it (None: not known yet)."""
        ...


@dataclass(frozen=True)
class TPWorker:
    """One worker as its GetInfo reports it, as far as a re-form is concerned."""

    worker_id: str
    host: str
    serving: bool
    transitioning: bool
    tp_members: tuple[str, ...]
    group_members: tuple[str, ...]
    layer_start: int
    layer_end: int
    num_layers: int
    kv_blocks: int
    block_size: int
    transfer_address: str = ""  # its transfer listener (an in-place change moves the KV over the members' links)

    @property
    def tp_degree(self) -> int:
        return max(1, len(self.tp_members))

    @property
    def whole(self) -> bool:
        return (self.layer_start, self.layer_end) == (0, self.num_layers)


def tp_worker(info: worker_pb2.WorkerInfo, host: str) -> TPWorker:
    return TPWorker(
        info.worker_id,
        host,
        info.serving,
        info.transitioning,
        tuple(info.tp_members) or (info.worker_id,),
        tuple(info.group_members) or (info.worker_id,),
        info.layer_start,
        info.layer_end,
        info.num_layers_model,
        info.kv_blocks_total,
        info.block_size,
        info.transfer_address,
    )


def model_degree_error(shape: Fingerprint | None, degree: int) -> str | None:
    """tp_shard's check on the cluster's model (None when its shape is not known: rank 0 checks it again)."""
    if shape is None or not (shape.num_heads and shape.num_kv_heads and shape.intermediate_size):
        return None
    cfg = ModelConfig(
        vocab_size=max(1, shape.vocab_size),
        hidden_size=shape.hidden_size or shape.num_heads,
        num_layers=max(1, shape.num_layers),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
    )
    return degree_error(cfg, degree)


def check_transform(
    worker_ids: Sequence[str], degree: int, known: Sequence[str], found: Mapping[str, TPWorker], shape: Fingerprint | None
) -> int:
    """The degree of the instance `worker_ids` (rank order) would form; OrchestrationError when it cannot."""
    ids = list(worker_ids)
    degree = degree or len(ids)
    if degree not in DEGREES or degree == 1:
        raise OrchestrationError("INVALID_ARGUMENT", f"degree: a tensor-parallel instance spans 2 or 4 workers, got {degree}")
    why = model_degree_error(shape, degree)
    if why is not None:
        raise OrchestrationError("INVALID_ARGUMENT", why)
    if len(ids) != degree:
        raise OrchestrationError("INVALID_ARGUMENT", f"worker_ids: {len(ids)} workers for degree {degree} (one per rank)")
    if len(set(ids)) != len(ids):
        raise OrchestrationError("INVALID_ARGUMENT", f"worker_ids: {ids} names a worker twice")
    for w in ids:
        if w not in known:
            raise OrchestrationError("NOT_FOUND", f"worker_ids: no worker {w!r} (known: {', '.join(sorted(known))})")
        if w not in found:
            raise OrchestrationError("UNAVAILABLE", f"worker {w} is not reachable")
    for w in ids:
        i = found[w]
        if i.transitioning:
            raise OrchestrationError("ABORTED", f"worker {w} is in a drop / restore transition; retry when it finished")
        if i.tp_degree > 1:
            raise OrchestrationError(
                "FAILED_PRECONDITION",
                f"worker {w} is already in tensor-parallel instance "
                f"{i.tp_members[0]} (TP{i.tp_degree}: {', '.join(i.tp_members)}); split it first "
                "(kunctl tp-split)",
            )
        if len(i.group_members) > 1:
            raise OrchestrationError(
                "FAILED_PRECONDITION", f"worker {w} is in pipeline group {'+'.join(i.group_members)}: restore it first (kunctl restore)"
            )
        if not i.whole:
            raise OrchestrationError(
                "FAILED_PRECONDITION",
                f"worker {w} holds layers [{i.layer_start}, {i.layer_end}) of {i.num_layers}: restore its dropped layers first",
            )
        if not i.serving:
            raise OrchestrationError(
                "FAILED_PRECONDITION", f"worker {w} is not serving (standby, draining or starting); only serving whole instances re-form"
            )
    hosts = {found[w].host for w in ids}
    if len(hosts) > 1:
        where = ", ".join(f"{w} on {found[w].host}" for w in ids)
        raise OrchestrationError("FAILED_PRECONDITION", f"worker_ids: a tensor-parallel instance spans one host ({where})")
    return degree


def check_split(worker_id: str, known: Sequence[str], found: Mapping[str, TPWorker]) -> tuple[str, ...]:
    """The members (rank order) of the tensor-parallel instance `worker_id` is in; OrchestrationError otherwise."""
    if worker_id not in known:
        raise OrchestrationError("NOT_FOUND", f"worker_id: no worker {worker_id!r} (known: {', '.join(sorted(known))})")
    if worker_id not in found:
        raise OrchestrationError("UNAVAILABLE", f"worker {worker_id} is not reachable")
    i = found[worker_id]
    if i.tp_degree == 1:
        raise OrchestrationError(
            "FAILED_PRECONDITION", f"worker {worker_id} is a whole instance, not a member of a tensor-parallel instance"
        )
    return i.tp_members


def all_whole(members: Sequence[str], now: Mapping[str, TPWorker]) -> bool:
    """Every member reports itself a serving whole instance."""
    return all(w in now and now[w].tp_degree == 1 and now[w].serving for w in members)


def instance_pb(members: Sequence[str], w: TPWorker | None) -> memory_manager_pb2.TPInstance:
    blocks = w.kv_blocks if w is not None else 0
    return memory_manager_pb2.TPInstance(members=list(members), kv_blocks=blocks, kv_tokens=blocks * (w.block_size if w is not None else 0))


Reply = TypeVar("Reply")


async def ask_reachable(cluster: ClusterAccess, ids: Sequence[str],
                        ask: Callable[[worker_pb2_grpc.WorkerStub], Awaitable[Reply]]) -> dict[str, Reply]:
    """``ask(stub)`` of every worker in `ids` at once -> {worker: reply} of those that answered. A worker the cluster
    has no stub for, or whose call fails, is left out: re-forms and placement decide over the workers they can reach,
    and a member that cannot answer makes its instance unusable to them anyway."""

    async def one(w: str) -> Reply | None:
        stub = cluster.worker_stub(w)
        if stub is None:
            return None
        try:
            return await ask(stub)
        except grpc.aio.AioRpcError:
            return None

    got = await asyncio.gather(*(one(w) for w in ids))
    return {w: r for w, r in zip(ids, got) if r is not None}


class TPReformer:
    """Drives TransformTP / SplitTP through the workers' ReformTP (module docstring)."""

    def __init__(self, cluster: TPClusterAccess, orchestrator: Orchestrator, timeout_s: float, mode: str = "cold") -> None:
        self.cluster = cluster
        self.orchestrator = orchestrator
        self.timeout_s = timeout_s
        self.mode = mode  # memory_manager.tp_mode: how a change happens when the request does not say
        self.log = get_logger()
        # The members of the re-form under way: they re-execute and answer nothing for a while, and must not
        # expire from the membership meanwhile (the autoscaler would count them gone, the dispatcher drop them).
        self.reforming: set[str] = set()

    @contextlib.asynccontextmanager
    async def _members_reforming(self) -> AsyncIterator[None]:
        """`reforming` holds the members the re-form adds while it runs, and nothing after."""
        try:
            yield
        finally:
            self.reforming.clear()

    def _stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        stub = self.cluster.worker_stub(worker_id)
        if stub is None:
            raise OrchestrationError("NOT_FOUND", f"no worker {worker_id!r}")
        return stub

    async def _infos(self, ids: Sequence[str], timeout: float = 5.0, wait: bool = True) -> dict[str, TPWorker]:
        """The reachable ones of `ids`."""
        known = set(self.cluster.worker_ids)
        infos = await ask_reachable(self.cluster, [w for w in ids if w in known],
                                    lambda stub: stub.GetInfo(common_pb2.Empty(), timeout=timeout, wait_for_ready=wait))
        return {w: tp_worker(info, self.cluster.worker_host(w) or "") for w, info in infos.items()}

    async def _each(
        self, workers: Sequence[str], call: Callable[[str, worker_pb2_grpc.WorkerStub], Awaitable[worker_pb2.ReformTPReply]]
    ) -> tuple[dict[str, worker_pb2.ReformTPReply], dict[str, Exception]]:
        """call(worker id, stub) on every worker at once -> (replies, failures)."""

        async def one(w: str) -> worker_pb2.ReformTPReply | Exception:
            try:
                return await call(w, self._stub(w))
            except Exception as exc:  # collected; the caller decides
                return exc

        got = await asyncio.gather(*(one(w) for w in workers))
        return (
            {w: r for w, r in zip(workers, got) if not isinstance(r, Exception)},
            {w: r for w, r in zip(workers, got) if isinstance(r, Exception)},
        )

    def _reform(self, members: Sequence[str], rank: int, port: int = 0, host: str = "", in_place: bool = False,
                found: Mapping[str, TPWorker] | None = None) -> worker_pb2.ReformTPRequest:
        """A member's ReformTP; an in-place merge's names the members' transfer listeners (from `found`)."""
        addresses = {w: found[w].transfer_address for w in members if w in found and found[w].transfer_address} \
            if in_place and found is not None else {}
        return worker_pb2.ReformTPRequest(members=list(members), rank=rank, port=port, host=host,
                                          rendezvous_timeout_s=self.timeout_s, in_place=in_place,
                                          transfer_addresses=addresses)

    def _mode(self, asked: str) -> str:
        mode = asked or self.mode
        if mode not in MODES:
            raise OrchestrationError("INVALID_ARGUMENT", f"mode: one of {', '.join(MODES)} (empty: the cluster's "
                                     f"memory_manager.tp_mode, {self.mode}), got {asked!r}")
        return mode

    async def _wait(
        self,
        ids: Sequence[str],
        done: Callable[[Mapping[str, TPWorker]], bool],
        timeout_s: float,
        each: Callable[[Mapping[str, TPWorker]], Awaitable[None]] | None = None,
    ) -> bool:
        """Poll the members' GetInfo until `done` (True) or timeout_s (False); `each` acts on every poll."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = await self._infos(ids, timeout=min(2.0, max(0.1, deadline - time.monotonic())), wait=False)
            if done(found):
                return True
            if each is not None:
                await each(found)
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

    async def transform(self, req: memory_manager_pb2.TransformTPRequest) -> memory_manager_pb2.TPReport:
        async with self.orchestrator._exclusive("tensor-parallel re-form"), self._members_reforming():
            t0 = time.perf_counter()
            ids = list(req.worker_ids)
            if not ids:
                raise OrchestrationError("INVALID_ARGUMENT", "worker_ids: name the members, rank 0 first")
            mode = self._mode(req.mode)
            in_place = mode == "in-place"
            found = await self._infos(ids)
            self.reforming.update(ids)
            degree = check_transform(ids, req.degree, self.cluster.worker_ids, found, self.cluster.model_shape())
            report = memory_manager_pb2.TPReport(op="tp", members=ids, degree=degree, before=[instance_pb([w], found[w]) for w in ids],
                                                 mode=mode)
            self.log.info("tp_reform_start", op="tp", members=ids, degree=degree, mode=mode)
            try:
                first = await self._stub(ids[0]).ReformTP(self._reform(ids, 0, in_place=in_place, found=found),
                                                          timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                return await self._failed(report, ids, f"{ids[0]}: {exc.code().name}: {exc.details()}", t0)
            report.port = first.port
            report.handed_over = first.handed_over
            replies, failed = await self._each(
                ids[1:],
                lambda w, stub: stub.ReformTP(self._reform(ids, ids.index(w), first.port, first.host, in_place, found),
                                              timeout=self.timeout_s),
            )
            for r in replies.values():
                report.handed_over += r.handed_over
            if failed:
                return await self._failed(report, ids, self.orchestrator._errors(failed, "re-form"), t0)

            def formed(now: Mapping[str, TPWorker]) -> bool:
                return all(w in now and now[w].tp_members == tuple(ids) for w in ids) and now[ids[0]].serving

            if not await self._wait(ids, formed, self.timeout_s):
                return await self._failed(
                    report,
                    ids,
                    f"the TP{degree} instance did not serve within {self.timeout_s:g}s (memory_manager.transition_timeout_s)",
                    t0,
                )
            return await self._done(report, [ids], t0)

    async def split(self, req: memory_manager_pb2.SplitTPRequest, cold_fallback: bool = True) -> memory_manager_pb2.TPReport:
        """`cold_fallback` False: an in-place split that rank 0 refuses because the instance was formed cold is
        FAILED_PRECONDITION instead of a cold split (the idle split of a busy instance must not hand its requests
        over to re-prefill)."""
        async with self.orchestrator._exclusive("tensor-parallel split"), self._members_reforming():
            t0 = time.perf_counter()
            if not req.worker_id:
                raise OrchestrationError("INVALID_ARGUMENT", "worker_id: name a member of the instance to split")
            mode = self._mode(req.mode)
            found = await self._infos([req.worker_id])
            members = list(check_split(req.worker_id, self.cluster.worker_ids, found))
            self.reforming.update(members)
            found = await self._infos(members)
            report = memory_manager_pb2.TPReport(
                op="tp-split", members=members, degree=1, before=[instance_pb(members, found.get(members[0]))], mode=mode
            )
            self.log.info("tp_reform_start", op="tp-split", members=members, mode=mode)
            if mode == "in-place" and await self._split_in_place(members, report, cold_fallback):
                return await self._done(report, [[w] for w in members], t0)
            # rank 0 first: it hands its requests over and stops the followers cleanly before they leave
            try:
                first = await self._stub(members[0]).ReformTP(self._reform([members[0]], 0), timeout=self.timeout_s)
                report.handed_over = first.handed_over
            except grpc.aio.AioRpcError as exc:
                self.log.warning("tp_split_rank0_failed", code=exc.code().name, error=exc.details())
            ok = await self._as_whole(members, self.timeout_s)
            if not ok:
                report.error = f"not every member served as a whole instance within {self.timeout_s:g}s"
                return await self._finish(report, members, t0)
            return await self._done(report, [[w] for w in members], t0)

    async def _split_in_place(self, members: Sequence[str], report: memory_manager_pb2.TPReport,
                              cold_fallback: bool = True) -> bool:
        """Ask rank 0 for an in-place split (it takes the followers with it) and wait until every member serves alone.
        False when the split is to go on cold: the instance was formed cold (its members hold their shards only; with
        `cold_fallback`) or it did not end in time. FAILED_PRECONDITION when rank 0 refused (its requests do not fit
        the whole instances) and serves on as the instance."""
        try:
            await self._stub(members[0]).ReformTP(self._reform([members[0]], 0, in_place=True), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or not cold_fallback:
                raise OrchestrationError(exc.code().name, f"{members[0]}: {exc.details()}") from None
            self.log.info("tp_split_cold", members=list(members), why=exc.details())
            report.mode = "cold"
            return False

        last: list[Mapping[str, TPWorker]] = []

        def settled(now: Mapping[str, TPWorker]) -> bool:  # whole, or back to the instance (the split was refused)
            last[:] = [now]
            return all_whole(members, now) or (members[0] in now and now[members[0]].tp_degree > 1 and now[members[0]].serving)

        # rank 0 stopped serving before it answered (it is re-forming), so `settled` cannot see the instance as it was
        if not await self._wait(members, settled, self.timeout_s):
            report.error = f"the in-place split did not end within {self.timeout_s:g}s; splitting cold"
            report.mode = "cold"
            return False
        if all_whole(members, last[0]):
            return True
        raise OrchestrationError("FAILED_PRECONDITION", f"the in-place split of {members[0]}'s instance was refused (its "
                                 "running requests do not fit the whole instances: see the worker's log); it serves on")

    async def _as_whole(self, members: Sequence[str], timeout_s: float) -> bool:
        """Re-form every member that is still in an instance of more than one as a whole instance (again on every
        poll: one that is stopping or restarting answers later) until each serves alone, or timeout_s."""
        asked: dict[str, float] = {}
        head, followers = members[0], list(members[1:])

        async def ask(now: Mapping[str, TPWorker]) -> None:
            # the followers once rank 0 has left the instance (it stops them cleanly on its way out)
            rank0_in = head in now and now[head].tp_degree > 1
            late = [
                w
                for w in ([head] if rank0_in else [head, *followers])
                if w in now and now[w].tp_degree > 1 and time.monotonic() - asked.get(w, -1e9) > 1.0
            ]
            for w in late:
                asked[w] = time.monotonic()
            await self._each(late, lambda w, stub: stub.ReformTP(self._reform([w], 0), timeout=self.timeout_s))

        return await self._wait(members, lambda now: all_whole(members, now), timeout_s, ask)

    async def _failed(
        self, report: memory_manager_pb2.TPReport, members: Sequence[str], error: str, t0: float
    ) -> memory_manager_pb2.TPReport:
        """Heal: every member back to a whole instance (bounded: a member waiting at the rendezvous comes back by
        itself once its rendezvous times out)."""
        self.log.error("tp_reform_failed", members=list(members), error=error)
        report.error = error
        healed = await self._as_whole(members, 2 * self.timeout_s)
        report.healed = healed
        if not healed:
            report.error += "; not every member serves as a whole instance yet (they fall back on their own)"
        return await self._finish(report, members, t0)

    async def _done(
        self, report: memory_manager_pb2.TPReport, instances: Sequence[Sequence[str]], t0: float
    ) -> memory_manager_pb2.TPReport:
        report.completed = True
        out = await self._finish(report, [w for i in instances for w in i], t0, instances)
        self.log.info(
            "tp_reform_done", op=report.op, members=list(report.members), degree=report.degree, ms=round(report.total_seconds * 1e3, 1)
        )
        return out

    async def _finish(
        self, report: memory_manager_pb2.TPReport, members: Sequence[str], t0: float, instances: Sequence[Sequence[str]] | None = None
    ) -> memory_manager_pb2.TPReport:
        now = await self._infos(members, wait=False)
        if instances is None:  # as they are now
            instances = [list(now[w].tp_members) for w in members if w in now and now[w].tp_members[0] == w]
        report.after.extend(instance_pb(i, now.get(i[0])) for i in instances)
        await self.cluster.refresh()
        report.epoch = self.cluster.layout.epoch
        report.total_seconds = time.perf_counter() - t0
        return report
