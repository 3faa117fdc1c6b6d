"""Transformation-aware routing in the memory manager (services/memory_manager/tp_placement.py): the scheduler's inputs
from the workers' GetInfo (measured capacities, one instance per rank 0), and PlaceLongRequest against fake workers:
ROUTE to an instance that holds the request, a scale-up through the re-form path before a ROUTE to the new rank 0,
WAIT while a drop holds the transition lock, REFUSE with the cluster's maximum."""

from __future__ import annotations

import asyncio

import pytest
from test_tp_reform_orchestration import FakeCluster, _unreachable, fast_polls, reformer  # noqa: F401  (fast_polls: autouse)

from kunserve.services.memory_manager.orchestrator import OrchestrationError
from kunserve.services.memory_manager.tp_placement import (
    MeasuredTPMemory,
    PlacementWorker,
    TPPlacer,
    kv_tokens,
    placement_inputs,
)
from kunserve.shared.policy.elastic_tp import ElasticTPScheduler, Refuse, ScaleUp
from kunserve.v1 import memory_manager_pb2

pytestmark = pytest.mark.timeout(30)

TP1, TP2 = 1280, 5632
Reply = memory_manager_pb2.PlaceLongRequestReply


def pw(
    wid: str,
    *,
    tp: tuple[str, ...] = (),
    host: str = "h",
    serving: bool = True,
    whole: bool = True,
    group: tuple[str, ...] = (),
    by_degree: dict[int, int] | None = None,
) -> PlacementWorker:
    return PlacementWorker(
        wid, host, serving, False, whole, tp or (wid,), group or (wid,), 16, {1: TP1, 2: TP2} if by_degree is None else by_degree
    )


def test_inputs_take_the_smallest_measured_capacity_and_one_instance_per_rank0():
    memory, instances = placement_inputs(
        [
            pw("a", tp=("a", "b")),
            pw("b", tp=("a", "b"), serving=False),
            pw("c", by_degree={1: TP1 - 16, 2: TP2}),
            pw("d", whole=False, by_degree={}),
            pw("e", group=("e", "d")),
        ]
    ) or (None, None)
    assert isinstance(memory, MeasuredTPMemory)
    assert (memory.capacity_tokens(1), memory.capacity_tokens(2)) == (TP1 - 16, TP2)
    assert not memory.valid_degree(4)
    with pytest.raises(ValueError, match="no worker measured"):
        memory.capacity_tokens(4)
    assert [(i.members, i.serving, i.used_tokens) for i in instances] == [
        (("a", "b"), True, 0),
        (("c",), True, 0),
        (("d",), False, 0),
        (("e",), False, 0),
    ]


def test_no_measured_tp1_capacity_gives_no_inputs():
    assert placement_inputs([pw("a", by_degree={})]) is None


def test_the_scheduler_over_measured_capacities():
    memory, instances = placement_inputs([pw("a"), pw("b"), pw("c", host="far")]) or (None, [])
    s = ElasticTPScheduler(memory, max_degree=2)
    plan = s.route(4000, instances)
    assert plan == ScaleUp(host="h", instances=("a", "b"), members=("a", "b"), degree=2)
    refused = s.route(TP2 + 16, instances)
    assert isinstance(refused, Refuse) and refused.max_tokens == TP2 and str(TP2) in refused.reason


def test_kv_tokens_counts_what_the_worker_caches():
    assert kv_tokens(17, 16) == 16  # the last sampled token gets no KV
    assert kv_tokens(18, 16) == 32
    assert kv_tokens(1, 16) == 16


def cluster(*ids: str, host: str = "h") -> FakeCluster:
    c = FakeCluster()
    for w in ids:
        c.add(w, host=host).info.kv_tokens_by_degree.update({1: TP1, 2: TP2})
    return c


def place(p: TPPlacer, tokens: int) -> Reply:
    return asyncio.run(p.place(memory_manager_pb2.PlaceLongRequestRequest(request_id="r", tokens=tokens)))


def test_a_long_request_scales_co_located_instances_up_and_routes_to_the_new_rank0():
    c = cluster("w0", "w1")
    rep = place(TPPlacer(reformer(c)), 2000)
    assert rep.action == Reply.ROUTE and rep.worker_id == "w0" and rep.max_tokens == TP2, rep
    assert rep.scale_up.completed and list(rep.scale_up.members) == ["w0", "w1"] and rep.scale_up.degree == 2
    assert [(w, m, r) for w, m, r, _, _ in c.calls] == [("w0", ["w0", "w1"], 0), ("w1", ["w0", "w1"], 1)]
    # the instance now holds it: the next long request goes there without another re-form
    again = place(TPPlacer(reformer(c)), 2000)
    assert again.action == Reply.ROUTE and again.worker_id == "w0" and not again.scale_up.op
    assert len(c.calls) == 2


def test_no_layout_could_hold_it_refuses_with_the_maximum():
    c = cluster("w0", "w1")
    rep = place(TPPlacer(reformer(c)), TP2 + 100)
    assert rep.action == Reply.REFUSE and rep.max_tokens == TP2 and str(TP2) in rep.reason
    assert c.calls == []
    c.workers["w1"].GetInfo = _unreachable  # type: ignore[method-assign]
    rep = place(TPPlacer(reformer(c)), TP1 + 100)  # w1 may be restarting: the maximum is not known, no refusal yet
    assert rep.action == Reply.WAIT and "w1 did not answer" in rep.reason
    alone = cluster("w0")  # one worker: TP1 is the most any layout holds
    rep = place(TPPlacer(reformer(alone)), 2000)
    assert rep.action == Reply.REFUSE and rep.max_tokens == TP1


def test_busy_or_locked_workers_answer_wait():
    c = cluster("w0", "w1")
    c.workers["w1"].info.serving = False  # starting or standby: a layout could hold it, not now
    rep = place(TPPlacer(reformer(c)), 2000)
    assert rep.action == Reply.WAIT and "no host" in rep.reason
    c.workers["w1"].info.serving = True
    r = reformer(c)

    async def during_a_drop() -> Reply:
        async with r.orchestrator._exclusive():
            return await TPPlacer(r).place(memory_manager_pb2.PlaceLongRequestRequest(request_id="r", tokens=2000))

    rep = asyncio.run(during_a_drop())
    assert rep.action == Reply.WAIT and "ABORTED" in rep.reason and c.calls == []


def test_no_measured_capacity_waits_and_bad_tokens_are_refused():
    c = FakeCluster()
    c.add("w0")
    assert place(TPPlacer(reformer(c)), 2000).action == Reply.WAIT
    with pytest.raises(OrchestrationError) as e:
        place(TPPlacer(reformer(c)), 0)
    assert e.value.code == "INVALID_ARGUMENT"


def _ask(placer: TPPlacer, tokens: int) -> memory_manager_pb2.PlaceLongRequestReply:
    return asyncio.run(placer.place(memory_manager_pb2.PlaceLongRequestRequest(request_id="r", tokens=tokens)))


def test_a_merged_instance_is_not_planned_into_a_larger_one():
    """The re-form joins whole instances only: with w0+w1 at TP2, a request that needs TP4 must not plan a scale-up
    that includes them (it would fail on every ask); with four more whole workers it merges those."""
    import dataclasses

    from test_tp_reform_orchestration import SHAPE

    c = FakeCluster()
    c.shape = dataclasses.replace(SHAPE, num_kv_heads=4)
    for w in ("w0", "w1", "w2", "w3"):
        c.add(w).info.kv_tokens_by_degree.update({1: 1280, 2: 5632, 4: 12000})
    assert _ask(TPPlacer(reformer(c)), 2000).worker_id == "w0"
    calls = len(c.calls)
    rep = _ask(TPPlacer(reformer(c)), 8000)
    assert rep.action == memory_manager_pb2.PlaceLongRequestReply.WAIT and len(c.calls) == calls
    for w in ("w4", "w5"):
        c.add(w).info.kv_tokens_by_degree.update({1: 1280, 2: 5632, 4: 12000})
    rep = _ask(TPPlacer(reformer(c)), 8000)
    assert rep.action == memory_manager_pb2.PlaceLongRequestReply.ROUTE and rep.worker_id == "w2", rep.reason


def test_a_failed_scale_up_is_not_retried_on_every_ask():
    import grpc
    from test_tp_reform_orchestration import rpc_error

    c = FakeCluster()
    for w in ("w0", "w1"):
        c.add(w).info.kv_tokens_by_degree.update({1: 1280, 2: 5632})
    c.workers["w1"].fail_reform = rpc_error(grpc.StatusCode.INTERNAL, "nccl init failed")
    placer = TPPlacer(reformer(c, timeout_s=0.5), failure_cooldown_s=600)
    replies = [_ask(placer, 2000) for _ in range(3)]
    assert all(r.action == memory_manager_pb2.PlaceLongRequestReply.WAIT for r in replies)
    assert "not retried" in replies[-1].reason
    assert len([x for x in c.calls if x[0] == "w0" and len(x[1]) == 2]) == 1  # one TP2 ReformTP to rank 0


def test_an_instance_merged_for_a_long_request_splits_back_once_idle():
    import time

    from kunserve.v1 import common_pb2

    c = FakeCluster()
    for w in ("w0", "w1"):
        c.add(w).info.kv_tokens_by_degree.update({1: 1280, 2: 5632})
    busy = {"w0": 1}

    for fw in c.workers.values():
        async def get_stats(request, timeout=None, fw=fw):
            info = await fw.GetInfo(request)
            return common_pb2.WorkerStats(worker_id=fw.worker_id, tp_members=list(info.tp_members),
                                          num_running=busy.get(fw.worker_id, 0))
        fw.GetStats = get_stats  # type: ignore[attr-defined]

    placer = TPPlacer(reformer(c), idle_split_s=0.05)
    assert _ask(placer, 2000).worker_id == "w0"
    assert asyncio.run(placer.split_idle()) == []  # placed just now, and running a request
    time.sleep(0.1)
    asyncio.run(placer.split_idle())
    assert asyncio.run(placer.split_idle()) == []  # still running its request
    busy.clear()
    asyncio.run(placer.split_idle())  # the idle spell starts
    time.sleep(0.1)
    assert asyncio.run(placer.split_idle()) == ["w0"]
    assert c.workers["w0"].info.tp_degree == 1 and c.workers["w1"].info.tp_degree == 1
