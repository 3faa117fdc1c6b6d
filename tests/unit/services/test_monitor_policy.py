"""The monitor's overload policy loop: units from stats -> decision -> MemoryManager.Drop / Restore."""

import asyncio

import grpc
import pytest

from kunserve.services.monitor.servicer import GrpcMemoryManager, OverloadController, overload_config_from
from kunserve.shared.config import MonitorSection
from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.policy.overload import DROP, NONE, RESTORE, OverloadConfig
from kunserve.shared.rpc import SERVER_OPTIONS
from kunserve.v1 import memory_manager_pb2, memory_manager_pb2_grpc

LAYERS = 4


def whole(wid, used=0, total=1000, queued=0, epoch=1, **kw):
    return WorkerReport(Member(wid, 0, LAYERS), kv_blocks_used=used, kv_blocks_total=total,
                        queued_demand_blocks=queued, num_layers_model=LAYERS, unit_id=wid, unit_members=(wid,),
                        serving=True, epoch=epoch, kv_blocks_undropped=1000, **kw)


def member(wid, gid, members, used=0, total=2400, epoch=2, **kw):
    i = members.index(wid)
    return WorkerReport(Member(wid, 2 * i, 2 * i + 2), kv_blocks_used=used, kv_blocks_total=total, unit_id=gid,
                        unit_members=tuple(members), serving=(i == 0), epoch=epoch, kv_blocks_undropped=1000,
                        num_layers_model=LAYERS, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeMM:
    def __init__(self) -> None:
        self.drops: list[tuple[int, str]] = []
        self.restores: list[str] = []
        self.drop_result: object = memory_manager_pb2.TransitionReport(op="drop", epoch=2, completed=True)
        self.restore_result: object = memory_manager_pb2.TransitionReport(op="restore", epoch=3, completed=True)
        self.closed = False

    async def drop(self, required_blocks, reason):
        self.drops.append((required_blocks, reason))
        if isinstance(self.drop_result, BaseException):
            raise self.drop_result
        return self.drop_result

    async def restore(self, group_id):
        self.restores.append(group_id)
        r = self.restore_result(group_id) if callable(self.restore_result) else self.restore_result
        if isinstance(r, BaseException):
            raise r
        return r

    async def close(self):
        self.closed = True


def make(config=None, **kw):
    clock = Clock()
    load = ClusterLoad(stale_after_s=3.0)
    mm = FakeMM()
    ctl = OverloadController(load, mm, config or OverloadConfig(margin_frac=0.0, restore_hold_s=0.0,
                                                                  restore_cooldown_s=0.0),
                             interval_s=0.01, clock=clock, **kw)
    return ctl, load, mm, clock


def report(load, clock, *stats):
    for s in stats:
        load.observe(s, clock.t)


def rpc_error(code, details):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_overload_drops_with_the_requirement_and_settles_before_deciding_again():
    ctl, load, mm, clock = make()
    report(load, clock, whole("w0", used=990, queued=60), whole("w1", used=10))
    d = asyncio.run(ctl.tick())
    assert d.action == DROP and mm.drops == [(50, "overload")]
    assert ctl.counters.drops == 1 and ctl.counters.failures == 0 and ctl.policy.pending is None
    # the old (pre-drop) stats are still the latest: no second drop on them
    clock.t += 0.5
    assert asyncio.run(ctl.tick()) is None and len(mm.drops) == 1
    # new stats at the new epoch, the group absorbs the load
    clock.t += 0.5
    report(load, clock, member("w0", "g", ["w0", "w1"], used=1000), member("w1", "g", ["w0", "w1"], used=1000))
    d = asyncio.run(ctl.tick())
    assert d.action == NONE and len(mm.drops) == 1


def dropped(epoch=2, members=("w0", "w1")):
    return memory_manager_pb2.TransitionReport(
        op="drop", epoch=epoch, completed=True,
        groups=[memory_manager_pb2.PlannedGroup(group_id="g", changed=True, members=[
            memory_manager_pb2.WorkerLayout(worker_id=w) for w in members]),
            memory_manager_pb2.PlannedGroup(group_id="w9", members=[memory_manager_pb2.WorkerLayout(worker_id="w9")])])


def test_settling_waits_for_the_new_epoch_only_on_the_workers_the_drop_involved():
    ctl, load, mm, clock = make()
    mm.drop_result = dropped(members=("w0", "w1"))
    report(load, clock, whole("w0", used=990, queued=60), whole("w1", used=990), whole("w9", used=10))
    assert asyncio.run(ctl.tick()).action == DROP
    clock.t += 0.5
    # w0 already at the new epoch, w1 not yet; w9 (not involved) stays at its epoch
    report(load, clock, member("w0", "g", ["w0", "w1"], used=1500), whole("w1", used=990), whole("w9", used=10))
    assert asyncio.run(ctl.tick()) is None
    clock.t += 0.5
    report(load, clock, member("w0", "g", ["w0", "w1"], used=1500), member("w1", "g", ["w0", "w1"], used=1500),
           whole("w9", used=10))
    assert asyncio.run(ctl.tick()).action == NONE


def test_settling_gives_up_after_a_timeout_when_epochs_never_arrive():
    ctl, load, mm, clock = make(settle_timeout_s=2.0)
    mm.drop_result = dropped(members=("w0",))
    report(load, clock, whole("w0", used=990, queued=60))
    asyncio.run(ctl.tick())
    clock.t += 1.0
    report(load, clock, whole("w0", used=990, queued=60, epoch=1))   # fresh, but still the old epoch
    assert asyncio.run(ctl.tick()) is None
    clock.t += 1.5
    report(load, clock, whole("w0", used=990, queued=60, epoch=1))
    assert asyncio.run(ctl.tick()).action == DROP and len(mm.drops) == 2


def test_rpc_error_is_a_failed_action_with_backoff():
    ctl, load, mm, clock = make(backoff_s=1.0, max_backoff_s=3.0)
    mm.drop_result = rpc_error(grpc.StatusCode.UNAVAILABLE, "memory manager down")
    report(load, clock, whole("w0", used=990, queued=60))
    assert asyncio.run(ctl.tick()).action == DROP
    assert ctl.counters.failures == 1 and ctl.counters.drops == 0 and ctl.policy.pending is None
    clock.t += 0.5
    assert asyncio.run(ctl.tick()) is None                          # backing off
    clock.t += 0.6
    report(load, clock, whole("w0", used=990, queued=60))
    assert asyncio.run(ctl.tick()).action == DROP and len(mm.drops) == 2
    clock.t += 1.5
    assert asyncio.run(ctl.tick()) is None                          # second failure: 2 s
    clock.t += 0.6
    report(load, clock, whole("w0", used=990, queued=60))
    mm.drop_result = memory_manager_pb2.TransitionReport(op="drop", epoch=2, completed=True)
    assert asyncio.run(ctl.tick()).action == DROP
    assert ctl.counters.drops == 1 and ctl.counters.failures == 2


def test_not_completed_and_autoscale_are_counted():
    ctl, load, mm, clock = make()
    mm.drop_result = memory_manager_pb2.TransitionReport(op="drop", epoch=1, completed=False, rolled_back=True,
                                                         autoscale_needed=True, error="no plan meets 50 blocks")
    report(load, clock, whole("w0", used=990, queued=60))
    asyncio.run(ctl.tick())
    assert (ctl.counters.failures, ctl.counters.autoscale_needed, ctl.counters.drops) == (1, 1, 0)
    assert ctl.policy.pending is None


def test_underloaded_groups_are_restored_one_rpc_each():
    ctl, load, mm, clock = make()
    g1, g2 = ["a", "b"], ["c", "d"]
    report(load, clock, *(member(w, "g1", g1, used=100) for w in g1), *(member(w, "g2", g2, used=50) for w in g2),
           whole("e", epoch=2))
    d = asyncio.run(ctl.tick())
    assert d.action == RESTORE and mm.restores == ["g1", "g2"]
    assert ctl.counters.restores == 2 and ctl.counters.failures == 0 and ctl.policy.pending is None


def test_partial_restore_failure_counts_and_completes_not_ok():
    ctl, load, mm, clock = make()
    mm.restore_result = lambda gid: (rpc_error(grpc.StatusCode.ABORTED, "a transition is in progress") if gid == "g2"
                                     else memory_manager_pb2.TransitionReport(op="restore", epoch=3, completed=True))
    g1, g2 = ["a", "b"], ["c", "d"]
    report(load, clock, *(member(w, "g1", g1) for w in g1), *(member(w, "g2", g2) for w in g2))
    asyncio.run(ctl.tick())
    assert ctl.counters.restores == 1 and ctl.counters.failures == 1 and ctl.policy.pending is None


def formed(op, epoch, *groups):
    """A completed transition report whose changed units are `groups` (tuples of worker ids)."""
    return memory_manager_pb2.TransitionReport(op=op, epoch=epoch, completed=True, groups=[
        memory_manager_pb2.PlannedGroup(group_id="+".join(g), changed=True, members=[
            memory_manager_pb2.WorkerLayout(worker_id=w) for w in g]) for g in groups])


PAIR_A, PAIR_B, QUAD = ("w0", "w1"), ("w2", "w3"), ("w0", "w2", "w1", "w3")


def pair_reports(epoch, used, queued=0):
    return [member(w, "+".join(g), list(g), used=used, total=1200, epoch=epoch,
                   queued_demand_blocks=queued if w == g[0] else 0) for g in (PAIR_A, PAIR_B) for w in g]


def test_overload_that_outlasts_a_drop_asks_for_a_second_one_once_held_again():
    """Drops stack (§5.6): two pairs still blocked after the first drop get a second drop (the memory manager
    merges them into a quad), after overload_hold_s in the new layout, not at once on the old timer."""
    ctl, load, mm, clock = make(OverloadConfig(margin_frac=0.0, overload_hold_s=1.0, restore_hold_s=0.0,
                                               restore_cooldown_s=0.0))
    hot = [whole(w, used=990, queued=60) for w in ("w0", "w1", "w2", "w3")]
    report(load, clock, *hot)
    assert asyncio.run(ctl.tick()).action == NONE  # held for 0 s
    clock.t += 1.0
    report(load, clock, *hot)
    mm.drop_result = formed("drop", 2, PAIR_A, PAIR_B)
    assert asyncio.run(ctl.tick()).action == DROP and len(mm.drops) == 1
    clock.t += 0.2
    report(load, clock, *pair_reports(epoch=2, used=1200, queued=100))  # still blocked as pairs
    d = asyncio.run(ctl.tick())
    assert d.action == NONE and "not held long enough" in d.reason
    clock.t += 1.0
    report(load, clock, *pair_reports(epoch=2, used=1200, queued=100))
    mm.drop_result = formed("drop", 3, QUAD)
    d = asyncio.run(ctl.tick())
    assert d.action == DROP and d.units == ("w0+w1", "w2+w3") and mm.drops[-1] == (200, "overload")
    assert ctl.counters.drops == 2 and ctl.counters.failures == 0


def test_a_quiet_quad_is_restored_to_pairs_then_to_whole_instances():
    ctl, load, mm, clock = make()
    mm.restore_result = lambda gid: formed("restore", 4, PAIR_A, PAIR_B) if gid == "+".join(QUAD) else formed(
        "restore", 5, *((w,) for w in gid.split("+")))
    report(load, clock, *(member(w, "+".join(QUAD), list(QUAD), used=100, total=2000, epoch=3) for w in QUAD))
    assert asyncio.run(ctl.tick()).action == RESTORE and mm.restores == ["w0+w2+w1+w3"]
    clock.t += 0.2
    report(load, clock, *pair_reports(epoch=4, used=50))
    assert asyncio.run(ctl.tick()).action == RESTORE and mm.restores[1:] == ["w0+w1", "w2+w3"]
    assert ctl.counters.restores == 3 and ctl.counters.failures == 0


def test_no_decision_while_anything_transitions():
    ctl, load, mm, clock = make()
    report(load, clock, whole("w0", used=990, queued=60), whole("w1", transitioning=True))
    assert asyncio.run(ctl.tick()) is None and not mm.drops


def test_loop_survives_exceptions_and_stops_on_shutdown():
    async def scenario():
        ctl, load, mm, clock = make()
        calls = 0
        real_tick = ctl.tick

        async def flaky_tick():
            nonlocal calls
            calls += 1
            if calls <= 2:
                raise RuntimeError("boom")
            return await real_tick()

        ctl.tick = flaky_tick
        ctl.start()
        while calls < 5:
            await asyncio.sleep(0.01)
        assert ctl.counters.tick_errors == 2
        task = ctl._task
        await ctl.stop()
        assert task.done() and mm.closed
    asyncio.run(scenario())


def test_an_exception_mid_action_never_leaves_the_policy_pending():
    ctl, load, mm, clock = make()

    async def broken(decision, loads):
        raise KeyError("bug")

    ctl._act = broken
    report(load, clock, whole("w0", used=990, queued=60))
    with pytest.raises(KeyError):
        asyncio.run(ctl.tick())
    assert ctl.policy.pending is None


def test_overload_config_from_monitor_section():
    c = overload_config_from(MonitorSection(overload_hold_s=1.5, restore_threshold=0.4, restore_hold_s=7,
                                            restore_cooldown_s=20))
    assert (c.overload_hold_s, c.restore_threshold, c.restore_hold_s, c.restore_cooldown_s) == (1.5, 0.4, 7, 20)


class _FakeMMServicer(memory_manager_pb2_grpc.MemoryManagerServicer):
    def __init__(self):
        self.requests = []

    async def Drop(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.ABORTED, "a transition is in progress")

    async def Restore(self, request, context):
        self.requests.append(request)
        return memory_manager_pb2.TransitionReport(op="restore", epoch=9, completed=True)


def test_grpc_client_against_an_in_process_memory_manager():
    async def scenario():
        server = grpc.aio.server(options=SERVER_OPTIONS)
        fake = _FakeMMServicer()
        memory_manager_pb2_grpc.add_MemoryManagerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            load = ClusterLoad(stale_after_s=3.0)
            clock = Clock()
            ctl = OverloadController(load, GrpcMemoryManager(f"127.0.0.1:{port}", drop_timeout_s=5,
                                                             restore_timeout_s=5),
                                     OverloadConfig(margin_frac=0.0), clock=clock)
            load.observe(whole("w0", used=990, queued=60), clock.t)
            d = await ctl.tick()
            assert d.action == DROP and ctl.counters.failures == 1 and ctl.policy.pending is None
            assert fake.requests[0].required_blocks == 50 and fake.requests[0].reason == "overload"
            rep = await ctl.mm.restore("g")
            assert rep.completed and rep.epoch == 9 and fake.requests[1].group_id == "g"
            await ctl.stop()
        finally:
            await server.stop(0)
    asyncio.run(scenario())
