"""The worker's stats reporter against an in-process fake monitor: it survives failing snapshots and
broken streams, backs off while streams fail at once, and only task cancellation ends it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kunserve.cli.launcher import free_port
from kunserve.services.worker.reporter import report_stats_forever
from kunserve.v1 import common_pb2, monitor_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class FakeMonitor(monitor_pb2_grpc.MonitorServicer):
    def __init__(self, reject: bool = False) -> None:
        self.reject = reject
        self.streams = 0
        self.reports: list[common_pb2.WorkerStats] = []

    async def ReportStats(self, request_iterator, context):
        self.streams += 1
        if self.reject:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "go away")
        async for s in request_iterator:
            self.reports.append(s)
        return common_pb2.Empty()


async def serve(monitor: FakeMonitor):
    server = grpc.aio.server()
    monitor_pb2_grpc.add_MonitorServicer_to_server(monitor, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_failing_snapshots_are_retried_and_cancellation_ends_the_task():
    async def scenario():
        monitor = FakeMonitor()
        server, address = await serve(monitor)
        calls = 0

        def snapshot():
            nonlocal calls
            calls += 1
            if calls <= 2:
                raise RuntimeError("engine not ready")
            return common_pb2.WorkerStats(worker_id="w", kv_blocks_total=calls)

        task = asyncio.create_task(report_stats_forever(address, 0.01, snapshot))
        for _ in range(500):
            if len(monitor.reports) >= 3:
                break
            assert not task.done(), task
            await asyncio.sleep(0.01)
        assert len(monitor.reports) >= 3 and monitor.reports[0].worker_id == "w"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_streams_that_fail_at_once_back_off():
    async def scenario():
        monitor = FakeMonitor(reject=True)
        server, address = await serve(monitor)
        task = asyncio.create_task(report_stats_forever(
            address, 0.01, lambda: common_pb2.WorkerStats(worker_id="w")))
        await asyncio.sleep(1.6)
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(None)
        return monitor.streams

    streams = asyncio.run(asyncio.wait_for(scenario(), 30))
    # 0.2 + 0.4 + 0.8 s of backoff: at most 4 attempts in 1.6 s (a reset per attempt would make 8)
    assert 2 <= streams <= 4, streams
