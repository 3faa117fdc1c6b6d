"""The dispatcher's throttling of merged instances (`dispatcher.elastic_tp`, Gyges Algorithm 2's reduced rate) against
scripted fake workers (real gRPC on loopback): worker-0 heads a TP2 instance (worker-1 its follower) that holds long
requests; worker-2 is a whole instance. Short requests avoid worker-0 while it holds no long request and worker-2 has
room, take it while it holds one, and every way a long request's stream ends releases its hold."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_dispatcher_resume import PROMPT, FakeCluster, assert_one_stream, run

from kunserve import client
from kunserve.v1 import common_pb2

pytestmark = pytest.mark.timeout(60)

LONG = 40  # max_tokens: prompt + LONG needs 3 blocks of 16, more than worker-2's 2


def tp_cluster(on: bool = True) -> FakeCluster:
    fc = FakeCluster(3, route_timeout_s=10.0)
    fc.cfg.dispatcher.elastic_tp = on
    for wid in ("worker-0", "worker-1"):
        st = fc.workers[wid].stats
        st.tp_degree = 2
        st.tp_members[:] = ["worker-0", "worker-1"]
        st.kv_blocks_total = 8
    fc.workers["worker-1"].stats.serving = False  # a follower takes no request of its own
    fc.workers["worker-2"].stats.kv_blocks_total = 2
    return fc


async def until(cond, what: str) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("on", [True, False])
def test_short_requests_avoid_an_idle_merged_instance_while_a_whole_one_has_room(on):
    async def scenario():
        async with tp_cluster(on) as fc:
            await fc.pool.refresh()
            res, events = await fc.generate(PROMPT, 6, rid="short")
            assert_one_stream(res, events, 6)
            # worker-0 is the freest (8 free blocks against 2): only throttling sends the request elsewhere
            assert res.worker_id == ("worker-2" if on else "worker-0")
            req = client.make_request(PROMPT, request_id="offline", max_tokens=6)
            req.request_class = common_pb2.REQUEST_CLASS_OFFLINE
            res = await client.generate(fc.channel, req, timeout=30)
            assert res.worker_id == ("worker-2" if on else "worker-0")
            assert fc.servicer._throttled == (frozenset({"worker-0"}) if on else frozenset())

    run(scenario())


def test_a_full_whole_instance_sends_short_requests_to_the_throttled_one():
    async def scenario():
        async with tp_cluster() as fc:
            fc.workers["worker-2"].stats.kv_blocks_used = 2
            await fc.pool.refresh()
            res, events = await fc.generate(PROMPT, 6, rid="short")
            assert_one_stream(res, events, 6)
            assert res.worker_id == "worker-0"

    run(scenario())


def test_a_merged_instance_holding_a_long_request_takes_short_ones_until_it_ends():
    async def scenario():
        async with tp_cluster() as fc:
            fc.workers["worker-0"].plan = ["slow", "ok"]
            await fc.pool.refresh()
            long = asyncio.create_task(fc.generate(PROMPT, LONG, rid="long"))
            await until(lambda: "long" in fc.workers["worker-0"].active, "the long request runs on worker-0")
            assert fc.servicer._long_held.counts == {"worker-0": 1}
            res, _ = await fc.generate(PROMPT, 6, rid="short-during")
            assert res.worker_id == "worker-0"
            res, events = await long
            assert_one_stream(res, events, LONG)
            assert fc.servicer._long_held.counts == {}
            res, _ = await fc.generate(PROMPT, 6, rid="short-after")
            assert res.worker_id == "worker-2"

    run(scenario())


@pytest.mark.parametrize("ending", ["error", "move", "cancel", "client-gone"])
def test_every_end_of_a_long_requests_stream_releases_its_hold(ending):
    async def scenario():
        async with tp_cluster() as fc:
            w0 = fc.workers["worker-0"]
            w0.plan = {"error": [("error", grpc.StatusCode.INVALID_ARGUMENT)], "move": [("move", 3, "worker-0"), "ok"]}.get(
                ending, ["slow"]
            )
            await fc.pool.refresh()
            if ending == "error":
                with pytest.raises(grpc.aio.AioRpcError):
                    await fc.generate(PROMPT, LONG, rid="long")
            elif ending == "move":
                res, events = await fc.generate(PROMPT, LONG, rid="long")
                assert_one_stream(res, events, LONG)
                assert [c.attach for c in w0.calls] == [False, True]
            else:
                task = asyncio.create_task(fc.generate(PROMPT, LONG, rid="long"))
                await until(lambda: "long" in w0.active, "the long request runs on worker-0")
                assert fc.servicer._long_held.counts == {"worker-0": 1}
                if ending == "cancel":
                    await client.cancel(fc.channel, "long")
                    await task
                else:
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                await until(lambda: "long" not in fc.servicer.records, "the dispatcher let the request go")
            assert fc.servicer._long_held.counts == {}

    run(scenario())
