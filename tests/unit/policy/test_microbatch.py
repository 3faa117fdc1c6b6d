"""Microbatch formulation (KunServe Fig. 11 lookahead and token-count chunking), property-based:
every queued token is scheduled exactly once, a request's chunks keep their order, microbatches are
cost-balanced when the work allows it."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kunserve.shared.policy.costmodel import KunServeCostModel
from kunserve.shared.policy.microbatch import (
    DecodeSplit,
    MicrobatchFormer,
    MicroChunk,
    WorkItem,
    lookahead_microbatches,
    microbatch_cost,
    split_batch,
    token_microbatches,
)

MODEL = KunServeCostModel(alpha=9e-8, beta=8.5e-5, gamma=3.7e-3, lam=3.5e-3)

items_st = st.lists(st.tuples(st.integers(1, 600), st.integers(0, 1500)), min_size=1, max_size=24).map(
    lambda xs: [WorkItem(f"r{i}", c, p) for i, (c, p) in enumerate(xs)])
models_st = st.builds(lambda a, b, g, f: KunServeCostModel(a, b, g, g * f),
                      st.floats(1e-9, 1e-6), st.floats(1e-6, 1e-3), st.floats(0, 5e-3), st.floats(0, 1))


def check_partition(items: list[WorkItem], mbs: list[list[MicroChunk]]) -> None:
    """Exactly-once, in order, contiguous per request; no request twice in one microbatch; each
    microbatch is a contiguous piece of the queue in token order."""
    by_req: dict[str, list[MicroChunk]] = {}
    for mb in mbs:
        assert mb, "no empty microbatch"
        ids = [c.request_id for c in mb]
        assert len(ids) == len(set(ids)), "a request appears twice in one microbatch"
        for c in mb:
            assert c.num_tokens > 0
            by_req.setdefault(c.request_id, []).append(c)
    assert set(by_req) == {it.request_id for it in items}
    for it in items:
        chunks = by_req[it.request_id]
        pos = it.prefix
        for c in chunks:  # in microbatch order = execution order
            assert c.start == pos, f"{it.request_id}: chunk at {c.start}, expected {pos}"
            pos = c.end
        assert pos == it.prefix + it.tokens, "every token exactly once"
    flat = [(c.request_id, c.start, c.num_tokens) for mb in mbs for c in mb]
    order = {it.request_id: i for i, it in enumerate(items)}
    keys = [(order[r], s) for r, s, _ in flat]
    assert keys == sorted(keys), "microbatches are contiguous pieces of the queue"


@settings(max_examples=150, deadline=None)
@given(items=items_st, model=models_st, min_tokens=st.integers(1, 512), k=st.one_of(st.none(), st.integers(1, 40)))
def test_lookahead_schedules_every_token_once_in_order(items, model, min_tokens, k):
    mbs = lookahead_microbatches(items, model, min_tokens=min_tokens, num_microbatches=k)
    check_partition(items, mbs)
    total = sum(it.tokens for it in items)
    want = k if k is not None else max(1, total // min_tokens)
    assert len(mbs) == min(max(1, want), total)


@settings(max_examples=150, deadline=None)
@given(items=items_st, budget=st.integers(1, 700))
def test_token_chunking_schedules_every_token_once_with_equal_counts(items, budget):
    mbs = token_microbatches(items, budget)
    check_partition(items, mbs)
    sizes = [sum(c.num_tokens for c in mb) for mb in mbs]
    assert all(s == budget for s in sizes[:-1]) and 0 < sizes[-1] <= budget
    assert len(mbs) == math.ceil(sum(it.tokens for it in items) / budget)


def _max_step(items: list[WorkItem], model: KunServeCostModel) -> float:
    """Upper bound of the cost one token moved across a split point can change a side by."""
    longest = max(it.prefix + it.tokens for it in items)
    return model.alpha * (longest + 1) + model.beta + model.gamma


@settings(max_examples=150, deadline=None)
@given(items=items_st, model=models_st, k=st.integers(2, 16))
def test_lookahead_microbatches_are_cost_balanced(items, model, k):
    total = sum(it.tokens for it in items)
    assume(total >= 4 * k)
    mbs = lookahead_microbatches(items, model, min_tokens=1, num_microbatches=k)
    costs = [microbatch_cost(mb, model) for mb in mbs]
    depth = math.ceil(math.log2(k))
    # Each split is exact up to one token's cost; an error at one level is shared by the parts below it.
    assert max(costs) - min(costs) <= 2 * depth * _max_step(items, model) + 1e-12


def test_balance_beats_token_counts_when_prefixes_differ():
    # Fig. 9: the same token count costs more deep into a long prompt (prefix attention)
    items = [WorkItem("short", 512, 0), WorkItem("deep", 512, 3500), WorkItem("fresh", 1024, 0)]
    model = KunServeCostModel(alpha=4e-7, beta=5e-5, gamma=1e-3, lam=0.5e-3)
    by_tokens = [microbatch_cost(mb, model) for mb in token_microbatches(items, 512)]
    balanced = [microbatch_cost(mb, model) for mb in lookahead_microbatches(items, model, min_tokens=512)]
    assert len(balanced) == len(by_tokens) == 4
    spread = lambda xs: (max(xs) - min(xs)) / (sum(xs) / len(xs))  # noqa: E731
    assert spread(balanced) < 0.02 < 0.2 < spread(by_tokens)


def test_split_matches_fig11_half_cost():
    mb = [MicroChunk("a", 0, 1000)]
    left, right = split_batch(mb, MODEL, 1, 1)
    assert left[0].start == 0 and right[0].start == left[0].num_tokens and left[0].num_tokens + right[0].num_tokens == 1000
    # the later chunk attends to the earlier one, so the halves of equal cost hold unequal tokens
    assert left[0].num_tokens > right[0].num_tokens
    cl, cr = microbatch_cost(left, MODEL), microbatch_cost(right, MODEL)
    assert abs(cl - cr) <= MODEL.alpha * 1001 + MODEL.beta


def test_bad_input():
    with pytest.raises(ValueError):
        WorkItem("a", 0)
    with pytest.raises(ValueError, match="twice"):
        lookahead_microbatches([WorkItem("a", 5), WorkItem("a", 5)], MODEL, min_tokens=1)
    with pytest.raises(ValueError):
        lookahead_microbatches([WorkItem("a", 5)], MODEL, min_tokens=0)
    with pytest.raises(ValueError):
        token_microbatches([WorkItem("a", 5)], 0)
    assert lookahead_microbatches([], MODEL, min_tokens=4) == []


def test_former_looks_ahead_only_on_a_queue_longer_than_one_microbatch():
    f = MicrobatchFormer(MODEL)
    short = [WorkItem("a", 60), WorkItem("b", 40)]  # exactly one microbatch's budget: nothing to balance
    long = [WorkItem(f"r{i}", 200, i * 10) for i in range(8)]
    assert not f.uses_lookahead(short, 100) and f.form(short, 100) == token_microbatches(short, 100)
    assert f.uses_lookahead(long, 100)
    mbs = f.form(long, 100)
    assert len(mbs) == 16 and mbs == lookahead_microbatches(long, MODEL, min_tokens=100, num_microbatches=16)
    assert len(f.form(long, 150)) == 11  # ceil(1600 / 150): on average no larger than a chunked microbatch
    for off in (MicrobatchFormer(None), MicrobatchFormer(MODEL, lookahead=False)):  # no cost model; the ablation
        assert not off.uses_lookahead(long, 100) and off.form(long, 100) == token_microbatches(long, 100)


class DecodeRun:
    """Feeds a DecodeSplit as a head would: one observation per sampled microbatch, on a fake clock; each arm
    decodes `decoding` requests at its own TPOT."""

    def __init__(self, ds: DecodeSplit, tpot: dict[bool, float], decoding: int = 8) -> None:
        self.ds, self.tpot, self.decoding, self.now = ds, tpot, decoding, 0.0

    def run(self, seconds: float) -> list[bool]:
        arms = []
        end = self.now + seconds
        while self.now < end:
            split = self.ds.split
            per_mb = self.decoding // 2 if split else self.decoding  # tokens sampled per microbatch
            self.now += self.tpot[split] * per_mb / self.decoding
            self.ds.observe(self.now, per_mb, self.decoding)
            arms.append(split)
        return arms


@pytest.mark.parametrize("faster", [True, False])
def test_decode_split_keeps_the_arm_that_decodes_faster(faster):
    ds = DecodeSplit(window_s=0.1, hold_windows=5)
    run = DecodeRun(ds, {faster: 0.010, not faster: 0.015})
    run.run(0.1)  # a window measuring split, then one measuring whole
    run.run(0.12)
    held = run.run(0.4)
    assert held and all(a == faster for a in held[2:])


def test_decode_split_measures_again_after_holding():
    ds = DecodeSplit(window_s=0.1, hold_windows=3)
    run = DecodeRun(ds, {True: 0.015, False: 0.010})
    arms = run.run(2.0)  # windows of 0.1 s: measure 2, hold 3, measure 2, ...
    switches = sum(a != b for a, b in zip(arms, arms[1:]))
    assert switches >= 5, "split -> whole (measure) -> held -> split (measure again) -> whole ..."
    run.tpot = {True: 0.010, False: 0.015}  # the load changed: splitting pays now
    assert all(run.run(1.0)[-5:])


def test_decode_split_ignores_single_requests_and_pauses_and_fixed_modes():
    ds = DecodeSplit(window_s=0.1)
    for k in range(100):
        ds.observe(k * 0.01, 1, 1)  # one request decoding: nothing to split, nothing measured
    assert ds.split and ds._phase == 0
    for k in range(20):
        ds.observe(10.0 + k * 0.2, 8, 8)  # every gap longer than a window: idle, never a full window
    assert ds.split and ds._phase == 0
    for mode, split in (("on", True), ("off", False)):
        fixed = DecodeSplit(mode)
        DecodeRun(fixed, {True: 0.5, False: 0.001}).run(5.0)
        assert fixed.split is split
    with pytest.raises(ValueError):
        DecodeSplit("sometimes")
