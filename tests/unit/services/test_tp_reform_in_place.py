"""The memory manager's in-place tensor-parallel changes (services/memory_manager/tp_reform.py, `mode`) against fake
workers that change in place: TransformTP sends ReformTP{in_place} to rank 0 and then the followers with rank 0's port;
an empty mode is the reformer's (memory_manager.tp_mode) and a bad one INVALID_ARGUMENT; SplitTP in place asks rank 0
alone and waits for every member to serve whole, falls back to the cold split for an instance formed cold (or one
that does not settle in time), and raises FAILED_PRECONDITION without a cold re-form when rank 0 refused and serves
on as the instance."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from test_tp_reform_orchestration import FakeCluster, FakeWorker, fast_polls, rpc_error  # noqa: F401  (fast_polls: autouse)

from kunserve.services.memory_manager.orchestrator import OrchestrationError, Orchestrator
from kunserve.services.memory_manager.tp_reform import TPReformer
from kunserve.v1 import memory_manager_pb2, worker_pb2

pytestmark = pytest.mark.timeout(30)


class InPlaceWorker(FakeWorker):
    """A FakeWorker that also takes ReformTP{in_place}: it answers at once and keeps answering GetInfo (it serves
    on while it changes), showing the new membership after `settle_polls` GetInfo calls. An in-place split is
    refused with FAILED_PRECONDITION when `formed_cold`; otherwise rank 0 stops serving at once and then either takes
    every member with it to whole instances, or (`refuse_split`) serves on as the instance; `never_settles`: an
    in-place change never ends (a cold ReformTP still re-forms it)."""

    def __init__(self, cluster: InPlaceCluster, worker_id: str, **kw) -> None:
        super().__init__(cluster, worker_id, **kw)
        self.in_place_cluster = cluster
        self.formed_cold = False
        self.refuse_split = False
        self.settle_polls = 2
        self.never_settles = False
        self._settle: tuple[int, Callable[[], None]] | None = None

    async def GetInfo(self, request, timeout=None, wait_for_ready=None):
        if self._settle is not None:
            polls, apply = self._settle
            if polls <= 1:
                self._settle = None
                apply()
            else:
                self._settle = (polls - 1, apply)
        return await super().GetInfo(request, timeout, wait_for_ready)

    async def ReformTP(self, request: worker_pb2.ReformTPRequest, timeout=None):
        self.in_place_cluster.modes.append((self.worker_id, request.in_place))
        if not request.in_place:
            self._settle = None
            return await super().ReformTP(request, timeout)
        self.cluster.calls.append((self.worker_id, list(request.members), request.rank, request.port, request.host))
        members = list(request.members)
        if len(members) > 1:
            port = request.port or (5000 if request.rank == 0 else 0)
            self._later(lambda: self._become(members, serving=request.rank == 0))
            return worker_pb2.ReformTPReply(worker_id=self.worker_id, reforming=True, port=port, host="h")
        if self.formed_cold:
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} is rank 0, formed cold")
        instance = list(self.info.tp_members)
        self.info.serving = False  # rank 0 stops serving while the split goes on

        def settle() -> None:
            if self.refuse_split:
                self.info.serving = True
                return
            for w in instance:
                self.in_place_cluster.workers[w]._become([w], serving=True)

        self._later(settle)
        return worker_pb2.ReformTPReply(worker_id=self.worker_id, reforming=True)

    def _later(self, apply: Callable[[], None]) -> None:
        if not self.never_settles:
            self._settle = (self.settle_polls, apply)

    def _become(self, members: list[str], *, serving: bool) -> None:
        self.info.ClearField("tp_members")
        self.info.tp_members.extend(members)
        self.info.tp_degree = len(members)
        self.info.serving = serving
        self.info.kv_blocks_total = self.kv_blocks * len(members)


class InPlaceCluster(FakeCluster):
    """A FakeCluster of InPlaceWorkers; `modes` records (worker id, in_place) of every ReformTP, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[tuple[str, bool]] = []

    def add(self, worker_id: str, host: str = "h", **kw) -> InPlaceWorker:
        worker = InPlaceWorker(self, worker_id, **kw)
        self.workers[worker_id] = worker
        self.hosts[worker_id] = host
        return worker


def reformer(c: InPlaceCluster, mode: str = "cold", timeout_s: float = 2.0) -> TPReformer:
    return TPReformer(c, Orchestrator(c, timeout_s), timeout_s, mode)  # type: ignore[arg-type]


def transform(r: TPReformer, ids: list[str], mode: str = "") -> memory_manager_pb2.TPReport:
    return asyncio.run(r.transform(memory_manager_pb2.TransformTPRequest(worker_ids=ids, mode=mode)))


def split(r: TPReformer, worker_id: str, mode: str = "") -> memory_manager_pb2.TPReport:
    return asyncio.run(r.split(memory_manager_pb2.SplitTPRequest(worker_id=worker_id, mode=mode)))


def whole_pair() -> InPlaceCluster:
    c = InPlaceCluster()
    c.add("w0")
    c.add("w1")
    return c


def tp2_pair() -> InPlaceCluster:
    c = InPlaceCluster()
    c.add("w0", tp=("w0", "w1"))
    c.add("w1", tp=("w0", "w1"), serving=False)
    return c


def test_transform_in_place_asks_every_member_in_place_rank0_first_with_its_port():
    c = whole_pair()
    rep = transform(reformer(c), ["w0", "w1"], "in-place")
    assert rep.completed and not rep.error and rep.mode == "in-place", rep
    assert c.modes == [("w0", True), ("w1", True)]
    assert c.calls == [("w0", ["w0", "w1"], 0, 0, ""), ("w1", ["w0", "w1"], 1, 5000, "h")]
    assert rep.port == 5000 and [list(i.members) for i in rep.after] == [["w0", "w1"]]
    assert c.workers["w0"].info.serving and not c.workers["w1"].info.serving


def test_an_empty_mode_is_the_reformers_default():
    c = whole_pair()
    rep = transform(reformer(c, mode="in-place"), ["w0", "w1"])
    assert rep.completed and rep.mode == "in-place" and c.modes == [("w0", True), ("w1", True)], rep
    c = whole_pair()
    rep = transform(reformer(c, mode="cold"), ["w0", "w1"])
    assert rep.completed and rep.mode == "cold" and c.modes == [("w0", False), ("w1", False)], rep
    c = whole_pair()  # an asked mode wins over the default
    rep = transform(reformer(c, mode="in-place"), ["w0", "w1"], "cold")
    assert rep.mode == "cold" and c.modes == [("w0", False), ("w1", False)], rep


def test_a_bad_mode_is_invalid_argument_naming_the_choices_before_touching_a_worker():
    c = tp2_pair()
    r = reformer(c)
    for run in (lambda: transform(r, ["w0", "w1"], "bogus"), lambda: split(r, "w0", "hot")):
        with pytest.raises(OrchestrationError) as e:
            run()
        assert e.value.code == "INVALID_ARGUMENT" and "cold, in-place" in str(e.value), e.value
    assert "'hot'" in str(e.value)
    assert c.calls == [] and c.modes == []


def test_split_in_place_asks_rank0_alone_and_completes_when_every_member_is_whole():
    c = tp2_pair()
    rep = split(reformer(c), "w1", "in-place")  # any member names the instance
    assert rep.completed and not rep.error and rep.mode == "in-place" and rep.op == "tp-split", rep
    assert c.modes == [("w0", True)] and c.calls == [("w0", ["w0"], 0, 0, "")]  # never a ReformTP to the follower
    assert [list(i.members) for i in rep.before] == [["w0", "w1"]]
    assert [list(i.members) for i in rep.after] == [["w0"], ["w1"]]
    assert all(w.info.tp_degree == 1 and w.info.serving for w in c.workers.values())


def test_split_of_an_instance_formed_cold_falls_back_to_the_cold_split():
    c = tp2_pair()
    c.workers["w0"].formed_cold = True
    rep = split(reformer(c, mode="in-place"), "w0")
    assert rep.completed and rep.mode == "cold", rep
    assert c.modes[0] == ("w0", True) and ("w1", False) in c.modes
    assert all(not in_place for _, in_place in c.modes[1:]), c.modes
    assert [list(i.members) for i in rep.after] == [["w0"], ["w1"]]


def test_without_cold_fallback_an_instance_formed_cold_is_not_split_at_all():
    """The idle split of a busy instance: an instance formed cold would hand its requests over to re-prefill."""
    c = tp2_pair()
    c.workers["w0"].formed_cold = True
    r = reformer(c, mode="in-place")
    with pytest.raises(OrchestrationError) as e:
        asyncio.run(r.split(memory_manager_pb2.SplitTPRequest(worker_id="w0"), cold_fallback=False))
    assert e.value.code == "FAILED_PRECONDITION", e.value
    assert c.modes == [("w0", True)]  # no cold re-form
    assert [list(w.info.tp_members) for w in c.workers.values()] == [["w0", "w1"], ["w0", "w1"]]


def test_split_that_does_not_settle_in_time_falls_back_to_the_cold_split():
    c = tp2_pair()
    c.workers["w0"].never_settles = True  # the in-place split never ends; the cold re-form still brings it back
    rep = split(reformer(c, timeout_s=0.3), "w0", "in-place")
    assert rep.completed and rep.mode == "cold" and "splitting cold" in rep.error, rep
    assert c.modes[0] == ("w0", True) and ("w0", False) in c.modes and ("w1", False) in c.modes


def test_a_refused_split_raises_failed_precondition_and_leaves_the_instance_serving():
    c = tp2_pair()
    c.workers["w0"].refuse_split = True
    with pytest.raises(OrchestrationError) as e:
        split(reformer(c), "w0", "in-place")
    assert e.value.code == "FAILED_PRECONDITION" and "refused" in str(e.value) and "serves on" in str(e.value)
    assert c.modes == [("w0", True)]  # no cold re-form after the refusal
    assert [(list(w.info.tp_members), w.info.serving) for w in c.workers.values()] == [(["w0", "w1"], True), (["w0", "w1"], False)]


def test_another_error_from_rank0_is_raised_with_its_code():
    c = tp2_pair()

    async def aborted_in_place(request: worker_pb2.ReformTPRequest, timeout=None):
        c.modes.append(("w0", request.in_place))
        raise rpc_error(grpc.StatusCode.ABORTED, "worker w0 is in a drop / restore transition")

    c.workers["w0"].ReformTP = aborted_in_place  # type: ignore[method-assign]
    with pytest.raises(OrchestrationError) as e:
        split(reformer(c), "w0", "in-place")
    assert e.value.code == "ABORTED" and "w0: worker w0 is in a drop / restore transition" in str(e.value)
    assert c.modes == [("w0", True)]
