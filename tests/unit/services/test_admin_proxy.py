"""The memory manager's admin proxy to a worker that came up after the layout refresh first failed to reach it.

CI once saw `kunctl memory worker-0` fail with UNAVAILABLE right after the cluster was healthy: the refresh loop
had put the channel into reconnect backoff while the worker was still starting, and a fail-fast call inside the
backoff window reported a healthy worker as unreachable. The worker here is a fake that only answers
GetMemoryMap: the fault injected is the start-up order, not the worker's behaviour.
"""

from __future__ import annotations

import asyncio

import grpc
from helpers import make_config

from kunserve.services.memory_manager.servicer import AdminServicer, MemoryManager
from kunserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc


class MemoryMapOnly(worker_pb2_grpc.WorkerServicer):
    async def GetMemoryMap(self, request, context):
        return worker_pb2.MemoryMap(layer_start=0, layer_end=4)


async def _serve(port: int, register) -> grpc.aio.Server:
    server = grpc.aio.server()
    register(server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def test_admin_reaches_a_worker_that_started_after_failed_refreshes():
    async def scenario():
        cfg = make_config(1)
        mm = MemoryManager(cfg)
        # several failed refreshes: the channel's reconnect backoff grows to its 1 s cap
        for _ in range(6):
            await mm.refresh(timeout=0.3)
            await asyncio.sleep(0.3)
        worker = await _serve(cfg.workers[0].port, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(
            MemoryMapOnly(), s))
        admin = await _serve(cfg.memory_manager.port, lambda s: admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(mm), s))
        try:
            async with grpc.aio.insecure_channel(cfg.memory_manager.address) as ch:
                reply = await admin_pb2_grpc.AdminStub(ch).GetWorkerMemory(
                    admin_pb2.WorkerRef(worker_id=cfg.workers[0].id), timeout=10.0)
            assert (reply.layer_start, reply.layer_end) == (0, 4)
        finally:
            await worker.stop(None)
            await admin.stop(None)
            await mm.close()

    asyncio.run(scenario())


def test_admin_reports_a_worker_that_never_answers_as_unavailable():
    async def scenario():
        cfg = make_config(1)
        mm = MemoryManager(cfg)
        admin = await _serve(cfg.memory_manager.port, lambda s: admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(mm), s))
        try:
            async with grpc.aio.insecure_channel(cfg.memory_manager.address) as ch:
                try:
                    await admin_pb2_grpc.AdminStub(ch).GetWorkerMemory(
                        admin_pb2.WorkerRef(worker_id=cfg.workers[0].id), timeout=10.0)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    assert cfg.workers[0].id in exc.details() and cfg.workers[0].address in exc.details()
                else:
                    raise AssertionError("a worker nobody listens for answered")
        finally:
            await admin.stop(None)
            await mm.close()

    asyncio.run(scenario())
