"""The engine's side of a coordinated transition (KunServe §4.2): requests whose KV is still landing are held out of
the scheduler while the others run, released once every receiving member has reported, and their greedy tokens
then equal an uninterrupted run's. Simulated in one engine: snapshot mid-decode, clear (as a transition does,
the KV bytes stay in the pool), wipe the held requests' KV, install with a landing, land the saved bytes later."""

from __future__ import annotations

import pytest
import torch
from engine_testing import MID_DECODE_REQS, finish, one_torch_thread, run_until_mid_decode, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.kv_landing import KVLanding
from kunserve.shared.model.architecture import TINY_CONFIG

CFG = TINY_CONFIG
EPOCH = 7


def make() -> Engine:
    return Engine(CFG, weights_for(CFG), num_kv_blocks=40, block_size=8,
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=48))


def uninterrupted() -> dict[str, list[int]]:
    eng = make()
    return finish(eng, run_until_mid_decode(eng, MID_DECODE_REQS))


def relanded(held_ids: set[str]) -> tuple[Engine, dict[str, list[int]], dict[str, torch.Tensor], list]:
    """An engine whose requests in `held_ids` wait for KV from "w1" (their blocks wiped); returns it, the tokens so
    far, the saved KV of the held requests and the snapshots."""
    eng = make()
    out = run_until_mid_decode(eng, MID_DECODE_REQS)
    snaps = eng.snapshot()
    held = [s for s in snaps if s.request.request_id in held_ids]
    assert held and all(s.blocks for s in held)
    saved = {s.request.request_id: eng.export_blocks(s.blocks, 0, CFG.num_layers) for s in held}
    eng.clear()
    for s in held:
        eng.import_blocks(s.blocks, 0, CFG.num_layers, torch.zeros_like(saved[s.request.request_id]))
    eng.install(snaps, KVLanding.expecting(EPOCH, {rid: {"w1"} for rid in held_ids}))
    return eng, out, saved, snaps


def decoding_ids() -> set[str]:
    eng = make()
    run_until_mid_decode(eng, MID_DECODE_REQS)
    return {s.request_id for s in eng.seqs.values() if s.generated and s.block_table}


def test_held_requests_wait_while_the_others_run_then_finish_with_the_reference_tokens():
    held_ids = decoding_ids()
    eng, out, saved, snaps = relanded(held_ids)
    before = {rid: len(out[rid]) for rid in held_ids}
    for _ in range(6):  # the others progress; the held ones produce nothing
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    assert {rid: len(out[rid]) for rid in held_ids} == before
    assert eng.kv_landing and eng.landing_epoch == EPOCH
    blocks = {s.request.request_id: s.blocks for s in snaps}
    assert not eng.land_blocks(EPOCH + 1, blocks[min(held_ids)], 0, CFG.num_layers, saved[min(held_ids)])  # stale
    assert not eng.export_blocks(blocks[min(held_ids)], 0, CFG.num_layers).any(), "a stale landing wrote KV"
    assert eng.kv_landed(EPOCH + 1, "w1", sorted(held_ids)) == []  # another transition's report: ignored
    for rid in sorted(held_ids):
        assert eng.land_blocks(EPOCH, blocks[rid], 0, CFG.num_layers, saved[rid])
    assert sorted(eng.kv_landed(EPOCH, "w1", sorted(held_ids))) == sorted(held_ids)
    assert not eng.kv_landing
    assert finish(eng, out) == uninterrupted()


def test_only_held_requests_left_is_no_work_and_a_step_does_nothing():
    eng = make()
    run_until_mid_decode(eng, MID_DECODE_REQS)
    snaps = [s for s in eng.snapshot() if s.blocks]
    eng.clear()
    eng.install(snaps, KVLanding.expecting(EPOCH, {s.request.request_id: {"w0", "w1"} for s in snaps}))
    assert not eng.has_work() and eng.step() == []
    ids = [s.request.request_id for s in snaps]
    assert eng.kv_landed(EPOCH, "w0", ids) == []  # w1 still owes its share
    assert sorted(eng.kv_landed(EPOCH, "w1", ids)) == sorted(ids) and eng.has_work()


def test_an_aborted_held_request_keeps_its_blocks_until_its_kv_has_landed():
    held_ids = decoding_ids()
    victim = min(held_ids)
    eng, _, _, snaps = relanded(held_ids)
    blocks = next(s.blocks for s in snaps if s.request.request_id == victim)
    used = eng.allocator.num_used
    assert eng.abort(victim) and victim not in eng.seqs
    assert eng.allocator.num_used == used  # KV is still being written into them
    eng.kv_landed(EPOCH, "w1", [victim])
    assert eng.allocator.num_used == used - len(blocks)
    eng.kv_landed(EPOCH, "w1", sorted(held_ids - {victim}))
    assert not eng.kv_landing


def test_a_group_breaking_turns_held_requests_into_recompute_preemptions():
    """preempt_all (a member was lost): the held requests' KV will never land; they re-prefill and their greedy
    tokens are still the reference's, and later landing reports are ignored."""
    held_ids = decoding_ids()
    eng, out, _, _ = relanded(held_ids)
    eng.preempt_all()
    assert not eng.kv_landing and eng.landing_epoch is None
    assert eng.kv_landed(EPOCH, "w1", sorted(held_ids)) == []
    ref = uninterrupted()
    got = finish(eng, out)
    for rid in ref:
        if MID_DECODE_REQS[[r.request_id for r in MID_DECODE_REQS].index(rid)].sampling.greedy:
            assert got[rid] == ref[rid], rid


def test_a_landing_that_will_never_complete_re_prefills_only_the_held_requests():
    """abandon_landing (a whole instance after a restore whose sender was lost): the held requests re-prefill, an
    aborted one's blocks are freed, the running ones go on untouched, nothing more of that landing is written,
    and greedy tokens are the reference's."""
    held_ids = decoding_ids()
    victim = min(held_ids)
    eng, out, saved, snaps = relanded(held_ids)
    others = {rid: (s.num_computed, s.num_preemptions) for rid, s in eng.seqs.items() if rid not in held_ids}
    assert others, "some requests run beside the held ones"
    assert eng.abandon_landing(EPOCH + 1) == [] and eng.kv_landing
    assert eng.abort(victim)
    del out[victim]
    assert sorted(eng.abandon_landing(EPOCH)) == sorted(held_ids - {victim})
    assert not eng.kv_landing and eng.landing_epoch is None
    assert {rid: (eng.seqs[rid].num_computed, eng.seqs[rid].num_preemptions) for rid in others} == others
    rid = min(held_ids - {victim})
    blocks = next(s.blocks for s in snaps if s.request.request_id == rid)
    assert not eng.land_blocks(EPOCH, blocks, 0, CFG.num_layers, saved[rid])
    assert eng.kv_landed(EPOCH, "w1", sorted(held_ids)) == []
    got = finish(eng, out)  # every block free at the end: the aborted request's too
    ref = uninterrupted()
    for r in MID_DECODE_REQS:
        if r.request_id != victim and r.sampling.greedy:
            assert got[r.request_id] == ref[r.request_id], r.request_id


def test_a_group_breaking_frees_the_blocks_of_aborted_held_requests():
    held_ids = decoding_ids()
    eng, out, _, _ = relanded(held_ids)
    for rid in held_ids:
        assert eng.abort(rid)
        del out[rid]
    eng.preempt_all()
    assert not eng.kv_landing
    finish(eng, out)  # asserts every block is free


@pytest.mark.parametrize("waits, expected", [
    ({"a": {"w0"}, "b": {"w0", "w1"}}, ["a"]),
    ({"a": set()}, []),  # nothing to wait for: never held
])
def test_kv_landing_releases_a_request_when_its_last_worker_reports(waits, expected):
    landing = KVLanding.expecting(1, waits)
    assert landing.landed("w0", ["a", "b", "zzz"]) == expected
    assert landing.landed("w1", ["b"]) == (["b"] if "b" in waits else [])


def test_aborting_a_held_request_never_shows_another_thread_no_landing_in_between():
    """kv_landing is read from other threads (the worker's status): while the only held request is aborted it moves
    from the held requests to the aborted ones, and at no moment is it in neither."""
    victim = min(decoding_ids())
    eng, _, _, _ = relanded({victim})
    seen: list[bool] = []

    class Watched(dict):
        def pop(self, *args):
            out = super().pop(*args)
            seen.append(eng.kv_landing)
            return out

        def __delitem__(self, key):
            super().__delitem__(key)
            seen.append(eng.kv_landing)

    eng._held = Watched(eng._held)
    assert eng.kv_landing and eng.abort(victim)
    assert seen and all(seen), "a reader saw no landing while the aborted request's KV was still coming"
    assert eng.kv_landing
    eng.kv_landed(EPOCH, "w1", [victim])
    assert not eng.kv_landing and eng.allocator.num_used == sum(len(s.block_table) for s in eng.seqs.values())
