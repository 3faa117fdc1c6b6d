"""The routing policy while workers re-form (shared/policy/router.py): a worker that refused a request as not serving
and then went silent (a tensor-parallel re-form restarts it in place) is still worth waiting for, until a report taken
after the refusal says it serves; a worker that never refused and stopped answering is not."""

from __future__ import annotations

from kunserve.shared.policy.router import FreenessRouter, RoutingLoad


def load(wid: str, t: float, healthy: bool = True, serving: bool = True) -> RoutingLoad:
    return RoutingLoad(wid, 100, 0, 0, 16, healthy, t, serving=serving)


def test_a_refusing_worker_that_restarts_is_waited_for_until_it_reports():
    r = FreenessRouter()
    r.update(load("w0", 1.0))
    r.update(load("w1", 1.0))
    r.refused("w0", now=2.0)  # "re-forming": its stream ended with FAILED_PRECONDITION
    r.update(load("w0", 2.5, serving=False))  # still up a moment, not serving
    r.set_healthy("w0", False)  # then its stats stopped answering: it re-executes
    r.set_healthy("w1", False)  # the other member too, and it refused nothing this dispatcher sent
    assert r.choose() is None and r.may_become_routable()
    assert not r.may_become_routable(exclude={"w0"})
    r.update(load("w0", 3.0, serving=True))  # back, serving (rank 0 of the new instance)
    assert r.choose() == "w0"
    r.set_healthy("w0", False)  # gone again without refusing anything: nothing to wait for
    assert not r.may_become_routable()
