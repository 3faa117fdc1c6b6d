"""The routing policy while workers re-form (shared/policy/router.py): a worker that said it is re-forming (its stats
or its refusal) and then went silent (a tensor-parallel re-form restarts it in place) is worth waiting for, until a
report says it serves, its deadline passes or it is forgotten; a worker that merely refused a request or timed out a
poll and then stopped answering is not."""

from __future__ import annotations

from kunserve.shared.policy.router import FreenessRouter, RoutingLoad


def load(wid: str, t: float, healthy: bool = True, serving: bool = True) -> RoutingLoad:
    return RoutingLoad(wid, 100, 0, 0, 16, healthy, t, serving=serving)


def test_a_reforming_worker_that_restarts_is_waited_for_until_it_reports():
    r = FreenessRouter()
    r.update(load("w0", 1.0))
    r.update(load("w1", 1.0))
    r.reforming("w0", now=2.0, until=60.0)  # its stream ended with FAILED_PRECONDITION "re-forming"
    r.update(load("w0", 1.5))  # a poll sent before the refusal, answering late: cannot make it routable
    assert r.choose() == "w1"
    r.set_healthy("w0", False)  # then its stats stopped answering: it re-executes
    r.set_healthy("w1", False)  # the other member too, and it said nothing
    assert r.choose() is None and r.may_become_routable(now=3.0)
    assert not r.may_become_routable(exclude={"w0"}, now=3.0)
    r.update(load("w0", 4.0, serving=True))  # back, serving (rank 0 of the new instance)
    assert r.choose() == "w0"
    r.set_healthy("w0", False)  # gone again without saying it re-forms: nothing to wait for
    assert not r.may_become_routable(now=5.0)


def test_a_reform_is_waited_for_only_until_its_deadline():
    r = FreenessRouter()
    r.update(load("w0", 1.0))
    r.update(load("w0", 2.0, serving=False))
    r.reforming("w0", now=2.0, until=30.0)  # its stats said it re-forms
    r.set_healthy("w0", False)
    assert r.may_become_routable(now=29.0)
    assert not r.may_become_routable(now=30.0)  # it never came back: requests fail instead of waiting


def test_a_dead_worker_that_once_refused_is_not_worth_waiting_for():
    r = FreenessRouter()
    r.update(load("w0", 1.0))
    r.refused("w0", 2.0)  # a poll that timed out, or a FAILED_PRECONDITION during a drop
    r.set_healthy("w0", False)  # then it died: its polls fail with UNAVAILABLE
    assert r.choose() is None
    assert not r.may_become_routable(now=3.0)
    assert not r.may_become_routable()


def test_requests_arriving_while_every_worker_reforms_wait():
    r = FreenessRouter()
    for w in ("w0", "w1"):
        r.update(load(w, 1.0))
    # nothing was running, so no request was refused: a poll during the re-form said so, then the polls failed
    for w in ("w0", "w1"):
        r.update(load(w, 2.0, serving=False))
        r.reforming(w, now=2.0, until=60.0)
        r.set_healthy(w, False)
    assert r.choose() is None
    assert r.may_become_routable(now=3.0)


def test_a_removed_worker_is_forgotten():
    r = FreenessRouter()
    r.update(load("joined-7", 1.0))
    r.routed("joined-7", "req", 32, now=1.5)
    r.reforming("joined-7", now=2.0, until=60.0)
    r.forget("joined-7")  # it left the cluster
    assert r.workers == {} and r._pending == {} and r._refused_at == {} and r._back_by == {}
    assert not r.may_become_routable(now=3.0)
    r.update(load("joined-7", 4.0))  # an id used again is a new worker
    assert r.choose() == "joined-7"
