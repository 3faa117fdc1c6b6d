"""The memory manager's orchestrator (services/memory_manager/orchestrator.py) against a fake cluster: drop,
restore, migrate and the explicit grouping drive Prepare -> Execute -> Commit on the right workers at one
epoch, and a failing step aborts every member. The fake implements `ClusterAccess`; its worker stubs are
plain objects with async methods that record each call and answer worker_pb2 messages (no gRPC, no
processes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from kunserve.services.memory_manager.orchestrator import ClusterAccess, OrchestrationError, Orchestrator
from kunserve.shared.policy.cluster_layout import LayoutState
from kunserve.v1 import memory_manager_pb2, worker_pb2

pytestmark = pytest.mark.timeout(30)

L = 4  # layers of the model
TRANSITION_RPCS = ("PrepareTransition", "ExecuteTransition", "CommitTransition", "AbortTransition")


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def seq(request_id: str, old_unit: str, blocks: list[int], age_s: float = 1.0) -> worker_pb2.SeqState:
    return worker_pb2.SeqState(request_id=request_id, old_unit=old_unit, old_blocks=blocks, age_s=age_s,
                               prompt_token_ids=[1, 2, 3])


@dataclass
class Call:
    worker_id: str
    rpc: str
    request: object


class FakeWorker:
    """One worker's stub: answers what a worker would, records every call in the cluster's shared log, and
    raises the exception set for an RPC in `fail`."""

    def __init__(self, log: list[Call], worker_id: str, *, layers: tuple[int, int] = (0, L), group_id: str = "",
                 members: tuple[str, ...] = (), epoch: int = 1, seqs: tuple[worker_pb2.SeqState, ...] = (),
                 kv_blocks_after: int = 100) -> None:
        self.log = log
        self.worker_id = worker_id
        self.info = worker_pb2.WorkerInfo(
            worker_id=worker_id, num_layers_model=L, layer_start=layers[0], layer_end=layers[1],
            group_id=group_id or worker_id, group_members=list(members) or [worker_id], epoch=epoch,
            transfer_address=f"{worker_id}:7000", serving=not members or members[0] == worker_id)
        self.seqs = list(seqs)
        self.kv_blocks_after = kv_blocks_after
        self.fail: dict[str, BaseException] = {}
        self.gate: dict[str, asyncio.Event] = {}  # an RPC that waits for its event before answering

    async def _record(self, rpc: str, request: object) -> None:
        self.log.append(Call(self.worker_id, rpc, request))
        if rpc in self.gate:
            await self.gate[rpc].wait()
        if rpc in self.fail:
            raise self.fail[rpc]

    async def GetInfo(self, request, timeout=None, wait_for_ready=None):
        await self._record("GetInfo", request)
        return self.info

    async def GetMemoryMap(self, request, timeout=None):
        await self._record("GetMemoryMap", request)
        return worker_pb2.MemoryMap(worker_id=self.worker_id, block_size=16, block_bytes=16 * 256,
                                    layers=[worker_pb2.LayerMemory(layer=i, weight_bytes=1 << 20) for i in range(L)])

    async def PrepareTransition(self, spec, timeout=None, wait_for_ready=None):
        await self._record("PrepareTransition", spec)
        return worker_pb2.TransitionPrepared(worker_id=self.worker_id, seqs=self.seqs,
                                             kv_blocks_after=self.kv_blocks_after, kv_blocks_now=50)

    async def ExecuteTransition(self, spec, timeout=None):
        await self._record("ExecuteTransition", worker_pb2.TransitionSpec.FromString(spec.SerializeToString()))
        return worker_pb2.TransitionDone(worker_id=self.worker_id, epoch=spec.epoch, bytes_sent=1000,
                                         exchange_seconds=0.25, remap_seconds=0.5)

    async def CommitTransition(self, ref, timeout=None):
        await self._record("CommitTransition", ref)
        return worker_pb2.TransitionDone(worker_id=self.worker_id, epoch=ref.epoch, paused_seconds=0.125)

    async def AbortTransition(self, ref, timeout=None):
        await self._record("AbortTransition", ref)
        return worker_pb2.TransitionDone(worker_id=self.worker_id, epoch=ref.epoch)

    async def RenewTransition(self, ref, timeout=None):
        await self._record("RenewTransition", ref)
        return worker_pb2.TransitionLease(epoch=ref.epoch, expires_in_s=1.0)


@dataclass
class FakeCluster:
    """`ClusterAccess` over fake workers; `refresh` only counts."""

    workers: dict[str, FakeWorker] = field(default_factory=dict)
    layout: LayoutState = field(default_factory=LayoutState)
    log: list[Call] = field(default_factory=list)
    refreshes: int = 0

    def add(self, worker_id: str, **kw) -> FakeWorker:
        self.workers[worker_id] = FakeWorker(self.log, worker_id, **kw)
        return self.workers[worker_id]

    @property
    def worker_ids(self) -> list[str]:
        return list(self.workers)

    def worker_stub(self, worker_id: str) -> FakeWorker | None:
        return self.workers.get(worker_id)

    async def refresh(self) -> None:
        self.refreshes += 1

    def calls(self, rpc: str) -> list[Call]:
        return [c for c in self.log if c.rpc == rpc]

    def transition_calls(self) -> list[tuple[str, str]]:
        return [(c.rpc, c.worker_id) for c in self.log if c.rpc in TRANSITION_RPCS]


def orchestrator(cluster: ClusterAccess, lease_s: float = 5.0) -> Orchestrator:
    return Orchestrator(cluster, timeout_s=5.0, lease_s=lease_s)


def run(coro):
    return asyncio.run(coro)


def wholes(*ids: str, epoch: int = 3, layout_epoch: int = 2) -> FakeCluster:
    c = FakeCluster(layout=LayoutState(epoch=layout_epoch))
    for w in ids:
        c.add(w, epoch=epoch)
    return c


def paired(layout_epoch: int = 5) -> FakeCluster:
    """w0 + w1 a pipeline group (w0 the head, owning two requests), w2 whole."""
    c = FakeCluster(layout=LayoutState(epoch=layout_epoch))
    members = ("w0", "w1")
    c.add("w0", layers=(0, 2), group_id="w0+w1", members=members, epoch=5, kv_blocks_after=10,
          seqs=(seq("r1", "w0+w1", [4, 5, 6]), seq("r2", "w0+w1", [0])))
    c.add("w1", layers=(2, 4), group_id="w0+w1", members=members, epoch=5, kv_blocks_after=10)
    c.add("w2", epoch=3)
    return c


def transition_epochs(c: FakeCluster) -> set[int]:
    return {call.request.epoch for call in c.log if call.rpc in TRANSITION_RPCS}


def unit_ids(units) -> list[str]:
    return [u.unit_id for u in units]


def ranges(unit) -> list[tuple[str, int, int]]:
    return [(m.worker_id, m.layer_start, m.layer_end) for m in unit.members]


# -- drop ---------------------------------------------------------------------------------------------------


def test_a_drop_prepares_executes_and_commits_the_merged_unit_at_one_epoch():
    c = wholes("w0", "w1", "w2")
    c.workers["w0"].seqs = [seq("r1", "w0", [0, 1])]
    c.workers["w0"].kv_blocks_after = 50
    c.workers["w1"].seqs = [seq("r2", "w1", [0])]
    c.workers["w1"].kv_blocks_after = 40

    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))

    assert report.completed and not report.rolled_back, report.error
    # only the merged unit's members transition, each step on all of them before the next one starts
    assert c.transition_calls() == [("PrepareTransition", "w0"), ("PrepareTransition", "w1"),
                                    ("ExecuteTransition", "w0"), ("ExecuteTransition", "w1"),
                                    ("CommitTransition", "w0"), ("CommitTransition", "w1")]
    assert transition_epochs(c) == {4}  # one past the newest epoch any worker reports
    prepare = c.calls("PrepareTransition")[0].request
    assert prepare.op == "drop" and prepare.lease_s == 5.0
    assert unit_ids(prepare.old_units) == ["w0", "w1"]
    assert [ranges(u) for u in prepare.new_units] == [[("w0", 0, 2), ("w1", 2, 4)]]
    assert [m.transfer_address for m in prepare.new_units[0].members] == ["w0:7000", "w1:7000"]
    execute = c.calls("ExecuteTransition")[0].request
    assert unit_ids(execute.new_units) == ["w0+w1"] and execute.new_units[0].kv_blocks == 40  # min over members
    moved = {s.request_id: (s.new_unit, list(s.new_blocks)) for s in execute.seqs}
    assert moved == {"r1": ("w0+w1", [0, 1]), "r2": ("w0+w1", [2])}  # the head's request keeps its ids
    assert report.epoch == 4 and c.layout.epoch == 4 and c.refreshes == 1
    assert report.requests_moved == 2 and report.kv_bytes_moved == 2000
    assert report.exchange_seconds == 0.25 and report.remap_seconds == 0.5
    assert [g.group_id for g in report.groups] == ["w0+w1"] and not report.autoscale_needed


def test_a_drop_with_nothing_to_merge_touches_no_worker():
    c = paired()
    c.workers.pop("w2")
    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert not report.completed and report.autoscale_needed and "no drop plan" in report.error
    assert c.transition_calls() == [] and report.epoch == 5


def test_a_failing_execute_aborts_every_member_and_reports_the_error():
    c = wholes("w0", "w1", "w2")
    c.workers["w0"].seqs = [seq("r1", "w0", [0])]
    c.workers["w1"].fail["ExecuteTransition"] = rpc_error(grpc.StatusCode.INTERNAL, "kv exchange broke")

    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))

    assert not report.completed and report.rolled_back
    assert report.error == "execute failed: w1: INTERNAL: kv exchange broke"
    assert c.transition_calls() == [("PrepareTransition", "w0"), ("PrepareTransition", "w1"),
                                    ("ExecuteTransition", "w0"), ("ExecuteTransition", "w1"),
                                    ("AbortTransition", "w0"), ("AbortTransition", "w1")]
    assert {call.request.epoch for call in c.calls("AbortTransition")} == {4}
    assert c.refreshes == 1 and report.epoch == 2  # the layout as the workers report it after healing


def test_a_failing_commit_aborts_every_member_too():
    c = wholes("w0", "w1")
    c.workers["w0"].fail["CommitTransition"] = RuntimeError("gone")
    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert report.rolled_back and report.error == "execute failed: w0: RuntimeError: gone"
    assert [w for rpc, w in c.transition_calls() if rpc == "AbortTransition"] == ["w0", "w1"]


def test_a_failing_prepare_rolls_back_before_anything_moves():
    c = wholes("w0", "w1")
    c.workers["w0"].fail["PrepareTransition"] = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "busy")
    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert report.rolled_back and not report.completed
    assert report.error == "prepare failed: w0: FAILED_PRECONDITION: busy"
    assert c.transition_calls() == [("PrepareTransition", "w0"), ("PrepareTransition", "w1"),
                                    ("AbortTransition", "w0"), ("AbortTransition", "w1")]
    assert report.epoch == 2 and c.refreshes == 0


def test_requests_that_do_not_fit_the_new_unit_roll_back_at_the_plan_step():
    c = wholes("w0", "w1")
    c.workers["w0"].seqs = [seq("r1", "w0", list(range(8)))]
    c.workers["w1"].kv_blocks_after = 5
    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert report.rolled_back and report.error.startswith("plan failed: planner: TransitionError: unit w0+w1")
    assert [rpc for rpc, _ in c.transition_calls()] == ["PrepareTransition"] * 2 + ["AbortTransition"] * 2


# -- the explicit grouping ----------------------------------------------------------------------------------


def test_explicit_groups_split_evenly_in_the_order_given():
    c = wholes("w0", "w1", "w2", "w3")
    req = memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=["w2", "w0"])])

    async def scenario():
        orch = orchestrator(c)
        reply, _, old, new = await orch.plan(req)
        return reply, old, new, await orch.drop(req)

    reply, old, new, report = run(scenario())
    assert reply.met and reply.epoch == 2 and [g.group_id for g in reply.groups] == ["w2+w0"]
    assert unit_ids(old) == ["w2", "w0"] and [ranges(u) for u in new] == [[("w2", 0, 2), ("w0", 2, 4)]]
    assert c.calls("GetMemoryMap") == []  # an explicit grouping needs no cost model
    assert report.completed, report.error
    assert c.transition_calls() == [("PrepareTransition", "w0"), ("PrepareTransition", "w2"),
                                    ("ExecuteTransition", "w0"), ("ExecuteTransition", "w2"),
                                    ("CommitTransition", "w0"), ("CommitTransition", "w2")]
    assert [ranges(u) for u in c.calls("PrepareTransition")[0].request.new_units] == [[("w2", 0, 2), ("w0", 2, 4)]]


@pytest.mark.parametrize("groups, code, message", [
    ([["w0"]], "INVALID_ARGUMENT", "at least 2 workers"),
    ([["w2", "w9"]], "NOT_FOUND", "no worker 'w9'"),
    ([["w0", "w0"]], "INVALID_ARGUMENT", "w0 is in two groups"),
    ([["w2", "w3"], ["w3", "w4"]], "INVALID_ARGUMENT", "w3 is in two groups"),
    ([["w0", "w2"]], "FAILED_PRECONDITION", "already in group w0+w1: name w1 too"),
    ([["w1", "w0"]], "FAILED_PRECONDITION", "already form group w0+w1"),
    ([["w2", "w3", "w4", "w5", "w6"]], "INVALID_ARGUMENT", "5 stages for a 4-layer model"),
    ([["w2", "w7"]], "UNAVAILABLE", "w7 is not reachable"),
])
def test_explicit_groups_that_cannot_form_are_refused_before_any_worker_is_touched(groups, code, message):
    c = paired()
    for w in ("w3", "w4", "w5", "w6", "w7"):
        c.add(w)
    c.workers["w7"].fail["GetInfo"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "down")
    req = memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=g) for g in groups])
    with pytest.raises(OrchestrationError) as e:
        run(orchestrator(c).drop(req))
    assert e.value.code == code and message in str(e.value)
    assert c.transition_calls() == []


# -- restore ------------------------------------------------------------------------------------------------


def test_a_restore_splits_the_group_into_whole_instances_and_spreads_its_requests():
    c = paired()
    report = run(orchestrator(c).restore(memory_manager_pb2.RestoreRequest(group_id="w0+w1")))

    assert report.completed, report.error
    assert c.transition_calls() == [("PrepareTransition", "w0"), ("PrepareTransition", "w1"),
                                    ("ExecuteTransition", "w0"), ("ExecuteTransition", "w1"),
                                    ("CommitTransition", "w0"), ("CommitTransition", "w1")]
    prepare = c.calls("PrepareTransition")[0].request
    assert prepare.op == "restore" and unit_ids(prepare.old_units) == ["w0+w1"]
    assert [ranges(u) for u in prepare.new_units] == [[("w0", 0, L)], [("w1", 0, L)]]
    execute = c.calls("ExecuteTransition")[0].request
    assert [(u.unit_id, u.kv_blocks) for u in execute.new_units] == [("w0", 10), ("w1", 10)]
    # largest first to the freest instance: r1 to w0 (the old head: keeps its ids), r2 to w1
    assert {s.request_id: (s.new_unit, list(s.new_blocks)) for s in execute.seqs} == {
        "r1": ("w0", [4, 5, 6]), "r2": ("w1", [0])}
    assert transition_epochs(c) == {6}
    assert report.epoch == 6 and report.requests_moved == 2 and [g.group_id for g in report.groups] == ["w0", "w1"]


def test_a_restore_without_a_group_id_restores_every_group():
    c = paired()
    report = run(orchestrator(c).restore(memory_manager_pb2.RestoreRequest()))
    assert report.completed and sorted({w for _, w in c.transition_calls()}) == ["w0", "w1"]


@pytest.mark.parametrize("group_id, code", [("nope", "NOT_FOUND"), ("w2", "FAILED_PRECONDITION")])
def test_a_restore_of_what_is_no_group_is_refused(group_id, code):
    c = paired()
    with pytest.raises(OrchestrationError) as e:
        run(orchestrator(c).restore(memory_manager_pb2.RestoreRequest(group_id=group_id)))
    assert e.value.code == code and c.transition_calls() == []


def test_nothing_to_restore_is_a_completed_no_op():
    c = wholes("w0", "w1")
    report = run(orchestrator(c).restore(memory_manager_pb2.RestoreRequest()))
    assert report.completed and "nothing to restore" in report.error and c.transition_calls() == []


# -- incremental drops: groups merge (pairs -> a quad), a restore undoes one merge ---------------------------


def two_pairs(layout_epoch: int = 5) -> FakeCluster:
    """w0 + w1 and w2 + w3, each head owning requests (w0: r1, r2; w2: r3)."""
    c = FakeCluster(layout=LayoutState(epoch=layout_epoch))
    for head, stage, seqs in (("w0", "w1", (seq("r1", "w0+w1", [4, 5, 6]), seq("r2", "w0+w1", [0]))),
                              ("w2", "w3", (seq("r3", "w2+w3", [0, 1]),))):
        gid = f"{head}+{stage}"
        c.add(head, layers=(0, 2), group_id=gid, members=(head, stage), epoch=5, kv_blocks_after=20, seqs=seqs)
        c.add(stage, layers=(2, 4), group_id=gid, members=(head, stage), epoch=5, kv_blocks_after=30)
    return c


QUAD = ("w0", "w2", "w1", "w3")


def quad() -> FakeCluster:
    """The two pairs merged: w0 [0, 1), w2 [1, 2), w1 [2, 3), w3 [3, 4); the head w0 owns three requests."""
    c = FakeCluster(layout=LayoutState(epoch=7))
    for i, w in enumerate(QUAD):
        c.add(w, layers=(i, i + 1), group_id="+".join(QUAD), members=QUAD, epoch=7, kv_blocks_after=8,
              seqs=(seq("r1", "+".join(QUAD), [0, 1, 2]), seq("r2", "+".join(QUAD), [3]),
                    seq("r3", "+".join(QUAD), [4, 5])) if i == 0 else ())
    return c


def test_a_second_drop_merges_two_pairs_into_a_quad_where_each_member_keeps_half_its_layers():
    c = two_pairs()

    async def scenario():
        orch = orchestrator(c)
        reply, *_ = await orch.plan(memory_manager_pb2.DropRequest())
        return reply, await orch.drop(memory_manager_pb2.DropRequest())

    reply, report = run(scenario())
    assert reply.met and reply.freed_bytes == L << 20 and reply.freed_blocks == 256  # one more model copy freed
    assert [(g.group_id, [(m.worker_id, m.layer_start, m.layer_end) for m in g.members]) for g in reply.groups] == [
        ("w0+w2+w1+w3", [("w0", 0, 1), ("w2", 1, 2), ("w1", 2, 3), ("w3", 3, 4)])]
    assert report.completed, report.error
    assert c.transition_calls() == [(rpc, w) for rpc in ("PrepareTransition", "ExecuteTransition", "CommitTransition")
                                    for w in ("w0", "w1", "w2", "w3")]
    prepare = c.calls("PrepareTransition")[0].request
    assert prepare.op == "drop" and unit_ids(prepare.old_units) == ["w0+w1", "w2+w3"]
    execute = c.calls("ExecuteTransition")[0].request
    assert [(u.unit_id, u.kv_blocks) for u in execute.new_units] == [("w0+w2+w1+w3", 20)]  # min over members
    # the old head w0 heads the quad: its requests keep their ids, the other pair's get the lowest free ones
    assert {s.request_id: (s.old_unit, s.new_unit, list(s.new_blocks)) for s in execute.seqs} == {
        "r1": ("w0+w1", "w0+w2+w1+w3", [4, 5, 6]), "r2": ("w0+w1", "w0+w2+w1+w3", [0]),
        "r3": ("w2+w3", "w0+w2+w1+w3", [1, 2])}
    assert transition_epochs(c) == {6} and report.epoch == 6 and report.requests_moved == 3
    assert [g.group_id for g in report.groups] == ["w0+w2+w1+w3"]


def test_a_failing_member_of_a_merge_of_pairs_aborts_all_four():
    c = two_pairs()
    c.workers["w3"].fail["ExecuteTransition"] = rpc_error(grpc.StatusCode.INTERNAL, "kv exchange broke")
    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert report.rolled_back and not report.completed
    assert report.error == "execute failed: w3: INTERNAL: kv exchange broke"
    assert [w for rpc, w in c.transition_calls() if rpc == "AbortTransition"] == ["w0", "w1", "w2", "w3"]
    assert {call.request.epoch for call in c.calls("AbortTransition")} == {6}


@pytest.mark.parametrize("given", [["w0", "w1", "w2", "w3"], ["w3", "w2", "w1", "w0"]])
def test_an_explicit_group_of_whole_pairs_is_laid_out_as_the_planner_merges(given):
    c = two_pairs()
    req = memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=given)])
    report = run(orchestrator(c).drop(req))
    assert report.completed, report.error
    prepare = c.calls("PrepareTransition")[0].request
    assert sorted(unit_ids(prepare.old_units)) == ["w0+w1", "w2+w3"]
    assert [ranges(u) for u in prepare.new_units] == [[("w0", 0, 1), ("w2", 1, 2), ("w1", 2, 3), ("w3", 3, 4)]]


def test_an_explicit_group_of_a_pair_and_a_whole_instance_forms_three_stages():
    c = paired()
    req = memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=["w2", "w0", "w1"])])
    report = run(orchestrator(c).drop(req))
    assert report.completed, report.error
    prepare = c.calls("PrepareTransition")[0].request
    assert unit_ids(prepare.old_units) == ["w2", "w0+w1"]
    # everyone keeps layers it holds: w0 [0, 2) and w1 [2, 4) unchanged, w2 (whole) takes the middle
    assert [ranges(u) for u in prepare.new_units] == [[("w0", 0, 2), ("w2", 2, 3), ("w1", 3, 4)]]


def test_restoring_a_quad_by_id_splits_it_into_the_pairs_it_came_from():
    c = quad()
    report = run(orchestrator(c).restore(memory_manager_pb2.RestoreRequest(group_id="w0+w2+w1+w3")))
    assert report.completed, report.error
    prepare = c.calls("PrepareTransition")[0].request
    assert prepare.op == "restore" and unit_ids(prepare.old_units) == ["w0+w2+w1+w3"]
    # each member grows around the layer it holds: w0 [0, 1) -> [0, 2), w1 [2, 3) -> [2, 4), ...
    assert [ranges(u) for u in prepare.new_units] == [[("w0", 0, 2), ("w1", 2, 4)], [("w2", 0, 2), ("w3", 2, 4)]]
    execute = c.calls("ExecuteTransition")[0].request
    # largest first to the freest pair: r1 -> w0+w1 (w0 was the head: keeps its ids), r3 and r2 -> w2+w3 (ids in input order)
    assert {s.request_id: (s.new_unit, list(s.new_blocks)) for s in execute.seqs} == {
        "r1": ("w0+w1", [0, 1, 2]), "r2": ("w2+w3", [0]), "r3": ("w2+w3", [1, 2])}
    assert [g.group_id for g in report.groups] == ["w0+w1", "w2+w3"] and report.epoch == 8


def test_restoring_every_group_takes_a_quad_back_to_whole_instances():
    c = quad()
    report = run(orchestrator(c).restore(memory_manager_pb2.RestoreRequest()))
    assert report.completed, report.error
    prepare = c.calls("PrepareTransition")[0].request
    assert [ranges(u) for u in prepare.new_units] == [[(w, 0, L)] for w in QUAD]


# -- migrate ------------------------------------------------------------------------------------------------


def test_a_migration_moves_the_youngest_requests_that_fit_and_counts_only_those():
    c = wholes("w0", "w1", "w2")
    c.workers["w0"].seqs = [seq("old", "w0", [0, 1], age_s=5.0), seq("young", "w0", [2, 3, 4], age_s=1.0)]
    c.workers["w0"].kv_blocks_after = 10
    c.workers["w1"].seqs = [seq("resident", "w1", [0, 1], age_s=2.0)]
    c.workers["w1"].kv_blocks_after = 6  # 4 free: "young" fits, "old" then no longer does
    report = run(orchestrator(c).migrate(memory_manager_pb2.MigrateRequest(src_worker="w0", dst_worker="w1",
                                                                          blocks=10)))
    assert report.completed, report.error
    execute = c.calls("ExecuteTransition")[0].request
    assert execute.op == "migrate" and unit_ids(execute.old_units) == unit_ids(execute.new_units) == ["w0", "w1"]
    assert {s.request_id: (s.old_unit, s.new_unit, list(s.new_blocks)) for s in execute.seqs} == {
        "old": ("w0", "w0", [0, 1]), "young": ("w0", "w1", [2, 3, 4]), "resident": ("w1", "w1", [0, 1])}
    assert report.requests_moved == 1
    assert sorted({w for _, w in c.transition_calls()}) == ["w0", "w1"]


def test_a_migration_with_nothing_that_fits_rolls_back():
    c = wholes("w0", "w1")
    c.workers["w0"].seqs = [seq("big", "w0", list(range(8)))]
    c.workers["w1"].kv_blocks_after = 4
    report = run(orchestrator(c).migrate(memory_manager_pb2.MigrateRequest(src_worker="w0", dst_worker="w1",
                                                                          blocks=8)))
    assert report.rolled_back and report.error == ("plan failed: planner: TransitionError: nothing to migrate: "
                                                   "no running request on w0 fits the free KV of w1")
    assert [rpc for rpc, _ in c.transition_calls()] == ["PrepareTransition"] * 2 + ["AbortTransition"] * 2


@pytest.mark.parametrize("src, dst, blocks, code", [
    ("w2", "w9", 1, "NOT_FOUND"), ("w2", "w2", 1, "INVALID_ARGUMENT"), ("w2", "w3", 0, "INVALID_ARGUMENT"),
    ("w2", "w0", 1, "FAILED_PRECONDITION"),
])
def test_a_migration_between_anything_but_two_whole_instances_is_refused(src, dst, blocks, code):
    c = paired()
    c.add("w3")
    with pytest.raises(OrchestrationError) as e:
        run(orchestrator(c).migrate(memory_manager_pb2.MigrateRequest(src_worker=src, dst_worker=dst, blocks=blocks)))
    assert e.value.code == code and c.transition_calls() == []


# -- one transition at a time, leases -----------------------------------------------------------------------


def test_a_second_transition_while_one_runs_is_refused_and_leases_are_renewed_meanwhile():
    c = wholes("w0", "w1", "w2", "w3")
    first = memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=["w0", "w1"])])
    second = memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=["w2", "w3"])])

    async def scenario():
        orch = orchestrator(c, lease_s=0.03)  # renewals every 10 ms
        gate = c.workers["w0"].gate["ExecuteTransition"] = asyncio.Event()
        running = asyncio.create_task(orch.drop(first))
        while not c.calls("ExecuteTransition"):
            await asyncio.sleep(0.005)
        with pytest.raises(OrchestrationError) as e:
            await orch.drop(second)
        await asyncio.sleep(0.05)
        gate.set()
        return e.value, await running, orch

    refused, report, orch = run(scenario())
    assert refused.code == "ABORTED" and "epoch 4" in str(refused)
    assert report.completed and orch.started_epochs == {4}
    renewals = c.calls("RenewTransition")
    assert renewals and {r.worker_id for r in renewals} == {"w0", "w1"} and {r.request.epoch for r in renewals} == {4}


def test_an_unknown_worker_stub_is_refused_as_not_found():
    c = wholes("w0", "w1")

    class Partial(FakeCluster):
        def worker_stub(self, worker_id):
            return None if worker_id == "w1" else super().worker_stub(worker_id)

    p = Partial(workers=c.workers, layout=c.layout, log=c.log)
    with pytest.raises(OrchestrationError) as e:
        run(orchestrator(p).view())
    assert e.value.code == "NOT_FOUND"


def test_no_reachable_worker_is_unavailable():
    c = wholes("w0")
    c.workers["w0"].fail["GetInfo"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "down")
    with pytest.raises(OrchestrationError) as e:
        run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert e.value.code == "UNAVAILABLE"


def test_the_view_leaves_out_groups_with_an_unreachable_member():
    c = paired()
    c.workers["w1"].fail["GetInfo"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "down")
    view = run(orchestrator(c).view())
    assert unit_ids(view.units) == ["w2"] and view.reachable("w0") and not view.reachable("w1")
    assert view.epochs == {"w0": 5, "w2": 3} and view.num_layers == L
    assert view.member("w2").transfer_address == "w2:7000" and view.unit_of("w0") is None


def test_the_spec_says_whether_the_kv_lands_after_the_commit():
    """memory_manager.coordinated_exchange reaches every member as TransitionSpec.background_kv, and the report
    says so (its exchange time then excludes the landing)."""
    for background in (True, False):
        c = wholes("w0", "w1")
        c.workers["w0"].seqs = [seq("r1", "w0", [0])]
        orch = Orchestrator(c, timeout_s=5.0, background_kv=background)
        report = run(orch.drop(memory_manager_pb2.DropRequest()))
        assert report.completed, report.error
        specs = [call.request for call in c.log if call.rpc in ("PrepareTransition", "ExecuteTransition")]
        assert specs and all(s.background_kv is background for s in specs)
        assert report.kv_in_background is background
        assert report.pause_seconds == 0.125  # the longest any member served nothing


# -- tensor-parallel instances take no part in drops, restores or migrations -----------------------------------


def with_tp_pair() -> FakeCluster:
    """w0 + w1 form a TP2 instance; w2 and w3 are whole instances."""
    c = wholes("w0", "w1", "w2", "w3")
    for w in ("w0", "w1"):
        c.workers[w].info.tp_degree = 2
        c.workers[w].info.tp_members[:] = ["w0", "w1"]
    return c


def test_tensor_parallel_members_are_left_out_of_drop_plans():
    c = with_tp_pair()
    report = run(orchestrator(c).drop(memory_manager_pb2.DropRequest()))
    assert report.completed, report.error
    prepare = c.calls("PrepareTransition")[0].request
    assert [ranges(u) for u in prepare.new_units] == [[("w2", 0, 2), ("w3", 2, 4)]]
    assert {w for _, w in c.transition_calls()} == {"w2", "w3"}


@pytest.mark.parametrize("call", [
    lambda o: o.drop(memory_manager_pb2.DropRequest(groups=[memory_manager_pb2.GroupMembers(worker_ids=["w2", "w1"])])),
    lambda o: o.migrate(memory_manager_pb2.MigrateRequest(src_worker="w0", dst_worker="w2", blocks=1)),
    lambda o: o.migrate(memory_manager_pb2.MigrateRequest(src_worker="w2", dst_worker="w1", blocks=1)),
])
def test_a_drop_or_migration_naming_a_tensor_parallel_member_is_refused(call):
    c = with_tp_pair()
    with pytest.raises(OrchestrationError) as e:
        run(call(orchestrator(c)))
    assert e.value.code == "FAILED_PRECONDITION" and "tensor-parallel instance w0 (TP2: w0, w1)" in str(e.value)
    assert c.transition_calls() == []
