"""The SLO-aware token budget (ConServe §4.2) alone, inside the scheduler (property-based: decodes
first, predicted latency under the SLO, never more KV than exists, nothing lost), inside the engine
(greedy tokens identical to the dense reference under budget-driven chunking), and its wiring in the
worker build (profile match -> SLO budget, else a warning and the fixed budget)."""

from __future__ import annotations

import random

import pytest
from engine_testing import check_greedy, one_torch_thread, weights_for  # noqa: F401 - fixture
from hypothesis import given, settings
from hypothesis import strategies as st

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.policy.batch_scheduler import FixedTokenBudget, Scheduler, SchedulerConfig, Sequence
from kunserve.shared.policy.costmodel import BatchShape, ConServeLatencyModel
from kunserve.shared.policy.token_budget import SLOTokenBudget

CON = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)


def test_budget_admits_the_most_tokens_under_the_slo():
    b = SLOTokenBudget(CON, tbt_s=0.05)
    n = b.max_tokens_for(0)
    assert b.predict(BatchShape.of([(n, 0)])) <= 0.05 < b.predict(BatchShape.of([(n + 1, 0)]))
    # decodes are always admitted and leave less room for prompt tokens, the more context they hold
    with_decodes = b.max_tokens_for(8, decode_context_tokens=8 * 1024)
    assert 8 < with_decodes < n + 8
    assert b.max_tokens_for(8, decode_context_tokens=8 * 64) > with_decodes


def test_chunks_are_sized_by_the_model_not_a_fixed_size():
    b = SLOTokenBudget(CON, tbt_s=0.05)
    empty = BatchShape()
    fresh = b.chunk_limit(empty, 0, 10_000)
    deep = b.chunk_limit(empty, 1500, 10_000)
    assert deep < fresh  # attention over a 1500-token prefix costs tokens
    assert b.predict(empty.with_chunk(deep, 1500)) <= 0.05 < b.predict(empty.with_chunk(deep + 1, 1500))
    assert b.chunk_limit(empty, 0, 7) == 7  # never more than asked


def test_floors_caps_and_validation():
    tight = SLOTokenBudget(CON, tbt_s=0.001, min_chunk_tokens=16)  # below the constant term: nothing fits
    assert tight.max_tokens_for(0) == 16 and tight.max_tokens_for(3, decode_context_tokens=30) == 3 + 16
    decodes = BatchShape.of_decodes(3, 30)
    assert tight.chunk_limit(decodes, 0, 100) == 16  # the iteration's first prompt chunk gets the floor
    assert tight.chunk_limit(decodes.with_chunk(16, 0), 0, 100) == 0  # later chunks do not
    capped = SLOTokenBudget(CON, tbt_s=100.0, max_tokens=300)
    assert capped.max_tokens_for(10, decode_context_tokens=100) == 300
    assert capped.chunk_limit(BatchShape.of([(250, 0)]), 0, 1000) == 50
    for kwargs in ({"tbt_s": 0}, {"tbt_s": 1, "headroom": 0}, {"tbt_s": 1, "headroom": 1.5}, {"tbt_s": 1, "max_tokens": 0}):
        with pytest.raises(ValueError):
            SLOTokenBudget(CON, **kwargs)
    assert SLOTokenBudget(CON, tbt_s=0.2, headroom=0.5).target_s == pytest.approx(0.1)


# -- inside the scheduler ---------------------------------------------------------------------------------
def _seq(rid: str, n: int, max_tokens: int, bs: int, arrival: float) -> Sequence:
    req = EngineRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), arrival)
    return Sequence(req, list(req.prompt_token_ids), BlockTable(bs))


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 12)), min_size=1, max_size=10),
       bs=st.sampled_from([1, 4, 16]), slack=st.integers(0, 40), tbt_ms=st.floats(4.0, 80.0),
       k=st.tuples(st.floats(1e-6, 2e-4), st.floats(0, 1e-7), st.floats(0, 2e-6), st.floats(0, 4e-3)),
       max_seqs=st.sampled_from([3, 64]), seed=st.integers(0, 1000))
def test_scheduler_under_the_slo_budget(prompts, bs, slack, tbt_ms, k, max_seqs, seed):
    model = ConServeLatencyModel(k1=k[0], k2=k[1], k4=k[2], k5=k[3])
    budget = SLOTokenBudget(model, tbt_s=tbt_ms / 1e3, min_chunk_tokens=8)
    largest = max(-(-(n + m) // bs) for n, m in prompts)
    alloc = BlockAllocator(largest + slack)
    sch = Scheduler(alloc, bs, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs), budget)
    rng = random.Random(seed)
    seqs = [_seq(f"r{i}", n, m, bs, float(i)) for i, (n, m) in enumerate(prompts)]
    pending = list(seqs)
    finished: set[str] = set()
    for _step in range(3000):
        while pending and rng.random() < 0.5:
            sch.add(pending.pop(0))
        if not pending and not sch.running and not sch.waiting:
            break
        decodes_before = [s for s in sch.running if s.remaining == 1]
        chunks = sch.schedule()
        # never more KV than exists; every chunk's tokens have blocks
        assert alloc.num_used <= alloc.num_blocks
        for c in chunks:
            assert c.seq.block_table.capacity >= c.start + c.num_tokens
        # decodes first (all of them unless the sequence cap or a preemption intervened)
        kinds = [c.num_tokens == 1 and c.start > 0 and c.completes for c in chunks]
        assert kinds == sorted(kinds, reverse=True) or not any(kinds)
        if max_seqs == 64 and sch.num_preemptions == 0:
            assert sum(kinds) == len(decodes_before)
        # predicted latency under the SLO, except the progress floor of the first prompt chunk
        shape = BatchShape.of((c.num_tokens, c.start) for c in chunks)
        prompt_chunks = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        if budget.predict(shape) > budget.target_s:
            assert len(prompt_chunks) <= 1 and all(c.num_tokens <= 8 for c in prompt_chunks) or not prompt_chunks
        for c in chunks:  # what the engine does after the forward
            c.seq.num_computed = c.start + c.num_tokens
            if c.completes:
                c.seq.tokens.append(7)
                c.seq.generated.append(7)
                if len(c.seq.generated) >= c.seq.request.sampling.max_tokens:
                    sch.remove(c.seq)
                    finished.add(c.seq.request_id)
    assert finished == {s.request_id for s in seqs}, "nothing is lost or starved"
    assert alloc.num_used == 0


def test_a_one_token_prompt_is_the_first_prompt_chunk_too():
    """Regression (found by the property above): a one-token prompt chunk looks like a decode in a BatchShape,
    so a second prompt chunk used to get the progress floor as well and push the step over the SLO."""
    tight = SLOTokenBudget(CON, tbt_s=0.001, min_chunk_tokens=8)  # nothing fits but the floor
    sch = Scheduler(BlockAllocator(64), 4, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64), tight)
    sch.add(_seq("one", 1, 4, 4, 0.0))
    sch.add(_seq("long", 50, 4, 4, 1.0))
    chunks = sch.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("one", 1)]


# -- inside the engine: tokens identical to the reference ------------------------------------------------
SMALL = TINY_CONFIG.replace(num_layers=2, name="small")


@pytest.mark.parametrize("seed", range(4))
def test_budget_driven_engine_matches_the_reference(seed):
    rng = random.Random(seed)
    w = weights_for(SMALL)
    # a budget that yields uneven, context-dependent chunks of a few to a few dozen tokens
    model = ConServeLatencyModel(k1=1e-4, k2=2e-6, k4=5e-6, k5=1e-3)
    budget = SLOTokenBudget(model, tbt_s=rng.choice([0.004, 0.008, 0.02]), min_chunk_tokens=rng.choice([1, 4]))
    eng = Engine(SMALL, w, num_kv_blocks=256, block_size=rng.choice([4, 16]), budget=budget)
    prompts = [[rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(1, 150))] for _ in range(6)]
    outs = [rng.randint(1, 12) for _ in prompts]
    sizes: set[int] = set()
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        sizes.update(c.num_tokens for c in out if c.num_tokens > 1)
        return out

    eng.scheduler.schedule = recording_schedule
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    added = 0
    while added < len(prompts) or eng.has_work():
        if added < len(prompts):
            eng.add_request(EngineRequest(f"r{added}", prompts[added], SamplingParams(max_tokens=outs[added],
                                                                                      ignore_eos=True)))
            added += 1
        for ev in eng.step():
            got[ev.request_id].append(ev.token_id)
    assert len(sizes) >= 3, "the budget sizes prompt chunks unevenly"
    assert all(len(got[f"r{i}"]) == outs[i] for i in range(len(prompts)))
    ties = sum(check_greedy(SMALL, w, prompts[i], got[f"r{i}"]) for i in range(len(prompts)))
    assert ties <= 1
    bi = eng.busy_idle()
    assert bi.busy_s > 0 and 0 <= bi.bubble_s <= bi.idle_s and 0 <= bi.bubble_ratio < 1


def test_fixed_budget_is_the_default():
    sch = Scheduler(BlockAllocator(4), 4, SchedulerConfig(max_num_batched_tokens=77))
    assert isinstance(sch.budget, FixedTokenBudget) and sch.budget.max_tokens_for(3) == 77
