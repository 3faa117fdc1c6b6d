"""The dispatcher's transformation-aware routing (`dispatcher.elastic_tp`) against scripted fake workers and a fake
memory manager (real gRPC on loopback): a request longer than every routable instance's KV asks the memory manager and
goes where it says, waits while told to (asking again), is refused with the cluster's maximum; one that fits some
instance goes there without asking; with the switch off nothing asks."""

from __future__ import annotations

import grpc
import pytest
from test_dispatcher_resume import PROMPT, FakeCluster, assert_one_stream, run

from kunserve.v1 import memory_manager_pb2, memory_manager_pb2_grpc

pytestmark = pytest.mark.timeout(60)

Reply = memory_manager_pb2.PlaceLongRequestReply
LONG = 40  # max_tokens: prompt + LONG exceeds two 16-token blocks


class FakeMemoryManager(memory_manager_pb2_grpc.MemoryManagerServicer):
    """PlaceLongRequest answers `replies` in order (the last repeating); `on_call(n)` runs before answer n."""

    def __init__(self, fc: FakeCluster, replies: list[Reply]) -> None:
        self.fc = fc
        self.replies = replies
        self.calls: list[memory_manager_pb2.PlaceLongRequestRequest] = []
        self.on_call = lambda n: None

    async def PlaceLongRequest(self, request, context):
        self.calls.append(request)
        self.on_call(len(self.calls))
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


async def with_memory_manager(fc: FakeCluster, mm: FakeMemoryManager) -> grpc.aio.Server:
    server = grpc.aio.server()
    memory_manager_pb2_grpc.add_MemoryManagerServicer_to_server(mm, server)
    server.add_insecure_port(fc.cfg.memory_manager.address)
    await server.start()
    return server


def small_workers(fc: FakeCluster, blocks: int = 2) -> None:
    for w in fc.workers.values():
        w.stats.kv_blocks_total = blocks


def elastic(n: int = 2, on: bool = True) -> FakeCluster:
    fc = FakeCluster(n, route_timeout_s=10.0)
    fc.cfg.dispatcher.elastic_tp = on
    return fc


def test_a_long_request_waits_then_goes_where_the_memory_manager_places_it():
    async def scenario():
        fc = elastic()
        mm = FakeMemoryManager(fc, [Reply(action=Reply.WAIT, reason="busy"), Reply(action=Reply.ROUTE, worker_id="worker-1")])

        def scale_up(n: int) -> None:
            if n == 2:  # the scale-up the placement ran: worker-1 now heads an instance that holds it
                fc.workers["worker-1"].stats.kv_blocks_total = 8

        mm.on_call = scale_up
        server = await with_memory_manager(fc, mm)
        try:
            small_workers(fc)
            async with fc:
                await fc.pool.refresh()
                res, events = await fc.generate(PROMPT, LONG, rid="long")
                assert_one_stream(res, events, LONG)
                assert res.worker_id == "worker-1"
                assert [(c.request_id, c.tokens) for c in mm.calls] == [("long", len(PROMPT) + LONG)] * 2
                assert fc.workers["worker-0"].calls == []
                # it fits worker-1 now: the next long request goes there without asking
                res, events = await fc.generate(PROMPT, LONG, rid="long-again")
                assert res.worker_id == "worker-1" and len(mm.calls) == 2
        finally:
            await server.stop(None)

    run(scenario())


def test_a_request_no_layout_holds_is_refused_with_the_maximum():
    async def scenario():
        fc = elastic()
        refuse = Reply(action=Reply.REFUSE, max_tokens=64, reason="the request needs 48 tokens of KV; the most any layout holds is 64")
        mm = FakeMemoryManager(fc, [refuse])
        server = await with_memory_manager(fc, mm)
        try:
            small_workers(fc)
            async with fc:
                await fc.pool.refresh()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await fc.generate(PROMPT, LONG, rid="too-long")
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = e.value.details()
                assert "maximum: 64 KV tokens, i.e. prompt + max_tokens <= 65" in details and f"{len(PROMPT) + LONG} tokens" in details
                assert len(mm.calls) == 1 and all(w.calls == [] for w in fc.workers.values())
                res, events = await fc.generate(PROMPT, 6, rid="short")  # short requests route as before
                assert_one_stream(res, events, 6)
                assert len(mm.calls) == 1
        finally:
            await server.stop(None)

    run(scenario())


def test_an_unreachable_memory_manager_ends_the_wait_at_the_route_timeout():
    async def scenario():
        fc = elastic()
        fc.route_timeout_s = 1.5
        small_workers(fc)
        async with fc:
            await fc.pool.refresh()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fc.generate(PROMPT, LONG, rid="long")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "route_timeout_s" in e.value.details() and "memory manager" in e.value.details()
            assert all(w.calls == [] for w in fc.workers.values())

    run(scenario())


@pytest.mark.parametrize("on", [True, False])
def test_an_instance_that_holds_it_takes_it_without_asking(on):
    async def scenario():
        fc = elastic(on=on)
        mm = FakeMemoryManager(fc, [Reply(action=Reply.REFUSE, max_tokens=1, reason="no")])
        server = await with_memory_manager(fc, mm)
        try:
            small_workers(fc)
            fc.workers["worker-0"].stats.kv_blocks_used = 0  # the freer one is too small
            fc.workers["worker-1"].stats.kv_blocks_total = 8
            fc.workers["worker-1"].stats.kv_blocks_used = 7
            async with fc:
                await fc.pool.refresh()
                res, events = await fc.generate(PROMPT, LONG, rid="long")
                assert_one_stream(res, events, LONG)
                assert mm.calls == []
                # with the switch off the most-free instance is chosen, whatever its capacity (it would refuse)
                assert res.worker_id == ("worker-1" if on else "worker-0")
        finally:
            await server.stop(None)

    run(scenario())


def test_a_request_that_expires_while_its_placed_worker_comes_up_ends_with_the_queue_timeout():
    """Placed on a worker that does not serve yet, the request waits for it; once its queue time runs out it ends with
    the queue timeout's answer (not the route deadline's, much later), and the wait does not poll the worker in a
    tight loop meanwhile."""
    import dataclasses

    async def scenario():
        fc = elastic()
        fc.route_timeout_s = 30.0
        mm = FakeMemoryManager(fc, [Reply(action=Reply.ROUTE, worker_id="worker-1")])
        server = await with_memory_manager(fc, mm)
        try:
            small_workers(fc)
            async with fc:
                await fc.pool.refresh()
                fc.workers["worker-1"].stats.serving = False
                fc.servicer.limits = dataclasses.replace(fc.servicer.limits, queue_timeout_s=0.5)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await fc.generate(PROMPT, LONG, rid="long")
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
                assert fc.workers["worker-1"].stats_calls < 500  # a spinning wait made thousands
        finally:
            await server.stop(None)

    run(scenario())
