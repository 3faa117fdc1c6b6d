"""A tensor-parallel member's gRPC face (services/worker/servicer.py with a TPMembership): a follower is not serving
and sends requests to rank 0; no member takes a layer drop, a restore or a transition; both report the instance's
degree and members. No process group is formed: the servicer only reads the membership."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from worker_servicer_fakes import Aborted, Context, Instance

from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.services.worker.tp_member import TPMembership
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import random_weights
from kunserve.v1 import common_pb2, worker_pb2

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
MEMBERS = ("t0", "t1")





@pytest.fixture(params=[0, 1], ids=["rank0", "follower"])
def member(request):
    rank = request.param
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    loop.start()
    tp = TPMembership(0, rank, MEMBERS, "127.0.0.1", 1, 30.0, 30.0)
    ident = WorkerIdentity(MEMBERS[rank], "127.0.0.1:1", "one", 1, CFG.vocab_size, 2048, "cpu", "float32")
    yield rank, WorkerServicer(ident, loop, Instance(), tp=tp)
    assert loop.stop(5.0)


def refused(call) -> Aborted:
    with pytest.raises(Aborted) as e:
        asyncio.run(call)
    return e.value


async def generate(servicer: WorkerServicer) -> None:
    req = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=1))
    async for _ in servicer.Generate(req, Context()):
        pass


def test_members_report_the_instance_and_refuse_layout_changes(member):
    rank, servicer = member
    stats = servicer.current_stats()
    assert (stats.tp_degree, list(stats.tp_members)) == (2, list(MEMBERS)) and stats.serving == (rank == 0)
    for call in (
        servicer.DropLayers(worker_pb2.DropLayersRequest(layers=[0]), Context()),
        servicer.RestoreLayers(worker_pb2.RestoreLayersRequest(layers=[0]), Context()),
        servicer.PrepareTransition(worker_pb2.TransitionSpec(epoch=1), Context()),
        servicer.ExecuteTransition(worker_pb2.TransitionSpec(epoch=1), Context()),
    ):
        e = refused(call)
        assert e.code is grpc.StatusCode.FAILED_PRECONDITION
        assert f"rank {rank} of tensor-parallel instance t0 (TP2: t0, t1)" in e.details
        assert "not supported on tensor-parallel instances" in e.details
    if rank == 1:
        e = refused(generate(servicer))
        assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "send requests to t0" in e.details
