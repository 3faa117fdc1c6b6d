"""A scale-down's drain when its call fails: the worker finishes a drain it began whatever becomes of the call, and
the memory manager's autoscaler asks the worker (GetInfo) whether it drains instead of leaving it marked draining
for good; a standby pod a refused give-back left over is given back while calm; the layout's last_error clears
once an action succeeds. In one process: a real MemoryManager, the worker side over gRPC as a small fake worker
servicer, or (for the worker's own half) a WorkerServicer over a fake engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers import make_config
from prometheus_client import CollectorRegistry

from kunserve.services.memory_manager.autoscaler import Autoscaler
from kunserve.services.memory_manager.scalers import ScalerError
from kunserve.services.memory_manager.servicer import MemoryManager
from kunserve.services.worker.cluster_membership import ACTIVE, DRAINING, STANDBY, ClusterMembership
from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.shared.config import AutoscaleSection
from kunserve.shared.policy.autoscale import SCALE_DOWN, ScaleDecision
from kunserve.shared.policy.membership import Fingerprint, Registration
from kunserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)
MODEL = Fingerprint(model_name="tiny", architecture="llama", num_layers=4, checkpoint="embedded seed 0")
JOINED = "worker-2"


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Drain fails with `drain_code` (the call's outcome, not the worker's); GetInfo says whether it serves."""

    def __init__(self, drain_code: grpc.StatusCode, serving: bool) -> None:
        self.drain_code = drain_code
        self.serving = serving
        self.drains = 0

    async def Drain(self, request, context):
        self.drains += 1
        await context.abort(self.drain_code, "the call ended without the worker's answer")

    async def GetInfo(self, request, context):
        return worker_pb2.WorkerInfo(worker_id=JOINED, serving=self.serving, group_members=[JOINED])


class FakeScaler:
    name = "fake"

    def __init__(self) -> None:
        self.fail: ScalerError | None = None
        self.left: list[str] = []
        self.given_back: list[str] = []

    async def available(self) -> int | None:
        return 1

    async def scale_up(self, count: int) -> list[str]:
        if self.fail is not None:
            raise self.fail
        return [JOINED]

    async def removable(self, candidates):
        return list(candidates)

    async def scale_down(self, worker_id: str) -> str:
        if self.fail is not None:
            raise self.fail
        self.given_back.append(worker_id)
        return "given back"

    async def left_over(self) -> list[str]:
        return list(self.left)


async def cluster_with_joined_worker(fake: FakeWorker, **section) -> tuple[MemoryManager, Autoscaler, grpc.aio.Server]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = make_config(2)
    mm = MemoryManager(cfg, registry=CollectorRegistry())
    mm.register(Registration("worker-0", cfg.workers[0].address, MODEL, "a"))
    mm.register(Registration(JOINED, f"127.0.0.1:{port}", MODEL, "i2"))
    mm.infos[JOINED] = worker_pb2.WorkerInfo(worker_id=JOINED, serving=True, group_members=[JOINED])
    auto = Autoscaler(mm, FakeScaler(), AutoscaleSection(scaler="local", **{"cooldown_s": 0.0, "drain_timeout_s": 0.0, **section}))
    return mm, auto, server


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED])
def test_a_drain_without_an_answer_from_a_worker_that_still_serves_clears_its_draining_mark(code):
    async def scenario():
        fake = FakeWorker(code, serving=True)
        mm, auto, server = await cluster_with_joined_worker(fake)
        try:
            await auto._scale_down(ScaleDecision(SCALE_DOWN, worker_id=JOINED))
            assert fake.drains == 1 and code.name in auto.last_error
            assert not mm.membership.draining(JOINED), "left marked draining: never routed to, never planned again"
            assert not auto.unsettled
            assert JOINED in [w for w in mm.membership.ids if not mm.membership.draining(w)]
        finally:
            await server.stop(None)
            await mm.close()

    asyncio.run(scenario())


def test_a_worker_draining_on_its_own_keeps_the_mark_until_it_leaves_or_serves_again():
    async def scenario():
        fake = FakeWorker(grpc.StatusCode.DEADLINE_EXCEEDED, serving=False)  # it got the drain and is draining
        mm, auto, server = await cluster_with_joined_worker(fake)
        try:
            await auto._scale_down(ScaleDecision(SCALE_DOWN, worker_id=JOINED))
            assert mm.membership.draining(JOINED) and auto.unsettled == {JOINED}
            await auto.tick()  # asked again: still not serving
            assert mm.membership.draining(JOINED) and auto.unsettled == {JOINED}
            mm.deregister(JOINED, "i2", "drained")  # the drain ended: it left
            await auto.tick()
            assert not auto.unsettled and JOINED not in mm.membership.ids
        finally:
            await server.stop(None)
            await mm.close()

    asyncio.run(scenario())


def test_an_unreachable_worker_is_asked_again_and_cleared_once_it_serves():
    async def scenario():
        fake = FakeWorker(grpc.StatusCode.UNAVAILABLE, serving=False)
        mm, auto, server = await cluster_with_joined_worker(fake)
        try:
            await auto._scale_down(ScaleDecision(SCALE_DOWN, worker_id=JOINED))
            assert mm.membership.draining(JOINED)
            fake.serving = True  # it never drained
            await auto.tick()
            assert not mm.membership.draining(JOINED) and not auto.unsettled
        finally:
            await server.stop(None)
            await mm.close()

    asyncio.run(scenario())


def test_a_left_over_standby_pod_is_given_back_when_calm_and_last_error_clears_on_success():
    async def scenario():
        fake = FakeWorker(grpc.StatusCode.UNAVAILABLE, serving=True)
        mm, auto, server = await cluster_with_joined_worker(fake, scale_down_hold_s=0.0)  # retried at every calm tick
        scaler = auto.scaler
        assert isinstance(scaler, FakeScaler)
        try:
            scaler.fail = ScalerError("ABORTED", "HTTP 409: the scale changed since it was read")
            scaler.left = ["worker-3"]
            decision = await auto.tick()  # calm: no need, no group (no monitor figure: no scale-down is sized)
            assert decision.action == "give_back" and "HTTP 409" in auto.last_error and not scaler.given_back
            scaler.fail = None
            decision = await auto.tick()
            assert decision.action == "give_back" and scaler.given_back == ["worker-3"]
            assert auto.last_action.startswith("give_back worker-3") and auto.state_pb().last_error == ""
        finally:
            await server.stop(None)
            await mm.close()

    asyncio.run(scenario())


# -- the worker's half ---------------------------------------------------------------------------------------------
class Instance:
    layer_range = (0, 4)

    def capacity_for(self, start: int, end: int) -> int:
        return 64


class Context:
    async def abort(self, code, details, trailing_metadata=()):
        raise AssertionError(f"{code}: {details}")


def test_a_drain_whose_call_is_cancelled_still_finishes_and_leaves_to_standby():
    """The memory manager dies (or its deadline passes) mid-drain: grpc cancels the handler. The worker must not stay
    DRAINING (never serving again, and not activatable either): the drain goes on, and it ends in standby."""

    async def scenario():
        identity = WorkerIdentity(JOINED, "127.0.0.1:1", "tiny", 4, 4096, 2048, "cpu", "float32")
        servicer = WorkerServicer(identity, engine_loop=None, instance=Instance())
        cluster = ClusterMembership("127.0.0.1:1", JOINED, identity.address, MODEL, ["worker-0"], lambda: 64)
        servicer.cluster = cluster
        assert cluster.state == ACTIVE
        servicer.streams.open("running")  # a request still running: the drain waits for it
        handler = asyncio.ensure_future(servicer.Drain(worker_pb2.DrainRequest(timeout_s=30.0, to_standby=True), Context()))
        while cluster.state != DRAINING:
            await asyncio.sleep(0.01)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert cluster.state == DRAINING
        servicer.streams.close("running")  # the request finishes
        assert servicer._draining is not None
        finished, handed_over, _ = await asyncio.wait_for(servicer._draining, 20)
        assert (finished, handed_over) == (1, 0)
        assert cluster.state == STANDBY, "the drain stopped with its call: the worker stays draining for good"
        await cluster.close()

    asyncio.run(scenario())
