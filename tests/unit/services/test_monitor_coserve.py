"""The monitor's policy loop with co-served offline work: an offline backlog that fills every worker's KV asks
for no drop; online demand beyond what the offline requests would give up does, for the online deficit."""

from __future__ import annotations

import asyncio

from test_monitor_policy import make, report, whole

from kunserve.shared.policy.overload import DROP, NONE, OverloadConfig


def test_offline_backlog_is_harvested_and_online_overload_drops():
    ctl, load, mm, clock = make(OverloadConfig(margin_frac=0.0, max_head_wait_s=5.0))  # offline requests wait 600 s
    offline_full = dict(offline_kv_blocks_used=950, offline_queued_demand_blocks=3000, num_offline_running=40,
                        num_offline_waiting=120, oldest_waiting_age_s=600.0)
    report(load, clock, whole("w0", used=1000, queued=3000, **offline_full),
           whole("w1", used=1000, queued=3000, **offline_full))
    for _ in range(3):
        assert asyncio.run(ctl.tick()).action == NONE
        clock.t += 1.0
    assert mm.drops == [] and not load.status(clock.t, 0.0).overloaded
    # online requests now hold 400 blocks and 700 more wait: 100 over what the offline requests would give up
    burst = dict(offline_full, offline_kv_blocks_used=600)
    report(load, clock, whole("w0", used=1000, queued=3700, **burst), whole("w1", used=1000, queued=3000, **offline_full))
    d = asyncio.run(ctl.tick())
    assert d.action == DROP and d.units == ("w0",) and mm.drops == [(100, "overload")]
