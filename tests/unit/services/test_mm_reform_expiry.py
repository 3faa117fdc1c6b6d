"""Membership expiry during a tensor-parallel re-form (services/memory_manager/tp_reform.py TPReformer.reforming,
servicer.py MemoryManager.refresh): the members of a re-form under way re-execute and answer nothing for longer than
member_timeout_s may allow, and must not expire meanwhile (the autoscaler would count them gone and the dispatcher
drop them); once the re-form is over, a member that stays silent expires as usual."""

from __future__ import annotations

import asyncio

import pytest
from helpers import make_config

from kunserve.services.memory_manager.orchestrator import OrchestrationError
from kunserve.services.memory_manager.servicer import MemoryManager
from kunserve.shared.policy.membership import Accepted, Fingerprint, Registration

pytestmark = pytest.mark.timeout(60)
MODEL = Fingerprint(
    model_name="tiny", architecture="llama", num_layers=4, hidden_size=256, vocab_size=4096, dtype="float32", checkpoint="embedded seed 0"
)


def test_the_members_of_a_reform_under_way_do_not_expire():
    async def scenario() -> tuple[bool, bool]:
        cfg = make_config(2)
        now = [100.0]
        mm = MemoryManager(cfg, clock=lambda: now[0])
        try:
            for w in cfg.workers:  # the seeds registered: the cluster's model is known
                mm.register(Registration(w.id, w.address, MODEL))
            assert isinstance(mm.register(Registration("joined-1", "127.0.0.1:9", MODEL)), Accepted)
            mm.tp.reforming.add("joined-1")  # it re-executes with its new membership
            now[0] += 3 * mm.membership.member_timeout_s
            await mm.refresh(timeout=0.2)
            kept = mm.membership.joined("joined-1")
            mm.tp.reforming.clear()  # the re-form ended; it never came back
            now[0] += 3 * mm.membership.member_timeout_s
            gone, _ = mm.membership.expire(now[0])
            return kept, gone == ["joined-1"]
        finally:
            await mm.close()

    kept, expired_after = asyncio.run(scenario())
    assert kept and expired_after


def test_a_reform_holds_its_members_while_it_runs_and_lets_go_after():
    from test_tp_reform_orchestration import FakeCluster, reformer, transform

    c = FakeCluster()
    for w in ("w0", "w1"):
        c.add(w)
    r = reformer(c)
    during: list[set[str]] = []
    for w in c.workers.values():
        original = w.ReformTP

        async def recording(request, timeout=None, original=original):
            during.append(set(r.reforming))
            return await original(request, timeout)

        w.ReformTP = recording  # type: ignore[method-assign]
    assert transform(r, ["w0", "w1"]).completed
    assert during == [{"w0", "w1"}, {"w0", "w1"}] and r.reforming == set()
    with pytest.raises(OrchestrationError):  # refused before any worker is touched: nothing is held either
        transform(r, ["w0", "missing"])
    assert r.reforming == set()


def test_overlapping_refreshes_skip_a_member_the_other_expired():
    async def scenario() -> list[str]:
        cfg = make_config(2)
        now = [100.0]
        mm = MemoryManager(cfg, clock=lambda: now[0])
        try:
            for w in cfg.workers:
                mm.register(Registration(w.id, w.address, MODEL))
            mm.register(Registration("joined-1", "127.0.0.1:9", MODEL))  # its join starts a refresh of its own
            now[0] += 3 * mm.membership.member_timeout_s
            await asyncio.gather(mm.refresh(timeout=0.2), mm.refresh(timeout=0.2))  # both list joined-1 first
            return mm.membership.ids
        finally:
            await mm.close()

    assert "joined-1" not in asyncio.run(scenario())
