"""The routing policy (pure): serving vs. healthy, refusals, waiting, pending demand stamped at routing."""

from __future__ import annotations

import pytest

from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad


def load(wid, used=0, t=0.0, healthy=True, serving=True, total=100):
    return RoutingLoad(wid, total, used, 0, 16, healthy, t, serving=serving)


@pytest.mark.parametrize("serving, group, transitioning, start, end, expected", [
    (True, "w0", False, 0, 4, True),     # a whole instance says so
    (True, "g0", False, 0, 2, True),     # the head of a complete group holds only a prefix
    (False, "g0", False, 2, 4, False),   # a non-head member
    (False, "w0", False, 0, 4, False),   # explicit "not serving" wins over a whole layer range
    (True, "w0", True, 0, 4, False),     # in the middle of a drop / restore: requests wait
    (False, "", False, 0, 2, False),     # no unit, not serving, part of the layers
    (False, "", False, 0, 0, False),     # nothing reported at all
])
def test_serving_comes_from_the_stats(serving, group, transitioning, start, end, expected):
    report = WorkerReport(Member("w0", start, end), num_layers_model=4 if end else 0, unit_id=group,
                          serving=serving, transitioning=transitioning)
    assert report.routable is expected


def test_only_healthy_serving_instances_are_chosen():
    r = FreenessRouter()
    r.update(load("a", used=10))
    r.update(load("b", used=0, serving=False))  # most free, but forming a group
    r.update(load("c", used=0, healthy=False))  # dead
    assert r.choose() == "a"
    assert r.choose(exclude={"a"}) is None
    assert r.may_become_routable(exclude={"a"})  # b is alive: worth waiting for
    assert not r.may_become_routable(exclude={"a", "b"})  # only the dead c is left
    r.set_healthy("b", False)
    assert not r.may_become_routable(exclude={"a"})
    assert not FreenessRouter().may_become_routable()


def test_a_refusal_holds_until_a_report_taken_after_it():
    r = FreenessRouter()
    r.update(load("a", t=1.0))
    r.refused("a", now=2.0)
    assert r.choose() is None and r.may_become_routable()
    r.update(load("a", t=1.5))  # a poll sent before the refusal, answering late: still refused
    assert r.choose() is None
    r.update(load("a", t=2.5))  # taken after the refusal, says serving: routable again
    assert r.choose() == "a"
    r.update(load("a", t=3.0, serving=False))
    assert r.choose() is None
    r.refused("zzz", now=1.0)  # unknown instance: remembered, harmless
    r.update(load("zzz", t=0.5))
    assert not r.workers["zzz"].serving


def test_pending_demand_counts_from_the_routing_moment():
    r = FreenessRouter()
    r.update(load("a", t=0.0))
    # The request arrived at t=1 but waited for a routable worker and was routed at t=5: a report
    # taken at t=3 does not include it yet.
    r.routed("a", "r1", 16 * 10, now=5.0)
    r.update(load("a", t=3.0))
    assert r.freeness("a") == 90
    r.update(load("a", used=10, t=6.0))  # now it does
    assert r.freeness("a") == 90
    r.done("a", "r1")
    assert r.freeness("a") == 90
