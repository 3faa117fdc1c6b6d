"""Conservation in every overload policy: every request finishes or is reported failed, no token is generated twice
(the simulator raises SimulationError on a repeated or missing token index), and KV blocks in use are exactly what
the requests' tables hold, never above capacity (checked after every event)."""

from __future__ import annotations

import pytest

from kunserve.benchkit.trace import TraceRequest
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES
from kunserve.sim.cluster import SimRequest, Simulation, SimulationError


@pytest.mark.parametrize("policy", OVERLOAD_POLICIES)
def test_every_request_ends_once_with_all_its_tokens(make_setup, bursty_trace, policy):
    sim = Simulation(make_setup(policy), bursty_trace, check_invariants=True)
    out = sim.run()
    results = out.replay.results
    assert len(results) == len(bursty_trace)
    for r, req in zip(results, sorted(bursty_trace, key=lambda r: r.arrival_s)):
        assert r.ok or r.error, "a request neither finished nor failed"
        if r.ok:
            assert r.tokens == req.output_tokens
            assert r.token_times_s == sorted(r.token_times_s)
            assert r.ttft_s == r.token_times_s[0] > 0
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    for w in sim.workers.values():  # everything left: no block held, nothing queued
        assert w.allocator.num_used == 0 and not w.seqs
        assert not w.scheduler.running and not w.scheduler.waiting


def test_a_request_the_engine_refuses_fails_with_the_engines_message(make_setup):
    # 2000 prompt tokens + 100 out exceed the embedded model's 2048-token context: the worker's own validation says so
    trace = [TraceRequest(0.0, 2000, 100), TraceRequest(0.1, 100, 10)]
    out = Simulation(make_setup("recompute"), trace).run()
    bad, good = out.replay.results
    assert not bad.ok and bad.error.startswith("INVALID_ARGUMENT") and "context" in bad.error
    assert good.ok and good.tokens == 10


def test_a_token_generated_twice_is_an_error(make_setup):
    sim = Simulation(make_setup("recompute"), [TraceRequest(0.0, 10, 3)])
    req = SimRequest(0, "r", 0.0, 10, 3)
    sim.token(req, 0, False)
    with pytest.raises(SimulationError, match="generated twice"):
        sim.token(req, 0, False)


def test_kv_over_capacity_is_caught(make_setup, bursty_trace):
    sim = Simulation(make_setup("recompute"), bursty_trace)
    w = next(iter(sim.workers.values()))
    w.allocator.allocate(3)  # blocks no request holds
    with pytest.raises(SimulationError, match="blocks in use"):
        sim.verify()
