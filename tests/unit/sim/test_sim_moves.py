"""A simulated request records the workers its tokens came from, as a client sees them in the token events: the
integration test `test_sim_agreement.py` compares these trails with a real cluster's."""

from __future__ import annotations

from kunserve.benchkit.trace import TraceRequest
from kunserve.sim.cluster import Simulation

# the integration test's forced scenario: worker-1 runs r1 and r2, r3 waits there past the TTFT SLO, one drop
REQUESTS = [(480, 700), (128, 700), (128, 700), (480, 700), (64, 400)]


def test_a_drop_moves_the_stage_workers_requests_to_the_head(make_setup):
    setup = make_setup(
        engine__max_num_seqs=2,
        slo__ttft_ms=250,
        monitor__policy_interval_s=0.1,
        monitor__restore_hold_s=600.0,
    )
    sim = Simulation(setup, [TraceRequest(i * 0.2, p, o) for i, (p, o) in enumerate(REQUESTS)])
    outcome = sim.run()
    assert all(r.ok for r in outcome.replay.results)
    assert [(t["op"], t["completed"], t["groups"]) for t in outcome.transitions] == [("drop", True, [["worker-0", "worker-1"]])]
    assert [r.served_by for r in sim.requests] == [
        ["worker-0"],
        ["worker-1", "worker-0"],
        ["worker-1", "worker-0"],
        ["worker-0"],  # waited on worker-1 until the drop: its first token came from the head
        ["worker-0"],
    ]
    assert [r.worker_id for r in outcome.replay.results] == ["worker-0"] * len(REQUESTS)
