"""The pure plan of the in-place head split (shared/memory/kv_head_split.py): where every head of every used block
ends, that no slot is written before it was read, the staging bound, degree 2 and 4, and the K/V-major baseline."""

from __future__ import annotations

import random

import pytest

from kunserve.shared.memory.kv_head_split import (
    HeadSplitPlan,
    header_centric_split_cost,
    kv_major_split_cost,
    merged_block_id,
    plan_head_split,
    rank_heads,
    sub_block,
)


def _simulate(plan: HeadSplitPlan, used: list[set[int]]) -> list[dict[int, tuple[int, int, int]]]:
    """Run the plan over symbolic slots: member m's sub-block s starts as (m, block, rank) = what it holds. Each phase
    reads every source first (asserting it still holds its original content), then writes."""
    d = plan.degree
    state = [{sub_block(b, r, d): (m, b, r) for b in range(plan.num_blocks) for r in range(d)} for m in range(d)]
    written: list[set[int]] = [set() for _ in range(d)]
    for phase in plan.phases:
        staged = []
        for mv in phase:
            content = state[mv.src][mv.src_slot]
            assert mv.src_slot not in written[mv.src], f"{mv} reads a slot an earlier phase overwrote"
            assert content == (mv.src, mv.src_slot // d, mv.src_slot % d)
            staged.append((mv, content))
        for mv, content in staged:
            state[mv.dst][mv.dst_slot] = content
            written[mv.dst].add(mv.dst_slot)
    return state


def _check(plan: HeadSplitPlan, used: list[set[int]]) -> None:
    d = plan.degree
    state = _simulate(plan, used)
    for m, blocks in enumerate(used):
        assert plan.block_maps[m] == {b: merged_block_id(m, b, d) for b in sorted(blocks)}
        for b in blocks:
            j = plan.block_maps[m][b]
            for r in range(d):
                assert state[r][j] == (m, b, r), f"rank {r} lacks heads {r} of member {m}'s block {b} at merged {j}"
    merged = [j for mp in plan.block_maps for j in mp.values()]
    assert len(merged) == len(set(merged)) and all(0 <= j < plan.merged_num_blocks for j in merged)
    # only used blocks' heads move, each exactly once, and never to a slot that holds a kept head
    moves = plan.moves
    assert len(moves) == sum(len(u) for u in used) * (d - 1)
    assert len({(mv.src, mv.src_slot) for mv in moves}) == len(moves)
    assert len({(mv.dst, mv.dst_slot) for mv in moves}) == len(moves)
    assert plan.in_place == sum(len(u) for u in used)


def test_two_members_move_only_the_swapped_halves():
    used = [{0, 1, 3}, {1, 2}]
    plan = plan_head_split(used, num_blocks=4, num_kv_heads=8, max_phase_subblocks=2)
    assert plan.degree == 2 and plan.heads_per_rank == 4 and plan.merged_num_blocks == 8
    assert plan.block_maps == ({0: 0, 1: 2, 3: 6}, {1: 3, 2: 5})
    moves = {(mv.src, mv.src_slot, mv.dst, mv.dst_slot) for mv in plan.moves}
    # A's sub-block 2b+1 -> B's 2b; B's 2c -> A's 2c+1
    assert moves == {(0, 1, 1, 0), (0, 3, 1, 2), (0, 7, 1, 6), (1, 2, 0, 3), (1, 4, 0, 5)}
    assert plan.heads(0) == range(0, 4) and plan.heads(1) == range(4, 8)
    _check(plan, used)
    assert plan.staging_subblocks <= 2


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("limit", [1, 2, 3, 7, 1000])
def test_random_merges_put_every_head_right_within_the_staging_bound(degree, limit):
    rng = random.Random(degree * 100 + limit)
    for _ in range(20):
        nb = rng.randint(1, 12)
        used = [set(rng.sample(range(nb), rng.randint(0, nb))) for _ in range(degree)]
        plan = plan_head_split(used, nb, num_kv_heads=degree * rng.choice([1, 2]), max_phase_subblocks=limit)
        _check(plan, used)
        for phase in plan.phases:
            assert phase, "no empty phase"
            for m in range(degree):
                assert sum(1 for mv in phase if mv.dst == m) <= limit
        assert plan.staging_subblocks <= limit
        if limit >= 1000:
            assert len(plan.phases) <= 1


def test_degree_four_swaps_are_pairwise_between_same_block_index_slots():
    used = [{0}, {0}, set(), {0}]
    plan = plan_head_split(used, 1, num_kv_heads=4, max_phase_subblocks=1)
    _check(plan, used)
    for mv in plan.moves:
        assert mv.src_slot // 4 == mv.dst_slot // 4 == 0
        assert mv.src_slot % 4 == mv.dst and mv.dst_slot % 4 == mv.src  # m's slot r <-> r's slot m
    # rank 2's own block 0 is unused: it only receives; the others swap pairwise
    assert {mv.src for mv in plan.moves if mv.dst == 2} == {0, 1, 3}
    assert not [mv for mv in plan.moves if mv.src == 2]
    assert plan.staging_subblocks == 1


def test_a_swap_is_never_split_across_phases():
    used = [set(range(6)), set(range(6))]
    plan = plan_head_split(used, 6, 2, max_phase_subblocks=1)
    assert len(plan.phases) == 6
    for phase in plan.phases:
        assert {(mv.src, mv.dst) for mv in phase} == {(0, 1), (1, 0)}


def test_rank_heads_and_ids():
    assert [rank_heads(r, 4, 8) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert merged_block_id(1, 5, 2) == 11 and sub_block(5, 1, 2) == 11


@pytest.mark.parametrize(
    "args,match",
    [
        (([{0}], 2, 2, 1), "at least 2 members"),
        (([{0}, {0}, {0}], 2, 4, 1), "does not divide"),
        (([{0}, {2}], 2, 2, 1), "outside"),
        (([{0}, {0}], 2, 2, 0), "at least one"),
        (([{0}, {0}], 0, 2, 1), "num_blocks"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        plan_head_split(*args)
    with pytest.raises(ValueError):
        rank_heads(2, 2, 4)


def test_in_place_split_needs_one_phase_of_staging_the_kv_major_layout_reserves_and_trims():
    """The memory side of Gyges' −91.6%: two members at 90% KV use of 1000 blocks, 64 KiB blocks, 2 MiB pages."""
    nb, used_n = 1000, 900
    used = [set(range(used_n)), set(range(used_n))]
    block, page = 64 << 10, 2 << 20
    plan = plan_head_split(used, nb, 8, max_phase_subblocks=32)
    ours = header_centric_split_cost(plan, block)
    base = kv_major_split_cost(used, 8, block, page)
    assert ours.extra_bytes == 32 * block // 2 and ours.copied_bytes == 0
    assert base.extra_bytes == -(-used_n * block // 2 // page) * page and base.copied_bytes == used_n * block // 2
    assert ours.sent_bytes == base.sent_bytes == used_n * block // 2
    assert ours.extra_bytes / base.extra_bytes < 0.05
