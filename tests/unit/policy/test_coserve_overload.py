"""Co-serving composed with the cluster (ConServe request classes under KunServe's drop): workers report their
offline share, overload and the drop requirement count online demand only (offline KV is harvested: free for
this purpose), a restore waits until every request's KV fits the instances it splits into, and offline
requests go where online work leaves the most room. With no offline work every signal is the class-blind one."""

from __future__ import annotations

import dataclasses
import math
import random

from engine_testing import one_torch_thread, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine.api import EngineRequest, EngineStats, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.policy.batch_scheduler import Scheduler, SchedulerConfig, Sequence
from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.policy.overload import DROP, NONE, RESTORE, OverloadConfig, OverloadPolicy, UnitLoad
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad
from kunserve.shared.policy.units import build_units
from kunserve.shared.wire.cluster_state import engine_stats_to_pb, report_from_pb

SMALL = TINY_CONFIG.replace(num_layers=2, name="small")


def mk(rid: str, n_prompt: int, arrival: float = 0.0, offline: bool = False) -> Sequence:
    req = EngineRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=8), arrival, offline)
    return Sequence(req, list(req.prompt_token_ids), BlockTable(4))


# -- the worker's report ------------------------------------------------------------------------------------------
def test_the_scheduler_reports_its_offline_share_and_online_only_demand():
    s = Scheduler(BlockAllocator(100), 4, SchedulerConfig(max_num_batched_tokens=100))
    off, on = mk("off", 12, arrival=1.0, offline=True), mk("on", 8, arrival=5.0)
    s.add(off)
    s.add(on)
    assert (s.queued_demand_blocks(), s.online_queued_demand_blocks()) == (3 + 2, 2)
    assert (s.oldest_waiting_arrival(), s.oldest_online_waiting_arrival()) == (1.0, 5.0)
    assert s.num_offline() == (0, 1) and s.offline_kv_blocks() == 0
    s.schedule()  # both fit the budget: each gets its prompt's blocks
    assert s.num_offline() == (1, 0) and s.offline_kv_blocks() == 3
    assert s.online_queued_demand_blocks() == 0 and s.oldest_online_waiting_arrival() is None


def test_engine_stats_carry_the_offline_share_to_the_wire():
    w = weights_for(SMALL)
    eng = Engine(SMALL, w, num_kv_blocks=48, block_size=4, scheduler_config=SchedulerConfig(max_num_batched_tokens=64))
    rng = random.Random(1)
    eng.add_request(EngineRequest("off", [rng.randrange(SMALL.vocab_size) for _ in range(20)],
                                  SamplingParams(max_tokens=4), arrival_time=1.0, offline=True))
    eng.add_request(EngineRequest("on", [rng.randrange(SMALL.vocab_size) for _ in range(6)],
                                  SamplingParams(max_tokens=4), arrival_time=2.0))
    before = eng.stats()
    assert (before.num_offline_waiting, before.offline_queued_demand_blocks, before.queued_demand_blocks) == (1, 5, 7)
    assert before.oldest_online_waiting_arrival == 2.0 and before.oldest_waiting_arrival == 1.0
    eng.step()
    s = eng.stats()
    assert (s.num_offline_running, s.num_offline_waiting, s.offline_kv_blocks_used) == (1, 0, 5)  # its prompt's KV
    assert s.kv_blocks_used == 5 + 2
    pb = engine_stats_to_pb(before, now=4.0)
    assert (pb.oldest_waiting_age_s, pb.oldest_online_waiting_age_s) == (3.0, 2.0)
    r = report_from_pb(pb)
    assert (r.online_queued_demand_blocks, r.online_waiting_age_s, r.num_offline_waiting) == (2, 2.0, 1)


def test_a_report_without_a_class_breakdown_is_all_online():
    pb = engine_stats_to_pb(EngineStats(kv_blocks_total=10, kv_blocks_used=4, block_size=16, num_running=1,
                                        num_waiting=1, queued_demand_blocks=3, num_preemptions=0,
                                        prompt_tokens_total=0, generated_tokens_total=0,
                                        oldest_waiting_arrival=100.0), now=107.0)
    r = report_from_pb(pb)
    assert (r.online_kv_blocks_used, r.online_queued_demand_blocks, r.online_waiting_age_s) == (4, 3, 7.0)


# -- overload and the drop requirement -----------------------------------------------------------------------------
def inst(uid: str, used: int, queued: int = 0, offline_used: int = 0, offline_queued: int = 0,
         total: int = 1000) -> UnitLoad:
    return UnitLoad(uid, used, total, queued, offline_used_blocks=offline_used, offline_queued_demand_blocks=offline_queued)


def test_an_offline_backlog_filling_the_kv_is_no_overload():
    full = inst("a", used=1000, queued=800, offline_used=950, offline_queued=800)
    assert not full.overloaded and full.usage == 50
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.0))
    assert pol.observe(0.0, [full, inst("b", 1000, 500, 1000, 500)]).action == NONE
    assert pol.requirement([full]) == 0


def test_online_demand_beyond_what_offline_requests_would_give_up_drops_for_the_online_deficit():
    # online holds 700 of 1000 (offline 300, which online requests would take first), 400 online blocks wait
    hot = inst("a", used=1000, queued=600, offline_used=300, offline_queued=200)
    assert hot.overloaded and hot.usage == 1100
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.0))
    d = pol.observe(0.0, [hot, inst("b", 100)])
    assert d.action == DROP and d.units == ("a",) and d.required_blocks == 100
    assert OverloadPolicy(OverloadConfig(margin_frac=0.0, requirement="queued")).requirement([hot]) == 400
    # the same online demand fits once the offline blocks count as free
    assert not inst("a", used=1000, queued=200, offline_used=300).overloaded


def test_without_offline_work_every_signal_is_the_class_blind_one():
    rng = random.Random(7)
    for _ in range(500):
        used, queued, total = rng.randrange(0, 1200), rng.randrange(0, 600), rng.randrange(1, 1200)
        head = rng.choice([None, rng.randrange(0, 200)])
        u = UnitLoad("a", used, total, queued, head)
        assert u.overloaded == (used + (queued if head is None else head) > total)
        assert u.usage == used + queued
        if u.overloaded:  # R: the deficit of all queued demand, at least the head-of-line one's, plus the margin
            deficit = max(used + queued - total, used + u.head_demand - total)
            assert OverloadPolicy(OverloadConfig(margin_frac=0.05)).requirement([u]) == deficit + math.ceil(0.05 * total)


def worker(wid: str, **kw) -> WorkerReport:
    return WorkerReport(Member(wid, 0, 4), num_layers_model=4, unit_id=wid, unit_members=(wid,), serving=True,
                        kv_blocks_total=kw.pop("total", 100), **kw)


def test_offline_queue_time_is_no_overload_but_online_queue_time_is():
    offline_waits = worker("w0", kv_blocks_used=90, offline_kv_blocks_used=80, queued_demand_blocks=40,
                           offline_queued_demand_blocks=40, num_offline_waiting=3, oldest_waiting_age_s=60.0)
    assert build_units([offline_waits]).loads[0].head_wait_s == 0.0
    pol = OverloadPolicy(OverloadConfig(max_head_wait_s=5.0))
    assert pol.observe(0.0, build_units([offline_waits]).loads).action == NONE
    load = ClusterLoad(stale_after_s=3.0, max_head_wait_s=5.0)
    load.observe(offline_waits, 0.0)
    assert not load.status(0.1, 0.0).overloaded
    online_waits = dataclasses.replace(offline_waits, oldest_online_waiting_age_s=6.0)
    assert build_units([online_waits]).loads[0].head_wait_s == 6.0
    assert pol.observe(1.0, build_units([online_waits]).loads).action == DROP
    load.observe(online_waits, 1.0)
    assert load.status(1.1, 0.0).overloaded


def test_the_units_carry_the_heads_offline_share():
    (u,) = build_units([worker("w0", kv_blocks_used=70, offline_kv_blocks_used=60, queued_demand_blocks=50,
                               offline_queued_demand_blocks=45)]).loads
    assert (u.offline_used_blocks, u.offline_queued_demand_blocks, u.usage) == (60, 45, 15)
    status = ClusterLoad(stale_after_s=3.0)
    status.observe(worker("w0", kv_blocks_used=100, offline_kv_blocks_used=100, queued_demand_blocks=50,
                          offline_queued_demand_blocks=50), 0.0)
    assert not status.status(0.1, 0.0).overloaded


def test_a_restore_counts_online_usage_and_waits_until_every_requests_kv_fits():
    cfg = OverloadConfig(restore_hold_s=1.0, restore_cooldown_s=0.0)
    pol = OverloadPolicy(cfg)

    def pair(used: int, offline_used: int) -> UnitLoad:
        return UnitLoad("g", used, 2400, 0, None, 2000, 2, offline_used_blocks=offline_used)

    # online uses 100 of the 2000 undropped blocks, but offline KV (2100) would not fit the two instances
    assert pol.observe(0.0, [pair(2200, 2100)]).action == NONE
    assert pol.observe(5.0, [pair(2200, 2100)]).action == NONE
    assert pol.observe(6.0, [pair(1500, 1400)]).action == NONE  # fits now: the hold starts
    d = pol.observe(7.0, [pair(1500, 1400)])
    assert d.action == RESTORE and d.units == ("g",)


# -- routing offline requests --------------------------------------------------------------------------------------
def router(*loads: tuple[str, int, int]) -> FreenessRouter:
    """(worker, used blocks of 100, online requests) each."""
    r = FreenessRouter()
    for wid, used, online in loads:
        r.update(RoutingLoad(wid, 100, used, 0, 16, True, 0.0, online_requests=online))
    return r


def test_offline_work_goes_to_idle_capacity_before_a_busier_worker_with_more_free_kv():
    r = router(("a", 50, 0), ("b", 20, 3))
    assert r.choose_offline(64) == "a"
    assert r.choose() == "b"  # online routing: most free, as ever


def test_offline_work_prefers_a_worker_where_it_starts_at_once():
    r = router(("a", 98, 0), ("b", 60, 5))  # a has no online request but no room for 4 blocks either
    assert r.choose_offline(64) == "b"
    assert r.choose_offline(32) == "a"  # 2 blocks fit on a: it is idle
    assert router(("a", 99, 0), ("b", 99, 2)).choose_offline(64) == "a"  # fits nowhere: fewest online first
    assert router(("a", 60, 1), ("b", 40, 1)).choose_offline(64) == "b"  # then most free


def test_requests_routed_since_the_last_report_count_by_class():
    r = router(("a", 0, 0), ("b", 0, 0))
    r.routed("a", "on1", 16, now=1.0)
    assert r.online_requests("a") == 1 and r.choose_offline(16) == "b"
    r.routed("b", "off1", 16, now=1.0, offline=True)
    r.routed("b", "off2", 16, now=1.0, offline=True)
    assert r.online_requests("b") == 0 and r.freeness("b") == 98
    assert r.choose_offline(16) == "b"
    r.done("a", "on1")
    assert r.online_requests("a") == 0 and r.choose_offline(16) == "a"  # now idle and freer


def test_offline_routing_skips_excluded_and_unroutable_workers():
    r = router(("a", 0, 0), ("b", 90, 4))
    r.refused("a", now=1.0)
    assert r.choose_offline(16) == "b"
    assert r.choose_offline(16, exclude={"b"}) is None
