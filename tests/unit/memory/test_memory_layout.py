"""LayerMemoryLayout: weights and KV of a layer range; drop, restore, compaction, memory map."""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch

from kunserve.shared.memory import (
    KVCapacityError,
    LayerRangeError,
    OutOfPagesError,
    ViewStillAliveError,
    WeightSourceError,
    arena_pages,
    kv_capacity,
    plan_compaction,
)
from kunserve.shared.memory.testing import block_pattern, make_layout, pattern_source, tiny_llama_specs, weight_pattern

P = 16 * 1024


def _fill_kv(layout, tag_base=0):
    """Write a distinct pattern into every block of every held layer; return {(layer, block): checksum}."""
    sums = {}
    for x in layout.layers:
        kv = layout.layer_cache(x)
        for b in range(layout.num_blocks):
            kv[b] = block_pattern(layout, x, tag_base + b)
        sums[x] = kv.clone()
        del kv
    return sums


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def _state(layout):
    m = layout.memory_map()
    m.pop("generation")
    m.pop("stats")
    m.pop("layers")  # holds kv_base addresses, which may legitimately change for re-created layers
    return m


def test_initial_layout_shapes_and_contents():
    lay = make_layout(num_layers=6)
    lay.check_invariants()
    B = lay.block_bytes
    assert B == 2 * 2 * 4 * 16 * 4
    assert lay.held_groups == ["embed", "head"]
    plan = kv_capacity(48, lay.weight_pages, 6, P, B)
    assert lay.kv_pages_per_layer == plan.kv_pages_per_layer and lay.num_blocks == plan.num_blocks
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert kv.shape == (lay.num_blocks, 2, 2, 4, 16) and kv.dtype == torch.float32
        assert kv.data_ptr() == lay.kv_data_ptr(x)
        del kv
        for name, w in lay.layer_weights(x).items():
            assert torch.equal(w, pattern_source(name))
    assert torch.equal(lay.group_weights("embed")["model.embed_tokens.weight"],
                       pattern_source("model.embed_tokens.weight"))


def test_weights_occupy_whole_pages_per_layer():
    lay = make_layout(num_layers=4)
    layer_specs, _ = tiny_llama_specs()
    per_layer = arena_pages(layer_specs(0), P)
    m = lay.memory_map()
    for x in range(4):
        assert m["owner_pages"][f"weights:{x}"] == per_layer
        assert m["owner_pages"][f"kv:{x}"] == lay.kv_pages_per_layer
    # Views of different layers never share a page.
    w0 = lay.layer_weights(0)
    w1 = lay.layer_weights(1)
    end0 = max(t.data_ptr() + t.numel() * t.element_size() for t in w0.values())
    start1 = min(t.data_ptr() for t in w1.values())
    assert end0 <= lay._weights[0].vr.base + per_layer * P and start1 == lay._weights[1].vr.base


def test_drop_grows_capacity_by_freed_bytes_exactly():
    # 4 layers, 2 weight pages each, groups 1 + 1 page, 3 KV pages per layer, no spare: 22 pages.
    lay = make_layout(num_layers=4, num_pages=22)
    assert lay.kv_pages_per_layer == 3 and lay.spare_pages == 0
    B, n_before = lay.block_bytes, lay.num_blocks
    freed_pages = 2 + 3 + 1  # layer 3's weights and KV, and the head group (held with the last layer)
    r = lay.drop_layers([3])
    lay.check_invariants()
    assert r.pages_unmapped == freed_pages and r.pages_mapped == freed_pages
    assert lay.num_blocks - n_before == freed_pages * P // (B * 3) == 32
    assert lay.held_groups == ["embed"]


def test_drop_keeps_remaining_kv_in_place_and_unchanged():
    lay = make_layout(num_layers=6)
    before = _fill_kv(lay)
    ptrs = {x: lay.layer_cache(x).data_ptr() for x in lay.layers}
    old_blocks, spare = lay.num_blocks, lay.spare_pages
    freed = lay.memory_map()["owner_pages"]
    freed_pages = sum(freed[f"{k}:{x}"] for k in ("weights", "kv") for x in (4, 5)) + freed["group:head"]
    r = lay.drop_layers([4, 5])
    lay.check_invariants()
    assert (lay.layer_start, lay.layer_end) == (0, 4)
    gain_pages = (freed_pages + spare) // 4
    assert lay.kv_pages_per_layer == old_blocks * lay.block_bytes // P + gain_pages
    assert r.new_num_blocks - r.old_num_blocks == gain_pages * P // lay.block_bytes
    # Never less than the freed bytes allow, minus the rounding to whole pages per layer.
    assert (r.new_num_blocks - r.old_num_blocks) * lay.block_bytes * 4 > freed_pages * P - 4 * P
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert kv.data_ptr() == ptrs[x]
        assert torch.equal(kv[:old_blocks], before[x])
        kv[old_blocks:] = 1.0  # the new tail is real, writable memory
        del kv


def test_drop_then_restore_weights_byte_identical():
    lay = make_layout(num_layers=6)
    original = {n: t.clone() for n, t in lay.weights().items()}
    _fill_kv(lay)
    lay.drop_layers([0, 1])  # a prefix: embeddings go with layer 0
    assert lay.held_groups == ["head"]
    lay.check_invariants()
    used = []  # nothing in use: restore needs no compaction
    r = lay.restore_layers([0, 1], original, used_block_ids=used)
    lay.check_invariants()
    assert (lay.layer_start, lay.layer_end) == (0, 6) and r.layers == (0, 1)
    now = lay.weights()
    assert sorted(now) == sorted(original)
    for name, t in original.items():
        assert torch.equal(_bytes(now[name]), _bytes(t)), name
    assert lay.num_blocks == r.new_num_blocks < r.old_num_blocks


def test_restore_needs_compaction_when_tail_blocks_are_used():
    lay = make_layout(num_layers=6)
    lay.drop_layers([5])
    big = lay.num_blocks
    plan = lay.plan_restore([5])
    used = [0, 3, big - 1, big - 2]
    for x in lay.layers:
        kv = lay.layer_cache(x)
        for b in used:
            kv[b] = block_pattern(lay, x, b)
        del kv
    with pytest.raises(KVCapacityError) as ei:
        lay.restore_layers([5], pattern_source, used_block_ids=used)
    assert ei.value.needs_compaction and ei.value.grpc_code == "FAILED_PRECONDITION"
    assert lay.num_blocks == big  # nothing changed
    mapping = lay.plan_compaction(used, plan.num_blocks)
    assert mapping == {big - 2: 1, big - 1: 2}
    lay.apply_compaction(mapping)
    used = [mapping.get(b, b) for b in used]
    lay.restore_layers([5], pattern_source, used_block_ids=used)
    lay.check_invariants()
    for x in range(5):
        kv = lay.layer_cache(x)
        for old, new in [(0, 0), (3, 3), (big - 2, 1), (big - 1, 2)]:
            assert torch.equal(kv[new], block_pattern(lay, x, old))
        del kv


def test_restore_refused_when_used_blocks_exceed_capacity_left():
    lay = make_layout(num_layers=6)
    lay.drop_layers([5])
    plan = lay.plan_restore([5])
    before = _state(lay)
    used = list(range(plan.num_blocks + 1))
    with pytest.raises(KVCapacityError) as ei:
        lay.restore_layers([5], pattern_source, used_block_ids=used)
    assert not ei.value.needs_compaction and ei.value.used_blocks == plan.num_blocks + 1
    with pytest.raises(KVCapacityError):
        lay.plan_compaction(used, plan.num_blocks)
    assert _state(lay) == before
    lay.check_invariants()


def test_plan_compaction_pure():
    assert plan_compaction([0, 1, 2], 3) == {}
    assert plan_compaction([9, 0, 7, 2], 4) == {7: 1, 9: 3}
    with pytest.raises(KVCapacityError):
        plan_compaction([0, 1, 2], 2)


def test_apply_compaction_reads_all_sources_first():
    lay = make_layout(num_layers=2)
    for x in lay.layers:
        kv = lay.layer_cache(x)
        kv[1] = block_pattern(lay, x, 1)
        kv[2] = block_pattern(lay, x, 2)
        del kv
    lay.apply_compaction({2: 1, 1: 0})  # a chain: 1 is both a source and a destination
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert torch.equal(kv[0], block_pattern(lay, x, 1)) and torch.equal(kv[1], block_pattern(lay, x, 2))
        del kv
    with pytest.raises(ValueError, match="same destination"):
        lay.apply_compaction({1: 0, 2: 0})
    with pytest.raises(ValueError, match="outside"):
        lay.apply_compaction({lay.num_blocks: 0})


# ---------------------------------------------------------------------- errors
def _expect_layer_error(fn, layers, code, match):
    with pytest.raises(LayerRangeError, match=match) as ei:
        fn()
    assert ei.value.layers == tuple(sorted(layers)) and ei.value.grpc_code == code
    assert isinstance(ei.value, ValueError)


def test_drop_errors_leave_state_unchanged():
    lay = make_layout(num_layers=6, layer_start=1, layer_end=5, num_pages=40)
    before = _state(lay)
    _expect_layer_error(lambda: lay.drop_layers([5]), [5], "FAILED_PRECONDITION", "not held")
    _expect_layer_error(lambda: lay.drop_layers([0, 1]), [0], "FAILED_PRECONDITION", "not held")
    _expect_layer_error(lambda: lay.drop_layers([1, 2, 3, 4]), [1, 2, 3, 4], "FAILED_PRECONDITION", "every")
    _expect_layer_error(lambda: lay.drop_layers([2]), [2], "FAILED_PRECONDITION", "contiguous")
    _expect_layer_error(lambda: lay.drop_layers([1, 3]), [1, 3], "FAILED_PRECONDITION", "contiguous")
    _expect_layer_error(lambda: lay.drop_layers([7]), [7], "INVALID_ARGUMENT", "outside")
    _expect_layer_error(lambda: lay.drop_layers([-1]), [-1], "INVALID_ARGUMENT", "outside")
    _expect_layer_error(lambda: lay.drop_layers([1, 1]), [1], "INVALID_ARGUMENT", "duplicate")
    _expect_layer_error(lambda: lay.drop_layers([]), [], "INVALID_ARGUMENT", "no layers")
    assert _state(lay) == before
    lay.check_invariants()
    lay.drop_layers([1, 4])  # a prefix and a suffix at once leave [2, 4): allowed
    assert (lay.layer_start, lay.layer_end) == (2, 4)


def test_restore_errors_leave_state_unchanged():
    lay = make_layout(num_layers=6, layer_start=2, layer_end=4, num_pages=40)
    before = _state(lay)
    _expect_layer_error(lambda: lay.restore_layers([6], pattern_source, used_block_ids=()), [6], "INVALID_ARGUMENT", "outside")
    _expect_layer_error(lambda: lay.restore_layers([3, 4], pattern_source, used_block_ids=()), [3], "FAILED_PRECONDITION",
                        "already held")
    _expect_layer_error(lambda: lay.restore_layers([0], pattern_source, used_block_ids=()), [0], "FAILED_PRECONDITION", "contiguous")
    _expect_layer_error(lambda: lay.restore_layers([4, 6], pattern_source, used_block_ids=()), [6], "INVALID_ARGUMENT", "outside")
    _expect_layer_error(lambda: lay.restore_layers([4, 5, 5], pattern_source, used_block_ids=()), [5], "INVALID_ARGUMENT",
                        "duplicate")
    assert _state(lay) == before
    lay.restore_layers([0, 1, 4, 5], pattern_source, used_block_ids=())  # both sides at once
    assert (lay.layer_start, lay.layer_end) == (0, 6) and lay.held_groups == ["embed", "head"]
    for name, t in lay.weights().items():
        assert torch.equal(t, pattern_source(name))
    lay.check_invariants()


def test_restore_without_room_for_weights_is_resource_exhausted():
    lay = make_layout(num_layers=6, layer_start=0, layer_end=2, num_pages=12)  # 6 weight pages + 3 KV/layer
    with pytest.raises(OutOfPagesError) as ei:
        lay.plan_restore([2, 3, 4])
    assert ei.value.grpc_code == "RESOURCE_EXHAUSTED"
    with pytest.raises(OutOfPagesError):
        lay.restore_layers([2, 3, 4], pattern_source, used_block_ids=())
    lay.check_invariants()


def test_pool_too_small_for_weights():
    with pytest.raises(OutOfPagesError):
        make_layout(num_layers=6, num_pages=14)  # exactly the weights: no KV left


# ---------------------------------------------------------------------- view lifetimes
def test_drop_refused_while_weights_of_dropped_layer_are_referenced():
    lay = make_layout(num_layers=4)
    params = torch.nn.Parameter(lay.layer_weights(3)["model.layers.3.mlp.up_proj.weight"], requires_grad=False)
    before = _state(lay)
    with pytest.raises(ViewStillAliveError, match="weights:3"):
        lay.drop_layers([3])
    assert _state(lay) == before
    lay.check_invariants()
    w_kept = lay.layer_weights(0)  # views of remaining layers may stay alive
    del params
    lay.drop_layers([3])
    assert torch.equal(w_kept["model.layers.0.mlp.up_proj.weight"], pattern_source("model.layers.0.mlp.up_proj.weight"))


def test_restore_refused_while_a_stale_kv_tensor_covers_the_tail():
    lay = make_layout(num_layers=4)
    lay.drop_layers([3])
    gen = lay.generation
    stale = lay.layer_cache(0)  # covers the grown cache, whose tail restore takes back
    before = _state(lay)
    with pytest.raises(ViewStillAliveError, match="kv:0"):
        lay.restore_layers([3], pattern_source, used_block_ids=())
    assert _state(lay) == before and lay.generation == gen
    del stale
    lay.restore_layers([3], pattern_source, used_block_ids=())
    assert lay.generation == gen + 1
    lay.check_invariants()


def test_kv_tensor_kept_across_a_drop_stays_valid():
    lay = make_layout(num_layers=4)
    old = lay.layer_cache(0)
    old.fill_(2.0)
    lay.drop_layers([3])  # only adds pages behind it
    assert old.sum().item() == 2.0 * old.numel()
    new = lay.layer_cache(0)
    assert new.data_ptr() == old.data_ptr() and new.shape[0] > old.shape[0]


def test_weight_source_failure_rolls_back_the_restore():
    lay = make_layout(num_layers=4)
    lay.drop_layers([2, 3])
    before = _state(lay)
    layer_specs, groups = tiny_llama_specs()
    names = [s.name for s in layer_specs(2)] + [s.name for g in groups for s in g.tensors]
    source = {n: pattern_source(n) for n in names}  # layer 3 missing
    with pytest.raises(WeightSourceError, match="model.layers.3"):
        lay.restore_layers([2, 3], source, used_block_ids=())
    gc.collect()
    assert _state(lay) == before
    lay.check_invariants()
    wrong = dict(source)
    wrong["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightSourceError, match="shape"):
        lay.restore_layers([2], wrong, used_block_ids=())
    assert _state(lay) == before


# ---------------------------------------------------------------------- variants
def test_blocks_straddling_pages_when_page_is_not_a_multiple_of_block():
    lay = make_layout(num_layers=3, head_dim=12, num_pages=40)  # 768-byte blocks, 16 KiB pages
    assert P % lay.block_bytes != 0
    assert lay.num_blocks == lay.kv_pages_per_layer * P // lay.block_bytes
    before = _fill_kv(lay)
    old = lay.num_blocks
    lay.drop_layers([2])
    lay.check_invariants()
    assert lay.num_blocks == lay.kv_pages_per_layer * P // lay.block_bytes > old
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert torch.equal(kv[:old], before[x])
        kv.fill_(1.0)  # every block, including those across page boundaries, is mapped memory
        del kv


def test_bf16_kv_and_weights():
    lay = make_layout(num_layers=2, dtype=torch.bfloat16)
    kv = lay.layer_cache(0)
    assert kv.dtype == torch.bfloat16 and lay.block_bytes == 2 * 2 * 4 * 16 * 2
    del kv
    w = lay.layer_weights(1)["model.layers.1.self_attn.q_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, weight_pattern("model.layers.1.self_attn.q_proj.weight", (32, 32), torch.bfloat16))


def test_middle_stage_holds_no_groups_and_gets_embeddings_on_restore():
    lay = make_layout(num_layers=6, layer_start=2, layer_end=4, num_pages=40)
    assert lay.held_groups == []
    lay.restore_layers([0, 1], pattern_source, used_block_ids=())
    assert lay.held_groups == ["embed"]
    assert torch.equal(lay.group_weights("embed")["model.embed_tokens.weight"],
                       pattern_source("model.embed_tokens.weight"))
    with pytest.raises(KeyError):
        lay.group_weights("head")


def test_populated_pool():
    from kunserve.shared.memory.host import HostPagePool

    pool = HostPagePool(48, P, populate=True)
    lay = make_layout(num_layers=6, pool=pool)
    _fill_kv(lay)
    lay.drop_layers([5])
    lay.check_invariants()


def test_memory_map_is_plain_data_and_consistent():
    lay = make_layout(num_layers=6)
    lay.drop_layers([5])
    m = lay.memory_map()
    json.dumps(m)  # plain data only
    assert m["backend"] == "host" and m["page_size"] == P and m["num_pages"] == 48
    assert len(m["page_owners"]) == 48 and sum(m["owner_pages"].values()) == 48
    assert sum(r[1] for r in m["page_runs"]) == 48
    assert m["owner_pages"].get("free", 0) == m["free_pages"] == lay.spare_pages
    assert [row["layer"] for row in m["layers"]] == [0, 1, 2, 3, 4]
    assert all(row["kv_blocks"] == lay.num_blocks for row in m["layers"])
    assert m["kv"]["capacity_bytes"] == lay.num_blocks * lay.block_bytes * 5
    assert "kv:5" not in m["owner_pages"] and "group:head" not in m["owner_pages"]
    assert "page_owners" not in lay.memory_map(per_page=False)


def test_close_frees_every_range():
    lay = make_layout(num_layers=3)
    kv = lay.layer_cache(0)
    with pytest.raises(ViewStillAliveError):
        lay.close()
    del kv
    lay.close()
    assert lay.pool.free_count == lay.pool.num_pages and lay.pool.ranges == []
    lay.pool.close()


def test_restore_requires_the_used_block_ids():
    """Forgetting them could unmap live KV; GPU kernels would then read unmapped memory."""
    lay = make_layout(num_layers=3)
    lay.drop_layers([2])
    with pytest.raises(TypeError):
        lay.restore_layers([2], pattern_source)  # type: ignore[call-arg]


def test_a_peer_restores_layers_from_the_arena_bytes_of_a_live_layout():
    """Two layouts of one model pack an arena identically: a restore with no weight source leaves the arenas for
    the caller, who fills them from a peer's live pages (what services/worker/weight_exchange.py sends)."""
    peer = make_layout(num_layers=6)
    lay = make_layout(num_layers=6, layer_start=0, layer_end=3)
    r = lay.restore_layers([3, 4, 5], None, used_block_ids=())
    assert r.fill_seconds == 0.0 and lay.held_groups == ["embed", "head"]
    keys = lay.restore_arenas((0, 3), (0, 6), (3, 6))
    assert keys == ["group:head", "3", "4", "5"]
    for k in keys:
        assert lay.arena_nbytes(k) == peer.arena_nbytes(k)
        lay.fill_arena(k, peer.arena_bytes(k))
    lay.check_invariants()
    mine, theirs = lay.weights(), peer.weights()
    assert sorted(mine) == sorted(theirs)
    for name, t in theirs.items():
        assert torch.equal(_bytes(mine[name]), _bytes(t)), name
    del mine, theirs, t
    lay.release_views()
    peer.release_views()
    with pytest.raises(WeightSourceError):
        lay.fill_arena("3", torch.zeros(5, dtype=torch.uint8))
    sent = peer.arena_bytes("5")  # a send in flight pins the arena: its layer cannot be dropped under it
    with pytest.raises(ViewStillAliveError):
        peer.drop_layers([5])
    del sent
    peer.drop_layers([5])
    with pytest.raises(KeyError):
        peer.arena_bytes("5")


def test_restore_arenas_send_each_weight_group_with_exactly_one_piece():
    lay = make_layout(num_layers=6, layer_start=2, layer_end=4, num_pages=40)
    # a middle stage becoming whole: the embeddings come with layer 0, the head with the last layer
    assert lay.restore_arenas((2, 4), (0, 6), (0, 2)) == ["group:embed", "0", "1"]
    assert lay.restore_arenas((2, 4), (0, 6), (4, 6)) == ["group:head", "4", "5"]
    # a groups' holder gaining middle layers gets no group again
    assert lay.restore_arenas((0, 2), (0, 4), (2, 4)) == ["2", "3"]
    tied = make_layout(num_layers=6, layer_start=2, layer_end=4, num_pages=40)
    tied.groups = {"embed": dataclasses.replace(tied.groups["embed"], held_with="ends")}
    assert tied.restore_arenas((2, 4), (0, 6), (0, 2)) == ["group:embed", "0", "1"]
    assert tied.restore_arenas((2, 4), (0, 6), (4, 6)) == ["4", "5"]
    assert tied.restore_arenas((2, 4), (2, 6), (4, 6)) == ["group:embed", "4", "5"]
