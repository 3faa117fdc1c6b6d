"""The dispatcher routes by request class (fake workers, real gRPC on loopback): an online request goes to the
most free worker as ever, an offline one to where online work leaves the most room, and the worker is told
its class."""

from __future__ import annotations

from test_dispatcher_resume import PROMPT, FakeCluster, reference, run

from kunserve import client
from kunserve.v1 import common_pb2


def test_offline_requests_go_where_online_work_leaves_room_online_ones_as_ever():
    async def scenario():
        async with FakeCluster(2) as fc:
            busy, idle = fc.workers["worker-0"], fc.workers["worker-1"]
            busy.stats.kv_blocks_used, busy.stats.num_running = 10, 3                 # the freest, but serving online
            idle.stats.kv_blocks_used, idle.stats.num_running, idle.stats.num_offline_running = 40, 2, 2  # offline only
            await fc.pool.refresh()
            online, _ = await fc.generate(PROMPT, 3, rid="on")
            req = client.make_request(PROMPT, request_id="off", max_tokens=3)
            req.request_class = common_pb2.REQUEST_CLASS_OFFLINE
            offline = await client.generate(fc.channel, req, timeout=30)
            return online, offline, busy.calls, idle.calls

    online, offline, busy_calls, idle_calls = run(scenario())
    assert [c.request_id for c in busy_calls] == ["on"] and [c.request_id for c in idle_calls] == ["off"]
    assert idle_calls[0].request_class == common_pb2.REQUEST_CLASS_OFFLINE
    assert online.token_ids == offline.token_ids == reference(PROMPT, 3)
