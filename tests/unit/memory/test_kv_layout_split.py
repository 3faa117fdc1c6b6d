"""The header-centric KV block in the pool (shared/memory/kv_layout.py) and the in-place head split on the layout
(`LayerMemoryLayout.split_kv_heads`, `kv_layout.exchange_sub_blocks`): the kernels' view is unchanged, a rank's
heads are one byte range, and a TP1 -> TP2 / TP4 merge keeps every page and every kept byte where it is."""

from __future__ import annotations

import pytest
import torch

from kunserve.shared.memory import kv_layout
from kunserve.shared.memory.kv_head_split import plan_head_split, rank_heads
from kunserve.shared.memory.testing import make_layout


def _fill(layout, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for x in layout.layers:
        kv = layout.layer_cache(x)
        kv.copy_(torch.randn(kv.shape, generator=g))
        out[x] = kv.clone()
        del kv
    return out


def test_layer_cache_is_the_kernels_view_over_header_centric_blocks():
    lay = make_layout(num_kv_heads=4)
    spec = lay.kv_spec
    kv = lay.layer_cache(lay.layer_start)
    assert tuple(kv.shape) == (lay.num_blocks, 2, 4, spec.block_size, spec.head_dim)
    assert not kv.is_contiguous() and kv.data_ptr() == lay.kv_data_ptr(lay.layer_start)
    phys = kv_layout.physical_view(kv)
    assert phys.is_contiguous() and tuple(phys.shape[1:]) == spec.physical_block_shape == (4, 2, 4, 16)
    assert spec.head_bytes * 4 == spec.block_bytes
    kv[3, 1, 2, 1] = 7.0  # V of head 2, token 1 of block 3
    row = (3 * spec.block_bytes + 2 * spec.head_bytes + spec.head_bytes // 2 + 1 * spec.head_dim * 4) // 4
    assert float(phys.reshape(-1)[row]) == 7.0
    for r in range(2):  # the heads of rank r of a block: one contiguous byte range
        heads = phys[5, rank_heads(r, 2, 4).start : rank_heads(r, 2, 4).stop]
        assert heads.is_contiguous()
        assert heads.data_ptr() == kv.data_ptr() + 5 * spec.block_bytes + r * 2 * spec.head_bytes
    assert lay.memory_map()["kv"]["physical_block_shape"] == [4, 2, 4, 16]
    del kv, phys, heads


def test_compaction_moves_whole_blocks_through_the_view():
    lay = make_layout(num_kv_heads=4)
    before = _fill(lay, 1)
    nb = lay.num_blocks
    lay.apply_compaction({nb - 1: 0, nb - 2: 1})
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert torch.equal(kv[0], before[x][nb - 1]) and torch.equal(kv[1], before[x][nb - 2])
        assert torch.equal(kv[2:], before[x][2:])
        del kv


@pytest.mark.parametrize("degree", [2, 4])
def test_split_kv_heads_rereads_the_range_in_place(degree):
    lay = make_layout(num_kv_heads=4)
    before = _fill(lay, degree)
    nb, pages, free, gen = lay.num_blocks, lay.kv_pages_per_layer, lay.spare_pages, lay.generation
    bases = {x: lay.kv_data_ptr(x) for x in lay.layers}
    res = lay.split_kv_heads(degree)
    lay.check_invariants()
    assert res.old_num_blocks == nb and res.new_num_blocks == lay.num_blocks >= nb * degree
    assert res.new_block_bytes * degree == res.old_block_bytes
    assert res.kv_pages_before == res.kv_pages_after == lay.kv_pages_per_layer == pages
    assert res.pages_mapped == res.pages_unmapped == 0 and lay.spare_pages == free and lay.generation == gen + 1
    per = 4 // degree
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert kv.data_ptr() == bases[x] and tuple(kv.shape[1:3]) == (2, per)
        for b in range(nb):
            for r in range(degree):
                assert torch.equal(kv[b * degree + r], before[x][b][:, r * per : (r + 1) * per])
        del kv
    with pytest.raises(ValueError, match="that divides"):
        lay.split_kv_heads(3)


@pytest.mark.parametrize("degree", [2, 4])
def test_merge_of_layouts_puts_every_head_at_its_rank_and_merged_block(degree):
    """`degree` TP1 members (one pool each) merge: split in place, phased exchange; rank r ends with heads r of every
    member's used blocks at their merged ids, with no page mapped and at most one phase of staging."""
    members = [make_layout(num_kv_heads=4, num_layers=2) for _ in range(degree)]
    nb = members[0].num_blocks
    used = [set(range(m, nb, m + 2)) | {nb - 1} for m in range(degree)]
    before = [_fill(lay, 10 + m) for m, lay in enumerate(members)]
    free = [lay.spare_pages for lay in members]
    plan = plan_head_split(used, nb, 4, max_phase_subblocks=3)
    results = [lay.split_kv_heads(degree, plan) for lay in members]
    sub_bytes = members[0].block_bytes
    for x in members[0].layers:
        caches = [lay.layer_cache(x) for lay in members]
        peak = kv_layout.exchange_sub_blocks(plan, caches)
        assert 0 < peak <= 3 * sub_bytes == results[0].staging_bytes
        per = 4 // degree
        for m, blocks in enumerate(used):
            for b in blocks:
                j = plan.block_maps[m][b]
                for r in range(degree):
                    assert torch.equal(caches[r][j], before[m][x][b][:, r * per : (r + 1) * per])
        del caches
    for lay, f in zip(members, free):
        lay.check_invariants()
        assert lay.spare_pages == f
    base = results[0].kv_major
    assert base is not None and base.extra_bytes > results[0].staging_bytes and base.copied_bytes > 0


def test_exchange_refuses_caches_that_were_not_split():
    members = [make_layout(num_kv_heads=4, num_layers=1) for _ in range(2)]
    plan = plan_head_split([{0}, {0}], members[0].num_blocks, 4, 1)
    with pytest.raises(ValueError, match="split it first"):
        kv_layout.exchange_sub_blocks(plan, [lay.layer_cache(0) for lay in members])
    with pytest.raises(ValueError, match="merges 2 members"):
        kv_layout.exchange_sub_blocks(plan, [members[0].layer_cache(0)])
    with pytest.raises(ValueError, match="the plan is for degree 2"):
        members[0].split_kv_heads(2, plan_head_split([{0}, {0}], 1, 4, 1))
