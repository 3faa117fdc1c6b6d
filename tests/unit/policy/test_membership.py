"""Runtime membership: seeds from the config, workers that join and leave, standby offers, model checks."""

from __future__ import annotations

from kunserve.shared.policy.membership import (
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    Accepted,
    Fingerprint,
    Membership,
    Refused,
    Registration,
)

MODEL = Fingerprint(
    model_name="tiny", architecture="llama", num_layers=4, hidden_size=256, vocab_size=4096, dtype="float32", checkpoint="embedded seed 0"
)


def cluster(timeout: float = 10.0) -> Membership:
    m = Membership({"worker-0": "h:1", "worker-1": "h:2"}, member_timeout_s=timeout)
    assert isinstance(m.register(Registration("worker-0", "h:1", MODEL, "a"), now=1.0), Accepted)
    return m


def join(m: Membership, wid: str = "worker-2", now: float = 2.0, incarnation: str = "i2", **kw) -> Accepted | Refused:
    return m.register(Registration(wid, f"{wid}:9", MODEL, incarnation, **kw), now)


def test_seeds_are_members_in_config_order_before_anyone_registers():
    m = Membership({"b": "h:2", "a": "h:1"})
    assert m.ids == ["b", "a"]
    assert m.address("a") == "h:1"
    assert not m.joined("a")


def test_a_joiner_before_any_seed_registered_is_told_to_retry():
    m = Membership({"worker-0": "h:1"})
    r = join(m)
    assert isinstance(r, Refused) and r.code == UNAVAILABLE


def test_a_worker_with_the_clusters_model_joins_as_a_member_and_the_version_moves():
    m = cluster()
    v = m.version
    r = join(m)
    assert isinstance(r, Accepted) and r.joined and not r.seed
    assert m.version == v + 1 == r.version
    assert m.ids == ["worker-0", "worker-1", "worker-2"]
    assert r.members == ("worker-0", "worker-1", "worker-2")
    assert m.joined("worker-2") and m.address("worker-2") == "worker-2:9"
    again = join(m, now=3.0)
    assert isinstance(again, Accepted) and not again.joined and m.version == v + 1  # a heartbeat changes nothing


def test_a_different_model_is_refused_naming_every_difference():
    m = cluster()
    other = Fingerprint(
        model_name="tiny",
        architecture="llama",
        num_layers=8,
        hidden_size=512,
        vocab_size=4096,
        dtype="float32",
        checkpoint="embedded seed 0",
    )
    r = m.register(Registration("worker-2", "w:1", other, "x"), now=2.0)
    assert isinstance(r, Refused) and r.code == FAILED_PRECONDITION
    assert "num_layers: 8 (the cluster's: 4)" in r.message and "hidden_size: 512 (the cluster's: 256)" in r.message
    assert "worker-2" not in m.ids


def test_unknown_fields_are_not_compared_and_a_later_seed_fills_them_in():
    m = Membership({"worker-0": "h:1", "worker-1": "h:2"})
    m.register(Registration("worker-0", "h:1", Fingerprint(model_name="tiny", num_layers=4), "a"), 1.0)
    m.register(Registration("worker-1", "h:2", MODEL, "b"), 1.0)
    assert m.reference == MODEL
    r = m.register(Registration("worker-2", "w:1", Fingerprint(num_layers=4, checkpoint="other"), "x"), 2.0)
    assert isinstance(r, Refused) and "checkpoint: other" in r.message


def test_a_seed_cannot_be_standby_and_an_empty_address_is_invalid():
    m = cluster()
    r = m.register(Registration("worker-1", "h:2", MODEL, "b", standby=True), 2.0)
    assert isinstance(r, Refused) and r.code == INVALID_ARGUMENT
    r = m.register(Registration("worker-9", "", MODEL, "b"), 2.0)
    assert isinstance(r, Refused) and r.code == INVALID_ARGUMENT


def test_standby_offers_are_not_members_until_activated_then_drain_back():
    m = cluster()
    v = m.version
    r = join(m, standby=True)
    assert isinstance(r, Accepted) and r.standby and "worker-2" not in m.ids and "worker-2" in m.standby
    assert m.version == v
    r = join(m, now=3.0)  # activated: registers as a member
    assert isinstance(r, Accepted) and r.joined and "worker-2" in m.ids and "worker-2" not in m.standby
    r = join(m, now=4.0, standby=True)  # drained back to standby
    assert isinstance(r, Accepted) and r.standby and "worker-2" not in m.ids and "worker-2" in m.standby
    assert m.version == v + 2


def test_deregistered_incarnation_cannot_rejoin_but_a_restart_can():
    m = cluster()
    join(m)
    assert m.deregister("worker-2")
    assert "worker-2" not in m.ids
    late = join(m, now=3.0)  # a heartbeat already on its way when it left
    assert isinstance(late, Accepted) and late.removed and "worker-2" not in m.ids
    restarted = join(m, now=4.0, incarnation="i2-new")
    assert isinstance(restarted, Accepted) and restarted.joined and "worker-2" in m.ids


def test_seeds_never_leave():
    m = cluster()
    assert not m.deregister("worker-0")
    assert m.expire(1000.0) == ([], [])
    assert "worker-0" in m.ids


def test_silent_joined_workers_and_standbys_expire_after_the_timeout():
    m = cluster(timeout=5.0)
    join(m, now=2.0)
    join(m, "worker-3", now=2.0, incarnation="i3", standby=True)
    m.heard("worker-2", 6.0)
    assert m.expire(7.5) == ([], ["worker-3"])  # worker-3's offer is 5.5 s old
    assert m.expire(11.5) == (["worker-2"], [])
    assert m.ids == ["worker-0", "worker-1"]


def test_a_joined_worker_is_plannable_once_every_live_member_applied_its_version():
    m = cluster()
    m.register(Registration("worker-1", "h:2", MODEL, "b"), 1.0)
    r = join(m, now=2.0)
    assert isinstance(r, Accepted)
    assert m.plannable("worker-0", 2.0) and not m.plannable("worker-2", 2.0)
    for wid, addr, inc in (("worker-0", "h:1", "a"), ("worker-1", "h:2", "b"), ("worker-2", "worker-2:9", "i2")):
        m.register(Registration(wid, addr, MODEL, inc, members_version=r.version), 3.0)
    assert m.plannable("worker-2", 3.0)
    # a member that went silent does not hold the others back
    join(m, "worker-3", now=4.0, incarnation="i3")
    for wid, addr, inc in (("worker-0", "h:1", "a"), ("worker-2", "worker-2:9", "i2"), ("worker-3", "worker-3:9", "i3")):
        m.register(Registration(wid, addr, MODEL, inc, members_version=m.version), 20.0)
    assert m.plannable("worker-3", 20.0)  # worker-1 was last heard at 3.0


def test_draining_members_are_not_plannable_and_seeds_cannot_drain():
    m = cluster()
    join(m)
    assert not m.drain("worker-0")
    assert m.drain("worker-2") and m.draining("worker-2")
    assert not m.plannable("worker-2", 2.0)
    m.undrain("worker-2")
    assert not m.draining("worker-2")


def test_a_member_that_comes_back_at_another_address_rejoins_there():
    m = cluster()
    join(m)
    v = m.version
    r = m.register(Registration("worker-2", "elsewhere:1", MODEL, "i2"), 3.0)
    assert isinstance(r, Accepted) and r.joined and m.address("worker-2") == "elsewhere:1"
    assert m.version == v + 2  # left and joined


def test_a_worker_drained_back_to_standby_is_offered_again_under_the_same_incarnation():
    m = cluster()
    join(m)
    m.deregister("worker-2")
    r = join(m, now=3.0, standby=True)
    assert isinstance(r, Accepted) and r.standby and not r.removed and "worker-2" in m.standby


def test_a_new_joiner_does_not_make_earlier_joined_workers_unplannable():
    """worker-3's join reply listed worker-2: its first heartbeat (version 0) does not hold worker-2 back."""
    m = cluster()
    m.register(Registration("worker-1", "h:2", MODEL, "b"), 1.0)
    r = join(m, now=2.0)
    assert isinstance(r, Accepted)
    for wid, addr, inc in (("worker-0", "h:1", "a"), ("worker-1", "h:2", "b"), ("worker-2", "worker-2:9", "i2")):
        m.register(Registration(wid, addr, MODEL, inc, members_version=r.version), 3.0)
    assert m.plannable("worker-2", 3.0)
    assert isinstance(join(m, "worker-3", now=4.0, incarnation="i3"), Accepted)  # members_version 0
    assert m.plannable("worker-2", 4.0)
    assert not m.plannable("worker-3", 4.0)  # the others have not applied the list with worker-3 yet


def test_after_a_restart_the_version_base_keeps_old_acks_from_counting():
    """A restarted memory manager starts at a higher base: a seed that last applied the predecessor's version does
    not count as having applied the list with a worker that joins the new one."""
    old = cluster()
    old.version = 1_000
    join(old)
    seeds_applied = old.version  # what the seeds last got from the predecessor
    new = Membership({"worker-0": "h:1", "worker-1": "h:2"}, version=2_000)
    for wid, addr, inc in (("worker-0", "h:1", "a"), ("worker-1", "h:2", "b")):
        new.register(Registration(wid, addr, MODEL, inc, members_version=seeds_applied), 1.0)
    r = join(new, now=2.0)
    assert isinstance(r, Accepted) and r.version > seeds_applied
    assert not new.plannable("worker-2", 2.0)
    for wid, addr, inc in (("worker-0", "h:1", "a"), ("worker-1", "h:2", "b"), ("worker-2", "worker-2:9", "i2")):
        new.register(Registration(wid, addr, MODEL, inc, members_version=r.version), 3.0)
    assert new.plannable("worker-2", 3.0)


def test_a_stale_deregistration_of_another_incarnation_changes_nothing():
    m = cluster()
    join(m, incarnation="old")
    join(m, now=3.0, incarnation="new")  # restarted under its name
    assert not m.deregister("worker-2", "old")
    assert "worker-2" in m.ids
    assert m.deregister("worker-2", "new") and "worker-2" not in m.ids
    join(m, "worker-3", now=4.0, incarnation="s1", standby=True)
    assert not m.deregister("worker-3", "s0") and "worker-3" in m.standby
    assert m.deregister("worker-3", "s1") and "worker-3" not in m.standby
