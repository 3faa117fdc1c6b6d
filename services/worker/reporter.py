"""Keeps one client stream open to the monitor and sends the worker's stats every interval.

The monitor may start after the worker or restart: the reporter reconnects with capped backoff and
never blocks request serving. The backoff is reset only once a stream actually worked (two reports went
out on it, or it stayed up for STABLE_AFTER_S), so a monitor that accepts connections and drops them at
once is not hammered. Unexpected errors (a failing snapshot, anything that is not a gRPC status) are
logged and retried: the reporter never dies silently; only the cancellation of its task ends it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from kunserve.shared.log import get_logger
from kunserve.shared.rpc import channel
from kunserve.v1 import common_pb2, monitor_pb2_grpc

INITIAL_BACKOFF_S = 0.2
MAX_BACKOFF_S = 2.0
STABLE_AFTER_S = 5.0  # a stream that lived this long worked, whatever ended it


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def report_stats_forever(monitor_address: str, interval_s: float,
                               snapshot: Callable[[], common_pb2.WorkerStats]) -> None:
    log = get_logger()
    backoff = INITIAL_BACKOFF_S
    connected_once = False
    while True:
        sent = 0  # reports gRPC has written: it asks for report n+1 once report n is out
        snapshot_error: BaseException | None = None

        async def stream():
            nonlocal sent, snapshot_error
            while True:
                try:
                    report = snapshot()
                except Exception as exc:  # noqa: BLE001 - end this stream cleanly; logged and retried below
                    snapshot_error = exc
                    return
                yield report
                sent += 1
                await asyncio.sleep(interval_s)

        started = time.monotonic()
        try:
            async with channel(monitor_address) as ch:
                stub = monitor_pb2_grpc.MonitorStub(ch)
                if not connected_once:
                    log.info("stats_stream_opening", monitor=monitor_address)
                connected_once = True
                await stub.ReportStats(stream(), wait_for_ready=True)
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            # gRPC cancels the call itself when the request iterator fails: not our task's end.
            log.warning("stats_stream_cancelled", monitor=monitor_address)
        except grpc.aio.AioRpcError as exc:
            log.debug("stats_stream_lost", monitor=monitor_address, code=exc.code().name, error=exc.details())
        except Exception as exc:  # noqa: BLE001 - reporting must go on whatever broke
            log.warning("stats_stream_error", monitor=monitor_address, error=f"{type(exc).__name__}: {exc}",
                        exc_info=True)
        if snapshot_error is not None:
            log.warning("stats_snapshot_failed", error=f"{type(snapshot_error).__name__}: {snapshot_error}",
                        exc_info=snapshot_error)
        if sent >= 2 or (snapshot_error is None and time.monotonic() - started >= STABLE_AFTER_S):
            backoff = INITIAL_BACKOFF_S
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
