"""Elastic tensor parallelism in the simulator: a request longer than every whole instance's KV is refused without it
and served after a cold scale-up with it, the merged instance splits back once idle, and runs stay deterministic.

The cluster: the embedded model on instances with 26 MiB pools and 256 KiB pages, so a whole instance holds 1280 KV
tokens and a TP2 instance 5632 (the workers' own capacity rule, shared/model/tp_capacity.py), below the model's
2048-token context: a 1500 + 100 token request needs TP2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kunserve.benchkit.trace import TraceRequest
from kunserve.sim.cluster import ClusterSetup, Simulation
from kunserve.sim.shapes import Memory

POOL_BYTES = 26 << 20
PAGE_KIB = 256
LONG = (1500, 100)


@pytest.fixture
def elastic_setup(make_setup: Callable[..., ClusterSetup]) -> Callable[..., ClusterSetup]:
    def make(elastic: bool, instances: int = 3, **config: object) -> ClusterSetup:
        setup = make_setup(
            "kunserve",
            instances=instances,
            dispatcher__elastic_tp=elastic,
            memory_manager__tp_idle_split_s=5.0,
            engine__page_kib=PAGE_KIB,
            **config,
        )
        memory = Memory(setup.shape, POOL_BYTES, PAGE_KIB * 1024)
        return dataclasses.replace(setup, memory=memory, tp_reform_s=2.0)

    return make


def steady_with_long() -> list[TraceRequest]:
    """Short requests every 0.5 s for 25 s, and one long request at 1 s."""
    return [TraceRequest(0.5 * i, 200, 30) for i in range(50)] + [TraceRequest(1.0, *LONG)]


def _long(outcome):
    (r,) = [r for r in outcome.replay.results if (r.prompt_tokens, r.output_tokens) == LONG]
    return r


def test_a_long_request_is_refused_without_elastic_tp(elastic_setup):
    out = Simulation(elastic_setup(False), steady_with_long(), check_invariants=True).run()
    long = _long(out)
    assert not long.ok and long.error.startswith("INVALID_ARGUMENT"), long.error
    assert not [t for t in out.transitions if t["op"].startswith("tp")]
    assert "tp" not in out.counters
    assert all(r.ok for r in out.replay.results if r is not long)


def test_a_long_request_is_served_after_a_scale_up_and_the_instance_splits_when_idle(elastic_setup):
    sim = Simulation(elastic_setup(True), steady_with_long(), check_invariants=True)
    merged_kv: list[int] = []
    worker0 = sim.workers["worker-0"]
    original = worker0._iteration_done

    def spy(it):  # the KV the merged rank 0 holds while it serves the long request
        if worker0.tp_degree == 2:
            merged_kv.append(worker0.allocator.num_used)
        original(it)

    worker0._iteration_done = spy  # type: ignore[method-assign]
    out = sim.run()
    assert all(r.ok for r in out.replay.results), [r.error for r in out.replay.results if not r.ok]
    for r in out.replay.results:  # every token once, in order, whatever was handed over
        assert len(r.token_times_s) == r.output_tokens
        assert r.token_times_s == sorted(r.token_times_s)
    ops = [(t["op"], t["groups"]) for t in out.transitions if t["op"].startswith("tp")]
    assert ops == [("tp", [["worker-0", "worker-1"]]), ("tp-split", [["worker-0"], ["worker-1"]])]
    up, split = (t for t in out.transitions if t["op"].startswith("tp"))
    assert up["committed_s"] - up["started_s"] >= 2.0  # the re-form's restart constant at least
    long = _long(out)
    assert long.worker_id == "worker-0"
    assert long.ttft_s is not None and long.arrival_s + long.ttft_s >= up["committed_s"]
    assert split["started_s"] >= long.arrival_s + long.e2e_s + 5.0  # idle for tp_idle_split_s first
    # the merged instance held more KV than a whole instance has: the long request's
    assert max(merged_kv) * 16 > 1280
    assert out.counters["tp"]["scale_ups"] == 1 and out.counters["tp"]["splits"] == 1
    assert out.counters["tp"]["long_routed"] == 1
    # both workers serve whole again at the end, with a whole instance's KV
    assert [w.tp_degree for w in sim.workers.values()] == [1, 1, 1]
    assert {w.allocator.num_blocks for w in sim.workers.values()} == {80}


def test_handed_over_requests_resume_with_their_tokens(elastic_setup):
    """Requests running on the members when the re-form starts are handed back, re-prefilled elsewhere, and finish
    with every token once."""
    trace = [TraceRequest(0.0, 300, 200) for _ in range(6)] + [TraceRequest(0.5, *LONG)]
    sim = Simulation(elastic_setup(True, instances=2), trace, check_invariants=True)
    out = sim.run()
    assert all(r.ok for r in out.replay.results), [r.error for r in out.replay.results if not r.ok]
    assert out.counters["tp"]["handed_over"] > 0
    resumed = [r for r in sim.requests if r.handed_over]
    assert resumed and all(r.emitted == r.output_tokens for r in resumed)
    assert any(r.resumed_at > 0 for r in resumed)  # some had tokens when handed over: they re-prefilled them


def test_a_request_no_layout_holds_is_refused_with_elastic_tp(elastic_setup):
    """One instance: no TP2 layout exists, so placement refuses it with the cluster's maximum (no re-form)."""
    out = Simulation(elastic_setup(True, instances=1), [TraceRequest(0.0, *LONG)]).run()
    (r,) = out.replay.results
    assert not r.ok and "cluster's maximum: 1280 KV tokens" in r.error, r.error
    assert out.counters["tp"]["long_refused"] == 1 and not out.transitions


def test_elastic_runs_are_deterministic(elastic_setup):
    a = Simulation(elastic_setup(True), steady_with_long()).run()
    b = Simulation(elastic_setup(True), steady_with_long()).run()
    assert [r.token_times_s for r in a.replay.results] == [r.token_times_s for r in b.replay.results]
    assert a.transitions == b.transitions and a.counters == b.counters


def test_a_request_handed_over_long_after_it_arrived_waits_the_whole_route_timeout(elastic_setup):
    """The dispatcher's route deadline restarts with every token: requests decoding for longer than route_timeout_s
    when both workers re-form wait for the merged instance instead of failing at once."""
    trace = [TraceRequest(0.0, 100, 1000) for _ in range(2)] + [TraceRequest(4.0, *LONG)]
    sim = Simulation(elastic_setup(True, instances=2, dispatcher__route_timeout_s=3.0), trace, check_invariants=True)
    out = sim.run()
    assert all(r.ok for r in out.replay.results), [r.error for r in out.replay.results if not r.ok]
    assert any(r.handed_over and r.resumed_at > 0 for r in sim.requests)
