"""A follower's membership during a layer-staggered split (services/worker/tp_member.py `broken`): a follower that
heals from a failed split (its group broken by the failed collective, its engine whole again) is not broken to the
watch that would end the worker, while one whose loop failed otherwise is. Rank 0 and the follower run over a real
gloo group on two threads; the follower's part of the split is a stand-in that fails as a real one would."""

from __future__ import annotations

import threading

import pytest

from kunserve.benchkit.tp_members import free_port, on_ranks
from kunserve.services.worker.tp_member import TPMembership
from kunserve.shared.engine.engine import Engine, TPHealed
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.tensor_parallel import LayerSplitter, TPGroup, TPLeader
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import random_weights

pytestmark = pytest.mark.timeout(60)
CFG = TINY_CONFIG.replace(num_layers=1, name="one")
MEMBERS = ("t0", "t1")


def follower_after_stagger(begin: LayerSplitter | Exception) -> tuple[TPMembership, EngineLoop]:
    """Rank 1's membership once rank 0 said STAGGER and the follower's begin raised `begin`."""
    port = free_port()
    groups = on_ranks(2, lambda r: TPGroup(r, 2, "127.0.0.1", port, timeout_s=10, rendezvous_timeout_s=30))
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    tp = TPMembership(0, 1, MEMBERS, "127.0.0.1", port, 10.0, 30.0, in_place=True)
    ended = threading.Event()

    def begin_stagger() -> LayerSplitter:
        assert tp.follower is not None and tp.follower.changing  # the watch leaves a member alone meanwhile
        assert tp.broken(loop) is None
        groups[1].broken = "tensor-parallel all-gather failed on rank 1 of 2"  # what a failed collective leaves
        if isinstance(begin, Exception):
            raise begin
        return begin

    tp.follow(groups[1], loop.engine, 1, on_end=lambda f: ended.set(), begin_stagger=begin_stagger)
    assert tp.follower is not None
    tp.follower.start()
    TPLeader(groups[0]).stagger()
    assert ended.wait(30)
    for g in groups:
        g.close()
    return tp, loop


def test_a_follower_healed_from_a_failed_split_is_not_broken():
    tp, loop = follower_after_stagger(TPHealed("in-place TP2 staggered scale-down failed on rank 1; healed"))
    f = tp.follower
    assert f is not None and f.healed is not None and f.error is None and not f.changing
    assert tp.broken(loop) is None  # whole again: the servicer leaves the instance, the worker serves on


def test_a_follower_whose_split_failed_otherwise_is_broken():
    tp, loop = follower_after_stagger(RuntimeError("could not heal"))
    f = tp.follower
    assert f is not None and f.healed is None and f.error is not None and "could not heal" in f.error
    assert tp.broken(loop) is not None  # its state is not known: the watch ends the worker


def test_a_follower_told_to_move_a_layer_with_no_split_begun_is_broken():
    port = free_port()
    groups = on_ranks(2, lambda r: TPGroup(r, 2, "127.0.0.1", port, timeout_s=10, rendezvous_timeout_s=30))
    loop = EngineLoop(Engine(CFG, random_weights(CFG, 0), num_kv_blocks=64, block_size=8))
    tp = TPMembership(0, 1, MEMBERS, "127.0.0.1", port, 10.0, 30.0, in_place=True)
    tp.follow(groups[1], loop.engine, 1)
    assert tp.follower is not None
    tp.follower.start()
    TPLeader(groups[0]).split_layer()
    assert tp.follower.join(30)
    for g in groups:
        g.close()
    assert tp.follower.error is not None and "no split begun" in tp.follower.error
    assert tp.broken(loop) is not None
