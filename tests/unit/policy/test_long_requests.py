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
