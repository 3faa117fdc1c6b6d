"""Monitor: receives every worker's stats stream and serves the cluster status."""

from __future__ import annotations

import time

import grpc

from kunserve.shared.load import ClusterLoad
from kunserve.shared.log import get_logger
from kunserve.v1 import common_pb2, monitor_pb2_grpc


class MonitorServicer(monitor_pb2_grpc.MonitorServicer):
    def __init__(self, stale_after_s: float) -> None:
        self.load = ClusterLoad(stale_after_s=stale_after_s)
        self.log = get_logger()

    async def ReportStats(self, request_iterator, context: grpc.aio.ServicerContext):
        worker_id = None
        async for stats in request_iterator:
            if not stats.worker_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: must not be empty")
            if stats.kv_blocks_total < 0 or stats.kv_blocks_used < 0 or stats.kv_blocks_used > stats.kv_blocks_total:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"kv_blocks_used/kv_blocks_total: inconsistent ({stats.kv_blocks_used}/{stats.kv_blocks_total})")
            if worker_id is None:
                worker_id = stats.worker_id
                self.log.info("worker_stream_opened", worker=worker_id, address=stats.address)
            self.load.observe(stats, time.monotonic())
        self.log.info("worker_stream_closed", worker=worker_id)
        return common_pb2.Empty()

    async def GetClusterStatus(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        return self.load.status(time.monotonic(), time.time())
