"""Routing units (whole instances, pipeline groups) and their load from worker reports."""

from dataclasses import replace

from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.policy.overload import DROP, RESTORE, OverloadConfig, OverloadPolicy
from kunserve.shared.policy.units import TRANSITIONING, build_units, unit_loads

LAYERS = 4


def whole(wid, used=0, total=1000, queued=0, undropped=None, layer_end=LAYERS, **kw):
    kw.setdefault("serving", True)
    return WorkerReport(
        Member(wid, 0, layer_end), kv_blocks_used=used, kv_blocks_total=total, queued_demand_blocks=queued,
        num_layers_model=LAYERS, unit_id=wid, unit_members=(wid,),
        kv_blocks_undropped=total if undropped is None else undropped, **kw)


def group(gid, members, used=0, total=2400, queued=0, undropped=1000, epoch=1, **overrides):
    """Reports of every member of a pipeline group; the head carries the group's numbers."""
    out = []
    per = LAYERS // len(members)
    for i, wid in enumerate(members):
        r = WorkerReport(
            Member(wid, i * per, (i + 1) * per), unit_id=gid, unit_members=tuple(members), serving=(i == 0),
            epoch=epoch, num_layers_model=LAYERS,
            # every member describes the same block-id space; only the head's numbers count
            kv_blocks_total=total, kv_blocks_used=used, queued_demand_blocks=queued if i == 0 else 0,
            kv_blocks_undropped=undropped)
        out.append(replace(r, **overrides.get(wid, {})))
    return out


def test_whole_workers_are_units_of_their_own():
    u = build_units([whole("w1", used=10, queued=5), whole("w0", used=900, total=1000)])
    assert [x.unit_id for x in u.units] == ["w0", "w1"]
    w1 = u.units[1]
    assert w1.unit.worker_ids == ("w1",) and not w1.unit.is_group and w1.unit.head == "w1"
    assert (w1.load.used_blocks, w1.load.total_blocks, w1.load.queued_demand_blocks, w1.load.members) == (10, 1000, 5, 1)
    assert w1.load.undropped_total == 1000 and not u.skipped


def test_group_capacity_is_the_heads_block_space_not_the_sum():
    stats = group("g0", ["w2", "w0"], used=700, total=2400, queued=300, undropped=1000) + [whole("w1")]
    u = build_units(stats)
    g = next(x for x in u.units if x.unit_id == "g0")
    assert g.unit.worker_ids == ("w2", "w0") and g.unit.head == "w2" and g.unit.is_group  # pipeline order
    assert g.load.total_blocks == 2400                                    # not 2 x 2400
    assert g.load.used_blocks == 700 and g.load.queued_demand_blocks == 300
    assert g.load.undropped_total_blocks == 2000                          # sum of the members' undropped
    assert g.load.members == 2 and g.epoch == 1
    assert [x.unit_id for x in u.units] == ["g0", "w1"]


def test_group_undropped_unknown_when_a_member_does_not_report_it():
    u = build_units(group("g", ["a", "b"], undropped=1000, b={"kv_blocks_undropped": 0}))
    assert u.units[0].load.undropped_total_blocks is None


def test_stale_or_missing_member_skips_the_group():
    stats = group("g", ["a", "b", "c"])[:2] + [whole("w")]   # c is stale: the caller left it out
    u = build_units(stats)
    assert [x.unit_id for x in u.units] == ["w"]
    assert "c" in u.skipped["g"]


def test_transitioning_member_skips_the_unit():
    u = build_units(group("g", ["a", "b"], b={"transitioning": True}) + [whole("w", transitioning=True), whole("x")])
    assert [x.unit_id for x in u.units] == ["x"]
    assert u.skipped == {"g": TRANSITIONING, "w": TRANSITIONING} and u.transitioning


def test_members_that_disagree_or_straddle_an_epoch_are_skipped():
    u = build_units(group("g", ["a", "b"], b={"epoch": 2}))
    assert not u.units and "epoch" in u.skipped["g"]
    stats = group("g", ["a", "b"], b={"unit_members": ("b", "a")})
    assert "disagree" in build_units(stats).skipped["g"]
    # a worker claiming the group without being listed
    stats = group("g", ["a", "b"]) + [WorkerReport(Member("z", 0, 0), unit_id="g", unit_members=("a", "b"))]
    assert "z" in build_units(stats).skipped["g"]


def test_not_serving_units_are_not_routable():
    partial = whole("p", serving=False, layer_end=2)          # dropped layers outside a group: takes no requests
    headless = group("g", ["a", "b"], a={"serving": False})
    u = build_units([partial, *headless, whole("w")])
    assert [x.unit_id for x in u.units] == ["w"]
    assert u.skipped == {"p": "not serving", "g": "not serving"}


def test_units_drive_the_policy_from_cluster_load():
    load = ClusterLoad(stale_after_s=3.0)
    for s in [whole("w0", used=990, queued=50), whole("w1", used=100)]:
        load.observe(s, now=0.0)
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.0))
    d = pol.observe(0.0, unit_loads(load.fresh_reports(now=1.0)))
    assert d.action == DROP and d.units == ("w0",) and d.required_blocks == 40
    assert unit_loads(load.fresh_reports(now=10.0)) == []      # every report stale

    # after the drop the group is underloaded: below 50% of its undropped capacity -> restore
    load = ClusterLoad(stale_after_s=3.0)
    for s in group("g", ["w0", "w1"], used=300, total=2400, queued=0, undropped=1000):
        load.observe(s, now=0.0)
    pol = OverloadPolicy(OverloadConfig(restore_hold_s=0.0, restore_cooldown_s=0.0))
    d = pol.observe(0.0, unit_loads(load.fresh_reports(0.0)))
    assert d.action == RESTORE and d.units == ("g",)


def test_cluster_load_reported_since():
    load = ClusterLoad(stale_after_s=3.0)
    load.observe(whole("a", epoch=1), now=1.0)
    load.observe(whole("b", epoch=2), now=2.0)
    assert not load.reported_since(1.5, now=2.5)
    load.observe(whole("a", epoch=1), now=3.0)
    assert load.reported_since(1.5, now=3.0)
    assert not load.reported_since(1.5, now=3.0, min_epoch=2)
    assert load.reported_since(1.5, now=3.0, min_epoch=2, epoch_workers=["b"])   # a was not involved
    assert not load.reported_since(1.5, now=3.0, min_epoch=2, epoch_workers=["a"])
    load.observe(whole("a", epoch=2), now=3.1)
    assert load.reported_since(1.5, now=3.1, min_epoch=2)
    assert not load.reported_since(2.5, now=4.0)              # b (received at 2.0) has not reported since
    load.observe(whole("a", epoch=2), now=6.0)
    assert load.reported_since(2.5, now=6.5)                 # b is stale now: it no longer holds things up
    assert [s.worker_id for s in load.fresh_reports(now=6.5)] == ["a"]


def test_cluster_totals_count_a_pipeline_group_once():
    load = ClusterLoad(stale_after_s=3.0)
    for s in group("g", ["a", "b"], used=700, total=2400, queued=30) + [whole("w", used=10, total=1000)]:
        load.observe(s, now=0.0)
    st = load.status(now=0.5, wall_now=0.0)
    assert (st.kv_blocks_total, st.kv_blocks_used, st.queued_demand_blocks) == (3400, 710, 30)
    assert len(st.workers) == 3                              # every worker is still listed


def test_queue_time_reaches_the_unit_and_the_cluster_status():
    s = WorkerReport(Member("w0", 0, 4), kv_blocks_total=100, kv_blocks_used=10, serving=True, unit_id="w0",
                     unit_members=("w0",), num_layers_model=4, oldest_waiting_age_s=7.5)
    assert build_units([s]).loads[0].head_wait_s == 7.5
    load = ClusterLoad(stale_after_s=3.0, max_head_wait_s=5.0)
    load.observe(s, 0.0)
    assert load.status(0.1, 0.0).overloaded  # KV is fine; its oldest waiting request is past the TTFT SLO
    calm = ClusterLoad(stale_after_s=3.0)
    calm.observe(s, 0.0)
    assert not calm.status(0.1, 0.0).overloaded


def test_a_tensor_parallel_instance_is_its_rank_0_and_counts_once():
    """Rank 0 of a TP2 instance is a routable unit carrying the instance's KV; its follower is skipped (with why) and
    left out of the cluster's KV totals."""
    tp = {"tp_degree": 2, "tp_members": ("t0", "t1")}
    reports = [whole("t0", used=100, total=3000, **tp), whole("t1", total=3000, serving=False, **tp), whole("w")]
    u = build_units(reports)
    assert [x.unit_id for x in u.units] == ["t0", "w"] and u.units[0].load.total_blocks == 3000
    assert u.skipped == {"t1": "tensor-parallel member of t0: rank 0 reports the instance"}
    load = ClusterLoad()
    for r in reports:
        load.observe(r, now=0.0)
    status = load.status(0.0, 0.0)
    assert (status.kv_blocks_total, status.kv_blocks_used) == (4000, 100)
