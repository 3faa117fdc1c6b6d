"""Keeps one client stream open to the monitor and sends the worker's stats every interval.

The monitor may start after the worker or restart: the reporter reconnects with capped backoff and
never blocks request serving.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from kunserve.shared.log import get_logger
from kunserve.shared.rpc import insecure_channel
from kunserve.v1 import common_pb2, monitor_pb2_grpc


async def report_stats_forever(monitor_address: str, interval_s: float,
                               snapshot: Callable[[], common_pb2.WorkerStats]) -> None:
    log = get_logger()
    backoff = 0.2
    connected_once = False
    while True:
        async def stream():
            while True:
                yield snapshot()
                await asyncio.sleep(interval_s)

        try:
            async with insecure_channel(monitor_address) as channel:
                stub = monitor_pb2_grpc.MonitorStub(channel)
                if not connected_once:
                    log.info("stats_stream_opening", monitor=monitor_address)
                connected_once = True
                backoff = 0.2
                await stub.ReportStats(stream(), wait_for_ready=True)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            log.debug("stats_stream_lost", monitor=monitor_address, code=exc.code().name, error=exc.details())
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 2.0)
