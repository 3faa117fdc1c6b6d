"""Pure policies used by the dispatcher and the monitor: routing by freeness, load and overload."""

from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_layout import LayoutEntry, LayoutState
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad


def test_router_picks_most_free_healthy_instance():
    r = FreenessRouter()
    r.update(RoutingLoad("a", 100, 90, 0, 16, True, 0.0))
    r.update(RoutingLoad("b", 100, 10, 50, 16, True, 0.0))
    r.update(RoutingLoad("c", 100, 0, 0, 16, False, 0.0))  # unhealthy: never chosen
    assert r.choose() == "b"
    assert r.choose(exclude={"b"}) == "a"
    assert r.choose(exclude={"a", "b"}) is None


def test_router_counts_requests_routed_since_the_last_report():
    r = FreenessRouter()
    r.update(RoutingLoad("a", 100, 0, 0, 16, True, 0.0))
    r.update(RoutingLoad("b", 100, 0, 0, 16, True, 0.0))
    r.routed("a", "r1", 16 * 10, now=1.0)  # 10 blocks pending on a
    assert r.choose() == "b"
    r.update(RoutingLoad("a", 100, 10, 0, 16, True, 2.0))  # the report now includes r1
    assert r.freeness("a") == 90
    r.routed("b", "r2", 16 * 20, now=3.0)
    r.done("b", "r2")
    assert r.freeness("b") == 100


def stats(wid, total, used, demand, t, prompt=0, gen=0):
    return WorkerReport(Member(wid, 0, 0), kv_blocks_total=total, kv_blocks_used=used, queued_demand_blocks=demand,
                        timestamp_unix_s=t, prompt_tokens_total=prompt, generated_tokens_total=gen)


def test_cluster_load_overload_rates_and_staleness():
    load = ClusterLoad(stale_after_s=3.0, rate_smoothing=1.0)
    load.observe(stats("w0", 100, 60, 10, 0.0), now=0.0)
    load.observe(stats("w1", 100, 80, 30, 0.0), now=0.0)
    st = load.status(now=1.0, wall_now=1.0)
    assert st.overloaded and st.kv_blocks_used == 140 and st.queued_demand_blocks == 40
    load.observe(stats("w0", 100, 60, 10, 1.0, prompt=100, gen=50), now=1.0)
    st = load.status(now=1.5, wall_now=1.5)
    w0 = [w for w in st.workers if w.report.worker_id == "w0"][0]
    assert w0.prompt_tokens_per_s == 100 and w0.generated_tokens_per_s == 50 and abs(w0.kv_usage - 0.6) < 1e-9
    st = load.status(now=10.0, wall_now=10.0)  # nobody reported for 9 s
    assert not any(w.healthy for w in st.workers) and st.kv_blocks_total == 0 and not st.overloaded


def entry(wid, start, end):
    return LayoutEntry(Member(wid, start, end), "a:1", unit_id=wid, unit_members=(wid,))


def test_layout_epoch_bumps_only_on_change():
    lay = LayoutState()
    assert lay.observe(entry("w0", 0, 4), 4) and lay.epoch == 1
    assert not lay.observe(entry("w0", 0, 4), 4) and lay.epoch == 1
    assert lay.observe(entry("w0", 0, 2), 4) and lay.epoch == 2
    lay.mark_unreachable("w0")
    assert lay.epoch == 3 and not lay.workers["w0"].reachable
