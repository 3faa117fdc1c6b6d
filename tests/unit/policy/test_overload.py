"""The monitor's overload / underload policy on synthetic load time series."""

import pytest

from kunserve.shared.policy.batch_scheduler import PREEMPTION_MODES
from kunserve.shared.policy.overload import DROP, NONE, RESTORE, OverloadConfig, OverloadPolicy, UnitLoad
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES, overload_handling


def inst(uid, used, queued=0, head=None, total=1000):
    return UnitLoad(uid, used, total, queued, head)


def group(uid, used, queued=0, members=2, total=2400, per_instance=1000):
    return UnitLoad(uid, used, total, queued, None, per_instance * members, members)


def test_overload_is_used_plus_head_of_line_demand_over_capacity():
    assert not inst("a", 900, queued=500, head=100).overloaded      # 900 + 100 fits exactly
    assert inst("a", 901, queued=500, head=100).overloaded
    assert inst("a", 950, queued=60).overloaded                     # head unknown: all queued demand


def test_drop_at_once_with_r_from_the_queued_demand():
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.0))
    assert pol.observe(0.0, [inst("a", 500), inst("b", 600)]).action == NONE
    d = pol.observe(1.0, [inst("a", 980, queued=300, head=50), inst("b", 990, queued=100, head=100),
                          inst("c", 100)])
    assert d.action == DROP and d.units == ("a", "b")
    assert d.required_blocks == (980 + 300 - 1000) + (990 + 100 - 1000)
    paper = OverloadPolicy(OverloadConfig(margin_frac=0.0, requirement="queued"))
    assert paper.observe(0.0, [inst("a", 980, queued=300, head=50)]).required_blocks == 300


def test_margin_covers_decode_growth():
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.05))
    d = pol.observe(0.0, [inst("a", 1000, queued=10)])
    assert d.required_blocks == 10 + 50


def test_one_action_at_a_time_until_complete():
    pol = OverloadPolicy()
    hot = [inst("a", 1000, queued=10)]
    assert pol.observe(0.0, hot).action == DROP
    assert pol.pending == DROP
    for t in (0.5, 1.0, 5.0):
        d = pol.observe(t, hot)
        assert d.action == NONE and "in progress" in d.reason
    pol.complete(6.0)
    assert pol.observe(6.5, hot).action == DROP  # still overloaded after the drop: drop more


def test_unconfirmed_actions_expire():
    pol = OverloadPolicy(OverloadConfig(action_timeout_s=10))
    hot = [inst("a", 1000, queued=10)]
    assert pol.observe(0.0, hot).action == DROP
    assert pol.observe(9.0, hot).action == NONE
    assert pol.observe(10.0, hot).action == DROP


def test_overload_hold_filters_blips():
    pol = OverloadPolicy(OverloadConfig(overload_hold_s=1.0))
    series = [(0.0, 1000), (0.5, 500), (1.0, 1000), (1.5, 1000), (2.0, 1000)]
    actions = [pol.observe(t, [inst("a", used, queued=10)]).action for t, used in series]
    assert actions == [NONE, NONE, NONE, NONE, DROP]  # the timer restarts at 1.0 after the blip


def test_overload_outlasting_a_drop_asks_for_another_once_held_in_the_new_layout():
    pol = OverloadPolicy(OverloadConfig(overload_hold_s=2.0))
    pairs = [group("a+b", 2400, queued=100), group("c+d", 2400, queued=100)]
    assert pol.observe(0.0, [inst("a", 1000, queued=50)]).action == NONE
    assert pol.observe(2.0, [inst("a", 1000, queued=50)]).action == DROP
    pol.complete(2.5)
    assert pol.observe(3.0, pairs).action == NONE  # the hold restarts in the new layout
    d = pol.observe(5.0, pairs)
    assert d.action == DROP and d.units == ("a+b", "c+d")  # the planner merges the pairs into a quad


def test_restore_after_hold_below_half_the_undropped_capacity():
    cfg = OverloadConfig(restore_hold_s=10, restore_cooldown_s=30)
    pol = OverloadPolicy(cfg)
    assert pol.observe(0.0, [inst("a", 1000, queued=50), inst("b", 1000, queued=50)]).action == DROP
    pol.complete(1.0)
    # the pair is now one group: 2 members, 2000 blocks undropped; usage drops to 900 (< 1000) at t=5
    decisions = {}
    for t in range(2, 60):
        used = 1800 if t < 5 else 900
        decisions[t] = pol.observe(float(t), [group("a", used)])
    restores = [t for t, d in decisions.items() if d.action == RESTORE]
    # below 50% since t=5, hold 10 s -> 15, but the cool-down after the drop (done at 1) lasts until 31
    assert restores == [31]
    assert decisions[31].units == ("a",)


def test_no_flapping_on_a_noisy_signal_around_the_threshold():
    cfg = OverloadConfig(restore_hold_s=5, restore_cooldown_s=0)
    pol = OverloadPolicy(cfg)
    actions = []
    for t in range(100):
        used = 990 if t % 3 else 1010  # crosses 50% of 2000 every third sample
        actions.append(pol.observe(float(t), [group("g", used)]).action)
    assert RESTORE not in actions  # never held below the threshold for 5 s


def test_restore_only_dropped_groups_and_never_while_overloaded():
    pol = OverloadPolicy(OverloadConfig(restore_hold_s=0, restore_cooldown_s=0))
    assert pol.observe(0.0, [inst("a", 10)]).action == NONE  # an undropped instance has nothing to restore
    d = pol.observe(1.0, [group("g", 10), inst("a", 1000, queued=10)])
    assert d.action == DROP  # overload wins
    pol.complete(1.5)
    d = pol.observe(2.0, [group("g", 10), group("h", 2000)])
    assert d.action == RESTORE and d.units == ("g",)
    pol.complete(2.5)


def test_drop_cool_down_after_restore():
    pol = OverloadPolicy(OverloadConfig(restore_hold_s=0, restore_cooldown_s=0, drop_cooldown_s=3))
    assert pol.observe(0.0, [group("g", 10)]).action == RESTORE
    pol.complete(1.0)
    hot = [inst("g", 1000, queued=10), inst("x", 1000, queued=1)]
    assert pol.observe(2.0, hot).action == NONE
    assert pol.observe(4.0, hot).action == DROP


def test_full_burst_cycle():
    """Quiet -> burst (one drop) -> drained (one restore, after the hold) -> quiet."""
    pol = OverloadPolicy(OverloadConfig(restore_hold_s=5, restore_cooldown_s=10))
    grouped = False
    log = []
    for t in range(80):
        phase = "quiet" if t < 10 else "burst" if t < 30 else "drained"
        if grouped:  # a and b merged: 2400 blocks now, 2000 as two instances
            used = {"quiet": 800, "burst": 2300, "drained": 600}[phase]
            loads = [UnitLoad("g", used, 2400, 0, None, 2000, 2)]
        else:
            used, queued = {"quiet": (400, 0), "burst": (1000, 300), "drained": (300, 0)}[phase]
            loads = [inst("a", used, queued), inst("b", used, queued)]
        d = pol.observe(float(t), loads)
        if d.action != NONE:
            log.append((t, d.action, d.units))
            grouped = d.action == DROP
            pol.complete(t + 0.5)
    assert log == [(10, DROP, ("a", "b")), (35, RESTORE, ("g",))]


def test_bad_config():
    with pytest.raises(ValueError):
        OverloadConfig(restore_threshold=1.5)
    with pytest.raises(ValueError):
        OverloadConfig(requirement="everything")


# --- queue time: a head-of-line wait beyond the TTFT SLO is overload (what clients see) ------------------------

def waiting(uid, used, wait_s, queued=0, total=1000):
    return UnitLoad(uid, used, total, queued, None, head_wait_s=wait_s)


def test_head_of_line_wait_beyond_the_slo_is_overload_even_with_free_kv():
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.0, max_head_wait_s=5.0))
    assert not pol.overloaded(waiting("a", 100, 4.9, queued=40))
    assert pol.overloaded(waiting("a", 100, 5.1, queued=40))
    assert not waiting("a", 100, 5.1, queued=40).overloaded  # the KV half alone says no
    d = pol.observe(0.0, [waiting("a", 100, 6.0, queued=40), waiting("b", 100, 0.2)])
    assert d.action == DROP and d.units == ("a",)
    assert d.required_blocks == 40  # room for what waits there
    assert "queue time over 5 s on a (6.0 s)" in d.reason


def test_queue_time_is_ignored_unless_configured():
    pol = OverloadPolicy(OverloadConfig(margin_frac=0.0))
    assert pol.observe(0.0, [waiting("a", 100, 1e6, queued=40)]).action == NONE


def test_a_waiting_group_is_not_restored():
    pol = OverloadPolicy(OverloadConfig(restore_hold_s=0.0, restore_cooldown_s=0.0, max_head_wait_s=5.0))
    slow = UnitLoad("g", 10, 2400, 0, None, 2000, 2, head_wait_s=9.0)
    d = pol.observe(0.0, [slow])
    assert d.action == DROP  # overloaded by queue time: never a restore candidate


def test_max_head_wait_must_be_positive():
    with pytest.raises(ValueError):
        OverloadConfig(max_head_wait_s=0.0)


def test_each_overload_label_decodes_to_what_every_component_does():
    assert OVERLOAD_POLICIES == ("kunserve", "recompute", "swap", "migrate", "static-pp", "queue")
    traits = {p: overload_handling(p) for p in OVERLOAD_POLICIES}
    assert all(h.label == p and h.preemption in PREEMPTION_MODES for p, h in traits.items())
    assert {p: h.preemption for p, h in traits.items() if h.preemption != "recompute"} == {"swap": "swap",
                                                                                         "queue": "none"}
    assert {p: h.monitor_action for p, h in traits.items() if h.monitor_action} == {"kunserve": "drop",
                                                                                    "migrate": "migrate"}
    assert [p for p, h in traits.items() if h.static_pairs] == ["static-pp"]
    with pytest.raises(ValueError, match="kunserve, recompute"):
        overload_handling("fifo")
