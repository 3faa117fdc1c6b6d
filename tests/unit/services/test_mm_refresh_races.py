"""The memory manager's layout refresh against workers that leave while it asks them (servicer.py
MemoryManager.refresh / refresh_forever): a departed worker's channel closes under a call in flight, and the refresh
must end normally; one failed refresh must not end the loop that keeps the layout and the membership."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers import make_config

from kunserve.services.memory_manager.servicer import MemoryManager
from kunserve.shared.policy.membership import Fingerprint, Registration
from kunserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)
MODEL = Fingerprint(
    model_name="tiny", architecture="llama", num_layers=4, hidden_size=256, vocab_size=4096, dtype="float32", checkpoint="embedded seed 0"
)


class SlowWorker(worker_pb2_grpc.WorkerServicer):
    """A worker whose GetInfo answers after its caller's deadline."""

    async def GetInfo(self, request, context):
        await asyncio.sleep(30)
        return worker_pb2.WorkerInfo()


def test_a_refresh_whose_worker_channel_closes_under_the_call_ends_normally():
    async def scenario() -> list[str]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(SlowWorker(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        cfg = make_config(2)
        mm = MemoryManager(cfg)
        try:
            for w in cfg.workers:
                mm.register(Registration(w.id, w.address, MODEL))
            mm.register(Registration("joined-1", f"127.0.0.1:{port}", MODEL))
            ch = mm._channel("joined-1")
            assert ch is not None
            refresh = asyncio.create_task(mm.refresh(timeout=5.0))
            await asyncio.sleep(0.5)  # its GetInfo to joined-1 is in flight
            await ch.close()  # no grace: the call is cancelled locally, as a close past the grace would
            await asyncio.wait_for(refresh, 10.0)  # raises if the cancellation escaped the refresh
            return mm.membership.ids
        finally:
            await mm.close()
            await server.stop(None)

    assert "joined-1" in asyncio.run(scenario())  # not expired: it merely went unanswered once


def test_one_failed_refresh_does_not_end_the_refresh_loop():
    async def scenario() -> int:
        mm = MemoryManager(make_config(2))
        calls = 0
        original = mm.refresh

        async def flaky(timeout: float = 1.0) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("injected")
            await original(timeout=0.1)

        mm.refresh = flaky  # type: ignore[method-assign]
        loop = asyncio.create_task(mm.refresh_forever(interval_s=0.05))
        try:
            for _ in range(200):
                if calls >= 3:
                    break
                await asyncio.sleep(0.05)
            assert not loop.done()
            return calls
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await mm.close()

    assert asyncio.run(scenario()) >= 3
