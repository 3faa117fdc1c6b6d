"""Throttling merged units for short requests (shared/policy/long_requests.py, Gyges Algorithm 2's reduced rate): which
requests are long, which merged units are throttled, and that a short request goes to a throttled unit only when no
other unit has room for it."""

from __future__ import annotations

from kunserve.shared.policy.long_requests import choose_unthrottled, is_long, throttled_units
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad

BS = 16
# w0 + w1 merged into a TP2 instance headed by w0; w2, w3 whole
MEMBERS = {"w0": ("w0", "w1"), "w1": ("w0", "w1"), "w2": ("w2",), "w3": ("w3",)}


def router(free: dict[str, int], total: dict[str, int] | None = None, offline_busy: dict[str, int] | None = None) -> FreenessRouter:
    """Units with `free` KV blocks each (w1, a TP follower, is not routable); capacities `total` (default 100, the
    merged w0 352)."""
    total = {"w0": 352, "w1": 176, "w2": 100, "w3": 100, **(total or {})}
    r = FreenessRouter()
    for wid, cap in total.items():
        used = cap - free.get(wid, cap)
        r.update(
            RoutingLoad(
                wid,
                kv_blocks_total=cap,
                kv_blocks_used=used,
                block_size=BS,
                healthy=True,
                serving=wid != "w1",
                online_requests=(offline_busy or {}).get(wid, 0),
            )
        )
    return r


def test_a_request_is_long_when_no_whole_instance_holds_it():
    r = router({})
    assert not is_long(r, MEMBERS, 100 * BS + 1)  # the last sampled token needs no KV
    assert is_long(r, MEMBERS, 100 * BS + 2)
    r.workers["w3"].kv_blocks_total = 120  # the largest whole instance decides, routable or not
    r.workers["w3"].serving = False
    assert not is_long(r, MEMBERS, 100 * BS + 2)
    # the merged instance's members do not count as whole instances, however large
    assert is_long(router({}, total={"w1": 10_000}), MEMBERS, 200 * BS)


def test_with_no_whole_instance_known_every_request_is_long():
    r = router({}, total={})
    del r.workers["w2"], r.workers["w3"]
    assert is_long(r, MEMBERS, 2)


def test_merged_heads_without_a_long_request_are_throttled():
    four = {**MEMBERS, "w4": ("w4", "w5", "w6", "w7"), "w5": ("w4", "w5", "w6", "w7")}
    assert throttled_units(four, {}) == {"w0", "w4"}  # followers and whole instances never are
    assert throttled_units(four, {"w0": 1}) == {"w4"}
    assert throttled_units(four, {"w0": 0, "w4": 2}) == {"w0"}
    assert throttled_units({"w2": ("w2",)}, {}) == frozenset()


def test_a_short_request_avoids_a_throttled_unit_while_another_has_room():
    r = router({"w0": 300, "w2": 5, "w3": 2})  # the merged unit is by far the freest
    assert choose_unthrottled(r, offline=False, tokens=5 * BS, throttled=frozenset()) == "w0"
    assert choose_unthrottled(r, offline=False, tokens=5 * BS, throttled=frozenset({"w0"})) == "w2"
    # the freest other unit lacks room: the throttled one takes it rather than queueing it behind a full instance
    assert choose_unthrottled(r, offline=False, tokens=5 * BS + 1, throttled=frozenset({"w0"})) == "w0"
    # an excluded (failed, draining, too small) unit stays out either way
    assert choose_unthrottled(r, offline=False, tokens=5 * BS, throttled=frozenset({"w0"}), exclude={"w2"}) == "w0"
    assert choose_unthrottled(r, offline=False, tokens=BS, throttled=frozenset({"w0"}), exclude={"w2"}) == "w3"


def test_with_room_nowhere_the_freest_unit_queues_it_as_without_throttling():
    r = router({"w0": 3, "w2": 1, "w3": 2})
    assert choose_unthrottled(r, offline=False, tokens=10 * BS, throttled=frozenset({"w0"})) == "w0"
    r = router({"w0": 1, "w2": 1, "w3": 2})
    assert choose_unthrottled(r, offline=False, tokens=10 * BS, throttled=frozenset({"w0"})) == "w3"


def test_only_throttled_units_routable_still_route():
    r = router({"w0": 10})
    r.workers["w2"].serving = r.workers["w3"].serving = False
    assert choose_unthrottled(r, offline=False, tokens=BS, throttled=frozenset({"w0"})) == "w0"
    r.workers["w0"].healthy = False
    assert choose_unthrottled(r, offline=False, tokens=BS, throttled=frozenset({"w0"})) is None


def test_offline_requests_are_throttled_likewise():
    # w0 has no online work and the most room, where an offline request goes without throttling
    r = router({"w0": 300, "w2": 20, "w3": 30}, offline_busy={"w2": 3, "w3": 1})
    assert choose_unthrottled(r, offline=True, tokens=BS, throttled=frozenset()) == "w0"
    assert choose_unthrottled(r, offline=True, tokens=BS, throttled=frozenset({"w0"})) == "w3"
    assert choose_unthrottled(r, offline=True, tokens=31 * BS, throttled=frozenset({"w0"})) == "w0"


def test_pending_routes_count_against_room():
    r = router({"w0": 300, "w2": 4, "w3": 1})
    assert choose_unthrottled(r, offline=False, tokens=3 * BS, throttled=frozenset({"w0"})) == "w2"
    r.routed("w2", "a", 2 * BS, now=1.0)  # its report does not show this one yet
    assert choose_unthrottled(r, offline=False, tokens=3 * BS, throttled=frozenset({"w0"})) == "w0"


def test_a_unit_where_requests_wait_has_no_room_whatever_its_free_kv():
    """A worker also queues at its batch limits with KV free: a short request does not wait there while a throttled
    unit would start it now."""
    r = router({"w0": 300, "w2": 50, "w3": 40})
    assert choose_unthrottled(r, offline=False, tokens=BS, throttled=frozenset({"w0"})) == "w2"
    r.workers["w2"].queued_demand_blocks = 1
    r.workers["w3"].queued_demand_blocks = 1
    assert choose_unthrottled(r, offline=False, tokens=BS, throttled=frozenset({"w0"})) == "w0"
