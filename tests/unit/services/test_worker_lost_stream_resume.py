"""A stream the worker ends as lost (services/worker/servicer.py `_pump`) is forgotten before its status goes out:
grpc's abort() sends the status and only then raises, so the dispatcher may resume the same request on this worker
before the ended stream's generator has finished; that resume must be taken, not refused as ALREADY_EXISTS, and the
ended stream must not close the resumed one's registration."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from worker_servicer_fakes import Aborted, Context, Instance

from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.shared.engine.api import FinishReason, TokenEvent
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import random_weights
from kunserve.v1 import worker_pb2

CFG = TINY_CONFIG.replace(num_layers=1, name="one")


def servicer() -> WorkerServicer:
    """A whole worker whose engine loop is never started: requests are queued, the test emits their events."""
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    ident = WorkerIdentity("w0", "127.0.0.1:1", "one", 1, CFG.vocab_size, 2048, "cpu", "float32")
    return WorkerServicer(ident, loop, Instance())


@pytest.mark.parametrize("reason", [FinishReason.LOST, FinishReason.ERROR])
def test_a_request_ended_as_lost_can_be_resumed_here_while_its_status_goes_out(reason):
    s = servicer()
    resumed: list[object] = []

    class Resuming(Context):
        """The dispatcher's resume arrives while this stream's status is being sent."""

        async def abort(self, code, details, trailing_metadata=()):
            resumed.append(asyncio.ensure_future(first_event(s, "r1-resumed")))
            await asyncio.sleep(0)  # the status on the wire: other RPCs run
            await asyncio.sleep(0)
            await super().abort(code, details)

    async def first_event(srv: WorkerServicer, tag: str) -> str:
        req = worker_pb2.WorkerGenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
        gen = srv.Generate(req, Context())
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        srv.engine.emit(TokenEvent("r1", 7, 0, FinishReason.LENGTH))
        await asyncio.sleep(0)
        ev = await task
        rest = [e async for e in gen]  # the stream ends after its finished event
        return f"{tag}:{ev.token_id}:{len(rest)}"

    async def scenario() -> tuple[grpc.StatusCode, str, bool]:
        req = worker_pb2.WorkerGenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
        gen = s.Generate(req, Resuming())
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        s.engine.emit(TokenEvent("r1", -1, 0, reason, error="gone"))  # as the engine thread delivers it
        with pytest.raises(Aborted) as e:
            await task
        again = await resumed[0]  # type: ignore[misc]
        return e.value.code, again, "r1" in s.streams

    code, again, still_open = asyncio.run(scenario())
    assert code is (grpc.StatusCode.UNAVAILABLE if reason is FinishReason.LOST else grpc.StatusCode.INTERNAL)
    assert again == "r1-resumed:7:0"  # the resumed stream was taken and got its own event, then ended
    assert not still_open  # both streams ended and forgot themselves
