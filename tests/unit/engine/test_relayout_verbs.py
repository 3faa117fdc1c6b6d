"""The engine's verbs for a layout change: export / import KV blocks (also what swap preemption uses),
become a group head / a later stage / a whole instance, leave a broken group, reset the scheduler, and the
pooled instance's heal. The worker's transition runner only calls these.

Oracle: after an export -> import at new block ids (another engine, or the same one renumbered) the greedy
and seeded tokens equal an uninterrupted run's, which itself matches the dense reference."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from engine_testing import MID_DECODE_REQS, clone, finish, one_torch_thread, run_until_mid_decode, weights_for  # noqa: F401 - fixture
from oracle import compare_greedy

from kunserve.shared.engine.api import SeqSnapshot
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.reference import reference_scores
from kunserve.shared.model.weights import load_model_source

CFG = TINY_CONFIG  # 4 layers
BS = 8
BLOCKS = 40
SCHED = SchedulerConfig(max_num_batched_tokens=48)
REQS = MID_DECODE_REQS


def make(num_blocks: int = BLOCKS, sched: SchedulerConfig = SCHED) -> Engine:
    return Engine(CFG, weights_for(CFG), num_kv_blocks=num_blocks, block_size=BS, scheduler_config=sched)


@functools.lru_cache(maxsize=1)
def uninterrupted() -> dict[str, list[int]]:
    eng = make()
    out = finish(eng, run_until_mid_decode(eng, REQS))
    for r in REQS:
        if r.sampling.greedy:
            ref, margins = reference_scores(CFG, weights_for(CFG), r.prompt_token_ids, out[r.request_id])
            compare_greedy(out[r.request_id], ref, margins)
    return out


def fill_kv(eng: Engine, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(CFG.num_layers):
        cache = eng.kv.layer_cache(layer)
        cache.copy_(torch.randn(cache.shape, generator=g, dtype=cache.dtype))


def renumbered(snaps: list[SeqSnapshot], mapping: dict[int, int]) -> list[SeqSnapshot]:
    return [SeqSnapshot(s.request, list(s.generated), s.num_computed, [mapping[b] for b in s.blocks],
                        s.generator_state, s.num_preemptions) for s in snaps]


# -- export / import --------------------------------------------------------------------------------------

def test_export_then_import_at_new_ids_is_exact():
    src, dst = make(), make(BLOCKS + 9)
    fill_kv(src, 1)
    fill_kv(dst, 2)
    old, new = [3, 7, 1, 20], [41, 0, 5, 12]
    data = src.export_blocks(old, 0, CFG.num_layers)
    assert data.device.type == "cpu"
    assert tuple(data.shape) == (CFG.num_layers * 4, 2, CFG.num_kv_heads, BS, CFG.head_dim)
    for i, layer in enumerate(range(CFG.num_layers)):  # layer-major rows
        assert torch.equal(data[i * 4:(i + 1) * 4], src.kv.layer_cache(layer)[old])
    untouched = [b for b in range(dst.kv.num_blocks) if b not in new]
    before = {layer: dst.kv.layer_cache(layer)[untouched].clone() for layer in range(CFG.num_layers)}
    dst.import_blocks(new, 0, CFG.num_layers, data)
    for layer in range(CFG.num_layers):
        assert torch.equal(dst.kv.layer_cache(layer)[new], src.kv.layer_cache(layer)[old])
        assert torch.equal(dst.kv.layer_cache(layer)[untouched], before[layer])
    # a layer range of its own: only those layers travel and land
    part = src.export_blocks([2], 1, 3)
    assert part.shape[0] == 2
    dst.import_blocks([9], 1, 3, part)
    assert all(torch.equal(dst.kv.layer_cache(x)[9], src.kv.layer_cache(x)[2]) for x in (1, 2))
    # the data is a copy: changing the source afterwards changes nothing exported
    snapshot = data.clone()
    fill_kv(src, 3)
    assert torch.equal(data, snapshot)


def test_import_checks_the_shape_and_the_layers_before_writing():
    eng = make()
    fill_kv(eng)
    data = eng.export_blocks([0, 1], 0, 2)
    before = eng.kv.layer_cache(0).clone()
    with pytest.raises(ValueError, match="expected"):
        eng.import_blocks([4, 5, 6], 0, 2, data)  # 3 blocks, data for 2
    with pytest.raises(ValueError, match="expected"):
        eng.import_blocks([4, 5], 0, 3, data)  # 3 layers, data for 2
    assert torch.equal(eng.kv.layer_cache(0), before)
    eng.use_weights(weights_for(CFG), (0, 2))
    with pytest.raises(ValueError, match=r"not within the held \[0, 2\)"):
        eng.export_blocks([0], 1, 3)
    with pytest.raises(ValueError, match="not within"):
        eng.import_blocks([0], 2, 3, data[:1])


def test_tokens_go_on_identically_after_export_import_into_another_engine_at_new_ids():
    old = make()
    out = run_until_mid_decode(old, REQS)
    snaps = old.snapshot()
    used = old.allocator.used_ids()
    new = make(BLOCKS + 13)
    targets = list(range(new.allocator.num_blocks))
    random.Random(1).shuffle(targets)
    mapping = dict(zip(used, targets))
    new.import_blocks([mapping[b] for b in used], 0, CFG.num_layers, old.export_blocks(used, 0, CFG.num_layers))
    old.clear()
    new.become_whole(renumbered(snaps, mapping))
    assert new.allocator.used_ids() == sorted(mapping.values())
    assert finish(new, out) == uninterrupted()


def test_tokens_go_on_identically_after_renumbering_in_place():
    """A transition's local flow: the blocks stay on this engine at new ids (export, fresh block space, import)."""
    eng = make()
    out = run_until_mid_decode(eng, REQS)
    snaps = eng.snapshot()
    used = eng.allocator.used_ids()
    mapping = {b: eng.allocator.num_blocks - 1 - i for i, b in enumerate(used)}  # to the tail, reversed
    data = eng.export_blocks(used, 0, CFG.num_layers)
    eng.become_whole(renumbered(snaps, mapping))
    eng.import_blocks([mapping[b] for b in used], 0, CFG.num_layers, data)
    assert finish(eng, out) == uninterrupted()


def test_swap_uses_export_and_import():
    eng = make()
    run_until_mid_decode(eng, REQS)
    seq = next(s for s in eng.seqs.values() if s.num_computed > BS)
    n = -(-seq.num_computed // BS)
    old_ids = seq.block_table.ids[:n]
    want = eng.export_blocks(old_ids, 0, CFG.num_layers)
    eng.swap_out(seq)
    assert torch.equal(seq.swapped, want)
    new_ids = [BLOCKS - 1 - i for i in range(n)]
    seq.block_table.ids[:n] = new_ids
    eng.swap_in(seq)
    assert seq.swapped is None
    assert torch.equal(eng.export_blocks(new_ids, 0, CFG.num_layers), want)


# -- roles ------------------------------------------------------------------------------------------------

class IdleLink:
    max_inflight = 2

    def send(self, batch, hidden) -> None:
        raise AssertionError("nothing is scheduled in these tests")

    def result(self, mb_id: int, block: bool):
        return None


def test_become_head_links_caps_the_block_space_and_takes_the_requests():
    eng = make()
    run_until_mid_decode(eng, REQS)
    snaps = eng.snapshot()
    eng.use_weights(weights_for(CFG), (0, 2))
    link = IdleLink()
    eng.become_head(link, 30, [])
    assert eng.link is link and eng.serving and eng.kv_limit == 30 and not eng.seqs
    assert eng.allocator.num_blocks == 30 and eng.scheduler.allocator is eng.allocator
    assert eng.sync_kv_capacity() == 30, "the cap holds while the storage has more"
    eng.become_head(link, BLOCKS, snaps)
    assert eng.snapshot() == snaps
    assert eng.allocator.used_ids() == sorted(b for s in snaps for b in s.blocks)
    with pytest.raises(ValueError, match="head"):
        make().become_head(link, 30, [])  # holds every layer: a whole instance, not a head


def test_become_stage_holds_no_requests_and_the_whole_block_space():
    eng = make()
    run_until_mid_decode(eng, REQS)
    eng.use_weights(weights_for(CFG), (2, 4))
    eng.become_stage()
    assert not eng.seqs and not eng.serving and eng.link is None and eng.kv_limit is None
    assert eng.allocator.num_blocks == BLOCKS and eng.allocator.num_used == 0
    head = make()
    head.use_weights(weights_for(CFG), (0, 2))
    with pytest.raises(ValueError, match="later stage"):
        head.become_stage()


def test_become_whole_again_from_a_head():
    eng = make()
    out = run_until_mid_decode(eng, REQS)
    snaps = eng.snapshot()
    eng.use_weights(weights_for(CFG), (0, 2))
    eng.become_head(IdleLink(), 30, [])
    eng.use_weights(weights_for(CFG), (0, CFG.num_layers))
    eng.become_whole(snaps)
    assert eng.link is None and eng.kv_limit is None and eng.allocator.num_blocks == BLOCKS and eng.serving
    assert finish(eng, out) == uninterrupted()


def test_become_whole_with_recompute_reprefills_and_keeps_the_tokens():
    eng = make()
    out = run_until_mid_decode(eng, REQS)
    snaps = eng.snapshot()
    preemptions = eng.scheduler.num_preemptions
    eng.become_whole(snaps, recompute=True)
    assert eng.allocator.num_used == 0 and not eng.scheduler.running
    assert [s.request_id for s in eng.scheduler.waiting] == [s.request.request_id for s in snaps]
    assert all(eng.seqs[s.request.request_id].num_preemptions == s.num_preemptions + 1 for s in snaps)
    assert eng.scheduler.num_preemptions == preemptions, "the scheduler's counters go on"
    got = finish(eng, out)
    for r in REQS:  # a re-prefill sums in another order than decoding did: the reference decides
        if r.sampling.greedy:
            ref, margins = reference_scores(CFG, weights_for(CFG), r.prompt_token_ids, got[r.request_id])
            compare_greedy(got[r.request_id], ref, margins)


def test_leave_group_preempts_every_request_and_unlinks():
    eng = make()
    run_until_mid_decode(eng, REQS)
    eng.use_weights(weights_for(CFG), (0, 2))
    eng.become_head(IdleLink(), BLOCKS, eng.snapshot())
    owned = set(eng.seqs)
    eng.leave_group()
    assert eng.link is None and eng.kv_limit is None and set(eng.seqs) == owned
    assert eng.allocator.num_used == 0 and not eng.scheduler.running and not eng.scheduler.pinned
    assert eng.sync_kv_capacity() == BLOCKS


def test_clear_resets_the_scheduler_but_not_its_counters():
    eng = make(16)
    for r in (REQS[0], REQS[1], REQS[3]):
        eng.add_request(clone(r))
    for _ in range(12):
        eng.step()
    counters = (eng.scheduler.num_preemptions, eng.stats().prompt_tokens_total)
    assert counters[0] > 0, "a tight cache preempts"
    eng.clear()
    sch = eng.scheduler
    assert not sch.running and not sch.waiting and not sch.pinned and not eng.seqs and not eng.has_work()
    assert sch.allocator is eng.allocator and eng.allocator.num_used == 0 and eng.allocator.num_blocks == 16
    assert (sch.num_preemptions, eng.stats().prompt_tokens_total) == counters


# -- the pooled instance: heal -----------------------------------------------------------------------------

MIB = 1 << 20


@pytest.fixture
def inst():
    i = PooledInstance(load_model_source(None), layer_range=(0, 4), pool_bytes=24 * MIB, page_size=256 * 1024,
                       block_size=16, backend="host", scheduler_config=SCHED)
    yield i
    i.close()


def test_heal_after_a_failed_transition_keeps_the_requests_as_recompute(inst):
    """The worker's failed transition in miniature: requests snapshotted, KV cleared, layers dropped; heal
    brings every layer back and the requests finish with the reference's tokens."""
    eng = inst.engine
    greedy = [r for r in REQS if r.sampling.greedy]
    for r in greedy:
        eng.add_request(clone(r))
    out: dict[str, list[int]] = {r.request_id: [] for r in greedy}
    for _ in range(8):
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    snaps = eng.snapshot()
    eng.clear()
    inst.to_range(0, 2)
    assert not eng.serving
    inst.heal(snaps)
    assert inst.layer_range == (0, 4) and eng.serving and eng.link is None
    assert eng.allocator.num_blocks == inst.capacity_for(0, 4)
    finish(eng, out)
    w = inst.source.load_weights()
    for r in greedy:
        ref, margins = reference_scores(inst.cfg, w, r.prompt_token_ids, out[r.request_id])
        compare_greedy(out[r.request_id], ref, margins)


def test_heal_without_requests_keeps_the_engines_own(inst):
    eng = inst.engine
    inst.to_range(0, 2)
    eng.become_head(IdleLink(), 10, [])
    eng.add_request(clone(REQS[0]))
    inst.heal()
    assert inst.layer_range == (0, 4) and eng.link is None and list(eng.seqs) == ["g0"]
    assert eng.allocator.num_blocks == inst.capacity_for(0, 4)
