"""The head gather on real KV tensors (`kv_layout.apply_sub_block_moves`, `TorchKVStorage.merge_kv_heads`,
`LayerMemoryLayout.merge_kv_heads`): `degree` TP1 members merge by the head split, then scale back down to TP1 with
every kept block's bytes, exactly, at its new whole block id of the member that keeps it."""

from __future__ import annotations

import random

import pytest
import torch

from kunserve.shared.engine.kv_storage import TorchKVStorage
from kunserve.shared.memory import kv_layout
from kunserve.shared.memory.kv_head_split import SubBlockMove, assign_requests, plan_head_gather, plan_head_split
from kunserve.shared.memory.testing import make_layout

HEADS = 4
LAYERS = (0, 1)


def _requests(used: list[set[int]], block_maps: tuple[dict[int, int], ...], seed: int) -> dict[str, list[int]]:
    """The merged blocks, grouped into requests of 1 to 3 blocks each (as a scheduler's block tables would be)."""
    rng = random.Random(seed)
    merged = [block_maps[m][b] for m, blocks in enumerate(used) for b in sorted(blocks)]
    rng.shuffle(merged)
    out: dict[str, list[int]] = {}
    while merged:
        n = min(len(merged), rng.randint(1, 3))
        out[f"r{len(out)}"], merged = merged[:n], merged[n:]
    return out


def _round_trip(members, caches_of, merge, degree: int, nb: int, seed: int, prefer_origin: bool) -> None:
    """Split + exchange (TP1 -> TP`degree`), then assign + gather + merge (TP`degree` -> TP1); every kept whole block
    must come back byte for byte."""
    rng = random.Random(seed)
    # leave `degree` blocks of slack so that the greedy packing of requests of up to 3 blocks always fits
    used = [set(rng.sample(range(nb), rng.randint(1, nb - 3))) for _ in range(degree)]
    before = {x: [caches_of(mem, x).clone() for mem in members] for x in LAYERS}
    split = plan_head_split(used, nb, HEADS, max_phase_subblocks=4)
    for mem in members:
        mem.split_kv_heads(degree)
    for x in LAYERS:
        kv_layout.exchange_sub_blocks(split, [caches_of(mem, x) for mem in members])
    origin = {j: (m, b) for m, mp in enumerate(split.block_maps) for b, j in mp.items()}

    requests = _requests(used, split.block_maps, seed)
    prefer = {rid: origin[blocks[0]][0] for rid, blocks in requests.items()} if prefer_origin else None
    assigned = assign_requests({rid: len(b) for rid, b in requests.items()}, degree, nb, prefer)
    owners = {j: assigned[rid] for rid, blocks in requests.items() for j in blocks}
    gather = plan_head_gather(owners, nb, HEADS, degree)
    if prefer_origin:  # the split put member m's blocks at m's slots: a gather back home moves fewer heads
        assert gather.in_place > 0
    sub_bytes = caches_of(members[0], 0)[0].numel() * caches_of(members[0], 0).element_size()
    for x in LAYERS:
        peak = kv_layout.apply_sub_block_moves(gather.moves, [caches_of(mem, x) for mem in members])
        assert peak == gather.staging_subblocks * sub_bytes
    for mem in members:
        merge(mem)
    for x in LAYERS:
        for j, m in owners.items():
            src_m, b = origin[j]
            got = caches_of(members[m], x)[gather.block_maps[m][j]]
            assert tuple(got.shape[:2]) == (2, HEADS)
            assert torch.equal(got, before[x][src_m][b]), f"layer {x}: merged block {j} did not come back whole"


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("prefer_origin", [False, True])
def test_torch_storage_round_trip_keeps_every_kept_block(degree, prefer_origin):
    nb = 10
    members = [TorchKVStorage(LAYERS, nb, HEADS, block_size=4, head_dim=8) for _ in range(degree)]
    g = torch.Generator().manual_seed(degree)
    for mem in members:
        for x in LAYERS:
            mem.layer_cache(x).copy_(torch.randn(mem.layer_cache(x).shape, generator=g))

    def merge(mem: TorchKVStorage) -> None:
        mem.merge_kv_heads(degree)
        assert mem.num_blocks == nb and mem.kv_heads_per_block == HEADS

    _round_trip(members, lambda mem, x: mem.layer_cache(x), merge, degree, nb, seed=degree + 7 * prefer_origin, prefer_origin=prefer_origin)


@pytest.mark.parametrize("degree", [2, 4])
def test_layout_round_trip_keeps_every_kept_block_and_every_page(degree):
    members = [make_layout(num_kv_heads=HEADS, num_layers=len(LAYERS)) for _ in range(degree)]
    nb = members[0].num_blocks
    pages = [(lay.kv_pages_per_layer, lay.spare_pages) for lay in members]
    g = torch.Generator().manual_seed(degree)
    for lay in members:
        for x in LAYERS:
            kv = lay.layer_cache(x)
            kv.copy_(torch.randn(kv.shape, generator=g))
            del kv

    def merge(lay) -> None:
        gen = lay.generation
        assert lay.merge_kv_heads(degree) == nb == lay.num_blocks
        assert lay.kv_spec.num_kv_heads == HEADS and lay.generation == gen + 1

    _round_trip(members, lambda lay, x: lay.layer_cache(x), merge, degree, nb, seed=degree, prefer_origin=True)
    for lay, p in zip(members, pages):
        lay.check_invariants()
        assert (lay.kv_pages_per_layer, lay.spare_pages) == p


def test_layout_merge_drops_a_tail_that_is_not_a_whole_block():
    lay = make_layout(num_kv_heads=HEADS, num_layers=1)
    nb = lay.num_blocks
    lay.split_kv_heads(2)
    assert lay.merge_kv_heads(2) == nb == lay.num_blocks  # floor of the mapped bytes over the whole block
    with pytest.raises(ValueError, match="degree >= 2"):
        lay.merge_kv_heads(1)


def test_torch_storage_merge_rereads_sub_blocks_as_whole_blocks_and_drops_a_partial_tail():
    st = TorchKVStorage([0], 4, 2, block_size=2, head_dim=4)
    st.layer_cache(0).copy_(torch.arange(st.layer_cache(0).numel(), dtype=torch.float32).view(st.layer_cache(0).shape))
    sub = st.layer_cache(0).clone()
    st.merge_kv_heads(2)
    assert st.num_blocks == 2 and st.kv_heads_per_block == 4
    for b in range(2):
        for r in range(2):
            assert torch.equal(st.layer_cache(0)[b][:, 2 * r : 2 * r + 2], sub[b * 2 + r])
    with pytest.raises(ValueError, match="at least 4 sub-blocks, got 2"):
        st.merge_kv_heads(4)
    with pytest.raises(ValueError, match="degree >= 2"):
        st.merge_kv_heads(1)
    odd = TorchKVStorage([0], 5, 1, block_size=2, head_dim=4)  # 5 sub-blocks of one head: two whole blocks of two
    odd.layer_cache(0).copy_(torch.arange(odd.layer_cache(0).numel(), dtype=torch.float32).view(odd.layer_cache(0).shape))
    before = odd.layer_cache(0).clone()
    odd.merge_kv_heads(2)
    assert odd.num_blocks == 2 and odd.layer_cache(0).shape[0] == 2
    for b in range(2):
        for r in range(2):
            assert torch.equal(odd.layer_cache(0)[b][:, r : r + 1], before[b * 2 + r])


def test_apply_sub_block_moves_reads_before_writing_and_refuses_bad_moves():
    caches = [kv_layout.allocate(2, 1, 2, 2, torch.float32) for _ in range(2)]
    for m, c in enumerate(caches):
        for s in range(2):
            c[s].fill_(10 * m + s)
    cycle = [SubBlockMove(0, 0, 1, 0), SubBlockMove(1, 0, 1, 1), SubBlockMove(1, 1, 0, 0)]
    assert kv_layout.apply_sub_block_moves(cycle, caches) == 2 * caches[1][0].numel() * 4
    assert [float(caches[0][0].flatten()[0]), float(caches[1][0].flatten()[0]), float(caches[1][1].flatten()[0])] == [11.0, 0.0, 10.0]
    with pytest.raises(ValueError, match="two moves write sub-block 0 of member 1"):
        kv_layout.apply_sub_block_moves([SubBlockMove(0, 0, 1, 0), SubBlockMove(0, 1, 1, 0)], caches)
    with pytest.raises(ValueError, match="has 2 sub-blocks"):
        kv_layout.apply_sub_block_moves([SubBlockMove(0, 2, 1, 0)], caches)
    with pytest.raises(ValueError, match="2 caches"):
        kv_layout.apply_sub_block_moves([SubBlockMove(0, 0, 2, 0)], caches)
