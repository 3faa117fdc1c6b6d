"""KunServe Fig. 6 drop plans."""

import random

import pytest

from kunserve.shared.policy.cluster import Member, Unit
from kunserve.shared.policy.planner import ModelCost, balanced_split, merged_members, plan_drop, plan_split

L = 32
GB = 1 << 30
MODEL = ModelCost(num_layers=L, layer_bytes=GB // 2, kv_bytes_per_token=128 * 1024, block_size=16)  # 16 GiB model


def pipeline(gid, ids, num_layers=L):
    return Unit(gid, [Member(i, s, e) for i, (s, e) in zip(ids, balanced_split(num_layers, len(ids)))])


def check_cover(group, num_layers=L):
    """Contiguous, balanced, covering the model exactly once, in pipeline order."""
    ranges = [m.range for m in group.members]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_paper_example_merges_the_groups_of_size_1_and_2():
    groups = [Unit.single("a", L), pipeline("g2", ["b", "c"]), pipeline("g3", ["d", "e", "f"])]
    plan = plan_drop(groups, MODEL, required_bytes=1)
    assert plan.merges == (("a", "g2", "a"),)
    assert plan.met and plan.fallback is None and not plan.autoscale_needed
    assert plan.freed_bytes == MODEL.model_bytes == plan.net_freed_bytes
    (merged,) = plan.changed_units
    assert sorted(merged.merged_from) == ["a", "g2"] and merged.size == 3
    check_cover(merged)
    # aligned: b [0,16) c [16,32) a [0,32) -> b [0,11), a [11,22), c [22,32): everyone keeps a subset
    assert [m.worker_id for m in merged.members] == ["b", "a", "c"]
    assert plan.load_bytes == 0 and all(not m.load for m in merged.members)
    untouched = [g for g in plan.units if g.unit_id == "g3"][0]
    assert not untouched.changed and untouched.merged_from == ("g3",)


def test_two_instances_split_the_model_in_halves():
    plan = plan_drop([Unit.single("x", L), Unit.single("y", L)], MODEL, required_bytes=GB)
    (g,) = plan.units
    assert [(m.worker_id, m.range) for m in g.members] == [("x", (0, 16)), ("y", (16, 32))]
    assert [m.drop for m in g.members] == [((16, 32),), ((0, 16),)]
    assert all(m.freed_bytes == 16 * (GB // 2) for m in g.members)


def test_merges_continue_until_the_requirement_is_met_and_stop_there():
    groups = [Unit.single(f"i{k}", L) for k in range(8)]
    one_copy = MODEL.model_bytes
    plan = plan_drop(groups, MODEL, required_bytes=2 * one_copy + 1)  # needs 3 merges
    assert len(plan.merges) == 3 and plan.freed_bytes == 3 * one_copy and plan.met
    sizes = sorted(g.size for g in plan.units)
    assert sizes == [1, 1, 2, 2, 2]  # the smallest groups merge first: three pairs, not one deep pipeline
    for g in plan.changed_units:
        check_cover(g)
    assert plan_drop(groups, MODEL, required_bytes=0).merges == ()


def test_no_plan_when_the_requirement_cannot_be_met():
    groups = [Unit.single("a", L), Unit.single("b", L), Unit.single("c", L)]
    plan = plan_drop(groups, MODEL, required_bytes=10 * MODEL.model_bytes)
    assert not plan.met and plan.autoscale_needed and plan.fallback == "kv_centric"
    assert len(plan.merges) == 2 and plan.freed_bytes == 2 * MODEL.model_bytes  # best effort, one group left
    (g,) = plan.units
    check_cover(g)
    single = plan_drop([Unit.single("a", L)], MODEL, required_bytes=1)
    assert not single.met and single.merges == ()


def test_pipeline_depth_limit_stops_merging():
    groups = [pipeline("p", ["a", "b"]), pipeline("q", ["c", "d"]), pipeline("r", ["e", "f"])]
    plan = plan_drop(groups, MODEL, required_bytes=10 * MODEL.model_bytes, max_group_size=4)
    assert len(plan.merges) == 1 and not plan.met
    tiny = ModelCost(num_layers=2, layer_bytes=1)
    plan = plan_drop([Unit.single("a", 2), Unit.single("b", 2), Unit.single("c", 2)], tiny, required_bytes=5)
    assert len(plan.merges) == 1  # a 3-stage pipeline of a 2-layer model is impossible


def test_requirement_in_blocks():
    # one merge frees 16 GiB; a whole-model block is 16 tokens * 128 KiB * 32 layers = 64 MiB -> 256 blocks
    assert MODEL.block_bytes == 64 << 20 and MODEL.bytes_to_blocks(MODEL.model_bytes) == 256
    groups = [Unit.single(f"i{k}", L) for k in range(4)]
    assert len(plan_drop(groups, MODEL, required_blocks=256).merges) == 1
    assert len(plan_drop(groups, MODEL, required_blocks=257).merges) == 2


def test_uneven_layers_and_sizes_still_cover_exactly_once():
    model = ModelCost(num_layers=7, layer_bytes=tuple(range(10, 17)))
    groups = [Unit.single("a", 7), pipeline("g", ["b", "c"], 7), pipeline("h", ["d", "e", "f"], 7)]
    plan = plan_drop(groups, model, required_bytes=10**9)
    assert not plan.met and len(plan.merges) == 2
    (g,) = plan.units
    assert [e - s for s, e in (m.range for m in g.members)] == [2, 1, 1, 1, 1, 1]
    check_cover(g, 7)
    # the freed total is one model copy per merge; loads (misaligned splits) are reported, not hidden
    assert plan.freed_bytes == 2 * model.model_bytes
    assert plan.net_freed_bytes == plan.freed_bytes
    for m in g.members:
        assert m.freed_bytes == model.bytes_of(m.old_start, m.old_end) - model.bytes_of(*m.range)


def test_random_layouts_are_deterministic_and_valid():
    rng = random.Random(7)
    for _trial in range(200):
        n = rng.randint(1, 12)
        sizes = []
        left = n
        while left:
            k = rng.randint(1, min(4, left))
            sizes.append(k)
            left -= k
        groups, c = [], 0
        for gi, k in enumerate(sizes):
            groups.append(pipeline(f"g{gi}", [f"i{c + j}" for j in range(k)]))
            c += k
        rng.shuffle(groups)
        r = rng.randint(0, 4) * MODEL.model_bytes
        plan = plan_drop(groups, MODEL, required_bytes=r)
        assert plan == plan_drop(list(reversed(groups)), MODEL, required_bytes=r)
        assert plan.met == (plan.freed_bytes >= r)
        assert plan.freed_bytes == len(plan.merges) * MODEL.model_bytes == plan.net_freed_bytes
        assert sorted(m.worker_id for g in plan.units for m in g.members) == sorted(
            i.worker_id for g in groups for i in g.members)
        for g in plan.changed_units:
            check_cover(g)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="exactly once"):
        plan_drop([Unit("g", [Member("a", 0, 10), Member("b", 12, 32)])], MODEL, required_bytes=1)
    with pytest.raises(ValueError, match="two groups"):
        plan_drop([Unit.single("a", L), Unit("b", [Member("a", 0, L)])], MODEL, required_bytes=1)
    with pytest.raises(ValueError, match="exactly one"):
        plan_drop([Unit.single("a", L)], MODEL)


# -- incremental drops: groups merge like instances; restore undoes one merge at a time ---------------------


def test_a_second_drop_merges_two_pairs_into_a_quad_that_only_unmaps():
    groups = [pipeline("p", ["a", "b"]), pipeline("q", ["c", "d"])]
    plan = plan_drop(groups, MODEL, required_bytes=1)
    assert plan.merges == (("p", "q", "p"),) and plan.met and plan.freed_bytes == MODEL.model_bytes
    (quad,) = plan.changed_units
    check_cover(quad)
    # each member keeps the half of its old range nearer the middle of the model's order: nothing is loaded
    assert [(m.worker_id, m.range) for m in quad.members] == [("a", (0, 8)), ("c", (8, 16)), ("b", (16, 24)),
                                                               ("d", (24, 32))]
    assert plan.load_bytes == 0 and all(m.freed_bytes == 8 * (GB // 2) for m in quad.members)
    assert sorted(quad.merged_from) == ["p", "q"]


def test_pairs_of_a_four_worker_cluster_merge_only_when_the_requirement_asks_for_it():
    wholes = [Unit.single(f"i{k}", L) for k in range(4)]
    first = plan_drop(wholes, MODEL, required_bytes=2 * MODEL.model_bytes)
    assert sorted(g.size for g in first.units) == [2, 2]  # two drops: two pairs, not a quad
    pairs = [Unit(g.unit_id, [Member(m.worker_id, *m.range) for m in g.members]) for g in first.units]
    assert plan_drop(pairs, MODEL, required_bytes=0).merges == ()
    second = plan_drop(pairs, MODEL, required_bytes=1)
    assert [g.size for g in second.units] == [4] and second.load_bytes == 0


def test_merged_members_keep_a_part_of_what_they_hold():
    members = [Member("w1", 2, 4, "t1"), Member("w0", 0, 2, "t0"), Member("w2", 0, 4, "t2")]
    assert merged_members(members, 4) == (Member("w0", 0, 2, "t0"), Member("w2", 2, 3, "t2"), Member("w1", 3, 4, "t1"))


def test_a_quad_splits_into_the_pairs_it_was_merged_from():
    quad = Unit("w0+w2+w1+w3", [Member("w0", 0, 8, "t0"), Member("w2", 8, 16), Member("w1", 16, 24),
                                 Member("w3", 24, 32)])
    pairs = plan_split(quad, L)
    assert [(u.unit_id, [(m.worker_id, m.range) for m in u.members]) for u in pairs] == [
        ("w0+w1", [("w0", (0, 16)), ("w1", (16, 32))]), ("w2+w3", [("w2", (0, 16)), ("w3", (16, 32))])]
    assert pairs[0].members[0].transfer_address == "t0"
    wholes = plan_split(pairs[0], L)
    assert [(u.unit_id, [m.range for m in u.members]) for u in wholes] == [("w0", [(0, L)]), ("w1", [(0, L)])]
    assert [u.unit_id for u in plan_split(quad, L, parts=4)] == ["w0", "w2", "w1", "w3"]


def test_a_three_member_group_splits_into_a_pair_and_an_instance():
    group = pipeline("g", ["a", "b", "c"])  # a [0, 11), b [11, 22), c [22, 32)
    pair, single = plan_split(group, L)
    assert [(m.worker_id, m.range) for m in pair.members] == [("a", (0, 16)), ("c", (16, 32))]
    assert [(m.worker_id, m.range) for m in single.members] == [("b", (0, L))]


def test_a_split_that_would_move_a_member_off_its_layers_gives_whole_instances():
    lopsided = Unit("g", [Member("a", 0, 1), Member("b", 1, 2), Member("c", 2, 3), Member("d", 3, 32)])
    assert [u.unit_id for u in plan_split(lopsided, L)] == ["a", "b", "c", "d"]


def test_bad_splits_are_rejected():
    with pytest.raises(ValueError, match="cannot split"):
        plan_split(pipeline("g", ["a", "b"]), L, parts=3)
    with pytest.raises(ValueError, match="cannot split"):
        plan_split(Unit.single("a", L), L)
    with pytest.raises(ValueError, match="exactly once"):
        plan_split(Unit("g", [Member("a", 0, 10), Member("b", 12, 32)]), L)


def test_splits_of_merged_groups_keep_every_member_on_its_layers():
    """Groups the greedy built (any number of merges, any layer count): every split into 2..n parts tiles the
    model per unit, keeps the workers, and gives every member a range overlapping the one it holds."""
    rng = random.Random(11)
    for _trial in range(300):
        n = rng.randint(2, 8)
        num_layers = rng.randint(n, 40)
        model = ModelCost(num_layers=num_layers, layer_bytes=1)
        plan = plan_drop([Unit.single(f"i{k}", num_layers) for k in range(n)], model,
                         required_bytes=10 * num_layers * n)
        for planned in plan.changed_units:
            group = Unit(planned.unit_id, [Member(m.worker_id, *m.range) for m in planned.members])
            for parts in range(2, group.size + 1):
                units = plan_split(group, num_layers, parts)
                assert sorted(w for u in units for w in u.worker_ids) == sorted(group.worker_ids)
                for u in units:
                    check_cover(u, num_layers)
                    assert u.unit_id == "+".join(u.worker_ids)
                    for m in u.members:
                        old = group.member(m.worker_id)
                        assert max(old.layer_start, m.layer_start) < min(old.layer_end, m.layer_end)
                if num_layers % group.size == 0 and group.size % parts == 0:
                    assert len(units) == parts, "an evenly laid out group splits as asked"
