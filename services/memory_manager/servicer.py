"""Memory manager: keeps the cluster layout (rebuilt from the workers) and serves the admin port.

kunctl talks only to this service; it proxies cluster status from the monitor so that one admin
port is enough (compose publishes it on localhost only).
"""

from __future__ import annotations

import asyncio

import grpc

from kunserve.shared.config import ClusterConfig
from kunserve.shared.layout import LayoutState
from kunserve.shared.log import get_logger
from kunserve.shared.rpc import insecure_channel
from kunserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, memory_manager_pb2_grpc, monitor_pb2_grpc, worker_pb2_grpc


class MemoryManager:
    """Owns the layout; refreshes it from the workers' GetInfo."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.layout = LayoutState()
        self.log = get_logger()
        self._channels = {w.id: insecure_channel(w.address) for w in cfg.workers}
        self.monitor_channel = insecure_channel(cfg.monitor.address)

    async def refresh(self, timeout: float = 1.0) -> None:
        async def one(worker_id: str) -> None:
            stub = worker_pb2_grpc.WorkerStub(self._channels[worker_id])
            try:
                info = await stub.GetInfo(common_pb2.Empty(), timeout=timeout)
            except grpc.aio.AioRpcError:
                self.layout.mark_unreachable(worker_id)
                return
            try:
                if self.layout.observe(worker_id, info.address, info.layer_start, info.layer_end, info.num_layers_model):
                    self.log.info("layout_changed", worker=worker_id, layers=[info.layer_start, info.layer_end],
                                  epoch=self.layout.epoch)
            except ValueError as exc:
                self.log.error("layout_inconsistent", worker=worker_id, error=str(exc))

        await asyncio.gather(*(one(w) for w in self._channels))

    async def refresh_forever(self, interval_s: float = 1.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        await self.monitor_channel.close()


class MemoryManagerServicer(memory_manager_pb2_grpc.MemoryManagerServicer):
    def __init__(self, mm: MemoryManager) -> None:
        self.mm = mm

    async def GetLayout(self, request, context):
        return self.mm.layout.to_pb()


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, mm: MemoryManager) -> None:
        self.mm = mm

    async def GetStatus(self, request, context):
        out = admin_pb2.AdminStatus(layout=self.mm.layout.to_pb())
        try:
            out.cluster.CopyFrom(await monitor_pb2_grpc.MonitorStub(self.mm.monitor_channel).GetClusterStatus(
                common_pb2.Empty(), timeout=2.0))
        except grpc.aio.AioRpcError as exc:
            out.monitor_error = f"monitor at {self.mm.cfg.monitor.address} unreachable: {exc.code().name}"
        return out
