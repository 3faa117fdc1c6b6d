"""The worker's transition runner (services/worker/relayout.py) on real engines in one process: two workers,
each a pooled instance on its own engine thread, linked by an in-memory fake of the transfer service (no UCX,
no gRPC). The test drives prepare / execute / commit / abort as the memory manager's orchestrator does.

Oracle: requests whose life spans the transitions (drop into a pipeline group mid-decode, pipeline, restore,
or a transition that fails or expires) finish with the dense reference's greedy tokens, every token once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass

import pytest
import torch
from engine_testing import one_torch_thread  # noqa: F401 - fixture
from oracle import compare_greedy

from kunserve.services.worker.handover import Moved
from kunserve.services.worker.relayout import TransitionRefused, TransitionRunner
from kunserve.services.worker.weight_exchange import WeightReceiver
from kunserve.shared.engine.api import EngineRequest, FinishReason, SamplingParams, TokenEvent
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.model.pool_placement import fused_source
from kunserve.shared.model.reference import reference_scores
from kunserve.shared.model.weights import load_model_source
from kunserve.shared.policy.batch_scheduler import SchedulerConfig
from kunserve.shared.policy.cluster import Member, Unit
from kunserve.shared.policy.planner import merged_members, plan_split, unit_id_for
from kunserve.shared.policy.transition_plan import SeqMove, assign_restore_targets, assign_tables, weight_pieces
from kunserve.shared.streams import StreamRegistry
from kunserve.shared.transfer.framing import KV_EXCHANGE, WEIGHTS
from kunserve.shared.transfer.service import Received, TransferError
from kunserve.shared.wire.transitions import unit_to_pb
from kunserve.v1 import transfer_pb2, worker_pb2

MIB = 1 << 20
NUM_LAYERS = 4
SOURCE = load_model_source(None)


# -- the fake transfer service ------------------------------------------------------------------------------

class FakeHandle:
    async def wait(self, timeout: float | None = None) -> int:
        return 0


class FakeNetwork:
    """Every fake service by name and address; messages are delivered on the event loop, copied (as the wire
    would), in submission order."""

    def __init__(self) -> None:
        self.services: dict[str, FakeTransfer] = {}
        self.dead: set[str] = set()
        self.refused: set[tuple[str, int]] = set()  # (sender, kind) whose submits fail
        self.weights_after_remap = False  # hold weights until their receiver can take them in place

    def add(self, name: str) -> FakeTransfer:
        svc = self.services[name] = FakeTransfer(self, name, f"{name}.test:{7000 + len(self.services)}")
        return svc

    def kill(self, name: str) -> None:
        """The worker is gone: its links end (the others hear of it), nothing reaches it any more."""
        self.dead.add(name)
        for other in self.services.values():
            if other.name != name and name in other.linked:
                other.linked.discard(name)
                for cb in other.lost_callbacks:
                    cb(name, TransferError(name, "connection reset"))


class FakeTransfer:
    """What the runner, the group link and the stage runner use of shared/transfer/service.TransferService."""

    def __init__(self, net: FakeNetwork, name: str, address: str) -> None:
        self.net = net
        self.name = name
        self.address = address
        self.linked: set[str] = set()
        self.callbacks: dict[int, object] = {}
        self.lost_callbacks: list = []
        self.queues: dict[int, asyncio.Queue] = collections.defaultdict(asyncio.Queue)
        self.sent: collections.Counter = collections.Counter()  # kind -> messages submitted
        self.allocators: dict[int, object] = {}
        self.in_place: collections.Counter = collections.Counter()  # kind -> messages received into allocated memory

    @property
    def peers(self) -> list[str]:
        return sorted(self.linked)

    async def connect(self, host: str, port: int, timeout: float | None = None, expect: str | None = None) -> str:
        other = next(s for s in self.net.services.values() if s.address == f"{host}:{port}")
        assert other.name == expect
        self.linked.add(other.name)
        other.linked.add(self.name)
        return other.name

    def on_message(self, kind: int, callback) -> None:
        self.callbacks[kind] = callback

    def on_peer_lost(self, callback) -> None:
        self.lost_callbacks.append(callback)

    def set_allocator(self, kind: int, allocator) -> None:
        if allocator is None:
            self.allocators.pop(kind, None)
        else:
            self.allocators[kind] = allocator

    def submit(self, peer: str, kind: int, data, *, request_ids=(), layer_start: int = 0, layer_end: int = 0,
               epoch: int = 0, name: str = "") -> FakeHandle:
        if peer not in self.linked or peer in self.net.dead or (self.name, kind) in self.net.refused:
            raise TransferError(peer, "not connected")
        nbytes = data.numel() * data.element_size() if isinstance(data, torch.Tensor) else 0
        header = transfer_pb2.TransferHeader(kind=kind, epoch=epoch, name=name, request_ids=list(request_ids),
                                             layer_start=layer_start, layer_end=layer_end, source=self.name,
                                             total_bytes=nbytes)
        msg = Received(self.name, header, data.clone() if isinstance(data, torch.Tensor) else data)
        self.sent[kind] += 1
        asyncio.get_running_loop().call_soon(self.net.services[peer].deliver, msg)
        return FakeHandle()

    def deliver(self, msg: Received) -> None:
        if self.name in self.net.dead:
            return
        kind = msg.header.kind
        if kind == WEIGHTS and self.net.weights_after_remap and kind not in self.allocators:
            asyncio.get_running_loop().call_later(0.005, self.deliver, msg)
            return
        alloc = self.allocators.get(kind)
        into = alloc(msg.peer, msg.header) if alloc is not None else None
        if into is not None:  # what the real service does: the message lands in the allocator's memory
            into.copy_(msg.data.reshape(-1).view(into.dtype))
            self.in_place[kind] += 1
            msg = Received(msg.peer, msg.header, into)
            del into
        cb = self.callbacks.get(msg.header.kind)
        if cb is not None:
            cb(msg)
        else:
            self.queues[msg.header.kind].put_nowait(msg)

    async def recv(self, kind: int, timeout: float | None = None) -> Received:
        try:
            return await asyncio.wait_for(self.queues[kind].get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no message within {timeout} s") from None


# -- workers and requests -----------------------------------------------------------------------------------

@dataclass
class Worker:
    wid: str
    inst: PooledInstance
    loop: EngineLoop
    svc: FakeTransfer
    streams: StreamRegistry[TokenEvent]
    runner: TransitionRunner

    def single(self) -> Unit:
        return Unit.single(self.wid, NUM_LAYERS, self.svc.address)

    def member(self, start: int, end: int) -> Member:
        return Member(self.wid, start, end, self.svc.address)


@contextlib.asynccontextmanager
async def cluster(n: int = 2, timeout_s: float = 20.0, host_copy: bool = True):
    net = FakeNetwork()
    workers: dict[str, Worker] = {}
    try:
        for i in range(n):
            wid = f"w{i}"
            inst = PooledInstance(SOURCE, layer_range=(0, NUM_LAYERS), pool_bytes=24 * MIB, page_size=256 * 1024,
                                  block_size=16, backend="host",
                                  scheduler_config=SchedulerConfig(max_num_batched_tokens=64), keep_host_copy=host_copy)
            loop = EngineLoop(inst.engine)
            svc = net.add(wid)
            streams: StreamRegistry[TokenEvent] = StreamRegistry()
            workers[wid] = Worker(wid, inst, loop, svc, streams,
                                  TransitionRunner(wid, loop, inst, svc, streams, timeout_s))  # type: ignore[arg-type]
            loop.start()
        yield net, workers
    finally:
        for w in workers.values():
            w.loop.stop()
            w.inst.close()


class Requests:
    """Requests submitted as the servicer's Generate does; each followed to its end across moves."""

    def __init__(self, workers: dict[str, Worker]) -> None:
        self.workers = workers
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tasks: list[asyncio.Task] = []
        self.max_tokens = 0
        self.where: dict[str, str] = {}  # request id -> the worker whose stream it is followed on

    def submit(self, wid: str, rid: str, prompt: list[int], max_tokens: int) -> None:
        w = self.workers[wid]
        q = w.streams.open(rid)
        w.loop.submit(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                      lambda ev: w.streams.put_threadsafe(rid, ev))
        self.prompts[rid] = prompt
        self.tokens[rid] = []
        self.max_tokens = max_tokens
        self.where[rid] = wid
        self.tasks.append(asyncio.create_task(self._follow(w, rid, q)))

    async def _follow(self, w: Worker, rid: str, q: asyncio.Queue) -> None:
        while True:
            item = await asyncio.wait_for(q.get(), 60)
            if isinstance(item, Moved):  # what the dispatcher does: attach at the new head
                w.streams.close(rid)
                w = self.workers[item.worker_id]
                self.where[rid] = item.worker_id
                q = w.runner.handover.attach(rid)
                assert q is not None, f"{rid} moved to {item.worker_id}, which does not have it"
                continue
            assert item.finish_reason in (FinishReason.NONE, FinishReason.LENGTH), item
            assert item.index == len(self.tokens[rid]), (rid, f"expected index {len(self.tokens[rid])}", item)
            self.tokens[rid].append(item.token_id)
            if item.finished:
                w.streams.close(rid)
                return

    async def until_each_has(self, n: int) -> None:
        """Every request has at least n tokens and none has finished. A worker whose requests all have n
        already is held (paused) until the others catch up: on a loaded machine one engine thread can otherwise
        finish its requests before another has produced n tokens. Only whole instances and group heads are held
        (pausing a later stage stalls its head's requests), and the decision is made again at every poll, because `where`
        follows a moved request only once its stream has delivered the move: a worker held on a stale view is
        released as soon as a request that still needs tokens is seen on it."""
        held: set[str] = set()
        try:
            for _ in range(6000):
                for task in self.tasks:
                    if task.done():
                        task.result()  # a failure surfaces as itself
                        pytest.fail("a request ended before the step under test")
                if all(len(t) >= n for t in self.tokens.values()):
                    return
                for wid, w in self.workers.items():
                    mine = [rid for rid, at in self.where.items() if at == wid]
                    role = w.runner.role
                    hold = ((role is None or role.is_head) and not w.runner.transitioning and bool(mine)
                            and all(len(self.tokens[rid]) >= n for rid in mine))
                    if hold and wid not in held and not w.loop.paused:
                        w.loop.pause()
                        held.add(wid)
                    elif not hold and wid in held:
                        w.loop.resume()
                        held.discard(wid)
                await asyncio.sleep(0.01)
            pytest.fail(f"requests never reached {n} tokens: {[len(t) for t in self.tokens.values()]}")
        finally:
            for wid in held:
                self.workers[wid].loop.resume()

    async def finish(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 120)
        weights = SOURCE.load_weights()
        for rid, got in self.tokens.items():
            assert len(got) == self.max_tokens, rid
            ref, margins = reference_scores(SOURCE.config, weights, self.prompts[rid], got)
            compare_greedy(got, ref, margins)


def start_requests(workers: dict[str, Worker], per_worker: int = 2, max_tokens: int = 40) -> Requests:
    reqs = Requests(workers)
    for i, wid in enumerate(sorted(workers)):
        for j in range(per_worker):
            prompt = [(97 * (i * per_worker + j) + 13 * k) % 3800 + 100 for k in range(20 + 17 * j)]
            reqs.submit(wid, f"{wid}-r{j}", prompt, max_tokens)
    return reqs


def pause(workers: dict[str, Worker]) -> None:
    """Hold every engine between iterations, so the transition starts mid-decode whatever the timing."""
    for w in workers.values():
        w.loop.pause()


# -- the orchestrator's part --------------------------------------------------------------------------------

def group_of(workers: dict[str, Worker]) -> Unit:
    w0, w1 = workers["w0"], workers["w1"]
    return Unit("g:w0+w1", (w0.member(0, 2), w1.member(2, NUM_LAYERS)))


async def prepare(workers: dict[str, Worker], epoch: int, op: str, old_units: list[Unit], new_units: list[Unit],
                  lease_s: float = 30.0) -> tuple[worker_pb2.TransitionSpec, dict[str, worker_pb2.TransitionPrepared]]:
    spec = worker_pb2.TransitionSpec(epoch=epoch, op=op, old_units=[unit_to_pb(u) for u in old_units],
                                     new_units=[unit_to_pb(u) for u in new_units], lease_s=lease_s)
    names = sorted(workers)
    replies = await asyncio.gather(*(workers[w].runner.prepare(spec) for w in names))
    return spec, dict(zip(names, replies))


def plan(spec: worker_pb2.TransitionSpec, prepared: dict[str, worker_pb2.TransitionPrepared], op: str,
         old_units: list[Unit], new_units: list[Unit]) -> worker_pb2.TransitionSpec:
    """Block tables in the new units, as services/memory_manager/orchestrator.py assigns them."""
    capacity = {u.unit_id: min(prepared[w].kv_blocks_after for w in u.worker_ids) for u in new_units}
    new_units = [Unit(u.unit_id, u.members, capacity[u.unit_id]) for u in new_units]
    seqs = [s for w in sorted(prepared) for s in prepared[w].seqs]
    unit_of_head = {w: u.unit_id for u in new_units for w in u.worker_ids}
    old_head = {u.unit_id: u.head for u in old_units}
    moves = [SeqMove(s.request_id, s.old_unit, unit_of_head[old_head[s.old_unit]], tuple(s.old_blocks)) for s in seqs]
    if op == "restore":
        moves = assign_restore_targets(moves, capacity)
    by_rid = {m.request_id: m for m in assign_tables(moves, new_units, old_heads=old_head)}
    for s in seqs:
        s.new_unit = by_rid[s.request_id].new_unit
        s.new_blocks[:] = list(by_rid[s.request_id].new_blocks)
    spec.ClearField("new_units")
    spec.new_units.extend(unit_to_pb(u) for u in new_units)
    spec.seqs.extend(seqs)
    return spec


async def execute(workers: dict[str, Worker], spec: worker_pb2.TransitionSpec) -> dict[str, object]:
    names = sorted(workers)
    done = await asyncio.gather(*(workers[w].runner.execute(spec) for w in names), return_exceptions=True)
    return dict(zip(names, done))


async def commit(workers: dict[str, Worker], epoch: int) -> None:
    for w in workers.values():
        await w.runner.commit(epoch)


async def drop(workers: dict[str, Worker], epoch: int = 1) -> dict[str, object]:
    old, new = [workers[w].single() for w in sorted(workers)], [group_of(workers)]
    spec, prepared = await prepare(workers, epoch, "drop", old, new)
    done = await execute(workers, plan(spec, prepared, "drop", old, new))
    await commit(workers, epoch)
    return done


# -- tests --------------------------------------------------------------------------------------------------

def test_drop_mid_decode_then_restore_keeps_the_greedy_tokens():
    async def main() -> None:
        async with cluster() as (net, workers):
            w0, w1 = workers["w0"], workers["w1"]
            reqs = start_requests(workers)
            await reqs.until_each_has(3)
            pause(workers)
            done = await drop(workers)
            assert all(isinstance(d, worker_pb2.TransitionDone) for d in done.values()), done
            assert w0.inst.layer_range == (0, 2) and w1.inst.layer_range == (2, NUM_LAYERS)
            assert w0.runner.role is not None and w0.runner.role.is_head and w0.loop.engine.link is not None
            assert w1.runner.role is not None and not w1.runner.role.is_head and w1.loop.engine.link is None
            assert w0.runner.unit_id == w1.runner.unit_id == "g:w0+w1" and w0.runner.members == ["w0", "w1"]
            assert sorted(w0.loop.engine.seqs) == sorted(reqs.tokens) and not w1.loop.engine.seqs
            assert done["w0"].bytes_sent > 0 and done["w1"].bytes_sent > 0, "KV went both ways"
            assert done["w0"].requests_owned == 4 and done["w1"].requests_owned == 0
            assert w0.runner.epoch == w1.runner.epoch == 1 and not w0.runner.transitioning
            # the group serves: every request goes on through the pipeline
            seen = {rid: len(t) for rid, t in reqs.tokens.items()}
            await reqs.until_each_has(min(seen.values()) + 4)
            assert net.services["w0"].sent[transfer_pb2.TRANSFER_KIND_ACTIVATION] > 0
            pause(workers)
            old, new = [group_of(workers)], [w0.single(), w1.single()]
            old = [Unit(old[0].unit_id, old[0].members, w0.loop.engine.allocator.num_blocks)]
            spec, prepared = await prepare(workers, 2, "restore", old, new)
            assert len(prepared["w0"].seqs) == 4 and not prepared["w1"].seqs, "the head reports the group's requests"
            done = await execute(workers, plan(spec, prepared, "restore", old, new))
            assert all(isinstance(d, worker_pb2.TransitionDone) for d in done.values()), done
            await commit(workers, 2)
            assert w0.inst.layer_range == w1.inst.layer_range == (0, NUM_LAYERS)
            assert w0.runner.role is None and w1.runner.role is None and w0.loop.engine.link is None
            assert w1.loop.engine.seqs, "the restore spread the requests over both instances"
            await reqs.finish()
            assert not w0.runner.handover.attach("w1-r0"), "attached once"

    asyncio.run(main())


def assert_weights_are_the_models(inst: PooledInstance) -> None:
    """Bit for bit the weights the model source gives (stored in the pool's dtype)."""
    ref = fused_source(SOURCE.load_weights())
    for name, t in inst.layout.weights().items():
        assert torch.equal(t, ref(name).to(t.dtype)), name
    inst.layout.release_views()


def test_restore_without_a_host_copy_pulls_the_missing_layers_from_the_peer():
    """engine.host_copy = false: the restore pulls each member's missing half from the other member on the
    weights class, received straight into the pages taken back from the KV tail; the weights are the model's
    bit for bit and the requests keep their greedy tokens."""
    async def main() -> None:
        async with cluster(host_copy=False) as (net, workers):
            net.weights_after_remap = True
            w0, w1 = workers["w0"], workers["w1"]
            assert w0.inst.host_copy is None and w1.inst.host_copy is None
            reqs = start_requests(workers)
            await reqs.until_each_has(3)
            pause(workers)
            await drop(workers)
            seen = {rid: len(t) for rid, t in reqs.tokens.items()}
            await reqs.until_each_has(min(seen.values()) + 3)
            done = await transition(workers, 2, "restore", [with_blocks(group_of(workers), workers)],
                                    [w0.single(), w1.single()])
            assert w0.inst.layer_range == w1.inst.layer_range == (0, NUM_LAYERS)
            for me, peer in (("w0", "w1"), ("w1", "w0")):
                assert done[me].weight_bytes_from_peers == done[peer].weight_bytes_sent > 0
                assert done[me].weight_bytes_from_host == done[me].weight_bytes_from_checkpoint == 0
                assert net.services[me].in_place[WEIGHTS] > 0, "received into the restored arenas"
                assert_weights_are_the_models(workers[me].inst)
            await reqs.finish()

    asyncio.run(main())


@pytest.mark.parametrize("host_copy", [True, False])
def test_weights_no_peer_delivers_come_from_the_host_copy_or_the_checkpoint(host_copy: bool):
    """The sender's link is gone: the receiver stops waiting for it and fills the arenas from its fallback."""
    async def main() -> None:
        net = FakeNetwork()
        svc = net.add("w0")
        inst = PooledInstance(SOURCE, layer_range=(0, NUM_LAYERS), pool_bytes=24 * MIB, page_size=256 * 1024,
                              block_size=16, backend="host", keep_host_copy=host_copy)
        try:
            inst.to_range(0, 2)
            old = [Unit("g", (Member("w0", 0, 2, svc.address), Member("w1", 2, NUM_LAYERS, "w1.test:1")))]
            new = [Unit.single("w0", NUM_LAYERS, svc.address), Unit.single("w1", NUM_LAYERS, "w1.test:1")]
            pieces = weight_pieces(old, new)
            inst.to_range(0, NUM_LAYERS, fill=False)
            rx = WeightReceiver.expecting(svc, inst, "w0", 2, pieces, old, new)  # type: ignore[arg-type]
            assert sorted(rx.missing) == ["2", "3", "group:head"]
            rx.install()
            await rx.receive(timeout_s=30.0)  # w1 is not linked: returns at once
            rx.uninstall()
            rx.finish()
            source = "host" if host_copy else "checkpoint"
            assert list(rx.bytes_by_source) == [source] and rx.bytes_by_source[source] > 0
            assert_weights_are_the_models(inst)
        finally:
            inst.close()

    asyncio.run(main())


def test_abort_after_prepare_resumes_the_old_layout_unchanged():
    async def main() -> None:
        async with cluster() as (_, workers):
            reqs = start_requests(workers)
            await reqs.until_each_has(2)
            old, new = [workers[w].single() for w in sorted(workers)], [group_of(workers)]
            _, prepared = await prepare(workers, 1, "drop", old, new)
            assert all(w.runner.transitioning and w.loop.paused for w in workers.values())
            assert prepared["w0"].kv_blocks_after > prepared["w0"].kv_blocks_now, "a drop frees weights for KV"
            for w in workers.values():
                await w.runner.abort(1)
            for w in workers.values():
                assert not w.runner.transitioning and not w.loop.paused and w.runner.epoch == 0
                assert w.inst.layer_range == (0, NUM_LAYERS) and w.runner.role is None
            await reqs.finish()

    asyncio.run(main())


def test_a_failed_execute_heals_every_member_and_keeps_its_requests():
    async def main() -> None:
        # w0 waits the whole timeout for KV that never comes; every other step of the two workers (an engine
        # call, a send) must fit in it too, on a loaded CI machine: long enough for those, short for the wait
        async with cluster(timeout_s=6.0) as (net, workers):
            reqs = start_requests(workers)
            await reqs.until_each_has(2)
            pause(workers)
            old, new = [workers[w].single() for w in sorted(workers)], [group_of(workers)]
            spec, prepared = await prepare(workers, 1, "drop", old, new)
            net.refused.add(("w1", KV_EXCHANGE))  # w1 cannot send its KV: it fails, w0 waits in vain
            done = await execute(workers, plan(spec, prepared, "drop", old, new))
            assert isinstance(done["w1"], TransferError)
            assert isinstance(done["w0"], TimeoutError)
            for w in workers.values():  # the orchestrator aborts everywhere
                await w.runner.abort(1)
            for w in workers.values():
                assert w.inst.layer_range == (0, NUM_LAYERS) and w.runner.role is None
                assert not w.runner.transitioning and not w.loop.paused and w.runner.epoch == 1
                assert set(w.loop.engine.seqs) <= {f"{w.wid}-r0", f"{w.wid}-r1"}, "each keeps its own (or finished)"
            await reqs.finish()

    asyncio.run(main())


def test_an_expired_lease_aborts_the_prepared_transition_on_its_own():
    async def main() -> None:
        async with cluster() as (_, workers):
            reqs = start_requests(workers)
            await reqs.until_each_has(2)
            old, new = [workers[w].single() for w in sorted(workers)], [group_of(workers)]
            await prepare(workers, 1, "drop", old, new, lease_s=2.0)
            w0 = workers["w0"]
            assert w0.runner.renew(1).expires_in_s == pytest.approx(2.0)
            with pytest.raises(TransitionRefused) as refused:
                w0.runner.renew(2)
            assert refused.value.code == "FAILED_PRECONDITION"
            deadline = time.monotonic() + 60.0
            while any(w.runner.transitioning for w in workers.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            for w in workers.values():
                assert not w.runner.transitioning and not w.loop.paused and w.runner.epoch == 0
                assert w.inst.layer_range == (0, NUM_LAYERS)
            await reqs.finish()

    asyncio.run(main())


@pytest.mark.parametrize("host_copy", [True, False])
def test_losing_the_stage_heals_the_head_to_a_whole_instance(host_copy: bool):
    """The peer that holds the head's missing layers is gone before any restore: the head fills them from its
    host copy, or without one from the checkpoint."""
    async def main() -> None:
        async with cluster(host_copy=host_copy) as (net, workers):
            w0 = workers["w0"]
            reqs = start_requests(workers)
            await reqs.until_each_has(2)
            pause(workers)
            await drop(workers)
            seen = {rid: len(t) for rid, t in reqs.tokens.items()}
            await reqs.until_each_has(min(seen.values()) + 2)
            workers["w1"].loop.stop()  # the stage's process dies
            net.kill("w1")
            await reqs.finish()
            assert w0.runner.role is None and w0.loop.engine.link is None
            assert w0.inst.layer_range == (0, NUM_LAYERS) and w0.loop.engine.serving
            assert_weights_are_the_models(w0.inst)

    asyncio.run(main())


def test_prepare_refuses_what_it_cannot_do():
    async def main() -> None:
        async with cluster(1) as (_, workers):
            w0 = workers["w0"]
            unit = [w0.single()]
            spec = worker_pb2.TransitionSpec(epoch=1, op="drop", old_units=[unit_to_pb(u) for u in unit],
                                             new_units=[unit_to_pb(u) for u in unit])
            cases = [
                (worker_pb2.TransitionSpec(epoch=1, old_units=spec.old_units, new_units=spec.new_units,
                                           lease_s=-1.0), "INVALID_ARGUMENT"),
                (worker_pb2.TransitionSpec(epoch=1, old_units=[unit_to_pb(Unit("x", (Member("x", 0, 4),)))],
                                           new_units=spec.new_units), "INVALID_ARGUMENT"),  # w0 in no old unit
                (worker_pb2.TransitionSpec(epoch=1, old_units=[unit_to_pb(Unit("w0", (w0.member(0, 2),
                                                                                      Member("x", 2, 4))))],
                                           new_units=spec.new_units), "FAILED_PRECONDITION"),  # not its range
            ]
            for bad, code in cases:
                with pytest.raises(TransitionRefused) as refused:
                    await w0.runner.prepare(bad)
                assert refused.value.code == code, refused.value
                assert not w0.runner.transitioning and not w0.loop.paused
            await w0.runner.prepare(spec)
            for again, code in [(spec, "ALREADY_EXISTS"), (worker_pb2.TransitionSpec(epoch=2), "ABORTED")]:
                with pytest.raises(TransitionRefused) as refused:
                    await w0.runner.prepare(again)
                assert refused.value.code == code
            with pytest.raises(TransitionRefused) as refused:
                await w0.runner.commit(1)  # not executed
            assert refused.value.code == "FAILED_PRECONDITION"
            await w0.runner.abort(1)
            assert not w0.runner.transitioning and not w0.loop.paused

    asyncio.run(main())


# -- incremental drops: pairs -> a quad -> pairs -> whole instances ------------------------------------------

def pairs_of(workers: dict[str, Worker]) -> list[Unit]:
    """w0 + w1 and w2 + w3, as two drops of whole instances form them."""
    return [Unit(f"{a}+{b}", (workers[a].member(0, 2), workers[b].member(2, NUM_LAYERS)))
            for a, b in (("w0", "w1"), ("w2", "w3"))]


def quad_of(workers: dict[str, Worker]) -> Unit:
    """The two pairs merged as the planner merges groups: each member keeps half of its old range."""
    members = merged_members([m for u in pairs_of(workers) for m in u.members], NUM_LAYERS)
    return Unit(unit_id_for(m.worker_id for m in members), members)


def with_blocks(unit: Unit, workers: dict[str, Worker]) -> Unit:
    return Unit(unit.unit_id, unit.members, workers[unit.head].loop.engine.allocator.num_blocks)


async def transition(workers: dict[str, Worker], epoch: int, op: str, old: list[Unit],
                     new: list[Unit]) -> dict[str, worker_pb2.TransitionDone]:
    pause(workers)
    spec, prepared = await prepare(workers, epoch, op, old, new)
    done = await execute(workers, plan(spec, prepared, op, old, new))
    assert all(isinstance(d, worker_pb2.TransitionDone) for d in done.values()), done
    await commit(workers, epoch)
    return done  # type: ignore[return-value]


def test_pairs_merge_into_a_quad_mid_decode_and_split_back_step_by_step():
    """Without any host copy: each split pulls the quarter a member gains from the quad member holding it."""
    async def main() -> None:
        async with cluster(4, host_copy=False) as (net, workers):
            reqs = start_requests(workers, per_worker=1, max_tokens=48)
            await reqs.until_each_has(2)
            await transition(workers, 1, "drop", [w.single() for w in workers.values()], pairs_of(workers))
            seen = {rid: len(t) for rid, t in reqs.tokens.items()}
            await reqs.until_each_has(min(seen.values()) + 2)

            quad = quad_of(workers)
            assert quad.worker_ids == ("w0", "w2", "w1", "w3")
            await transition(workers, 2, "drop", [with_blocks(u, workers) for u in pairs_of(workers)], [quad])
            assert [workers[w].inst.layer_range for w in quad.worker_ids] == [(0, 1), (1, 2), (2, 3), (3, 4)]
            head = workers["w0"]
            assert head.runner.role is not None and head.runner.role.is_head and head.runner.members == list(quad.worker_ids)
            assert sorted(head.loop.engine.seqs) == sorted(reqs.tokens), "the quad's head owns every request"
            assert all(not workers[w].loop.engine.seqs and workers[w].runner.role is not None for w in ("w1", "w2", "w3"))
            assert all(workers[w].runner.unit_id == quad.unit_id for w in workers)
            seen = {rid: len(t) for rid, t in reqs.tokens.items()}
            await reqs.until_each_has(min(seen.values()) + 3)  # the quad decodes through four stages

            pairs = list(plan_split(quad, NUM_LAYERS))
            assert [u.worker_ids for u in pairs] == [("w0", "w1"), ("w2", "w3")]
            done = await transition(workers, 3, "restore", [with_blocks(quad, workers)], pairs)
            assert [workers[w].inst.layer_range for w in ("w0", "w1", "w2", "w3")] == [(0, 2), (2, 4), (0, 2), (2, 4)]
            assert all(d.weight_bytes_from_peers > 0 and not d.weight_bytes_from_checkpoint for d in done.values())
            for w in workers.values():
                assert_weights_are_the_models(w.inst)
            assert workers["w0"].loop.engine.seqs and workers["w2"].loop.engine.seqs, "the restore spread the requests"
            seen = {rid: len(t) for rid, t in reqs.tokens.items()}
            await reqs.until_each_has(min(seen.values()) + 2)

            wholes = [u for p in pairs for u in plan_split(p, NUM_LAYERS)]
            done = await transition(workers, 4, "restore", [with_blocks(p, workers) for p in pairs], wholes)
            assert all(w.inst.layer_range == (0, NUM_LAYERS) and w.runner.role is None for w in workers.values())
            assert all(d.weight_bytes_from_peers > 0 and not d.weight_bytes_from_checkpoint for d in done.values())
            for w in workers.values():
                assert_weights_are_the_models(w.inst)
            await reqs.finish()

    asyncio.run(main())


def test_a_failed_merge_of_pairs_heals_every_member_and_keeps_every_request():
    async def main() -> None:
        async with cluster(4, timeout_s=6.0) as (net, workers):
            reqs = start_requests(workers, per_worker=1, max_tokens=32)
            await reqs.until_each_has(2)
            await transition(workers, 1, "drop", [w.single() for w in workers.values()], pairs_of(workers))
            pause(workers)
            old, new = [with_blocks(u, workers) for u in pairs_of(workers)], [quad_of(workers)]
            spec, prepared = await prepare(workers, 2, "drop", old, new)
            assert len(prepared["w0"].seqs) == len(prepared["w2"].seqs) == 2 and not prepared["w1"].seqs
            net.refused.add(("w3", KV_EXCHANGE))  # the second pair's stage cannot send its KV
            done = await execute(workers, plan(spec, prepared, "drop", old, new))
            assert isinstance(done["w3"], TransferError)
            for w in workers.values():  # the orchestrator aborts everywhere
                await w.runner.abort(2)
            for w in workers.values():
                assert w.inst.layer_range == (0, NUM_LAYERS) and w.runner.role is None and not w.runner.transitioning
            assert not workers["w1"].loop.engine.seqs and not workers["w3"].loop.engine.seqs
            await reqs.finish()

    asyncio.run(main())
