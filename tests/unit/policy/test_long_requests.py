"""Which routable units could hold a request's whole life (shared/policy/long_requests.py)."""

from __future__ import annotations

from kunserve.shared.policy.long_requests import kv_blocks_needed, split_by_fit
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad


def router(**blocks: int) -> FreenessRouter:
    r = FreenessRouter()
    for wid, n in blocks.items():
        r.workers[wid] = RoutingLoad(wid, kv_blocks_total=n, kv_blocks_used=n, block_size=16, healthy=True)
    return r


def test_the_last_sampled_token_needs_no_kv():
    assert kv_blocks_needed(17, 16) == 1
    assert kv_blocks_needed(18, 16) == 2


def test_units_split_by_capacity_whatever_is_in_use():
    r = router(small=80, big=352)
    r.workers["gone"] = RoutingLoad("gone", kv_blocks_total=1000, block_size=16, healthy=False)
    assert split_by_fit(r, 80 * 16 + 1) == (["big", "small"], [])
    assert split_by_fit(r, 80 * 16 + 2) == (["big"], ["small"])
    assert split_by_fit(r, 352 * 16 + 2) == ([], ["big", "small"])
    assert split_by_fit(r, 352 * 16 + 2, exclude={"big"}) == ([], ["small"])


def test_idle_split_waits_for_a_whole_idle_spell_and_for_placements_to_age():
    from kunserve.shared.policy.elastic_tp import IdleSplitPolicy

    p = IdleSplitPolicy(10.0)
    assert p.observe(0.0, [("w0", 2, True), ("w2", 1, True)]) == []  # a whole instance never splits
    assert p.observe(9.0, [("w0", 2, True)]) == []
    assert p.observe(5.0 + 9.0, [("w0", 2, False)]) == []  # busy: the spell starts again
    assert p.observe(15.0, [("w0", 2, True)]) == []
    assert p.observe(25.0, [("w0", 2, True)]) == ["w0"]
    assert p.observe(26.0, [("w0", 2, True)]) == []  # one decision per spell
    p.placed("w4", 30.0)  # placement just sent it a request its stats do not show yet
    assert p.observe(35.0, [("w4", 4, True)]) == [] and p.observe(41.0, [("w4", 4, True)]) == []
    assert p.observe(51.0, [("w4", 4, True)]) == ["w4"]
    assert IdleSplitPolicy(0.0).observe(100.0, [("w0", 2, True)]) == []
