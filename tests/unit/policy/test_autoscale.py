"""Autoscaling behind the drop: when to ask for an instance, when to give one back, and the hysteresis between."""

from __future__ import annotations

from kunserve.shared.policy.autoscale import (
    NOTHING,
    SCALE_DOWN,
    SCALE_UP,
    AutoscaleConfig,
    AutoscalePolicy,
    Candidate,
    ClusterSignals,
)

CFG = AutoscaleConfig(hold_s=30.0, scale_down_hold_s=60.0, scale_down_usage=0.5, cooldown_s=5.0, scale_up_timeout_s=120.0)


def policy(**kw) -> AutoscalePolicy:
    return AutoscalePolicy(AutoscaleConfig(**{**CFG.__dict__, **kw}))


WORKER_2 = (Candidate("worker-2", 100),)


def calm(now: float, used: int | None = 10, total: int = 300, removable=WORKER_2) -> ClusterSignals:
    return ClusterSignals(now=now, members=3, kv_used_blocks=used, kv_total_blocks=total, removable=tuple(removable))


def test_autoscale_needed_asks_for_one_instance_then_waits_for_it():
    p = policy()
    d = p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2, available=1))
    assert (d.action, d.count) == (SCALE_UP, 1) and "autoscale needed" in d.reason
    assert p.pending == 1
    d = p.decide(ClusterSignals(now=10.0, autoscale_needed=True, members=2, available=1))
    assert d.action == NOTHING and "waiting for the 1 instance" in d.reason


def test_the_time_to_serving_counts_from_when_the_need_began():
    p = policy(cooldown_s=0.0)
    p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2, available=0))  # nothing to add yet
    d = p.decide(ClusterSignals(now=4.0, autoscale_needed=True, members=2, available=1))
    assert d.action == SCALE_UP
    assert p.served(now=9.0) == 0.0  # the need began at 0
    assert p.pending == 0
    assert p.served(now=10.0) is None  # a worker nobody asked for


def test_a_drop_that_holds_asks_once_per_hold():
    p = policy()
    assert p.decide(ClusterSignals(now=29.0, dropped_since=0.0, members=2)).action == NOTHING
    d = p.decide(ClusterSignals(now=30.0, dropped_since=0.0, members=2))
    assert d.action == SCALE_UP and "a drop has held for 30 s" in d.reason
    p.served(now=40.0)
    # the group is still there, but the new instance serves since 40: the hold counts again from then
    assert p.decide(ClusterSignals(now=60.0, dropped_since=0.0, members=3)).action == NOTHING
    assert p.decide(ClusterSignals(now=70.0, dropped_since=0.0, members=3)).action == SCALE_UP


def test_no_instance_left_or_the_cap_reached_is_said_not_acted_on():
    p = policy()
    d = p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2, available=0))
    assert d.action == NOTHING and "no instance left" in d.reason
    p = policy(max_workers=2)
    d = p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2, available=None))
    assert d.action == NOTHING and "max_workers = 2" in d.reason
    p = policy(step=3, max_workers=4)
    d = p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2, available=None))
    assert (d.action, d.count) == (SCALE_UP, 2)


def test_an_instance_that_never_serves_is_given_up_on_and_asked_for_again():
    p = policy(scale_up_timeout_s=20.0)
    assert p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2)).action == SCALE_UP
    d = p.decide(ClusterSignals(now=21.0, autoscale_needed=True, members=2))
    assert d.expired == 1 and d.action == SCALE_UP and p.pending == 1


def test_a_refused_scale_up_is_not_waited_for_and_the_cooldown_spaces_retries():
    p = policy()
    assert p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2)).action == SCALE_UP
    p.failed(1)
    assert p.pending == 0
    d = p.decide(ClusterSignals(now=2.0, autoscale_needed=True, members=2))
    assert d.action == NOTHING and "cooling down" in d.reason
    assert p.decide(ClusterSignals(now=5.0, autoscale_needed=True, members=2)).action == SCALE_UP


def test_scale_down_after_the_calm_hold_when_usage_without_it_is_low():
    p = policy()
    assert p.decide(calm(0.0)).action == NOTHING
    assert p.decide(calm(59.0)).action == NOTHING
    d = p.decide(calm(60.0))
    assert (d.action, d.worker_id) == (SCALE_DOWN, "worker-2") and "KV usage without it 5%" in d.reason
    # one at a time: the next waits another hold
    assert p.decide(calm(61.0, removable=[Candidate("worker-3", 100)])).action == NOTHING


def test_no_scale_down_while_busy_dropped_overloaded_or_without_a_figure():
    p = policy()
    p.decide(calm(0.0))
    d = p.decide(calm(100.0, used=120))  # 120 / 200 = 60%
    assert d.action == NOTHING and "60%" in d.reason
    assert p.decide(calm(100.0, used=None)).action == NOTHING
    p.decide(
        ClusterSignals(
            now=101.0, dropped_since=100.0, members=3, kv_used_blocks=0, kv_total_blocks=300, removable=(Candidate("worker-2", 100),)
        )
    )
    assert p.decide(calm(150.0)).action == NOTHING  # calm again only since 150
    assert p.decide(calm(210.0)).action == SCALE_DOWN
    p = policy()
    p.decide(calm(0.0))
    assert (
        p.decide(
            ClusterSignals(
                now=100.0, overloaded=True, members=3, kv_used_blocks=0, kv_total_blocks=300, removable=(Candidate("worker-2", 100),)
            )
        ).action
        == NOTHING
    )


def test_a_scale_up_resets_the_calm_so_it_is_not_given_back_at_once():
    p = policy()
    assert p.decide(ClusterSignals(now=0.0, autoscale_needed=True, members=2)).action == SCALE_UP
    p.served(now=5.0)
    assert p.decide(calm(6.0)).action == NOTHING
    assert p.decide(calm(65.0)).action == NOTHING  # calm since 6
    assert p.decide(calm(66.0)).action == SCALE_DOWN


def test_nothing_to_remove_means_nothing_to_do():
    p = policy()
    p.decide(calm(0.0, removable=()))
    assert p.decide(calm(1000.0, removable=())).action == NOTHING


def test_the_need_counts_from_the_episode_the_drop_report_opened():
    p = policy()
    d = p.decide(ClusterSignals(now=3.0, autoscale_needed=True, needed_since=1.5, members=2))
    assert d.action == SCALE_UP and p.need_since() == 1.5
    assert p.served(now=10.0) == 1.5


def test_a_left_over_standby_instance_is_given_back_while_calm_and_not_too_often():
    from kunserve.shared.policy.autoscale import GIVE_BACK

    p = policy(cooldown_s=5.0, scale_down_hold_s=60.0)
    d = p.decide(calm(0.0, removable=(), used=10))
    assert d.action == NOTHING
    left = dict(removable=(), left_over=("worker-2",))
    d = p.decide(ClusterSignals(now=1.0, members=2, kv_used_blocks=10, kv_total_blocks=200, **left))
    assert (d.action, d.worker_id) == (GIVE_BACK, "worker-2")
    assert p.decide(ClusterSignals(now=30.0, members=2, kv_used_blocks=10, kv_total_blocks=200, **left)).action == NOTHING
    # not while a need or a drop is on
    assert p.decide(ClusterSignals(now=70.0, members=2, dropped_since=65.0, **left)).action == NOTHING
    d = p.decide(ClusterSignals(now=71.0, members=2, kv_used_blocks=10, kv_total_blocks=200, **left))
    assert d.action == GIVE_BACK


def test_a_scale_down_spaces_the_give_back_of_what_it_leaves_over():
    from kunserve.shared.policy.autoscale import GIVE_BACK

    p = policy(cooldown_s=0.0, scale_down_hold_s=60.0)
    p.decide(calm(0.0))
    d = p.decide(calm(60.0))
    assert d.action == SCALE_DOWN
    # the scaler refused to take it back: it is standby now; the next calm tick does not hammer the scaler
    d = p.decide(ClusterSignals(now=61.0, members=2, kv_used_blocks=10, kv_total_blocks=200, left_over=("worker-2",)))
    assert d.action == NOTHING
    d = p.decide(ClusterSignals(now=120.0, members=2, kv_used_blocks=10, kv_total_blocks=200, left_over=("worker-2",)))
    assert (d.action, d.worker_id) == (GIVE_BACK, "worker-2")
