"""What a worker's cold re-form (services/worker/servicer.py ReformTP, tp_member.py, __main__.py) must survive: a
ReformTP call cancelled mid-handover still ends in the re-exec; an activated standby worker re-executes in service;
an exec that fails exits for a supervisor to restart; a runtime membership that cannot form frees its build before the
whole-instance fallback allocates."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import pytest
from worker_servicer_fakes import Aborted, Context, Instance

from kunserve.services.worker import __main__ as worker_main
from kunserve.services.worker import servicer as servicer_mod
from kunserve.services.worker import tp_member
from kunserve.services.worker.build import WorkerBuildError
from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.services.worker.tp_member import EXIT_BROKEN, TPArgs, reform_argv
from kunserve.shared.config import load_config
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.log import get_logger
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import ModelSource, random_weights
from kunserve.shared.rpc import REFORMING
from kunserve.v1 import worker_pb2

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
SETTLE_S = 10.0  # a bound on waiting for what must happen, so that a regression fails instead of hanging





@pytest.fixture
def worker(monkeypatch):
    signals: list[int] = []
    monkeypatch.setattr(servicer_mod.os, "kill", lambda pid, sig: signals.append(sig))
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    loop.start()
    ident = WorkerIdentity("t0", "127.0.0.1:1", "one", 1, CFG.vocab_size, 2048, "cpu", "float32")
    servicer = WorkerServicer(ident, loop, Instance(), whole_model=ModelSource("one", CFG, random_weights(CFG, 0)))
    yield servicer, signals
    assert loop.stop(5.0)


def test_a_reform_call_cancelled_mid_handover_still_reexecutes(worker):
    servicer, signals = worker

    async def scenario() -> None:
        servicer.streams.open("slow")  # a running request whose stream its handler has not closed yet
        call = asyncio.ensure_future(servicer.ReformTP(worker_pb2.ReformTPRequest(members=["t0", "t1"]), Context()))
        while servicer.reform is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # into the handover's wait for the stream to close
        assert not call.done()
        call.cancel()  # the memory manager went away: grpc cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await call
        servicer.streams.close("slow")
        async with asyncio.timeout(SETTLE_S):
            while not signals:
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert signals == [servicer_mod.signal.SIGTERM]  # the graceful stop that ends in the re-exec


def test_a_reform_reexecutes_an_activated_standby_worker_in_service():
    old = ["--config", "c.toml", "--worker-id", "s1", "--standby", "--transfer-port", "7100"]
    assert reform_argv(old, TPArgs(("w0", "s1"), 1, 7000)) == [
        "--config", "c.toml", "--worker-id", "s1", "--transfer-port", "7100",
        "--tp-members", "w0,s1", "--tp-rank", "1", "--tp-port", "7000",
    ]  # fmt: skip


def test_a_failed_exec_exits_for_a_supervisor_to_restart(monkeypatch):
    def execv(path: str, argv: list[str]) -> None:
        raise OSError(7, "Argument list too long")

    monkeypatch.setattr(tp_member.os, "execv", execv)
    monkeypatch.setattr(tp_member, "close_on_exec", lambda: [])
    with pytest.raises(SystemExit) as e:
        tp_member.reexec(["--worker-id", "w0"])
    assert e.value.code == EXIT_BROKEN


class Held:
    """Stands for the failed build's pool and weights."""


def test_the_failed_build_is_freed_before_the_fallback_builds(monkeypatch):
    held: list[weakref.ref] = []
    alive_at_fallback: list[bool] = []

    def build(cfg, worker_id, runtime=None):
        if runtime is not None and len(runtime.members) > 1:
            pool = Held()
            pool.cycle = pool  # only the cycle collector frees it
            held.append(weakref.ref(pool))
            raise WorkerBuildError("--tp-members: cannot form the instance: rendezvous timed out")
        alive_at_fallback.append(held[0]() is not None)
        return "whole"

    monkeypatch.setattr(worker_main, "build_worker", build)
    gc.disable()  # the fallback must not rely on a collection happening to run
    try:
        got = worker_main.build_or_fall_back(load_config(None, environ={}), "a", TPArgs(("a", "b"), 0, 7000), get_logger())
    finally:
        gc.enable()
    assert got == "whole" and alive_at_fallback == [False]


def test_a_polled_worker_stays_up_until_a_poll_saw_it_reforming(worker, monkeypatch):
    servicer, signals = worker
    monkeypatch.setattr(servicer_mod, "REFORM_SEEN_WAIT_S", 60.0)

    async def scenario() -> tuple[bool, bool, bool]:
        before = await servicer.GetStats(None, Context())  # a dispatcher polls this worker
        call = asyncio.ensure_future(servicer.ReformTP(worker_pb2.ReformTPRequest(members=["t0", "t1"]), Context()))
        while servicer.reform is None:
            await asyncio.sleep(0.01)
        for _ in range(5):
            await asyncio.sleep(servicer_mod.DRAIN_POLL_S)
        waited = not call.done() and not signals
        seen = await servicer.GetStats(None, Context())
        reply = await call
        return before.reforming, waited, seen.reforming and reply.reforming

    before, waited, seen = asyncio.run(scenario())
    assert not before and waited and seen


def test_a_request_refused_during_a_reform_says_so_in_a_trailer(worker):
    servicer, _ = worker

    class Recording(Context):
        trailer: tuple = ()

        async def abort(self, code, details, trailing_metadata=()):
            self.trailer = trailing_metadata
            await super().abort(code, details)

    servicer.reform = TPArgs(("t0", "t1"), 0, 7000, "127.0.0.1")
    ctx = Recording()

    async def generate() -> None:
        req = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1, 2])
        async for _ in servicer.Generate(req, ctx):
            pass

    with pytest.raises(Aborted) as e:
        asyncio.run(generate())
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and ctx.trailer == ((REFORMING, "1"),)
