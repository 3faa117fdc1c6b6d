"""Gyges' transformation-aware scheduler (Algorithms 1 and 2) over plain instance snapshots."""

from __future__ import annotations

import random

import pytest

from kunserve.shared.policy.elastic_tp import (
    ElasticTPScheduler,
    Refuse,
    Route,
    ScaleDown,
    ScaleUp,
    TPInstance,
    TPMemory,
    Wait,
)

MIB = 1 << 20

# One worker: 100 MiB pool, 48 MiB of sharded (MLP) weights, 16 MiB replicated, 8 KV heads, 16 KiB per token.
MEM = TPMemory(pool_bytes=100 * MIB, sharded_bytes=48 * MIB, replicated_bytes=16 * MIB, kv_bytes_per_token=16 << 10, num_kv_heads=8)


def tp1(wid: str, host: str = "h0", requests: tuple[int, ...] = (), **kw: object) -> TPInstance:
    return TPInstance(members=(wid,), host=host, requests=requests, **kw)  # type: ignore[arg-type]


def test_capacity_grows_with_degree_by_the_released_weights() -> None:
    # TP1: 100-16-48 = 36 MiB of KV per member; TP2: 100-16-24 = 60 MiB each, each storing half of a token.
    assert MEM.capacity_tokens(1) == 36 * MIB // (16 << 10)
    assert MEM.capacity_tokens(2) == 2 * 60 * MIB // (16 << 10)
    assert MEM.capacity_tokens(4) == 4 * 72 * MIB // (16 << 10)
    assert MEM.degree_for(MEM.capacity_tokens(1) + 1) == 2
    assert MEM.degree_for(MEM.capacity_tokens(4) + 1) is None


def test_a_degree_that_does_not_divide_the_heads_is_refused() -> None:
    six = TPMemory(pool_bytes=100 * MIB, sharded_bytes=48 * MIB, replicated_bytes=16 * MIB, kv_bytes_per_token=16 << 10, num_kv_heads=6)
    with pytest.raises(ValueError, match="does not divide the model's 6 KV heads"):
        six.capacity_tokens(4)
    with pytest.raises(ValueError, match="must be one of"):
        MEM.capacity_tokens(3)
    assert six.degree_for(six.capacity_tokens(2) + 1) is None  # TP4 is not valid for 6 heads
    with pytest.raises(ValueError):
        ElasticTPScheduler(six, max_degree=4)


def test_short_requests_go_to_the_least_loaded_tp1_instance() -> None:
    s = ElasticTPScheduler(MEM)
    insts = [tp1("w0", requests=(500,)), tp1("w1", requests=(100,)), tp1("w2", requests=(900,))]
    assert s.route(200, insts) == Route("w1")


def test_short_requests_skip_reserved_and_prefer_tp1_over_a_throttled_merged_instance() -> None:
    s = ElasticTPScheduler(MEM)
    merged = TPInstance(members=("w0", "w1"), host="h0", requests=(100,))  # nothing long: throttled
    assert s.throttled(merged)
    insts = [merged, tp1("w2", requests=(1500,), reserved=True), tp1("w3", requests=(1000,))]
    assert s.route(200, insts) == Route("w3")
    # Only the throttled instance fits: it is still used rather than making the request wait.
    full = tp1("w3", requests=(s.capacity(1) - 10,))
    assert s.route(200, [merged, full]) == Route("w0")


def test_a_long_request_prefers_the_instance_at_the_highest_degree() -> None:
    s = ElasticTPScheduler(MEM)
    long = s.capacity(1) + 100
    tp2 = TPInstance(members=("w0", "w1"), host="h0", requests=(long,))
    tp4 = TPInstance(members=("w4", "w5", "w6", "w7"), host="h1", requests=(long,))
    assert s.route(long, [tp1("w2"), tp2, tp4]) == Route("w4")


def test_a_long_request_that_fits_nowhere_triggers_the_smallest_scale_up_on_one_host() -> None:
    s = ElasticTPScheduler(MEM)
    long = s.capacity(1) + 100
    insts = [
        tp1("a0", host="ha", requests=(300,)),
        tp1("b0", host="hb", requests=(50,)),
        tp1("b1", host="hb", requests=(10,)),
        tp1("b2", host="hb", requests=(2000,)),
    ]
    d = s.route(long, insts)
    assert d == ScaleUp(host="hb", instances=("b0", "b1"), members=("b0", "b1"), degree=2)


def test_scale_up_prefers_a_set_holding_a_merged_instance_and_keeps_its_head() -> None:
    s = ElasticTPScheduler(MEM)
    need4 = s.capacity(2) + 100
    tp2 = TPInstance(members=("w2", "w3"), host="h0", requests=(s.capacity(1) + 10,))
    insts = [tp1("w0"), tp1("w1"), tp2, tp1("w4", host="h1"), tp1("w5", host="h1"), tp1("w6", host="h1"), tp1("w7", host="h1")]
    d = s.route(need4, insts)
    assert isinstance(d, ScaleUp) and d.degree == 4 and d.host == "h0"
    assert d.members[:2] == ("w2", "w3") and set(d.members) == {"w0", "w1", "w2", "w3"}


def test_requests_that_would_not_fit_the_merged_instance_block_that_scale_up() -> None:
    s = ElasticTPScheduler(MEM)
    long = s.capacity(1) + 100
    busy = s.capacity(2) - long  # the pair's own requests leave too little beside the new one
    insts = [tp1("w0", requests=(busy,)), tp1("w1", requests=(1,))]
    assert isinstance(s.route(long, insts), Wait)
    assert isinstance(s.route(long, [tp1("w0"), tp1("w1", reserved=True)]), Wait)


def test_a_request_no_layout_could_hold_is_refused_with_the_cluster_maximum() -> None:
    s = ElasticTPScheduler(MEM)
    two_hosts = [tp1("w0", host="h0"), tp1("w1", host="h0"), tp1("w2", host="h1")]
    d = s.route(s.capacity(2) + 1, two_hosts)
    assert isinstance(d, Refuse) and d.max_tokens == s.capacity(2) and "TP2" in d.reason
    # With max_degree=2 a four-worker host still only reaches TP2.
    capped = ElasticTPScheduler(MEM, max_degree=2)
    d = capped.route(s.capacity(2) + 1, [tp1(f"w{i}") for i in range(4)])
    assert isinstance(d, Refuse) and d.max_tokens == s.capacity(2)


def test_a_short_request_that_fits_nowhere_waits_instead_of_merging() -> None:
    s = ElasticTPScheduler(MEM)
    insts = [tp1("w0", requests=(s.capacity(1),)), tp1("w1", requests=(s.capacity(1) - 5,))]
    assert isinstance(s.route(100, insts), Wait)


def test_not_serving_instances_are_neither_routed_to_nor_merged() -> None:
    s = ElasticTPScheduler(MEM)
    assert isinstance(s.route(10, [tp1("w0", serving=False)]), Wait)
    long = s.capacity(1) + 1
    assert isinstance(s.route(long, [tp1("w0"), tp1("w1", serving=False)]), Wait)


def test_scale_down_once_the_long_requests_are_gone_and_the_rest_packs() -> None:
    s = ElasticTPScheduler(MEM)
    long = s.capacity(1) + 100
    busy = TPInstance(members=("w0", "w1"), host="h0", requests=(long, 50))
    assert s.rebalance([busy]) == []
    drained = TPInstance(members=("w0", "w1"), host="h0", requests=(50, 60, 70))
    assert s.rebalance([drained]) == [ScaleDown("w0", 1)]
    # A TP4 instance holding a request that needs TP2 steps down to TP2, not to TP1.
    tp4 = TPInstance(members=("w0", "w1", "w2", "w3"), host="h0", requests=(long,))
    assert s.rebalance([tp4]) == [ScaleDown("w0", 2)]
    # Requests that do not pack into the split instances keep it merged (it stays throttled).
    crowded = TPInstance(members=("w0", "w1"), host="h0", requests=(s.capacity(1) - 10,) * 3)
    assert s.throttled(crowded) and s.rebalance([crowded]) == []


def test_route_is_deterministic_and_never_overfills() -> None:
    """Property: whatever the snapshot, a Route goes to a serving instance with room; a ScaleUp merges serving,
    unreserved instances of one host whose degrees add up and whose KV fits the merged capacity."""
    rng = random.Random(7)
    s = ElasticTPScheduler(MEM)
    for _ in range(400):
        insts = []
        for h in range(rng.randint(1, 3)):
            for k in range(rng.randint(1, 4)):
                insts.append(
                    tp1(
                        f"h{h}w{k}",
                        host=f"h{h}",
                        requests=tuple(rng.randint(1, 900) for _ in range(rng.randint(0, 3))),
                        serving=rng.random() > 0.1,
                        reserved=rng.random() < 0.1,
                    )
                )
        tokens = rng.randint(1, s.capacity(4) + 500)
        d = s.route(tokens, insts)
        assert d == s.route(tokens, list(reversed(insts)))
        by_id = {i.instance_id: i for i in insts}
        if isinstance(d, Route):
            inst = by_id[d.instance_id]
            assert inst.serving and s.free_tokens(inst) >= tokens
        elif isinstance(d, ScaleUp):
            chosen = [by_id[i] for i in d.instances]
            assert len({i.host for i in chosen}) == 1 and all(i.serving and not i.reserved for i in chosen)
            assert sum(i.degree for i in chosen) == d.degree
            assert sum(i.used_tokens for i in chosen) + tokens <= s.capacity(d.degree)
            assert tokens > s.capacity(1)
        elif isinstance(d, Refuse):
            assert tokens > d.max_tokens
