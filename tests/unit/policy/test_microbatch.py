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


def test_former_falls_back_to_token_chunking_on_a_short_queue():
    f = MicrobatchFormer(MODEL, min_tokens=64, chunk_tokens=100)
    short = [WorkItem("a", 200)]
    long = [WorkItem(f"r{i}", 200, i * 10) for i in range(8)]
    assert not f.uses_lookahead(short) and f.form(short) == token_microbatches(short, 100)
    assert f.uses_lookahead(long) and len(f.form(long)) == 1600 // 64
    assert not MicrobatchFormer(None).uses_lookahead(long)  # no cost model: token counts
    assert not MicrobatchFormer(MODEL, lookahead=False).uses_lookahead(long)
