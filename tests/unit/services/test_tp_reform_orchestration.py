"""The memory manager's tensor-parallel cold re-form (services/memory_manager/tp_reform.py) against fake workers:
TransformTP checks the group before it touches a worker, sends ReformTP to rank 0 first and hands its rendezvous port
to the followers, waits until the new instance serves; a failure heals every member to a whole instance; SplitTP
re-forms rank 0 first and the followers once it has left; a re-form and a drop never overlap (ABORTED)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from kunserve.services.memory_manager import tp_reform
from kunserve.services.memory_manager.orchestrator import OrchestrationError, Orchestrator
from kunserve.services.memory_manager.tp_reform import TPReformer, TPWorker, check_split, check_transform
from kunserve.shared.policy.cluster_layout import LayoutState
from kunserve.shared.policy.membership import Fingerprint
from kunserve.v1 import memory_manager_pb2, worker_pb2

pytestmark = pytest.mark.timeout(30)

L = 4
SHAPE = Fingerprint(num_layers=L, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=704, vocab_size=64)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeWorker:
    """A worker's stub: GetInfo from `info`; ReformTP records the call and, unless `stuck`, the worker comes back
    with the new membership after `restart_polls` GetInfo calls (UNAVAILABLE meanwhile, as while it re-executes)."""

    def __init__(
        self,
        cluster: FakeCluster,
        worker_id: str,
        *,
        kv_blocks: int = 80,
        tp: tuple[str, ...] = (),
        group: tuple[str, ...] = (),
        layers: tuple[int, int] = (0, L),
        serving: bool = True,
    ) -> None:
        self.cluster = cluster
        self.worker_id = worker_id
        self.kv_blocks = kv_blocks
        self.info = worker_pb2.WorkerInfo(
            worker_id=worker_id,
            num_layers_model=L,
            layer_start=layers[0],
            layer_end=layers[1],
            block_size=16,
            kv_blocks_total=kv_blocks if not tp else 2 * kv_blocks,
            group_members=list(group) or [worker_id],
            tp_members=list(tp) or [worker_id],
            tp_degree=len(tp) or 1,
            serving=serving,
        )
        self.fail_reform: grpc.aio.AioRpcError | None = None
        self.stuck = False  # re-forms never finish (a member that never arrives at the rendezvous)
        self.restart_polls = 2
        self._down = 0
        self._next: worker_pb2.WorkerInfo | None = None

    async def GetInfo(self, request, timeout=None, wait_for_ready=None):
        if self._down > 0:
            self._down -= 1
            if self._down == 0 and self._next is not None:
                self.info, self._next = self._next, None
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "restarting")
        if self.stuck and self._next is not None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "waiting at the rendezvous")
        return self.info

    async def ReformTP(self, request: worker_pb2.ReformTPRequest, timeout=None):
        self.cluster.calls.append((self.worker_id, list(request.members), request.rank, request.port, request.host))
        if self.fail_reform is not None:
            raise self.fail_reform
        members = list(request.members)
        nxt = worker_pb2.WorkerInfo()
        nxt.CopyFrom(self.info)
        nxt.ClearField("tp_members")
        nxt.tp_members.extend(members)
        nxt.tp_degree = len(members)
        nxt.serving = request.rank == 0
        nxt.kv_blocks_total = self.kv_blocks * (1 if len(members) == 1 else 2 * len(members) - 2)
        self._next = nxt
        self._down = self.restart_polls if not self.stuck else 10**9
        port = request.port or (5000 if request.rank == 0 else 0)
        return worker_pb2.ReformTPReply(worker_id=self.worker_id, reforming=True, port=port, host="h", handed_over=1)


@dataclass
class FakeCluster:
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)
    layout: LayoutState = field(default_factory=LayoutState)
    calls: list[tuple] = field(default_factory=list)
    shape: Fingerprint | None = SHAPE
    refreshes: int = 0

    def add(self, worker_id: str, host: str = "h", **kw) -> FakeWorker:
        self.workers[worker_id] = FakeWorker(self, worker_id, **kw)
        self.hosts[worker_id] = host
        return self.workers[worker_id]

    @property
    def worker_ids(self) -> list[str]:
        return list(self.workers)

    def worker_stub(self, worker_id: str):
        return self.workers.get(worker_id)

    def worker_host(self, worker_id: str) -> str | None:
        return self.hosts.get(worker_id)

    def model_shape(self) -> Fingerprint | None:
        return self.shape

    async def refresh(self) -> None:
        self.refreshes += 1


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(tp_reform, "POLL_S", 0.01)


def reformer(cluster: FakeCluster, timeout_s: float = 2.0) -> TPReformer:
    return TPReformer(cluster, Orchestrator(cluster, timeout_s), timeout_s)  # type: ignore[arg-type]


def transform(r: TPReformer, ids: list[str], degree: int = 0) -> memory_manager_pb2.TPReport:
    return asyncio.run(r.transform(memory_manager_pb2.TransformTPRequest(worker_ids=ids, degree=degree)))


def refusal(r: TPReformer, ids: list[str], degree: int = 0) -> tuple[str, str]:
    with pytest.raises(OrchestrationError) as e:
        transform(r, ids, degree)
    return e.value.code, str(e.value)


def test_transform_asks_rank0_first_and_hands_its_port_to_the_followers():
    c = FakeCluster()
    for w in ("w0", "w1"):
        c.add(w)
    rep = transform(reformer(c), ["w0", "w1"])
    assert rep.completed and not rep.healed and rep.degree == 2 and list(rep.members) == ["w0", "w1"], rep
    assert c.calls == [("w0", ["w0", "w1"], 0, 0, ""), ("w1", ["w0", "w1"], 1, 5000, "h")]
    assert [(list(i.members), i.kv_blocks, i.kv_tokens) for i in rep.before] == [(["w0"], 80, 1280), (["w1"], 80, 1280)]
    assert [(list(i.members), i.kv_blocks) for i in rep.after] == [(["w0", "w1"], 160)]
    assert rep.port == 5000 and rep.handed_over == 2 and c.refreshes >= 1


def test_transform_checks_the_group_before_touching_a_worker():
    c = FakeCluster()
    c.add("w0")
    c.add("w1")
    c.add("w2")
    c.add("w3")
    c.add("far", host="other")
    c.add("piped", group=("piped", "w9"))
    c.add("dropped", layers=(0, 2))
    c.add("standby", serving=False)
    c.add("tp0", tp=("tp0", "tp1"))
    r = reformer(c)
    assert refusal(r, ["w0", "w1"], 3)[0] == "INVALID_ARGUMENT"
    assert refusal(r, ["w0"], 0)[0] == "INVALID_ARGUMENT"  # a group of one: degree 1
    code, msg = refusal(r, ["w0", "w1"], 4)
    assert code == "INVALID_ARGUMENT" and "4 does not divide the model's 2 KV heads" in msg
    c.shape = None  # the model not known yet: the group size check still applies, rank 0 checks the model
    assert refusal(r, ["w0", "w1", "w2"], 2)[0] == "INVALID_ARGUMENT"
    assert refusal(r, ["w0", "w0"])[0] == "INVALID_ARGUMENT"
    assert refusal(r, ["w0", "nope"]) == (
        "NOT_FOUND",
        "worker_ids: no worker 'nope' (known: dropped, far, piped, standby, tp0, w0, w1, w2, w3)",
    )
    c.workers["w1"].GetInfo = _unreachable  # type: ignore[method-assign]
    assert refusal(r, ["w0", "w1"])[0] == "UNAVAILABLE"
    for other, why in (
        ("piped", "pipeline group"),
        ("dropped", "dropped layers"),
        ("standby", "not serving"),
        ("tp0", "already in tensor-parallel instance tp0"),
        ("far", "spans one host"),
    ):
        code, msg = refusal(r, ["w2", other])
        assert code == "FAILED_PRECONDITION" and why in msg, msg
    assert c.calls == []


async def _unreachable(request, timeout=None, wait_for_ready=None):
    raise rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")


def test_a_failed_member_heals_every_member_to_a_whole_instance():
    c = FakeCluster()
    c.add("w0")
    c.add("w1").fail_reform = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "worker w1 is draining")
    rep = transform(reformer(c), ["w0", "w1"])
    assert not rep.completed and rep.healed, rep
    assert "w1: FAILED_PRECONDITION: worker w1 is draining" in rep.error
    # rank 0 had re-formed as TP2 rank 0: it is re-formed back on its own
    assert c.calls[-1] == ("w0", ["w0"], 0, 0, "")
    assert [list(i.members) for i in rep.after] == [["w0"], ["w1"]]


def test_a_reform_that_never_serves_times_out_and_heals():
    c = FakeCluster()
    c.add("w0")
    c.add("w1")
    c.workers["w1"].stuck = True  # never comes back: its own rendezvous timeout makes it whole again
    rep = transform(reformer(c, timeout_s=0.3), ["w0", "w1"])
    assert not rep.completed and "did not serve within 0.3s" in rep.error
    assert ("w0", ["w0"], 0, 0, "") in c.calls  # rank 0 (formed, alone) is re-formed as a whole instance
    assert not rep.healed and "fall back on their own" in rep.error


def test_split_reforms_rank0_first_then_the_followers():
    c = FakeCluster()
    c.add("w0", tp=("w0", "w1"))
    c.add("w1", tp=("w0", "w1"), serving=False)
    r = reformer(c)
    rep = asyncio.run(r.split(memory_manager_pb2.SplitTPRequest(worker_id="w1")))
    assert rep.completed and rep.op == "tp-split" and rep.degree == 1 and list(rep.members) == ["w0", "w1"], rep
    assert c.calls == [("w0", ["w0"], 0, 0, ""), ("w1", ["w1"], 0, 0, "")]
    assert [(list(i.members), i.kv_blocks) for i in rep.before] == [(["w0", "w1"], 160)]
    assert [(list(i.members), i.kv_blocks) for i in rep.after] == [(["w0"], 80), (["w1"], 80)]
    with pytest.raises(OrchestrationError) as e:
        asyncio.run(r.split(memory_manager_pb2.SplitTPRequest(worker_id="w0")))
    assert e.value.code == "FAILED_PRECONDITION" and "whole instance" in str(e.value)


def test_one_transition_at_a_time():
    c = FakeCluster()
    c.add("w0")
    c.add("w1")
    r = reformer(c)

    async def during_a_drop() -> str:
        async with r.orchestrator._exclusive():
            with pytest.raises(OrchestrationError) as e:
                await r.transform(memory_manager_pb2.TransformTPRequest(worker_ids=["w0", "w1"]))
            return f"{e.value.code}: {e.value}"

    assert asyncio.run(during_a_drop()).startswith("ABORTED: a drop / restore")

    async def drop_during_a_reform() -> str:
        gate = asyncio.Event()
        reform = c.workers["w0"].ReformTP

        async def slow(request, timeout=None):
            await gate.wait()
            return await reform(request, timeout)

        c.workers["w0"].ReformTP = slow  # type: ignore[method-assign]
        running = asyncio.ensure_future(r.transform(memory_manager_pb2.TransformTPRequest(worker_ids=["w0", "w1"])))
        await asyncio.sleep(0.05)
        with pytest.raises(OrchestrationError) as e:
            await r.orchestrator.drop(memory_manager_pb2.DropRequest())
        gate.set()
        assert (await running).completed
        return f"{e.value.code}: {e.value}"

    assert asyncio.run(drop_during_a_reform()) == ("ABORTED: a tensor-parallel re-form is in progress; retry when it has finished")


def test_pure_checks():
    found = {w: TPWorker(w, "h", True, False, (w,), (w,), 0, L, L, 80, 16) for w in ("a", "b", "c", "d")}
    assert check_transform(["a", "b", "c", "d"], 0, list(found), found, None) == 4
    assert check_transform(["a", "b"], 2, list(found), found, SHAPE) == 2
    busy = dict(found, b=TPWorker("b", "h", True, True, ("b",), ("b",), 0, L, L, 80, 16))
    with pytest.raises(OrchestrationError) as e:
        check_transform(["a", "b"], 2, list(busy), busy, SHAPE)
    assert e.value.code == "ABORTED"
    tp = dict(found, a=TPWorker("a", "h", True, False, ("a", "b"), ("a",), 0, L, L, 80, 16))
    assert check_split("a", list(tp), tp) == ("a", "b")
    with pytest.raises(OrchestrationError) as e:
        check_split("x", list(tp), tp)
    assert e.value.code == "NOT_FOUND"
