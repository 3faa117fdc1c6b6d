"""A worker's side of the tensor-parallel cold re-form: the --tp-* membership (services/worker/tp_member.py TPArgs,
runtime_membership, reform_argv, close_on_exec) and the ReformTP RPC (services/worker/servicer.py): bad requests are
refused with a clear status before anything changes; an accepted one stops routing, hands running requests over with
FAILED_PRECONDITION (the dispatcher resumes them without writing the worker off) and leaves the process to re-execute."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from worker_servicer_fakes import Aborted, Context, Instance

from kunserve.services.worker import servicer as servicer_mod
from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.services.worker.tp_member import TPArgs, TPMembership, close_on_exec, reform_argv, runtime_membership
from kunserve.shared.config import load_config
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import ModelSource, random_weights
from kunserve.v1 import common_pb2, worker_pb2

CFG = TINY_CONFIG.replace(num_layers=1, name="one")





def test_tp_args_check_and_flags():
    TPArgs(("a", "b"), 1, 7000, "h").check("b")
    TPArgs(("a",)).check("a")
    for args, worker, why in (
        (TPArgs(("a", "a"), 0, 1), "a", "named twice"),
        (TPArgs(("a", "b", "c"), 0, 1), "a", "1, 2 or 4"),
        (TPArgs(("a", "b"), 0, 1), "c", "not one of them"),
        (TPArgs(("a", "b"), 0, 1), "b", "member 1"),
        (TPArgs(("a", "b"), 0, 0), "a", "port > 0"),
    ):
        with pytest.raises(ValueError, match=why):
            args.check(worker)
    new = TPArgs(("a", "b"), 1, 7000, "h", 30.0)
    assert new.argv() == ["--tp-members", "a,b", "--tp-rank", "1", "--tp-port", "7000", "--tp-host", "h", "--tp-rendezvous-timeout", "30"]
    old = ["--config", "c.toml", "--worker-id", "b", "--tp-members", "x,b", "--tp-rank=1", "--tp-port", "1"]
    assert reform_argv(old, TPArgs(("b",))) == ["--config", "c.toml", "--worker-id", "b", "--tp-members", "b", "--tp-rank", "0"]


def test_runtime_membership_overrides_the_config():
    cfg = load_config(None, environ={})
    rank0 = cfg.workers[0]
    assert runtime_membership(cfg, rank0.id, TPArgs((rank0.id,))) is None
    m = runtime_membership(cfg, "w1", TPArgs((rank0.id, "w1"), 1, 7000))
    assert m is not None and (m.rank, m.members, m.host, m.port, m.where) == (1, (rank0.id, "w1"), rank0.host, 7000, "--tp-members")
    with pytest.raises(ValueError, match="--tp-host"):
        runtime_membership(cfg, "w1", TPArgs(("elsewhere", "w1"), 1, 7000))


def test_close_on_exec_marks_inheritable_descriptors():
    r, w = os.pipe()
    try:
        os.set_inheritable(w, True)
        assert w in close_on_exec() and not os.get_inheritable(w)
    finally:
        os.close(r)
        os.close(w)


@pytest.fixture
def worker(monkeypatch):
    signals: list[int] = []
    monkeypatch.setattr(servicer_mod.os, "kill", lambda pid, sig: signals.append(sig))
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    loop.start()
    ident = WorkerIdentity("t0", "127.0.0.1:1", "one", 1, CFG.vocab_size, 2048, "cpu", "float32")
    whole = ModelSource("one", CFG, random_weights(CFG, 0))
    servicer = WorkerServicer(ident, loop, Instance(), whole_model=whole)
    yield servicer, signals
    assert loop.stop(5.0)


def reform(servicer: WorkerServicer, members: list[str], rank: int = 0, port: int = 0, host: str = ""):
    async def call():
        reply = await servicer.ReformTP(worker_pb2.ReformTPRequest(members=members, rank=rank, port=port, host=host), Context())
        await asyncio.sleep(2 * servicer_mod.REEXEC_AFTER_S)  # the stop it scheduled
        return reply

    return asyncio.run(call())


def refused(servicer: WorkerServicer, members: list[str], rank: int = 0, port: int = 0) -> Aborted:
    with pytest.raises(Aborted) as e:
        reform(servicer, members, rank, port)
    return e.value


def test_bad_reforms_are_refused_before_anything_changes(worker):
    servicer, signals = worker
    assert refused(servicer, ["t0", "t0"]).code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused(servicer, ["x", "t0"], 0).code is grpc.StatusCode.INVALID_ARGUMENT  # t0 is rank 1
    assert refused(servicer, ["x", "t0"], 1, 0).code is grpc.StatusCode.INVALID_ARGUMENT  # a follower needs the port
    e = refused(servicer, ["t0", "a", "b", "c"])
    assert e.code is grpc.StatusCode.INVALID_ARGUMENT and "does not divide the model's 2 KV heads" in e.details
    servicer.instance.layer_range = (0, 0)
    e = refused(servicer, ["t0", "t1"])
    assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "dropped layers" in e.details
    servicer.instance.layer_range = (0, 1)
    servicer.tp = TPMembership(0, 0, ("t0", "t1"), "127.0.0.1", 1, 30.0, 30.0)
    e = refused(servicer, ["t0", "t2"])
    assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "split it" in e.details
    servicer.tp = None
    assert reform(servicer, ["t0"]).reforming is False  # already a whole instance: nothing to do
    assert servicer.reform is None and servicer.serving and signals == []


def test_an_accepted_reform_stops_routing_and_leaves_to_reexecute(worker):
    servicer, signals = worker
    reply = reform(servicer, ["t0", "t1"])
    assert reply.reforming and reply.port > 0 and reply.host == "127.0.0.1"
    assert servicer.reform == TPArgs(("t0", "t1"), 0, reply.port, "127.0.0.1")
    assert not servicer.serving and signals == [servicer_mod.signal.SIGTERM]
    e = refused(servicer, ["t0"])
    assert e.code is grpc.StatusCode.ABORTED and "re-forming as rank 0 of TP2 (t0, t1)" in e.details
    for call in (
        servicer.DropLayers(worker_pb2.DropLayersRequest(layers=[0]), Context()),
        servicer.PrepareTransition(worker_pb2.TransitionSpec(epoch=1), Context()),
    ):
        with pytest.raises(Aborted) as a:
            asyncio.run(call)
        assert a.value.code is grpc.StatusCode.ABORTED and "re-forming" in a.value.details

    async def generate():
        req = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=1))
        async for _ in servicer.Generate(req, Context()):
            pass

    with pytest.raises(Aborted) as g:
        asyncio.run(generate())
    assert g.value.code is grpc.StatusCode.FAILED_PRECONDITION and "re-forming" in g.value.details


def test_running_requests_are_handed_over_for_a_reform(worker):
    servicer, _ = worker

    async def scenario() -> tuple[Aborted, worker_pb2.ReformTPReply]:
        req = worker_pb2.WorkerGenerateRequest(
            request_id="long", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=100, ignore_eos=True)
        )
        servicer.engine.pause()  # it stays running (queued) until the re-form hands it over

        async def consume() -> Aborted:
            try:
                async for _ in servicer.Generate(req, Context()):
                    pass
            except Aborted as exc:
                return exc
            raise AssertionError("the request finished instead of being handed over")

        running = asyncio.ensure_future(consume())
        while "long" not in servicer.streams:
            await asyncio.sleep(0.01)
        reply = await servicer.ReformTP(worker_pb2.ReformTPRequest(members=["t0", "t1"]), Context())
        return await running, reply

    ended, reply = asyncio.run(scenario())
    assert reply.handed_over == 1 and reply.finished == 0
    assert ended.code is grpc.StatusCode.FAILED_PRECONDITION and "re-forming" in ended.details


def test_a_runtime_membership_that_cannot_form_falls_back_to_a_whole_instance(monkeypatch):
    from kunserve.services.worker import __main__ as worker_main
    from kunserve.services.worker.build import WorkerBuildError
    from kunserve.shared.log import get_logger

    calls: list[TPArgs | None] = []

    def build(cfg, worker_id, runtime=None):
        calls.append(runtime)
        if runtime is None or len(runtime.members) > 1:
            raise WorkerBuildError("--tp-members: cannot form the instance: rendezvous timed out")
        return "whole"

    monkeypatch.setattr(worker_main, "build_worker", build)
    cfg = load_config(None, environ={})
    assert worker_main.build_or_fall_back(cfg, "a", TPArgs(("a", "b"), 0, 7000), get_logger()) == "whole"
    assert calls == [TPArgs(("a", "b"), 0, 7000), TPArgs(("a",))]
    with pytest.raises(WorkerBuildError):  # the configured layout failing is not papered over
        worker_main.build_or_fall_back(cfg, "a", None, get_logger())
