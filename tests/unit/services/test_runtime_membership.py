"""Runtime membership at the services' edges, in one process: a worker's ClusterMembership registering with a real
MemoryManager servicer over gRPC (seeds, joins, a different model refused, standby, drain), the layout the others
poll, the dispatcher's WorkerPool and the monitor following that layout, and the autoscaler's loop with a fake
scaler. No worker process runs: the memory manager's GetInfo to the joiners fails, which it treats as "not answering
yet"."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from helpers import make_config
from prometheus_client import CollectorRegistry

from kunserve.services.dispatcher.servicer import WorkerPool
from kunserve.services.memory_manager.autoscaler import Autoscaler
from kunserve.services.memory_manager.scalers import ScalerError
from kunserve.services.memory_manager.servicer import MemoryManager, MemoryManagerServicer
from kunserve.services.monitor.servicer import MonitorServicer
from kunserve.services.worker.cluster_membership import ACTIVE, OUT, STANDBY, ClusterMembership, MembershipRefused
from kunserve.shared.config import AutoscaleSection
from kunserve.shared.policy.membership import Fingerprint, Registration
from kunserve.shared.wire.cluster_state import report_to_pb
from kunserve.v1 import common_pb2, memory_manager_pb2, memory_manager_pb2_grpc

pytestmark = pytest.mark.timeout(60)
MODEL = Fingerprint(
    model_name="tiny", architecture="llama", num_layers=4, hidden_size=256, vocab_size=4096, dtype="float32", checkpoint="embedded seed 0"
)


async def serve_mm(mm: MemoryManager) -> grpc.aio.Server:
    server = grpc.aio.server()
    memory_manager_pb2_grpc.add_MemoryManagerServicer_to_server(MemoryManagerServicer(mm), server)
    server.add_insecure_port(mm.cfg.memory_manager.bind_address)
    await server.start()
    return server


def worker(cfg, wid: str, model: Fingerprint = MODEL, standby: bool = False, seen: list | None = None):
    return ClusterMembership(
        cfg.memory_manager.address,
        wid,
        f"127.0.0.1:{1000 + len(wid)}",
        model,
        [w.id for w in cfg.workers],
        lambda: 128,
        standby=standby,
        on_members=(seen.append if seen is not None else None),
    )


def test_seeds_joiners_standby_and_a_refused_model_through_the_memory_manager():
    async def scenario():
        cfg = make_config(2)
        mm = MemoryManager(cfg)
        server = await serve_mm(mm)
        try:
            seed = worker(cfg, "worker-0")
            await seed.register_until_accepted()
            members: list[frozenset[str]] = []
            joiner = worker(cfg, "worker-2", seen=members)
            await joiner.register_until_accepted()
            assert members[-1] == {"worker-0", "worker-1", "worker-2"}
            assert mm.membership.joined("worker-2")

            other = worker(cfg, "worker-3", model=dataclasses.replace(MODEL, num_layers=8))
            with pytest.raises(MembershipRefused) as refused:
                await other.register_until_accepted()
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "num_layers: 8 (the cluster's: 4)" in str(refused.value)

            spare = worker(cfg, "worker-4", standby=True)
            await spare.register_until_accepted()
            layout = mm.layout_pb()
            assert [s.worker_id for s in layout.standby] == ["worker-4"] and "worker-4" not in mm.membership.ids
            assert mm.standby_ids() == ["worker-4"]
            assert not spare.in_service and "standby" in spare.why_not_serving()
            await spare.activate()
            assert spare.state == ACTIVE and "worker-4" in mm.membership.ids and not mm.standby_ids()
            with pytest.raises(MembershipRefused):
                await spare.activate()  # not a standby worker any more

            spare.start_draining()
            assert not spare.in_service
            await spare.drained(to_standby=True)
            assert spare.state == STANDBY and "worker-4" not in mm.membership.ids
            await spare.register_once()  # its next heartbeat offers it again
            assert mm.standby_ids() == ["worker-4"]

            joiner.start_draining()
            await joiner.drained(to_standby=False)
            assert joiner.state == OUT and "worker-2" not in mm.membership.ids
            for c in (seed, joiner, other, spare):
                await c.close()
        finally:
            await server.stop(None)
            await mm.close()

    asyncio.run(scenario())


def test_a_joiner_waits_while_the_clusters_model_is_not_known():
    async def scenario():
        cfg = make_config(2)
        mm = MemoryManager(cfg)
        server = await serve_mm(mm)
        try:
            joiner = worker(cfg, "worker-2")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await joiner.register_once()
            assert unknown.value.code() == grpc.StatusCode.UNAVAILABLE
            waiting = asyncio.ensure_future(joiner.register_until_accepted())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await worker(cfg, "worker-1").register_until_accepted()
            await asyncio.wait_for(waiting, 10)
            assert mm.membership.joined("worker-2")
            await joiner.close()
        finally:
            await server.stop(None)
            await mm.close()

    asyncio.run(scenario())


def layout(*workers: tuple[str, str, bool], version: int = 2, settled: bool = True) -> memory_manager_pb2.ClusterLayout:
    return memory_manager_pb2.ClusterLayout(
        members_version=version,
        members_settled=settled,
        workers=[memory_manager_pb2.WorkerLayout(worker_id=w, address=a, draining=d) for w, a, d in workers],
    )


def test_the_dispatcher_follows_joins_drains_and_leaves_but_keeps_its_seeds():
    async def scenario():
        cfg = make_config(2)
        pool = WorkerPool(cfg)
        seeds = [(w.id, w.address, False) for w in cfg.workers]
        pool.apply_layout(layout(*seeds, ("worker-2", "127.0.0.1:1", False)))
        assert set(pool.stubs) == {"worker-0", "worker-1", "worker-2"} and not pool.draining
        pool.apply_layout(layout(*seeds, ("worker-2", "127.0.0.1:1", True)))
        assert pool.draining == {"worker-2"}
        pool.apply_layout(layout(seeds[0], version=3))  # worker-1 not answering: a seed stays
        assert set(pool.stubs) == {"worker-0", "worker-1"} and pool.members_version == 3
        pool.apply_layout(layout(*seeds, ("worker-2", "127.0.0.1:2", False)))  # back, elsewhere
        assert pool.addresses["worker-2"] == "127.0.0.1:2"
        await pool.close()

    asyncio.run(scenario())


def test_the_monitor_forgets_a_worker_that_left_and_ignores_its_last_reports():
    from kunserve.shared.policy.cluster import Member, WorkerReport

    monitor = MonitorServicer(stale_after_s=3.0, seeds=["worker-0"])

    def report(wid: str) -> common_pb2.WorkerStats:
        return report_to_pb(WorkerReport(Member(wid, 0, 4), unit_id=wid, unit_members=(wid,), kv_blocks_total=100, timestamp_unix_s=1.0))

    async def stream(*reports):
        for r in reports:
            yield r

    class Context:
        async def abort(self, code, details):
            raise AssertionError(details)

    asyncio.run(monitor.ReportStats(stream(report("worker-0"), report("worker-2")), Context()))

    def seen() -> set[str]:
        return {w.stats.worker_id for w in asyncio.run(monitor.GetClusterStatus(common_pb2.Empty(), None)).workers}

    assert seen() == {"worker-0", "worker-2"}
    monitor.apply_layout(layout(("worker-0", "a:1", False)))
    assert seen() == {"worker-0"}
    asyncio.run(monitor.ReportStats(stream(report("worker-2")), Context()))  # a drained worker's last report
    assert seen() == {"worker-0"}
    monitor.apply_layout(layout(("worker-0", "a:1", False), ("worker-2", "b:1", False)))  # it joined again
    asyncio.run(monitor.ReportStats(stream(report("worker-2")), Context()))
    assert seen() == {"worker-0", "worker-2"}


class FakeScaler:
    name = "fake"

    def __init__(self, fail: ScalerError | None = None) -> None:
        self.fail = fail
        self.asked: list[int] = []

    async def available(self) -> int | None:
        return 1

    async def scale_up(self, count: int) -> list[str]:
        self.asked.append(count)
        if self.fail is not None:
            raise self.fail
        return ["worker-2"]

    async def removable(self, candidates):
        return list(candidates)

    async def scale_down(self, worker_id: str) -> str:
        return "back"

    async def left_over(self) -> list[str]:
        return []


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_autoscaler_asks_on_autoscale_needed_measures_time_to_serving_and_reports_a_refusal():
    async def scenario():
        cfg = make_config(2)
        now = [100.0]
        registry = CollectorRegistry()
        mm = MemoryManager(cfg, registry=registry, clock=lambda: now[0])
        scaler = FakeScaler()
        auto = Autoscaler(mm, scaler, AutoscaleSection(scaler="local", cooldown_s=0.0), clock=lambda: now[0])
        try:
            assert (await auto.tick()).action == "nothing"
            mm.orchestrator.observers[-1].reported(memory_manager_pb2.TransitionReport(op="drop", completed=True, autoscale_needed=True))
            assert auto.needed_since == 100.0
            now[0] = 101.0
            assert (await auto.tick()).action == "scale_up" and scaler.asked == [1]
            assert auto.state_pb().pending == 1 and auto.state_pb().needed
            now[0] = 104.0
            auto.serving("worker-2")
            assert not auto.state_pb().needed and auto.state_pb().pending == 0
            assert sample(registry, "kunserve:autoscale_time_to_serving_seconds_sum") == 4.0
            assert sample(registry, "kunserve:autoscale_scale_ups_total", outcome="served") == 1

            scaler.fail = ScalerError("PERMISSION_DENIED", "the Kubernetes API refused PATCH: HTTP 403")
            auto.reported(memory_manager_pb2.TransitionReport(op="drop", completed=False, autoscale_needed=True))
            now[0] = 110.0
            await auto.tick()
            assert "HTTP 403" in auto.state_pb().last_error and auto.state_pb().pending == 0
            assert sample(registry, "kunserve:autoscale_scale_ups_total", outcome="failed") == 1
            auto.reported(memory_manager_pb2.TransitionReport(op="restore", completed=True))
            assert not auto.state_pb().needed
        finally:
            await mm.close()

    asyncio.run(scenario())


def test_a_restarted_memory_manager_settles_after_the_member_timeout_and_versions_keep_growing():
    """Its membership holds only the seeds until each joined worker's next heartbeat: the layout says it is not
    settled until member_timeout_s passed. Its versions start above every version its predecessor handed out."""

    async def scenario():
        cfg = make_config(2)
        now = [50.0]
        first = MemoryManager(cfg, clock=lambda: now[0], wall_clock=lambda: 1_000.0)
        first.register(Registration("worker-0", cfg.workers[0].address, MODEL, "a"))
        for i in range(3):
            first.register(Registration(f"worker-{2 + i}", f"127.0.0.1:{2000 + i}", MODEL, "x"))
        handed_out = first.membership.version
        await first.close()
        now[0] = 100.0
        second = MemoryManager(cfg, clock=lambda: now[0], wall_clock=lambda: 1_000.5)  # half a second later
        try:
            assert second.membership.version > handed_out
            assert not second.layout_pb().members_settled
            now[0] = 100.0 + cfg.memory_manager.member_timeout_s
            assert second.layout_pb().members_settled
        finally:
            await second.close()

    asyncio.run(scenario())


def test_before_the_layout_settles_a_joined_worker_it_does_not_list_is_kept_and_its_calls_go_on():
    """A memory manager that just restarted does not list worker-2 yet: the dispatcher keeps routing to it. Once
    settled, a worker still missing is gone: no new request goes there, and a call still open to it is not cut (it
    may finish)."""
    from kunserve.v1 import worker_pb2, worker_pb2_grpc

    class Streaming(worker_pb2_grpc.WorkerServicer):
        def __init__(self) -> None:
            self.go_on = asyncio.Event()

        async def Generate(self, request, context):
            yield worker_pb2.WorkerTokenEvent(request_id=request.request_id, token_id=1, index=0)
            await self.go_on.wait()
            yield worker_pb2.WorkerTokenEvent(
                request_id=request.request_id, token_id=2, index=1, finish_reason=common_pb2.FINISH_REASON_LENGTH
            )

    async def scenario():
        cfg = make_config(2)
        server = grpc.aio.server()
        fake = Streaming()
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        pool = WorkerPool(cfg)
        try:
            seeds = [(w.id, w.address, False) for w in cfg.workers]
            pool.apply_layout(layout(*seeds, ("worker-2", address, False)))
            call = pool.stubs["worker-2"].Generate(worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1]))
            got = [await call.read()]
            pool.apply_layout(layout(*seeds, settled=False))  # restarted: worker-2 not re-registered yet
            assert "worker-2" in pool.stubs
            pool.apply_layout(layout(*seeds))  # settled, and still not listed: it left
            assert "worker-2" not in pool.stubs and pool.router.choose() != "worker-2"
            fake.go_on.set()
            got.append(await asyncio.wait_for(call.read(), 10))
            assert [e.token_id for e in got] == [1, 2], "the call open to the worker that left was cut"
            assert await call.code() == grpc.StatusCode.OK
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_before_the_layout_settles_the_monitor_keeps_the_capacity_of_a_joined_worker_it_does_not_list():
    from kunserve.shared.policy.cluster import Member, WorkerReport

    monitor = MonitorServicer(stale_after_s=3.0, seeds=["worker-0"])

    async def stream(*reports):
        for r in reports:
            yield r

    class Context:
        async def abort(self, code, details):
            raise AssertionError(details)

    report = report_to_pb(
        WorkerReport(Member("worker-2", 0, 4), unit_id="worker-2", unit_members=("worker-2",), kv_blocks_total=100, timestamp_unix_s=1.0)
    )
    asyncio.run(monitor.ReportStats(stream(report), Context()))
    monitor.apply_layout(layout(("worker-0", "a:1", False), settled=False))
    assert {w.stats.worker_id for w in asyncio.run(monitor.GetClusterStatus(common_pb2.Empty(), None)).workers} == {"worker-2"}
    monitor.apply_layout(layout(("worker-0", "a:1", False)))
    assert not asyncio.run(monitor.GetClusterStatus(common_pb2.Empty(), None)).workers
