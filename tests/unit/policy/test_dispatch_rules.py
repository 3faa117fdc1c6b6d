"""The dispatcher's admission and routing rules, shared by the dispatcher service and the simulator."""

from __future__ import annotations

from kunserve.shared.policy import dispatch_rules
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad


def _router() -> FreenessRouter:
    r = FreenessRouter()
    r.update(RoutingLoad("w0", kv_blocks_total=100, kv_blocks_used=60, healthy=True, report_time=1.0))
    r.update(RoutingLoad("w1", kv_blocks_total=100, kv_blocks_used=10, healthy=True, report_time=1.0))
    r.update(RoutingLoad("w2", kv_blocks_total=300, healthy=True, report_time=1.0, serving=False))  # a group's stage
    r.update(RoutingLoad("w3", kv_blocks_total=100, healthy=False, report_time=1.0))  # dead
    return r


def test_capacity_counts_live_workers_and_routable_kv():
    assert dispatch_rules.capacity(_router()) == (3, 200 * 16)


def test_admission_bounds_scale_with_live_workers_unless_configured():
    kw = {"max_inflight_per_worker": 8, "max_prompt_tokens": 2048}
    assert dispatch_rules.admission_bounds(max_queued_prompt_tokens=0, live_workers=3, kv_tokens=3200, **kw) == (24, 3200)
    assert dispatch_rules.admission_bounds(max_queued_prompt_tokens=0, live_workers=0, kv_tokens=0, **kw) == (8, 2048)
    assert dispatch_rules.admission_bounds(max_queued_prompt_tokens=500, live_workers=2, kv_tokens=3200, **kw) == (16, 500)


def test_routing_picks_the_freest_routable_worker_and_waits_only_while_one_may_come():
    r = _router()
    assert dispatch_rules.choose_worker(r, offline=False, tokens=10) == "w1"
    assert dispatch_rules.choose_worker(r, offline=False, tokens=10, exclude={"w1"}) == "w0"
    assert dispatch_rules.choose_worker(r, offline=True, tokens=10) == "w1"
    assert dispatch_rules.choose_worker(r, offline=False, tokens=10, exclude={"w0", "w1"}) is None
    assert dispatch_rules.may_wait_for_route(r, now=5.0, deadline=6.0, exclude={"w0", "w1"})  # w2 is alive
    assert not dispatch_rules.may_wait_for_route(r, now=6.0, deadline=6.0)
    assert not dispatch_rules.may_wait_for_route(r, now=5.0, deadline=6.0, exclude={"w0", "w1", "w2"})


def test_a_long_prompt_is_refused_naming_the_limit_that_applies():
    auto = dispatch_rules.prompt_too_long(5000, "tokens", context_len=4096, max_prompt_tokens=4096, auto_prompt_tokens=True)
    assert auto == "prompt: 5000 tokens exceed the model context of 4096 tokens"
    set_ = dispatch_rules.prompt_too_long(600, "token ids", context_len=4096, max_prompt_tokens=512, auto_prompt_tokens=False)
    assert set_ == "prompt: 600 token ids exceed dispatcher.max_prompt_tokens = 512 tokens"
