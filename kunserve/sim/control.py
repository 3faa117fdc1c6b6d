"""The control plane of the simulated cluster: the monitor's overload loop and the memory manager's orchestrator,
the services' own code, running on simulated time.

The monitor's ``OverloadController`` (its tick loop, settle and back-off rules, the Llumnix-like destination
choice of ``migrate``) and the memory manager's ``Orchestrator`` (plan, block tables, restore targets, migration
choice, prepare / execute / commit) are asyncio code. They run here unchanged on an asyncio event loop whose clock
is the simulation's (`VirtualLoop`): their ``asyncio.sleep`` waits simulated seconds, and whatever they await on a
worker is a future the simulation resolves when the simulated worker gets there. In between, the loop never blocks
on the wall clock: the simulation runs it until it has nothing ready, then goes on to its next event or the
loop's next timer, whichever comes first.

The workers' side of a transition (services/worker/relayout.py) is `SimWorkerStub`: Prepare pulls a restore's
weights while the old unit still serves (coordinated exchange), then pauses the worker and waits for its
iterations / microbatches in flight to end before reporting its requests and the KV blocks it will have; Execute
waits for the remap (and, without coordinated exchange, for the whole KV exchange); Commit switches every member
to the new layout at once and lands the moved KV after it, holding each request whose KV moves until all of it
has arrived (``transition_plan.kv_flows`` says which blocks go where; each sender's flows go out one after another
at the network's bandwidth, a worker's own renumbering at device speed).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kunserve.services.memory_manager.orchestrator import Orchestrator
from kunserve.services.monitor.servicer import OverloadController, overload_config_from
from kunserve.shared.policy.cluster import Unit
from kunserve.shared.policy.cluster_layout import LayoutState
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.policy.transition_plan import SeqMove, kv_flows, weight_pieces
from kunserve.shared.wire.cluster_state import layout_entry_from_info
from kunserve.shared.wire.transitions import units_from_pb
from kunserve.v1 import memory_manager_pb2, worker_pb2

if TYPE_CHECKING:
    from kunserve.sim.cluster import Simulation

REMAP_S_PER_PAGE = 5e-6  # mapping / unmapping one pool page (CUDA VMM) during a transition's remap
CONTROL_RPC_S = 1e-3  # one control RPC round trip (prepare, execute, commit)


class VirtualLoop:
    """An asyncio event loop on the simulation's clock, run in slices: `run_ready` runs every callback ready now
    and every timer due by now, repeatedly, until none is; `next_timer` says when the next one is due."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.time = clock  # type: ignore[method-assign]  # the loop's timers run on simulated time

    def next_timer(self) -> float:
        scheduled = self.loop._scheduled  # type: ignore[attr-defined]  # the loop's timer heap (a few entries)
        if scheduled and not scheduled[0].cancelled():
            return float(scheduled[0].when())
        return min((h.when() for h in scheduled if not h.cancelled()), default=math.inf)

    def _due(self) -> bool:
        return bool(self.loop._ready) or self.next_timer() <= self.loop.time()  # type: ignore[attr-defined]

    def run_ready(self) -> None:
        while self._due():
            self.loop.call_soon(self.loop.stop)
            self.loop.run_forever()

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.run_ready()
        self.loop.close()


@dataclass
class _Transition:
    """One transition as the simulated workers carry it out."""

    spec: worker_pb2.TransitionSpec
    pull_s: float = 0.0  # weights pulled before the pause (coordinated restore)
    exchange: dict[str, float] = field(default_factory=dict)  # request -> seconds after the commit its KV lands
    exchange_s: float = 0.0
    bytes_sent: dict[str, int] = field(default_factory=dict)
    weight_bytes_in: dict[str, int] = field(default_factory=dict)
    executed: bool = False
    committed: bool = False
    started_at: float = 0.0


class SimWorkerStub:
    """What the orchestrator and the memory manager call on a worker (worker.proto's Worker service), answered by
    the simulated worker."""

    def __init__(self, control: ControlPlane, worker_id: str) -> None:
        self.control = control
        self.worker_id = worker_id

    @property
    def _worker(self) -> Any:
        return self.control.sim.workers[self.worker_id]

    async def GetInfo(self, request: Any, **_: Any) -> worker_pb2.WorkerInfo:  # noqa: N802 (gRPC method names)
        return self.info()

    def info(self) -> worker_pb2.WorkerInfo:
        """GetInfo's answer now (elastic TP's placement reads it synchronously, as one decision)."""
        w = self._worker
        sim = self.control.sim
        return worker_pb2.WorkerInfo(
            worker_id=w.worker_id,
            address=f"sim:{w.worker_id}",
            model_name=sim.shape.name,
            num_layers_model=sim.shape.num_layers,
            layer_start=w.member.layer_start,
            layer_end=w.member.layer_end,
            vocab_size=sim.shape.config.vocab_size,
            max_model_len=sim.shape.config.max_position_embeddings,
            block_size=w.setup.block_size,
            kv_blocks_total=w.allocator.num_blocks,
            transfer_address=w.member.transfer_address,
            group_id=w.unit.unit_id,
            group_members=list(w.unit.worker_ids),
            epoch=w.epoch,
            serving=w.serving,
            transitioning=w.paused and not w.reforming,
            tp_degree=w.tp_degree,
            tp_members=list(w.tp_members) if w.tp_degree > 1 else [],
            kv_tokens_by_degree=sim.elastic.tokens_by_degree if sim.elastic is not None and w.held_layers == w.num_layers else {},
        )

    async def GetMemoryMap(self, request: Any, **_: Any) -> worker_pb2.MemoryMap:  # noqa: N802
        w = self._worker
        shape = self.control.sim.shape
        return worker_pb2.MemoryMap(
            worker_id=w.worker_id,
            block_size=w.setup.block_size,
            block_bytes=shape.kv_spec.block_bytes,
            layer_start=w.member.layer_start,
            layer_end=w.member.layer_end,
            num_layers_model=shape.num_layers,
            layers=[worker_pb2.LayerMemory(layer=i, weight_bytes=shape.layer_bytes[i]) for i in range(*w.member.range)],
        )

    async def PrepareTransition(self, spec: worker_pb2.TransitionSpec, **_: Any) -> worker_pb2.TransitionPrepared:  # noqa: N802
        return await self.control.prepare(self.worker_id, spec)

    async def ExecuteTransition(self, spec: worker_pb2.TransitionSpec, **_: Any) -> worker_pb2.TransitionDone:  # noqa: N802
        return await self.control.execute(self.worker_id, spec)

    async def CommitTransition(self, ref: worker_pb2.TransitionRef, **_: Any) -> worker_pb2.TransitionDone:  # noqa: N802
        return await self.control.commit(self.worker_id, ref.epoch)

    async def AbortTransition(self, ref: worker_pb2.TransitionRef, **_: Any) -> worker_pb2.TransitionDone:  # noqa: N802
        return self.control.abort(self.worker_id, ref.epoch)

    async def RenewTransition(self, ref: worker_pb2.TransitionRef, **_: Any) -> worker_pb2.TransitionLease:  # noqa: N802
        return worker_pb2.TransitionLease(epoch=ref.epoch, expires_in_s=self.control.sim.cfg.memory_manager.transition_lease_s)


class SimClusterAccess:
    """The memory manager as the orchestrator sees it (orchestrator.ClusterAccess): the configured workers, their
    stubs and the layout rebuilt from their GetInfo (MemoryManager.refresh)."""

    def __init__(self, control: ControlPlane, worker_ids: Sequence[str]) -> None:
        self.control = control
        self._ids = tuple(worker_ids)
        self.layout = LayoutState()
        self._stubs = {w: SimWorkerStub(control, w) for w in self._ids}

    @property
    def worker_ids(self) -> Sequence[str]:
        return self._ids

    def worker_stub(self, worker_id: str) -> Any:
        return self._stubs.get(worker_id)

    async def refresh(self) -> None:
        for wid in self._ids:
            info = await self._stubs[wid].GetInfo(None)
            self.layout.observe(layout_entry_from_info(info), info.num_layers_model)


class SimMemoryManager:
    """The monitor's MemoryManagerActions: the memory manager's Drop / Restore / Migrate handlers, which hand the
    request to the orchestrator (MemoryManagerServicer)."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    async def drop(self, required_blocks: int, reason: str) -> memory_manager_pb2.TransitionReport:
        return await self.orchestrator.drop(memory_manager_pb2.DropRequest(required_blocks=required_blocks, reason=reason))

    async def restore(self, group_id: str) -> memory_manager_pb2.TransitionReport:
        return await self.orchestrator.restore(memory_manager_pb2.RestoreRequest(group_id=group_id))

    async def migrate(self, src: str, dst: str, blocks: int) -> memory_manager_pb2.TransitionReport:
        return await self.orchestrator.migrate(memory_manager_pb2.MigrateRequest(src_worker=src, dst_worker=dst, blocks=blocks))

    async def close(self) -> None:
        return None


@dataclass
class TransitionRecord:
    """A finished transition as the simulation saw it (simulated seconds)."""

    op: str
    epoch: int
    started_s: float
    committed_s: float
    completed: bool
    groups: list[list[str]]
    requests_moved: int
    kv_bytes_moved: int
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ControlPlane:
    """The monitor's overload loop and the memory manager's orchestrator over the simulated workers."""

    def __init__(self, sim: Simulation, *, monitor_action: str | None, static_pairs: bool) -> None:
        self.sim = sim
        cfg = sim.cfg
        self.vloop = VirtualLoop(lambda: sim.now)
        self.access = SimClusterAccess(self, list(sim.workers))
        self.orchestrator = Orchestrator(
            self.access,
            cfg.memory_manager.transition_timeout_s,
            cfg.memory_manager.transition_lease_s,
            background_kv=cfg.memory_manager.coordinated_exchange,
        )
        self.orchestrator.observers.append(self)
        ttft_slo_s = cfg.slo.ttft_ms / 1000.0
        self.load = ClusterLoad(stale_after_s=cfg.monitor.stale_after_s, max_head_wait_s=ttft_slo_s)
        self.controller: OverloadController | None = None
        if cfg.monitor.auto_drop and monitor_action is not None:
            self.controller = OverloadController(
                self.load,
                SimMemoryManager(self.orchestrator),
                overload_config_from(cfg.monitor, ttft_slo_s),
                interval_s=cfg.monitor.policy_interval_s,
                clock=lambda: sim.now,
                mode=monitor_action,
            )
        self.transitions: dict[int, _Transition] = {}
        self.records: list[TransitionRecord] = []
        self._static_pairs = static_pairs

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        loop = self.vloop.loop
        loop.run_until_complete(self.access.refresh())
        if self._static_pairs:
            loop.create_task(self.orchestrator.form_static_pairs(self.sim.cfg.memory_manager.transition_timeout_s))
        if self.controller is not None:
            loop.create_task(self.controller.run_forever())
        self.run()

    def run(self) -> None:
        self.vloop.run_ready()

    def next_time(self) -> float:
        return self.vloop.next_timer()

    def close(self) -> None:
        self.vloop.close()

    # -- the orchestrator's observer: how each transition ended --------------------------------------------------------
    def reported(self, report: memory_manager_pb2.TransitionReport) -> None:
        t = next(iter(self.transitions.values()), None)  # one transition at a time (the orchestrator's lock)
        started = t.started_at if t is not None else self.sim.now
        self.records.append(
            TransitionRecord(
                report.op,
                report.epoch,
                started,
                self.sim.now,
                report.completed,
                [[m.worker_id for m in g.members] for g in report.groups],
                report.requests_moved,
                report.kv_bytes_moved,
                report.error,
            )
        )
        self.transitions.clear()

    def refused(self, op: str, code: str) -> None:
        self.records.append(TransitionRecord(op, 0, self.sim.now, self.sim.now, False, [], 0, 0, f"refused: {code}"))

    # -- the workers' side of a transition ----------------------------------------------------------------------------
    def _transition(self, spec: worker_pb2.TransitionSpec) -> _Transition:
        t = self.transitions.get(spec.epoch)
        if t is None:
            t = self.transitions[spec.epoch] = _Transition(spec, started_at=self.sim.now)
            old, new = units_from_pb(spec.old_units), units_from_pb(spec.new_units)
            t.pull_s, t.weight_bytes_in = self._weights(old, new) if spec.background_kv else (0.0, {})
        return t

    def _weights(self, old: list[Unit], new: list[Unit]) -> tuple[float, dict[str, int]]:
        """Seconds to pull the layers each worker gains from the peer holding them (each worker's sends and receives
        one after another on its link), and the bytes each receives."""
        shape = self.sim.shape
        sent: dict[str, int] = {}
        received: dict[str, int] = {}
        for piece in weight_pieces(old, new):
            nbytes = sum(shape.layer_bytes[piece.layer_start : piece.layer_end])
            sent[piece.src] = sent.get(piece.src, 0) + nbytes
            received[piece.dst] = received.get(piece.dst, 0) + nbytes
        busiest = max([*sent.values(), *received.values()], default=0)
        return self.sim.time.links.network_s(busiest), received

    def _future(self) -> asyncio.Future[None]:
        return self.vloop.loop.create_future()

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def prepare(self, worker_id: str, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionPrepared:
        t = self._transition(spec)
        await self._sleep(CONTROL_RPC_S + t.pull_s)
        worker = self.sim.workers[worker_id]
        quiet = self._future()

        def on_quiet() -> None:
            if not quiet.done():
                quiet.set_result(None)
            self.sim.control_dirty = True

        worker.pause(on_quiet)
        await quiet
        new = units_from_pb(spec.new_units)
        member = next(u.member(worker_id) for u in new if u.member(worker_id) is not None)
        assert member is not None
        seqs = []
        if not worker.is_stage:
            now = self.sim.now
            for seq in sorted(worker.seqs.values(), key=lambda s: s.order):
                request = worker.requests[seq.request_id]
                seqs.append(
                    worker_pb2.SeqState(
                        request_id=seq.request_id,
                        num_computed=seq.num_computed,
                        age_s=now - request.arrival_s,
                        old_unit=worker.unit.unit_id,
                        old_blocks=list(seq.block_table.ids),
                        num_preemptions=seq.num_preemptions,
                    )
                )
        return worker_pb2.TransitionPrepared(
            worker_id=worker_id, seqs=seqs, kv_blocks_after=self.sim.memory.blocks(*member.range), kv_blocks_now=worker.allocator.num_blocks
        )

    async def execute(self, worker_id: str, spec: worker_pb2.TransitionSpec) -> worker_pb2.TransitionDone:
        t = self._transition(spec)
        t.spec = spec  # Execute's spec carries every request's new unit and block table
        if not t.executed:
            t.executed = True
            self._plan_exchange(t)
        worker = self.sim.workers[worker_id]
        old = units_from_pb(spec.old_units)
        new = units_from_pb(spec.new_units)
        o = next(u for u in old if worker_id in u.worker_ids).member(worker_id)
        n = next(u for u in new if worker_id in u.worker_ids).member(worker_id)
        assert o is not None and n is not None
        page = self.sim.memory.page_size
        shape = self.sim.shape
        moved_pages = abs(shape.weight_pages(*o.range, page) - shape.weight_pages(*n.range, page))
        remap_s = moved_pages * REMAP_S_PER_PAGE
        wait = CONTROL_RPC_S + remap_s + (0.0 if spec.background_kv else t.exchange_s)
        await self._sleep(wait)
        return worker_pb2.TransitionDone(
            worker_id=worker_id,
            epoch=spec.epoch,
            layer_start=n.layer_start,
            layer_end=n.layer_end,
            kv_blocks=self.sim.memory.blocks(*n.range),
            bytes_sent=t.bytes_sent.get(worker_id, 0),
            exchange_seconds=0.0 if spec.background_kv else t.exchange_s,
            remap_seconds=remap_s,
            weight_bytes_from_peers=t.weight_bytes_in.get(worker_id, 0),
            paused_seconds=0.0,
            requests_owned=len(worker.seqs),
        )

    def _plan_exchange(self, t: _Transition) -> None:
        """When each moved request's KV lands after the commit: kv_flows, each sender's flows in turn."""
        spec = t.spec
        old, new = units_from_pb(spec.old_units), units_from_pb(spec.new_units)
        moves = [SeqMove(s.request_id, s.old_unit, s.new_unit, tuple(s.old_blocks), tuple(s.new_blocks)) for s in spec.seqs]
        links = self.sim.time.links
        block_layer = self.sim.shape.kv_spec.block_bytes
        clock: dict[str, float] = {}
        for (src, dst), flow in sorted(kv_flows(old, new, moves).items()):
            rate = links.device if src == dst else links.network
            for part in flow.parts:
                nbytes = part.num_layers * len(part.old_blocks) * block_layer
                clock[src] = clock.get(src, 0.0) + nbytes / rate + (0.0 if src == dst else links.latency_s)
                t.exchange[part.request_id] = max(t.exchange.get(part.request_id, 0.0), clock[src])
                if src != dst:
                    t.bytes_sent[src] = t.bytes_sent.get(src, 0) + nbytes
        t.exchange_s = max(clock.values(), default=0.0)

    async def commit(self, worker_id: str, epoch: int) -> worker_pb2.TransitionDone:
        t = self.transitions[epoch]
        worker = self.sim.workers[worker_id]
        paused = self.sim.now - worker.paused_at
        if not t.committed:
            t.committed = True
            self.sim.apply_transition(t.spec, {} if not t.spec.background_kv else t.exchange)
        await self._sleep(CONTROL_RPC_S)
        return worker_pb2.TransitionDone(worker_id=worker_id, epoch=epoch, paused_seconds=paused)

    def abort(self, worker_id: str, epoch: int) -> worker_pb2.TransitionDone:
        """Before Execute nothing changed: resume as before (a rolled-back plan)."""
        t = self.transitions.get(epoch)
        worker = self.sim.workers[worker_id]
        if t is None or not t.committed:
            worker.resume()
        return worker_pb2.TransitionDone(worker_id=worker_id, epoch=epoch)


__all__ = ["ControlPlane", "TransitionRecord", "VirtualLoop"]
