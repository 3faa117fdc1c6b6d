"""The memory manager's idle split of merged instances (services/memory_manager/tp_placement.py `TPPlacer.split_idle`)
by the cluster's TP mode: in place a merged instance is split once placement sent it nothing for idle_split_s, whether
or not it holds requests (Algorithm 2: rank 0 refuses while they do not fit the whole instances); cold, a busy one is
never split. A refused split (OrchestrationError) is logged and the round goes on with the next instance; the refused
one is asked again after another idle_split_s. The placer's clock is a fake one, the reformer's split a recorder."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from test_tp_reform_orchestration import FakeCluster, FakeWorker, fast_polls, reformer  # noqa: F401  (fast_polls: autouse)

from kunserve.services.memory_manager import tp_placement
from kunserve.services.memory_manager.orchestrator import OrchestrationError
from kunserve.services.memory_manager.tp_placement import TPPlacer
from kunserve.v1 import common_pb2, memory_manager_pb2

pytestmark = pytest.mark.timeout(30)

IDLE_S = 10.0
TP1, TP2 = 1280, 5632
Reply = memory_manager_pb2.PlaceLongRequestReply


class StatsWorker(FakeWorker):
    """A FakeWorker that also answers GetStats: its membership, and `running` requests."""

    running = 0

    async def GetStats(self, request: common_pb2.Empty, timeout: float | None = None) -> common_pb2.WorkerStats:
        return common_pb2.WorkerStats(worker_id=self.worker_id, tp_members=list(self.info.tp_members), num_running=self.running)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Log:
    """The placer's logger: the events it logged, with their fields."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = info


class Setup:
    """Merged instances already formed (rank 0 first in each), every member measured, one placer over them; the
    reformer's split records its asks and, unless `refuse` names the instance, makes its members whole."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mode: str, *instances: tuple[str, ...]) -> None:
        self.cluster = FakeCluster()
        for members in instances:
            for rank, w in enumerate(members):
                fw = StatsWorker(self.cluster, w, tp=members, serving=rank == 0)
                fw.info.kv_tokens_by_degree.update({1: TP1, 2: TP2})
                self.cluster.workers[w], self.cluster.hosts[w] = fw, "h"
        r = reformer(self.cluster)
        r.mode = mode
        self.clock = Clock()
        monkeypatch.setattr(tp_placement, "time", SimpleNamespace(monotonic=self.clock.monotonic))
        self.asked: list[str] = []
        self.fallbacks: list[bool] = []  # cold_fallback of every split asked: only an idle instance may split cold
        self.refuse: set[str] = set()
        monkeypatch.setattr(r, "split", self.split)
        self.placer = TPPlacer(r, idle_split_s=IDLE_S)
        self.log = Log()
        monkeypatch.setattr(self.placer, "log", self.log)

    async def split(self, req: memory_manager_pb2.SplitTPRequest, cold_fallback: bool = True) -> memory_manager_pb2.TPReport:
        self.asked.append(req.worker_id)
        self.fallbacks.append(cold_fallback)
        if req.worker_id in self.refuse:
            raise OrchestrationError("FAILED_PRECONDITION", f"the in-place split of {req.worker_id}'s instance was refused")
        members = list(self.cluster.workers[req.worker_id].info.tp_members)
        for w in members:
            info = self.cluster.workers[w].info
            del info.tp_members[:]
            info.tp_members.append(w)
            info.tp_degree, info.serving = 1, True
        return memory_manager_pb2.TPReport(op="tp-split", members=members, degree=1, completed=True)

    def busy(self, worker_id: str, running: int = 1) -> None:
        worker = self.cluster.workers[worker_id]
        assert isinstance(worker, StatsWorker)
        worker.running = running

    def at(self, t: float) -> list[str]:
        """One split_idle round at t seconds after the start."""
        self.clock.now = 1000.0 + t
        return asyncio.run(self.placer.split_idle())

    def place(self, t: float, tokens: int) -> memory_manager_pb2.PlaceLongRequestReply:
        self.clock.now = 1000.0 + t
        return asyncio.run(self.placer.place(memory_manager_pb2.PlaceLongRequestRequest(request_id="r", tokens=tokens)))


def test_in_place_splits_a_busy_instance_once_idle_split_s_passed_without_placement(monkeypatch):
    s = Setup(monkeypatch, "in-place", ("w0", "w1"))
    s.busy("w0")
    assert s.placer.split_busy
    assert s.at(0) == []  # the spell starts
    assert s.at(IDLE_S - 0.5) == [] and s.asked == []
    assert s.at(IDLE_S) == ["w0"] and s.asked == ["w0"]
    assert s.fallbacks == [False]  # busy: in place or not at all (an instance formed cold must not hand requests over)
    assert [(e, kw["instance"]) for e, kw in s.log.events] == [("tp_idle_split", "w0")]
    assert list(s.cluster.workers["w1"].info.tp_members) == ["w1"]
    assert s.at(2 * IDLE_S + 1) == [] and s.asked == ["w0"]  # whole instances are not split


def test_cold_never_splits_a_busy_instance_but_does_an_idle_one(monkeypatch):
    s = Setup(monkeypatch, "cold", ("w0", "w1"))
    s.busy("w0")
    assert not s.placer.split_busy
    for t in (0, IDLE_S, 3 * IDLE_S, 10 * IDLE_S):
        assert s.at(t) == []
    assert s.asked == []
    s.busy("w0", 0)  # its request ended: the idle spell starts now, not when it was last seen busy
    t0 = 10 * IDLE_S + 1
    assert s.at(t0) == [] and s.at(t0 + IDLE_S - 0.5) == []
    assert s.at(t0 + IDLE_S) == ["w0"] and s.asked == ["w0"]
    assert s.fallbacks == [True]  # idle: a cold split costs nothing


def test_a_placement_restarts_the_idle_spell(monkeypatch):
    s = Setup(monkeypatch, "in-place", ("w0", "w1"))
    s.busy("w0")
    assert s.at(0) == []
    rep = s.place(IDLE_S - 1, 2000)  # longer than a TP1 instance holds: the TP2 instance takes it
    assert rep.action == Reply.ROUTE and rep.worker_id == "w0" and not rep.scale_up.op, rep
    assert s.at(IDLE_S) == [] and s.at(2 * IDLE_S - 1.5) == []
    assert s.asked == []
    assert s.at(2 * IDLE_S - 1) == []  # idle_split_s after the placement: the spell starts only now
    assert s.at(3 * IDLE_S - 1.5) == [] and s.asked == []
    assert s.at(3 * IDLE_S - 1) == ["w0"] and s.asked == ["w0"]


def test_a_refused_split_does_not_stop_the_round_and_is_asked_again_after_another_spell(monkeypatch):
    s = Setup(monkeypatch, "in-place", ("w0", "w1"), ("w2", "w3"))
    s.busy("w0")
    s.busy("w2")
    s.refuse.add("w0")  # its requests do not fit the whole instances yet
    assert s.at(0) == []
    assert s.at(IDLE_S) == ["w0", "w2"]
    assert s.asked == ["w0", "w2"]  # w0 first (refused), then w2 all the same
    assert list(s.cluster.workers["w0"].info.tp_members) == ["w0", "w1"]
    assert list(s.cluster.workers["w2"].info.tp_members) == ["w2"]
    deferred = [kw for e, kw in s.log.events if e == "tp_idle_split_deferred"]
    assert [(kw["instance"], kw["code"]) for kw in deferred] == [("w0", "FAILED_PRECONDITION")]
    assert "refused" in deferred[0]["reason"]
    # w0 serves on, merged: it is asked again once another idle_split_s has passed, not on the next round
    assert s.at(IDLE_S + 1) == [] and s.at(2 * IDLE_S + 0.5) == []
    assert s.asked == ["w0", "w2"]
    s.refuse.clear()
    assert s.at(2 * IDLE_S + 1) == ["w0"] and s.asked == ["w0", "w2", "w0"]
    assert list(s.cluster.workers["w1"].info.tp_members) == ["w1"]
