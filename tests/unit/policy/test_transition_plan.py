"""Layout-transition planning (shared/policy/transition_plan.py): which KV moves where in a drop (two whole instances
merge into a pipeline group) and a restore (the group splits back), compact block tables per new unit,
restore targets, and the checks that refuse a malformed transition. Pure: no torch, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunserve.shared.policy.cluster import Member, Unit
from kunserve.shared.policy.transition_plan import (
    Flow,
    FlowPart,
    SeqMove,
    TransitionError,
    WeightPiece,
    assign_restore_targets,
    assign_tables,
    check_unit,
    check_units,
    kv_flows,
    unit_of,
    weight_pieces,
)

L = 4  # layers of the model in the hand-written cases


def whole(uid: str, worker: str, kv_blocks: int = 0) -> Unit:
    return Unit(uid, (Member(worker, 0, L),), kv_blocks)


def group(uid: str, *members: tuple[str, int, int], kv_blocks: int = 0) -> Unit:
    return Unit(uid, tuple(Member(w, a, b) for w, a, b in members), kv_blocks)


OLD_WHOLES = [whole("uA", "A"), whole("uB", "B")]
GROUP = [group("g", ("A", 0, 2), ("B", 2, 4), kv_blocks=10)]


# -- drop: two wholes -> one group -------------------------------------------------------------------------

def test_drop_flows():
    check_units(OLD_WHOLES, GROUP, L)
    moves = assign_tables([SeqMove("a1", "uA", "g", (3, 5)), SeqMove("b1", "uB", "g", (0, 1, 2)),
                           SeqMove("a2", "uA", "g", (7,))], GROUP)
    # compact ids in the order given, one block per old block
    assert [m.new_blocks for m in moves] == [(0, 1), (2, 3, 4), (5,)]
    flows = kv_flows(OLD_WHOLES, GROUP, moves)
    assert set(flows) == {("A", "A"), ("A", "B"), ("B", "A"), ("B", "B")}
    # A's requests: layers 0-1 stay on A (local renumbering), layers 2-3 go to B; parts by request id
    assert flows["A", "A"] == Flow("A", "A", [FlowPart("a1", 0, 2, (3, 5), (0, 1)), FlowPart("a2", 0, 2, (7,), (5,))])
    assert flows["A", "B"] == Flow("A", "B", [FlowPart("a1", 2, 4, (3, 5), (0, 1)), FlowPart("a2", 2, 4, (7,), (5,))])
    # B's requests: layers 0-1 move to A, layers 2-3 stay on B (renumbered)
    assert flows["B", "A"] == Flow("B", "A", [FlowPart("b1", 0, 2, (0, 1, 2), (2, 3, 4))])
    assert flows["B", "B"] == Flow("B", "B", [FlowPart("b1", 2, 4, (0, 1, 2), (2, 3, 4))])
    assert flows["A", "B"].num_block_layers() == 2 * 2 + 2 * 1
    assert flows["B", "A"].num_block_layers() == 2 * 3
    assert flows["A", "A"].parts[0].num_layers == 2


def test_drop_into_a_three_member_group_with_a_third_whole_unchanged():
    old = [whole("uA", "A"), whole("uB", "B"), whole("uC", "C"), whole("uD", "D")]
    new = [group("g", ("A", 0, 1), ("B", 1, 3), ("C", 3, 4), kv_blocks=8), whole("uD", "D", kv_blocks=5)]
    check_units(old, new, L)
    moves = assign_tables([SeqMove("c", "uC", "g", (4,)), SeqMove("d", "uD", "uD", (2, 3))], new)
    flows = kv_flows(old, new, moves)
    assert flows["C", "A"].parts == [FlowPart("c", 0, 1, (4,), (0,))]
    assert flows["C", "B"].parts == [FlowPart("c", 1, 3, (4,), (0,))]
    assert flows["C", "C"].parts == [FlowPart("c", 3, 4, (4,), (0,))]
    # an instance that stays whole only renumbers its own blocks
    assert flows["D", "D"].parts == [FlowPart("d", 0, 4, (2, 3), (0, 1))]
    assert set(flows) == {("C", "A"), ("C", "B"), ("C", "C"), ("D", "D")}


# -- restore: group -> two wholes --------------------------------------------------------------------------

def test_restore_targets_and_flows():
    new = [whole("uA", "A", kv_blocks=6), whole("uB", "B", kv_blocks=6)]
    check_units(GROUP, new, L)
    moves = [SeqMove("r1", "g", "", (0,)), SeqMove("r2", "g", "", (1, 2, 3)), SeqMove("r3", "g", "", (4, 5)),
             SeqMove("r4", "g", "", (6,)), SeqMove("r5", "g", "", ())]
    targeted = assign_restore_targets(moves, {"uA": 6, "uB": 6})
    # largest first to the unit with the most free blocks, ties by unit id: r2 -> uA (6 vs 6), r3 -> uB (3 vs 6),
    # r1 -> uB (3 vs 4), r4 -> uA (3 vs 3), r5 (no blocks) -> uB (2 vs 3)
    assert {m.request_id: m.new_unit for m in targeted} == {"r2": "uA", "r3": "uB", "r1": "uB", "r4": "uA",
                                                            "r5": "uB"}
    assert [m.request_id for m in targeted] == ["r1", "r2", "r3", "r4", "r5"]  # input order kept
    assert all(m.old_unit == "g" and m.old_blocks == o.old_blocks for m, o in zip(targeted, moves))
    tabled = assign_tables(targeted, new)
    # compact ids per unit in the input order: uA gets r2 then r4, uB gets r1, r3 (and r5, no blocks)
    assert {m.request_id: m.new_blocks for m in tabled} == {"r1": (0,), "r2": (0, 1, 2), "r3": (1, 2), "r4": (3,),
                                                           "r5": ()}
    flows = kv_flows(GROUP, new, tabled)
    # every request's layers 0-1 come from A, 2-3 from B, to the whole instance it lands on
    assert flows["A", "A"].parts == [FlowPart("r2", 0, 2, (1, 2, 3), (0, 1, 2)), FlowPart("r4", 0, 2, (6,), (3,))]
    assert flows["B", "A"].parts == [FlowPart("r2", 2, 4, (1, 2, 3), (0, 1, 2)), FlowPart("r4", 2, 4, (6,), (3,))]
    assert flows["A", "B"].parts == [FlowPart("r1", 0, 2, (0,), (0,)), FlowPart("r3", 0, 2, (4, 5), (1, 2))]
    # r1 keeps block 0 on B: a part that would copy it onto itself is left out
    assert flows["B", "B"].parts == [FlowPart("r3", 2, 4, (4, 5), (1, 2))]
    assert all(p.request_id != "r5" for f in flows.values() for p in f.parts)  # a waiting request moves no KV


def test_restore_target_that_fits_nowhere():
    moves = [SeqMove("big", "g", "", tuple(range(7))), SeqMove("s", "g", "", (7,))]
    with pytest.raises(TransitionError, match="big"):
        assign_restore_targets(moves, {"uA": 6, "uB": 6})
    # fits in total but not in one piece after the others were placed
    moves = [SeqMove(f"r{i}", "g", "", (3 * i, 3 * i + 1, 3 * i + 2)) for i in range(3)]
    with pytest.raises(TransitionError):
        assign_restore_targets(moves, {"uA": 4, "uB": 5})
    with pytest.raises(TransitionError):
        assign_restore_targets([SeqMove("x", "g", "", (0,))], {})
    assert assign_restore_targets([], {}) == []


# -- block tables -------------------------------------------------------------------------------------------

def test_assign_tables_compact_per_unit_and_capacity():
    new = [whole("uA", "A", kv_blocks=4), whole("uB", "B", kv_blocks=3)]
    moves = [SeqMove("x", "g", "uA", (9, 8)), SeqMove("y", "g", "uB", (1, 2, 3)), SeqMove("w", "g", "uA", ()),
             SeqMove("z", "g", "uA", (5, 6))]
    out = assign_tables(moves, new)
    assert [(m.request_id, m.new_blocks) for m in out] == [("x", (0, 1)), ("y", (0, 1, 2)), ("w", ()), ("z", (2, 3))]
    assert [m.old_blocks for m in out] == [m.old_blocks for m in moves]
    assert all(m.new_blocks == () for m in moves), "the input moves are not modified"
    # exactly full is fine; one block more is refused, naming the unit
    with pytest.raises(TransitionError, match="uB"):
        assign_tables(moves + [SeqMove("v", "g", "uB", (4,))], new)
    with pytest.raises(TransitionError, match="nowhere"):
        assign_tables([SeqMove("q", "g", "nowhere", (1,))], new)
    with pytest.raises(TransitionError):  # kv_blocks defaults to 0: nothing fits
        assign_tables([SeqMove("q", "g", "u0", (1,))], [whole("u0", "A")])


def test_requests_without_blocks_produce_no_flows():
    moves = assign_tables([SeqMove("w1", "uA", "g", ()), SeqMove("w2", "uB", "g", ())], GROUP)
    assert kv_flows(OLD_WHOLES, GROUP, moves) == {}
    assert kv_flows(OLD_WHOLES, GROUP, []) == {}


def test_kv_flows_refuses_tables_of_the_wrong_length():
    with pytest.raises(TransitionError, match="r"):
        kv_flows(OLD_WHOLES, GROUP, [SeqMove("r", "uA", "g", (1, 2), (0,))])


# -- checks -----------------------------------------------------------------------------------------------

def test_check_units_accepts_drop_restore_and_identity():
    check_units(OLD_WHOLES, GROUP, L)
    check_units(GROUP, OLD_WHOLES, L)
    check_units(OLD_WHOLES, OLD_WHOLES, L)
    check_units(GROUP, [group("g2", ("A", 0, 3), ("B", 3, 4))], L)  # a rebalanced group
    assert unit_of(GROUP, "B").unit_id == "g"
    with pytest.raises(TransitionError):
        unit_of(GROUP, "Z")


def test_check_units_worker_in_two_units():
    with pytest.raises(TransitionError, match="twice"):
        check_units(OLD_WHOLES, [whole("uA", "A"), group("g", ("A", 0, 2), ("B", 2, 4))], L)
    with pytest.raises(TransitionError, match="twice"):
        check_units([whole("uA", "A"), whole("uA2", "A")], [whole("uA", "A")], L)
    with pytest.raises(TransitionError, match="twice"):  # twice inside one group
        check_units(OLD_WHOLES, [group("g", ("A", 0, 2), ("A", 2, 4)), whole("uB", "B")], L)


@pytest.mark.parametrize("ranges", [
    [(0, 2), (3, 4)],  # a gap
    [(0, 3), (2, 4)],  # an overlap
    [(0, 2), (2, 3)],  # does not reach the last layer
    [(1, 2), (2, 4)],  # does not start at 0
    [(2, 4), (0, 2)],  # out of pipeline order
    [(0, 2), (2, 2), (2, 4)],  # an empty member
    [(0, 2), (2, 5)],  # beyond the model
])
def test_check_units_ranges_that_do_not_tile(ranges):
    ws = ["A", "B", "C"][: len(ranges)]
    bad = Unit("g", tuple(Member(w, a, b) for w, (a, b) in zip(ws, ranges)))
    old = [whole(f"u{w}", w) for w in ws]
    with pytest.raises(TransitionError, match="g"):
        check_units(old, [bad], L)
    with pytest.raises(TransitionError):
        check_units([bad], old, L)


def test_check_units_empty_unit():
    with pytest.raises(TransitionError, match="no members"):
        check_unit(Unit("e", ()), L)


def test_check_units_new_range_must_overlap_the_old_one():
    old = [group("g", ("A", 0, 2), ("B", 2, 4))]
    with pytest.raises(TransitionError, match="overlap"):
        check_units(old, [group("g", ("B", 0, 2), ("A", 2, 4))], L)
    # touching ranges do not overlap: A held [0, 1), would hold [1, 4)
    with pytest.raises(TransitionError, match="does not overlap"):
        check_units([group("g", ("A", 0, 1), ("B", 1, 4))], [group("g", ("B", 0, 1), ("A", 1, 4))], L)
    # a partial overlap is fine (the worker keeps some layers)
    old3 = [group("g", ("A", 0, 1), ("B", 1, 3), ("C", 3, 4))]
    check_units(old3, [group("g", ("A", 0, 2), ("B", 2, 3), ("C", 3, 4))], L)


def test_check_units_different_worker_sets():
    with pytest.raises(TransitionError, match="same workers"):
        check_units(OLD_WHOLES, [group("g", ("A", 0, 2), ("C", 2, 4))], L)
    with pytest.raises(TransitionError, match="same workers"):
        check_units(OLD_WHOLES, [whole("uA", "A")], L)
    with pytest.raises(TransitionError, match="same workers"):
        check_units([whole("uA", "A")], GROUP, L)


# -- property: every (request, layer) moves exactly once, from its holder to its new holder -----------------

WORKERS = ["w0", "w1", "w2", "w3", "w4"]


@st.composite
def partitions(draw, num_layers: int):
    """Workers split into units; each unit's members tile [0, num_layers) in a random order of workers."""
    ws = draw(st.permutations(WORKERS))
    n = draw(st.integers(1, len(ws)))
    ws = ws[:n]
    units = []
    i = 0
    while i < len(ws):
        size = draw(st.integers(1, min(num_layers, len(ws) - i)))
        cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=size - 1, max_size=size - 1,
                                    unique=True))) if size > 1 else []
        bounds = [0, *cuts, num_layers]
        members = tuple(Member(w, a, b) for w, a, b in zip(ws[i:i + size], bounds, bounds[1:]))
        units.append(Unit(f"u{len(units)}", members))
        i += size
    return ws, units


@st.composite
def transitions(draw):
    num_layers = draw(st.integers(1, 6))
    ws, old = draw(partitions(num_layers))
    # the new units: the same workers in another partition (ranges need not overlap for kv_flows itself)
    perm = draw(st.permutations(ws))
    new = []
    i = 0
    while i < len(perm):
        size = draw(st.integers(1, min(num_layers, len(perm) - i)))
        cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=size - 1, max_size=size - 1,
                                    unique=True))) if size > 1 else []
        bounds = [0, *cuts, num_layers]
        new.append(Unit(f"n{len(new)}", tuple(Member(w, a, b) for w, a, b in zip(perm[i:i + size], bounds,
                                                                                     bounds[1:])), kv_blocks=64))
        i += size
    n_req = draw(st.integers(0, 8))
    moves = []
    for r in range(n_req):
        ou = draw(st.sampled_from(old))
        nu = draw(st.sampled_from(new))
        k = draw(st.integers(0, 5))
        old_blocks = tuple(draw(st.lists(st.integers(0, 99), min_size=k, max_size=k, unique=True)))
        moves.append(SeqMove(f"r{r}", ou.unit_id, nu.unit_id, old_blocks))
    order = draw(st.permutations(list(range(len(moves)))))
    return num_layers, old, new, [moves[i] for i in order]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transitions())
def test_every_layer_of_every_request_moves_exactly_once(t):
    num_layers, old, new, moves = t
    for u in old + new:
        check_unit(u, num_layers)
    tabled = assign_tables(moves, new)
    flows = kv_flows(old, new, tabled)
    old_by = {u.unit_id: u for u in old}
    new_by = {u.unit_id: u for u in new}
    by_req = {m.request_id: m for m in tabled}
    seen: dict[tuple[str, int], int] = {}
    for (src, dst), flow in flows.items():
        assert (flow.src, flow.dst) == (src, dst)
        assert flow.parts, "no empty flows"
        keys = [(p.request_id, p.layer_start) for p in flow.parts]
        assert keys == sorted(keys), "parts ordered by request, then layer"
        assert flow.num_block_layers() == sum(p.num_layers * len(p.old_blocks) for p in flow.parts)
        for p in flow.parts:
            m = by_req[p.request_id]
            assert p.old_blocks == m.old_blocks and p.new_blocks == m.new_blocks
            assert len(p.new_blocks) == len(p.old_blocks) > 0
            s = old_by[m.old_unit].member(src)
            d = new_by[m.new_unit].member(dst)
            assert s is not None and d is not None, "src is in the request's old unit, dst in its new unit"
            assert s.layer_start <= p.layer_start < p.layer_end <= s.layer_end
            assert d.layer_start <= p.layer_start < p.layer_end <= d.layer_end
            for layer in range(p.layer_start, p.layer_end):
                seen[p.request_id, layer] = seen.get((p.request_id, layer), 0) + 1
    def stays(m, layer: int) -> bool:  # held by the same worker before and after, at the same ids: no copy
        s = next(x for x in old_by[m.old_unit].members if x.layer_start <= layer < x.layer_end)
        d = next(x for x in new_by[m.new_unit].members if x.layer_start <= layer < x.layer_end)
        return s.worker_id == d.worker_id and m.old_blocks == m.new_blocks

    want = {(m.request_id, layer) for m in tabled if m.old_blocks for layer in range(num_layers)
            if not stays(m, layer)}
    assert set(seen) == want
    assert all(c == 1 for c in seen.values())
    # compact tables: per new unit the new ids are exactly 0..n-1
    for u in new:
        ids = sorted(b for m in tabled if m.new_unit == u.unit_id for b in m.new_blocks)
        assert ids == list(range(len(ids)))


def test_requests_staying_with_their_head_keep_their_block_ids():
    """With old_heads, a request whose new unit has its old head keeps its ids (its KV on the head stays
    put); the others get the lowest free ids; a kept id beyond the unit's capacity is not kept."""
    old = [Unit("A", (Member("A", 0, 4),)), Unit("B", (Member("B", 0, 4),))]
    new = [Unit("A+B", (Member("A", 0, 2), Member("B", 2, 4)), kv_blocks=8)]
    moves = [SeqMove("a1", "A", "A+B", (0, 1)), SeqMove("b1", "B", "A+B", (0, 1, 2)), SeqMove("a2", "A", "A+B", (2,)),
             SeqMove("a3", "A", "A+B", (9,))]
    got = {m.request_id: m.new_blocks for m in assign_tables(moves, new, old_heads={"A": "A", "B": "B"})}
    assert got["a1"] == (0, 1) and got["a2"] == (2,)
    assert got["b1"] == (3, 4, 5) and got["a3"] == (6,)
    flows = kv_flows(old, new, [m for m in assign_tables(moves, new, old_heads={"A": "A", "B": "B"})])
    assert ("A", "A") in flows and [p.request_id for p in flows["A", "A"].parts] == ["a3"]


# -- incremental drops: two pairs -> a quad, and back -----------------------------------------------------

PAIRS = [group("pA", ("A0", 0, 2), ("A1", 2, 4)), group("pB", ("B0", 0, 2), ("B1", 2, 4))]
QUAD = [group("q", ("A0", 0, 1), ("B0", 1, 2), ("A1", 2, 3), ("B1", 3, 4), kv_blocks=12)]


def test_merging_two_pairs_moves_only_the_layers_that_change_hands():
    check_units(PAIRS, QUAD, L)
    moves = assign_tables([SeqMove("a", "pA", "q", (2, 3)), SeqMove("b", "pB", "q", (0, 1, 2))], QUAD,
                          old_heads={"pA": "A0", "pB": "B0"})
    assert {m.request_id: m.new_blocks for m in moves} == {"a": (2, 3), "b": (0, 1, 4)}  # a stays with its head
    flows = kv_flows(PAIRS, QUAD, moves)
    # a: layers 0 and 2 stay where they are (same worker, same ids); 1 goes A0 -> B0, 3 goes A1 -> B1
    assert flows["A0", "B0"].parts == [FlowPart("a", 1, 2, (2, 3), (2, 3))]
    assert flows["A1", "B1"].parts == [FlowPart("a", 3, 4, (2, 3), (2, 3))]
    # b: layer 0 goes B0 -> A0, layer 2 B1 -> A1; layers 1 and 3 stay on their worker, renumbered
    assert flows["B0", "A0"].parts == [FlowPart("b", 0, 1, (0, 1, 2), (0, 1, 4))]
    assert flows["B1", "A1"].parts == [FlowPart("b", 2, 3, (0, 1, 2), (0, 1, 4))]
    assert flows["B0", "B0"].parts == [FlowPart("b", 1, 2, (0, 1, 2), (0, 1, 4))]
    assert flows["B1", "B1"].parts == [FlowPart("b", 3, 4, (0, 1, 2), (0, 1, 4))]
    assert set(flows) == {("A0", "B0"), ("A1", "B1"), ("B0", "A0"), ("B1", "A1"), ("B0", "B0"), ("B1", "B1")}


def test_splitting_a_quad_into_pairs_brings_each_request_back_to_one_pair():
    new = [group("pA", ("A0", 0, 2), ("A1", 2, 4), kv_blocks=6), group("pB", ("B0", 0, 2), ("B1", 2, 4), kv_blocks=6)]
    check_units(QUAD, new, L)
    targeted = assign_restore_targets([SeqMove("x", "q", "", (0, 1, 2)), SeqMove("y", "q", "", (3,))],
                                      {"pA": 6, "pB": 6})
    assert {m.request_id: m.new_unit for m in targeted} == {"x": "pA", "y": "pB"}
    flows = kv_flows(QUAD, new, assign_tables(targeted, new, old_heads={"q": "A0"}))
    # x stays on the quad's head A0 with its ids: only B0's layer 1 and B1's layer 3 come to the pair
    assert flows["B0", "A0"].parts == [FlowPart("x", 1, 2, (0, 1, 2), (0, 1, 2))]
    assert flows["B1", "A1"].parts == [FlowPart("x", 3, 4, (0, 1, 2), (0, 1, 2))]
    # y goes to the other pair: layers 0 (A0) and 2 (A1) come over, 1 and 3 are renumbered in place
    assert flows["A0", "B0"].parts == [FlowPart("y", 0, 1, (3,), (0,))]
    assert flows["A1", "B1"].parts == [FlowPart("y", 2, 3, (3,), (0,))]
    assert flows["B0", "B0"].parts == [FlowPart("y", 1, 2, (3,), (0,))]
    assert flows["B1", "B1"].parts == [FlowPart("y", 3, 4, (3,), (0,))]


# -- weights a transition gives a worker, and who sends them -------------------------------------------------

def test_a_pair_split_into_wholes_pulls_each_half_from_the_other_member():
    assert weight_pieces(GROUP, [whole("A", "A"), whole("B", "B")]) == [
        WeightPiece("B", "A", 2, 4), WeightPiece("A", "B", 0, 2)]
    assert weight_pieces(OLD_WHOLES, GROUP) == [], "a drop gains no layer"


def test_a_quad_split_into_pairs_pulls_each_quarter_from_the_quad_member_holding_it():
    quad = [Unit("q", (Member("A", 0, 1), Member("C", 1, 2), Member("B", 2, 3), Member("D", 3, 4)))]
    pairs = [group("p1", ("A", 0, 2), ("B", 2, 4)), group("p2", ("C", 0, 2), ("D", 2, 4))]
    assert weight_pieces(quad, pairs) == [WeightPiece("C", "A", 1, 2), WeightPiece("D", "B", 3, 4),
                                          WeightPiece("A", "C", 0, 1), WeightPiece("B", "D", 2, 3)]


def test_a_middle_member_pulls_from_the_members_on_both_sides():
    old = [Unit("t", (Member("A", 0, 1), Member("B", 1, 3), Member("C", 3, 4)))]
    new = [whole("A", "A"), whole("B", "B"), whole("C", "C")]
    assert [p for p in weight_pieces(old, new) if p.dst == "B"] == [WeightPiece("A", "B", 0, 1),
                                                                     WeightPiece("C", "B", 3, 4)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transitions())
def test_every_gained_layer_comes_once_from_a_member_of_the_old_unit_holding_it(t):
    num_layers, old, new, _ = t
    pieces = weight_pieces(old, new)
    got: dict[tuple[str, int], str] = {}
    for p in pieces:
        assert p.src != p.dst and p.layer_start < p.layer_end
        src = unit_of(old, p.dst).member(p.src)
        assert src is not None, "the sender is a member of the receiver's old unit"
        for layer in range(p.layer_start, p.layer_end):
            assert src.layer_start <= layer < src.layer_end
            assert (p.dst, layer) not in got
            got[p.dst, layer] = p.src
    want = set()
    for u in new:
        for m in u.members:
            o = unit_of(old, m.worker_id).member(m.worker_id)
            assert o is not None
            want |= {(m.worker_id, x) for x in range(m.layer_start, m.layer_end) if not o.layer_start <= x < o.layer_end}
    assert set(got) == want
    for a, b in zip(pieces, pieces[1:]):  # maximal pieces: neighbours from one source are merged
        assert not (a.dst == b.dst and a.src == b.src and a.layer_end == b.layer_start)
