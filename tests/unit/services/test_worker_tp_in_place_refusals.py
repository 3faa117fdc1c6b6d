"""A tensor-parallel member's refusals of an in-place ReformTP (services/worker/servicer.py `_reform_in_place`): an
in-place split is FAILED_PRECONDITION on a member formed cold (its pool holds its shard only: the memory manager then
splits cold) and on a follower (it is asked of rank 0, which takes the followers with it); an in-place join of a member
is refused until it is split. A refusal leaves the membership as it was. No process group is formed: the servicer only
reads the membership."""

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
from kunserve.v1 import worker_pb2

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
MEMBERS = ("t0", "t1")


def member(rank: int, *, in_place: bool) -> WorkerServicer:
    """Rank `rank` of the TP2 instance t0 + t1, formed in place or cold; its engine loop is never started."""
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    tp = TPMembership(0, rank, MEMBERS, "127.0.0.1", 1, 30.0, 30.0, in_place=in_place)
    ident = WorkerIdentity(MEMBERS[rank], "127.0.0.1:1", "one", 1, CFG.vocab_size, 2048, "cpu", "float32")
    return WorkerServicer(ident, loop, Instance(), tp=tp, tp_mode="in-place")


def refused(servicer: WorkerServicer, members: list[str], rank: int = 0, port: int = 0) -> Aborted:
    req = worker_pb2.ReformTPRequest(members=members, rank=rank, port=port, in_place=True)
    tp = servicer.tp
    with pytest.raises(Aborted) as e:
        asyncio.run(servicer.ReformTP(req, Context()))
    assert servicer.tp is tp and servicer.reform is None and not servicer.reform_in_place  # nothing changed
    return e.value


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "follower"])
def test_an_in_place_split_of_a_member_formed_cold_is_refused(rank):
    e = refused(member(rank, in_place=False), [MEMBERS[rank]])
    assert e.code is grpc.StatusCode.FAILED_PRECONDITION, e
    assert f"worker {MEMBERS[rank]} is rank {rank} of tensor-parallel instance t0 (TP2: t0, t1), formed cold" in e.details
    assert "kunctl tp-split --cold" in e.details


def test_an_in_place_split_asked_of_a_follower_names_rank0():
    e = refused(member(1, in_place=True), ["t1"])
    assert e.code is grpc.StatusCode.FAILED_PRECONDITION, e
    assert "worker t1 is rank 1 of tensor-parallel instance t0 (TP2: t0, t1)" in e.details
    assert "asked of rank 0 (t0)" in e.details


def test_a_member_joins_another_instance_in_place_only_once_split():
    e = refused(member(0, in_place=True), ["t0", "x"], port=7000)
    assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "split it (kunctl tp-split)" in e.details, e
