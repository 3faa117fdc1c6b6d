"""The pure plan of the head gather (shared/memory/kv_head_split.py), the inverse of the head split: which member
keeps which request, where every kept merged block lands as a whole block, that executing the moves (all reads, then
all writes) puts every rank's heads there, the in-place preference, the staging bound and the refusals."""

from __future__ import annotations

import itertools
import random

import pytest

from kunserve.shared.memory.kv_head_split import HeadGatherPlan, assign_requests, plan_head_gather, sub_block


def _execute(plan: HeadGatherPlan, used: set[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """Symbolic slots: member r's sub-block x of a used merged block x starts as (x, r) = heads of rank r of x; every
    other slot starts as ("junk", ...). All sources are read, then all destinations written."""
    d = plan.degree
    state: dict[tuple[int, int], tuple[int, int]] = {}
    for r in range(d):
        for s in range(plan.num_blocks * d):
            state[(r, s)] = (s, r) if s in used else (-1 - s, r)
    staged = [(mv, state[(mv.src, mv.src_slot)]) for mv in plan.moves]
    for mv, content in staged:
        state[(mv.dst, mv.dst_slot)] = content
    return state


def _check(plan: HeadGatherPlan, owners: dict[int, int]) -> None:
    d, nb = plan.degree, plan.num_blocks
    state = _execute(plan, set(owners))
    assert sorted(x for mp in plan.block_maps for x in mp) == sorted(owners)
    for m, mp in enumerate(plan.block_maps):
        assert sorted(mp.values()) == sorted(set(mp.values())) and all(0 <= y < nb for y in mp.values())
        for x, y in mp.items():
            assert owners[x] == m
            for r in range(d):
                assert state[(m, sub_block(y, r, d))] == (x, r), f"member {m} lacks heads {r} of merged {x} at whole {y}"
            if x % d == m:  # its own heads already lie in the right sub-block of whole block x // d
                assert y == x // d
    assert len(plan.moves) + plan.in_place == len(owners) * d
    assert plan.in_place == sum(1 for x, m in owners.items() if x % d == m)
    assert len({(mv.dst, mv.dst_slot) for mv in plan.moves}) == len(plan.moves)
    assert plan.staging_subblocks == max((sum(1 for mv in plan.moves if mv.dst == m) for m in range(d)), default=0)


@pytest.mark.parametrize("degree", [2, 4])
def test_random_gathers_put_every_head_of_every_kept_block_in_its_whole_block(degree):
    rng = random.Random(degree)
    for _ in range(200):
        nb = rng.randint(1, 9)
        cap = [nb] * degree
        owners: dict[int, int] = {}
        for x in rng.sample(range(nb * degree), rng.randint(0, nb * degree)):
            m = rng.choice([i for i in range(degree) if cap[i]])
            cap[m] -= 1
            owners[x] = m
        plan = plan_head_gather(owners, nb, 4 * degree // 2, degree)
        assert plan.heads_per_rank == 2
        _check(plan, owners)


def test_blocks_at_their_own_slot_stay_and_others_fill_the_lowest_free_whole_block():
    # degree 2, 3 whole blocks: merged 4 = 2*2 + 0 is member 0's slot, merged 1 = 0*2 + 1 is not.
    plan = plan_head_gather({4: 0, 1: 0, 3: 1, 2: 1}, num_blocks=3, num_kv_heads=2, degree=2)
    assert plan.block_maps == ({1: 0, 4: 2}, {2: 0, 3: 1})
    assert plan.in_place == 2  # merged 4 on member 0, merged 3 on member 1
    _check(plan, {4: 0, 1: 0, 3: 1, 2: 1})


def test_the_moves_can_form_a_cycle_so_every_read_comes_before_every_write():
    """Member 0 keeps merged 1, member 1 keeps merged 0 (one whole block each): the moves form the cycle
    (0,1) -> (0,0) -> (1,0) -> (1,1) -> (0,1), so no order of single moves is right; reading all first is."""
    owners = {1: 0, 0: 1}
    plan = plan_head_gather(owners, num_blocks=1, num_kv_heads=2, degree=2)
    assert plan.in_place == 0 and plan.staging_subblocks == 2
    _check(plan, owners)
    for order in itertools.permutations(plan.moves):
        state: dict[tuple[int, int], tuple[int, int]] = {(r, s): (s, r) for r in range(2) for s in range(2)}
        for mv in order:
            state[(mv.dst, mv.dst_slot)] = state[(mv.src, mv.src_slot)]
        assert any(state[(m, sub_block(y, r, 2))] != (x, r) for m in range(2) for x, y in plan.block_maps[m].items() for r in range(2))


def test_gather_refuses_bad_input():
    with pytest.raises(ValueError, match="member 0 is given 3 blocks but holds 2"):
        plan_head_gather({0: 0, 1: 0, 2: 0}, 2, 2, 2)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        plan_head_gather({4: 0}, 2, 2, 2)
    with pytest.raises(ValueError, match="members outside"):
        plan_head_gather({0: 2}, 2, 2, 2)
    with pytest.raises(ValueError, match="does not divide"):
        plan_head_gather({0: 0}, 2, 3, 2)
    with pytest.raises(ValueError, match="at least 2 members"):
        plan_head_gather({0: 0}, 2, 2, 1)
    with pytest.raises(ValueError, match="num_blocks"):
        plan_head_gather({}, 0, 2, 2)


def test_assign_requests_packs_largest_first_to_the_emptiest_member():
    out = assign_requests({"a": 5, "b": 4, "c": 3, "d": 1}, degree=2, num_blocks=7)
    assert out == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert assign_requests({"a": 2, "b": 2}, 2, 4, prefer={"a": 1, "b": 1}) == {"a": 1, "b": 1}
    # the preferred member is full: the emptiest one takes it
    assert assign_requests({"a": 3, "b": 2}, 2, 4, prefer={"b": 0}) == {"a": 0, "b": 1}
    assert assign_requests({}, 2, 0) == {}


def test_assign_requests_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="hold 9 blocks but 2 members of 4 blocks hold 8"):
        assign_requests({"a": 5, "b": 4}, 2, 4)
    with pytest.raises(ValueError, match="request 'c' holds 2 blocks but no member has room"):
        assign_requests({"a": 3, "b": 3, "c": 2}, 2, 4)  # 8 of 8 blocks, but 3 + 3 leave 1 + 1 free
    with pytest.raises(ValueError, match="negative"):
        assign_requests({"a": -1}, 2, 4)
    with pytest.raises(ValueError, match="preferred members"):
        assign_requests({"a": 1}, 2, 4, prefer={"a": 2})
