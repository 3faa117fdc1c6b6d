"""The dispatcher's request state machine against scripted in-process fake workers (real gRPC on loopback,
no engine): routing waits, FAILED_PRECONDITION retries, moved requests (attach), resume after a worker
failure, cancel while not on a worker, shutdown refusal, the shared poll.

The fake "model" is deterministic in the whole token sequence, so a resume (re-prefill of prompt + emitted
tokens) must continue with exactly the tokens an undisturbed run produces — the greedy property the
real engine has.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from kunserve import client
from kunserve.cli.launcher import assign_free_ports, with_workers
from kunserve.services.dispatcher.servicer import DispatcherServicer, WorkerPool
from kunserve.shared.config import load_config
from kunserve.shared.rpc import WORKER_END
from kunserve.v1 import common_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def next_token(tokens: list[int]) -> int:
    h = 17
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return 300 + h % 1000


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A worker whose Generate follows `plan`: a list of per-call behaviours, the last one repeating.

    Behaviours: "ok"; ("die", n) UNAVAILABLE after n tokens; ("stop", n) the same, as a worker shutting down
    says it (WORKER_END trailer); ("end", n) ends without a finish event after
    n tokens; ("move", n, wid) moves the request to worker `wid` after n tokens; "refuse"
    FAILED_PRECONDITION before any token; ("error", code) before any token; "slow" (a token per 50 ms).
    """

    def __init__(self, wid: str, cluster: FakeCluster) -> None:
        self.wid = wid
        self.cluster = cluster
        self.plan: list = ["ok"]
        self.calls: list[worker_pb2.WorkerGenerateRequest] = []
        self.cancels: list[str] = []
        self.stats_calls = 0
        self.stats = common_pb2.WorkerStats(worker_id=wid, kv_blocks_total=100, block_size=16, layer_start=0,
                                            layer_end=4, num_layers_model=4, serving=True, group_id=wid)
        self.stats_delay = 0.0
        self.attach_error: grpc.StatusCode | None = None
        self.active: dict[str, asyncio.Event] = {}

    def _behaviour(self):
        return self.plan.pop(0) if len(self.plan) > 1 else self.plan[0]

    async def Generate(self, request, context):
        self.calls.append(request)
        rid = request.request_id
        if request.attach:
            if self.attach_error is not None:
                await context.abort(self.attach_error, f"{self.wid}: attach refused")
            state = self.cluster.moved.pop((self.wid, rid), None)
            if state is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"{self.wid}: nothing to attach for {rid!r}")
            seq, n_prompt, start, max_tokens = state
        else:
            seq, n_prompt, start = list(request.prompt_token_ids), len(request.prompt_token_ids), 0
            max_tokens = request.sampling.max_tokens
        b = self._behaviour()
        kind = b[0] if isinstance(b, tuple) else b
        if kind == "refuse":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.wid} is not serving")
        if kind == "error":
            await context.abort(b[1], f"{self.wid}: bad request")
        cancelled = self.active.setdefault(rid, asyncio.Event())
        try:
            for i in range(start, max_tokens):
                if kind in ("die", "stop", "end", "move") and i - start == b[1]:
                    if kind == "die":
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.wid} crashed")
                    if kind == "stop":  # what a worker that shuts down says to its streams
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.wid} is shutting down",
                                            trailing_metadata=((WORKER_END, "shutdown"),))
                    if kind == "end":
                        return
                    self.cluster.moved[(b[2], rid)] = (seq, n_prompt, i, max_tokens)
                    yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=-1, index=i, moved_to=b[2])
                    return
                if kind == "slow":
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(cancelled.wait(), 0.05)
                if cancelled.is_set():
                    yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=-1, index=i,
                                                      finish_reason=common_pb2.FINISH_REASON_ABORTED)
                    return
                tok = next_token(seq)
                seq.append(tok)
                last = i == max_tokens - 1
                yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=tok, index=i,
                                                  finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)
        finally:
            self.active.pop(rid, None)

    async def Cancel(self, request, context):
        self.cancels.append(request.request_id)
        ev = self.active.get(request.request_id)
        if ev is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such request")
        ev.set()
        return common_pb2.CancelResponse(cancelled=True)

    async def GetStats(self, request, context):
        self.stats_calls += 1
        if self.stats_delay:
            await asyncio.sleep(self.stats_delay)
        return self.stats


class FakeCluster:
    def __init__(self, n: int, route_timeout_s: float = 5.0, max_resumes: int = 3) -> None:
        self.cfg = load_config(None, environ={})
        with_workers(self.cfg, n)
        assign_free_ports(self.cfg)
        self.moved: dict[tuple[str, str], tuple] = {}
        self.workers = {w.id: FakeWorker(w.id, self) for w in self.cfg.workers}
        self.route_timeout_s = route_timeout_s
        self.max_resumes = max_resumes
        self.servers: dict[str, grpc.aio.Server] = {}

    async def start_worker(self, wid: str) -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self.workers[wid], server)
        server.add_insecure_port(next(w.address for w in self.cfg.workers if w.id == wid))
        await server.start()
        self.servers[wid] = server

    async def stop_worker(self, wid: str) -> None:
        await self.servers.pop(wid).stop(None)

    async def __aenter__(self) -> FakeCluster:
        for wid in self.workers:
            await self.start_worker(wid)
        self.pool = WorkerPool(self.cfg)
        self.servicer = DispatcherServicer(self.pool, None, route_timeout_s=self.route_timeout_s,
                                           max_resumes=self.max_resumes)
        self.dispatcher = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.dispatcher)
        port = self.dispatcher.add_insecure_port("127.0.0.1:0")
        await self.dispatcher.start()
        self.address = f"127.0.0.1:{port}"
        await self.pool.wait_for_workers(5.0)
        self.poller = asyncio.create_task(self.pool.poll_forever(0.05))
        self.channel = client.insecure_channel(self.address)
        return self

    async def __aexit__(self, *exc) -> None:
        self.poller.cancel()
        await self.channel.close()
        await self.dispatcher.stop(None)
        await self.pool.close()
        for wid in list(self.servers):
            await self.stop_worker(wid)

    async def generate(self, prompt, max_tokens: int, rid: str = "", **kw):
        events = []
        res = await client.generate(self.channel, client.make_request(prompt, request_id=rid, max_tokens=max_tokens,
                                                                       **kw), timeout=30, on_event=events.append)
        return res, events


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


PROMPT = [5, 6, 7]


def assert_one_stream(res, events, n: int, prompt=PROMPT) -> None:
    assert res.token_ids == reference(prompt, n)
    tokens = [e for e in events if e.token_id >= 0]
    assert [e.index for e in tokens] == list(range(n))
    assert res.finish_reason == "length"
    assert all(e.num_prompt_tokens == len(prompt) for e in events)


def test_plain_request_and_client_errors_pass_through():
    async def scenario():
        async with FakeCluster(2) as fc:
            res, events = await fc.generate(PROMPT, 6)
            assert_one_stream(res, events, 6)
            for w in fc.workers.values():
                w.plan = [("error", grpc.StatusCode.INVALID_ARGUMENT)]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fc.generate(PROMPT, 6)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad request" in e.value.details()

    run(scenario())


@pytest.mark.parametrize("failure", ["die", "end"])
def test_worker_failure_mid_stream_resumes_on_another_worker(failure):
    async def scenario():
        async with FakeCluster(2) as fc:
            fc.workers["worker-0"].stats.kv_blocks_used = 0
            fc.workers["worker-1"].stats.kv_blocks_used = 50  # worker-0 is chosen first
            await fc.pool.refresh()
            fc.workers["worker-0"].plan = [(failure, 4)]
            res, events = await fc.generate(PROMPT, 10)
            assert_one_stream(res, events, 10)
            assert [e.worker_id for e in events if e.token_id >= 0] == ["worker-0"] * 4 + ["worker-1"] * 6
            resumed = fc.workers["worker-1"].calls[-1]
            assert list(resumed.prompt_token_ids) == PROMPT + res.token_ids[:4]
            assert resumed.sampling.max_tokens == 6 and resumed.request_id == res.request_id

    run(scenario())


def test_resumes_are_bounded_and_the_error_names_the_workers():
    async def scenario():
        async with FakeCluster(3, max_resumes=1) as fc:
            for w in fc.workers.values():
                w.plan = [("die", 2)]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fc.generate(PROMPT, 20)
            return e.value

    err = run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 1 resumes" in err.details()
    assert err.details().count("crashed") == 2


def test_a_request_two_workers_died_under_is_not_carried_to_a_third():
    """A poison request (one that crashes the worker running it) costs at most two workers: it is not sent
    to the third, which keeps serving others."""
    async def scenario():
        async with FakeCluster(3) as fc:
            fc.workers["worker-1"].stats.kv_blocks_used = 10  # route order: worker-0, worker-1, then worker-2
            fc.workers["worker-2"].stats.kv_blocks_used = 20
            await fc.pool.refresh()
            fc.workers["worker-0"].plan = [("die", 0)]
            fc.workers["worker-1"].plan = [("die", 2)]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fc.generate(PROMPT, 20)
            third = len(fc.workers["worker-2"].calls)
            res, _ = await fc.generate(PROMPT, 4)  # the survivor serves the next request
            return e.value, third, res

    err, third, res = run(scenario())
    assert err.code() == grpc.StatusCode.INTERNAL and "may be what makes them fail" in err.details()
    assert "worker-0" in err.details() and "worker-1" in err.details()
    assert third == 0 and res.worker_id == "worker-2" and len(res.token_ids) == 4


def test_workers_that_shut_down_under_a_request_are_not_counted_as_crashes():
    async def scenario():
        async with FakeCluster(3) as fc:
            fc.workers["worker-1"].stats.kv_blocks_used = 10
            fc.workers["worker-2"].stats.kv_blocks_used = 20
            await fc.pool.refresh()
            fc.workers["worker-0"].plan = [("stop", 2)]
            fc.workers["worker-1"].plan = [("stop", 2)]
            return await fc.generate(PROMPT, 12)

    res, events = run(scenario())
    assert_one_stream(res, events, 12)
    assert [e.worker_id for e in events] == ["worker-0"] * 2 + ["worker-1"] * 2 + ["worker-2"] * 8


def test_every_worker_dead_fails_fast_naming_them():
    async def scenario():
        async with FakeCluster(2, route_timeout_s=20) as fc:
            fc.workers["worker-0"].plan = [("die", 3)]
            fc.workers["worker-1"].plan = [("die", 0)]
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fc.generate(PROMPT, 20)
            return e.value, time.monotonic() - t0

    err, took = run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and took < 5
    assert "no routable worker" in err.details()
    assert "worker-0" in err.details() and "worker-1" in err.details()


def test_moved_request_attaches_and_continues_without_an_event_for_the_move():
    async def scenario():
        async with FakeCluster(2) as fc:
            fc.workers["worker-1"].stats.kv_blocks_used = 50
            await fc.pool.refresh()
            fc.workers["worker-0"].plan = [("move", 3, "worker-1")]
            res, events = await fc.generate(PROMPT, 8)
            assert_one_stream(res, events, 8)
            assert all(not e.finish_reason for e in events[:-1]) and len(events) == 8
            assert [e.worker_id for e in events] == ["worker-0"] * 3 + ["worker-1"] * 5
            attach = fc.workers["worker-1"].calls[-1]
            assert attach.attach and not attach.prompt_token_ids

    run(scenario())


def test_failed_attach_falls_back_to_resume():
    async def scenario():
        async with FakeCluster(2) as fc:
            fc.workers["worker-1"].stats.kv_blocks_used = 50
            await fc.pool.refresh()
            fc.workers["worker-0"].plan = [("move", 3, "worker-1"), "ok"]
            fc.workers["worker-1"].attach_error = grpc.StatusCode.NOT_FOUND  # lost the moved state
            res, events = await fc.generate(PROMPT, 8)
            assert_one_stream(res, events, 8)
            assert [c.attach for c in fc.workers["worker-1"].calls] == [True]
            # re-prefilled on the most-free routable worker (worker-0 again) with prompt + emitted tokens
            resumed = fc.workers["worker-0"].calls[-1]
            assert not resumed.attach and list(resumed.prompt_token_ids) == PROMPT + res.token_ids[:3]
            assert resumed.sampling.max_tokens == 5

    run(scenario())


def test_refusal_is_retried_on_the_same_worker_after_a_poll():
    async def scenario():
        async with FakeCluster(1) as fc:
            fc.workers["worker-0"].plan = ["refuse", "refuse", "ok"]
            res, events = await fc.generate(PROMPT, 5)
            assert_one_stream(res, events, 5)
            assert len(fc.workers["worker-0"].calls) == 3

    run(scenario())


def test_request_waits_for_a_routable_worker_then_times_out():
    async def scenario():
        async with FakeCluster(2, route_timeout_s=0.6) as fc:
            for w in fc.workers.values():
                w.stats.serving = False  # forming a group: alive, not routable
            await fc.pool.refresh()

            async def later():
                await asyncio.sleep(0.3)
                fc.workers["worker-1"].stats.serving = True

            t0 = time.monotonic()
            flip = asyncio.create_task(later())
            res, events = await fc.generate(PROMPT, 4)
            await flip
            assert time.monotonic() - t0 >= 0.25
            assert_one_stream(res, events, 4)
            assert res.worker_id == "worker-1"

            fc.workers["worker-1"].stats.serving = False
            await fc.pool.refresh()
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fc.generate(PROMPT, 4)
            took = time.monotonic() - t0
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no routable worker" in e.value.details()
            assert "worker-0: not serving" in e.value.details()
            assert 0.5 <= took < 3

    run(scenario())


def test_pending_demand_is_stamped_at_routing_time():
    async def scenario():
        async with FakeCluster(1, route_timeout_s=5) as fc:
            fc.workers["worker-0"].stats.serving = False
            fc.workers["worker-0"].plan = ["slow"]
            await fc.pool.refresh()
            t0 = time.monotonic()
            task = asyncio.create_task(fc.generate(PROMPT, 40, rid="stamp"))
            await asyncio.sleep(0.3)
            fc.workers["worker-0"].stats.serving = True
            while not fc.workers["worker-0"].calls:
                await asyncio.sleep(0.01)
            pend = fc.pool.router._pending["worker-0"].get("stamp")
            if pend is not None:  # a poll taken after routing may already have absorbed it
                assert pend.routed_at >= t0 + 0.25
            await client.cancel(fc.channel, "stamp")
            res, _ = await task
            assert res.finish_reason == "aborted"

    run(scenario())


def test_cancel_while_waiting_for_a_worker_ends_with_aborted():
    async def scenario():
        async with FakeCluster(2, route_timeout_s=20) as fc:
            for w in fc.workers.values():
                w.stats.serving = False
            await fc.pool.refresh()
            task = asyncio.create_task(fc.generate(PROMPT, 4, rid="waiting"))
            while "waiting" not in fc.servicer.records:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            assert await client.cancel(fc.channel, "waiting")
            res, events = await task
            assert time.monotonic() - t0 < 2
            assert res.finish_reason == "aborted" and res.token_ids == []
            assert events[-1].token_id == -1 and events[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
            assert not any(w.calls for w in fc.workers.values())  # never routed afterwards
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.cancel(fc.channel, "waiting")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

    run(scenario())


def test_cancel_on_a_worker_ends_with_the_workers_aborted_event():
    async def scenario():
        async with FakeCluster(1) as fc:
            fc.workers["worker-0"].plan = ["slow"]
            got: list = []
            task = asyncio.create_task(client.generate(
                fc.channel, client.make_request(PROMPT, request_id="running", max_tokens=200), timeout=30,
                on_event=got.append))
            while len(got) < 3:
                await asyncio.sleep(0.01)
            assert await client.cancel(fc.channel, "running")
            res = await task
            assert res.finish_reason == "aborted" and 3 <= len(res.token_ids) < 200
            assert fc.workers["worker-0"].cancels == ["running"]

    run(scenario())


def test_shutdown_refuses_new_requests_and_ends_in_flight_ones():
    async def scenario():
        async with FakeCluster(1) as fc:
            fc.workers["worker-0"].plan = ["slow"]
            got: list = []
            task = asyncio.create_task(client.generate(
                fc.channel, client.make_request(PROMPT, max_tokens=200), timeout=30, on_event=got.append))
            while len(got) < 2:
                await asyncio.sleep(0.01)
            await fc.servicer.shutdown()
            with pytest.raises(grpc.aio.AioRpcError) as e1:
                await task
            with pytest.raises(grpc.aio.AioRpcError) as e2:
                await fc.generate(PROMPT, 3)
            for err in (e1.value, e2.value):
                assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
            assert len(fc.workers["worker-0"].calls) == 1

    run(scenario())


def test_concurrent_waiters_share_one_poll():
    async def scenario():
        async with FakeCluster(2) as fc:
            fc.poller.cancel()
            for w in fc.workers.values():
                w.stats_delay = 0.2
                w.stats_calls = 0
            await asyncio.gather(*(fc.pool.refresh() for _ in range(10)))
            assert [w.stats_calls for w in fc.workers.values()] == [1, 1]
            # a waiter that is cancelled does not cancel the shared poll for the others
            a = asyncio.create_task(fc.pool.refresh())
            b = asyncio.create_task(fc.pool.refresh())
            await asyncio.sleep(0.05)
            a.cancel()
            await b
            assert [w.stats_calls for w in fc.workers.values()] == [2, 2]

    run(scenario())


def test_worker_process_gone_mid_stream_resumes():
    """The worker's server disappears (no status from the worker itself): UNAVAILABLE from the transport."""
    async def scenario():
        async with FakeCluster(2) as fc:
            fc.workers["worker-1"].stats.kv_blocks_used = 50
            await fc.pool.refresh()
            fc.workers["worker-0"].plan = ["slow"]
            fc.workers["worker-1"].plan = ["ok"]
            got: list = []
            task = asyncio.create_task(client.generate(
                fc.channel, client.make_request(PROMPT, max_tokens=60), timeout=30, on_event=got.append))
            while len(got) < 5:
                await asyncio.sleep(0.01)
            await fc.stop_worker("worker-0")
            res = await task
            assert res.token_ids == reference(PROMPT, 60)
            assert res.worker_id == "worker-1"

    run(scenario())


def test_a_poll_sent_before_a_failure_does_not_revive_the_worker():
    async def scenario():
        async with FakeCluster(1) as fc:
            fc.poller.cancel()
            fc.workers["worker-0"].stats_delay = 0.3
            poll = asyncio.create_task(fc.pool.refresh())
            await asyncio.sleep(0.1)
            fc.pool.failed("worker-0")  # a request saw its stream break meanwhile
            await poll
            assert not fc.pool.router.workers["worker-0"].healthy
            await fc.pool.refresh()  # sent after the failure: it answers, so it is alive again
            assert fc.pool.router.workers["worker-0"].healthy

    run(scenario())
