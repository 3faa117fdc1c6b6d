"""The Llumnix-like migration choice (shared/policy/migration.py): the source's youngest running requests
first, until the asked-for blocks are freed, each only if it fits in the destination's free blocks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kunserve.shared.policy.migration import RunningRequest, choose_migrations


def on(unit: str, *reqs: tuple[str, int, float]) -> list[RunningRequest]:
    return [RunningRequest(rid, unit, blocks, age) for rid, blocks, age in reqs]


def test_youngest_first_until_the_blocks_are_freed():
    reqs = on("src", ("old", 2, 3.0), ("new", 2, 1.0), ("mid", 2, 2.0))
    assert choose_migrations(reqs, "src", "dst", dst_capacity=100, blocks=3) == ["new", "mid"]
    assert choose_migrations(reqs, "src", "dst", dst_capacity=100, blocks=2) == ["new"]
    assert choose_migrations(reqs, "src", "dst", dst_capacity=100, blocks=100) == ["new", "mid", "old"]


def test_a_request_that_does_not_fit_is_skipped_and_later_ones_still_tried():
    reqs = on("src", ("big", 4, 1.0), ("small", 2, 2.0), ("tiny", 1, 3.0))
    assert choose_migrations(reqs, "src", "dst", dst_capacity=3, blocks=10) == ["small", "tiny"]


def test_what_the_destination_already_holds_is_not_free():
    reqs = on("src", ("a", 2, 1.0), ("b", 2, 2.0)) + on("dst", ("resident", 7, 0.5), ("empty", 0, 0.1))
    assert choose_migrations(reqs, "src", "dst", dst_capacity=10, blocks=10) == ["a"]
    assert choose_migrations(reqs, "src", "dst", dst_capacity=8, blocks=10) == []


def test_requests_without_kv_and_on_other_units_are_not_candidates():
    reqs = on("src", ("no-kv", 0, 0.1), ("a", 1, 1.0)) + on("other", ("elsewhere", 1, 0.2))
    assert choose_migrations(reqs, "src", "dst", dst_capacity=10, blocks=5) == ["a"]


def test_equal_ages_keep_the_given_order():
    reqs = on("src", ("x", 1, 1.0), ("y", 1, 1.0), ("z", 1, 1.0))
    assert choose_migrations(reqs, "src", "dst", dst_capacity=10, blocks=2) == ["x", "y"]


def test_nothing_when_nothing_fits_or_nothing_is_asked():
    reqs = on("src", ("a", 5, 1.0))
    assert choose_migrations(reqs, "src", "dst", dst_capacity=4, blocks=5) == []
    assert choose_migrations(reqs, "src", "dst", dst_capacity=10, blocks=0) == []
    assert choose_migrations([], "src", "dst", dst_capacity=10, blocks=5) == []


@given(st.lists(st.tuples(st.sampled_from(["src", "dst", "other"]), st.integers(0, 8), st.integers(0, 20)),
                max_size=12),
       st.integers(0, 40), st.integers(1, 30))
def test_the_choice_fits_and_stops_once_enough_is_freed(spec, capacity, blocks):
    reqs = [RunningRequest(f"r{i}", unit, kv, float(age)) for i, (unit, kv, age) in enumerate(spec)]
    chosen = choose_migrations(reqs, "src", "dst", dst_capacity=capacity, blocks=blocks)
    by_id = {r.request_id: r for r in reqs}
    assert len(set(chosen)) == len(chosen)
    assert all(by_id[c].unit_id == "src" and by_id[c].kv_blocks > 0 for c in chosen)
    held = sum(r.kv_blocks for r in reqs if r.unit_id == "dst")
    moved = [by_id[c].kv_blocks for c in chosen]
    assert sum(moved) <= max(0, capacity - held)
    assert [by_id[c].age_s for c in chosen] == sorted(by_id[c].age_s for c in chosen)
    if moved:
        assert sum(moved[:-1]) < blocks  # the last one was taken while too little was freed
    if sum(moved) < blocks:  # fewer freed than asked: every candidate left out did not fit
        room = capacity - held - sum(moved)
        left = [r for r in reqs if r.unit_id == "src" and r.kv_blocks > 0 and r.request_id not in chosen]
        assert all(r.kv_blocks > room for r in left)
