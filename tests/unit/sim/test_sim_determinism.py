"""The simulator is a pure function of its inputs: the same trace, config and seed give the same run."""

from __future__ import annotations

from kunserve.benchkit.trace import Burst, generate_trace
from kunserve.sim.cluster import Simulation


def _run(setup, trace):
    out = Simulation(setup, trace).run()
    return [r.to_dict() for r in out.replay.results], [s.to_dict() for s in out.replay.samples], out.transitions


def test_same_inputs_same_run(make_setup, bursty_trace):
    first = _run(make_setup("kunserve"), bursty_trace)
    second = _run(make_setup("kunserve"), bursty_trace)
    assert first == second
    assert first[2], "the burst should make kunserve drop (else this test shows little)"


def test_another_seed_another_run(make_setup):
    def trace(seed):
        return generate_trace(
            rate=1.0, cv=1.0, duration_s=20.0, seed=seed, scale=0.5, burst=[Burst(3.0, 6.0, 12.0)], max_prompt=1024, max_output=256
        )

    a = _run(make_setup("recompute"), trace(1))
    b = _run(make_setup("recompute"), trace(2))
    assert a[0] != b[0]
