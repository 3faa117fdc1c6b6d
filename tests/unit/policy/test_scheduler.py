"""The scheduler as a pure policy: decodes first, FCFS prompt chunks under the token budget, recompute
preemption of the newest request, nothing dropped. No model runs here: a fake "engine" advances the
sequences the way Engine.step does."""

from __future__ import annotations

import random

import pytest

from kunserve.shared.engine.api import EngineRequest, InvalidRequest, SamplingParams
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable
from kunserve.shared.policy.batch_scheduler import Scheduler, SchedulerConfig, Sequence


def seq(rid: str, n_prompt: int, max_tokens: int = 8, bs: int = 4, arrival: float = 0.0) -> Sequence:
    req = EngineRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), arrival)
    return Sequence(req, list(req.prompt_token_ids), BlockTable(bs))


def advance(sched: Scheduler, chunks) -> list[str]:
    """What the engine does after the forward: KV computed, one token for completed sequences, finish."""
    finished = []
    for c in chunks:
        c.seq.num_computed = c.start + c.num_tokens
        if c.completes:
            c.seq.tokens.append(7)
            c.seq.generated.append(7)
            if len(c.seq.generated) >= c.seq.request.sampling.max_tokens:
                sched.remove(c.seq)
                finished.append(c.seq.request_id)
    return finished


def test_decodes_first_then_fcfs_chunks_within_budget():
    alloc = BlockAllocator(100)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=10, max_prefill_chunk=6))
    a, b, c = seq("a", 3), seq("b", 9), seq("c", 4)
    for x in (a, b, c):
        s.add(x)
    chunks = s.schedule()
    assert [(ch.seq.request_id, ch.num_tokens) for ch in chunks] == [("a", 3), ("b", 6), ("c", 1)]
    advance(s, chunks)
    chunks = s.schedule()
    # a decodes first; b finishes its prompt (3 left); c continues (3 left); budget 10 = 1 + 3 + 3
    assert [(ch.seq.request_id, ch.num_tokens, ch.is_decode) for ch in chunks] == \
        [("a", 1, True), ("b", 3, False), ("c", 3, False)]
    assert all(len(ch.seq.block_table) * 4 >= ch.start + ch.num_tokens for ch in chunks)


def test_max_num_seqs_and_queued_demand():
    alloc = BlockAllocator(100)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2))
    seqs = [seq(f"r{i}", 5) for i in range(4)]
    for x in seqs:
        s.add(x)
    assert s.queued_demand_blocks() == 4 * 2
    chunks = s.schedule()
    assert [ch.seq.request_id for ch in chunks] == ["r0", "r1"]
    assert s.queued_demand_blocks() == 2 * 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_preempts_the_newest_and_requeues_it_in_arrival_order():
    alloc = BlockAllocator(6)  # 24 tokens
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=64))
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=12)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())  # both prefilled: 2 + 2 blocks, 9 tokens each now
    preempted_at = None
    for step in range(20):
        chunks = s.schedule()
        if b.num_preemptions and preempted_at is None:
            preempted_at = step
            assert b in s.waiting and b.num_computed == 0 and not b.block_table
            assert b.tokens[:8] == list(range(1, 9)) and len(b.tokens) > 9  # re-prefills prompt + generated
            assert [ch.seq for ch in chunks] == [a]
        advance(s, chunks)
        if not s.running and not s.waiting:
            break
    assert preempted_at is not None and a.num_preemptions == 0
    assert s.num_preemptions >= 1 and alloc.num_used == 0
    assert len(a.generated) == 12 and len(b.generated) == 12  # nothing dropped


def test_fcfs_a_waiting_request_is_not_overtaken():
    alloc = BlockAllocator(4)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=64))
    big, small = seq("big", 12, max_tokens=2), seq("small", 2, max_tokens=2)
    running = seq("run", 4, max_tokens=3)
    s.add(running)
    advance(s, s.schedule())  # run holds 1 block (+1 for its next token)
    s.add(big)
    s.add(small)
    chunks = s.schedule()
    ids = [ch.seq.request_id for ch in chunks]
    assert ids[0] == "run" and "small" not in ids  # big takes what is free; small waits behind it


def test_partial_prefills_preempt_newer_ones_instead_of_deadlocking():
    alloc = BlockAllocator(5)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=8, max_prefill_chunk=8))
    a, b = seq("a", 16, max_tokens=2), seq("b", 16, max_tokens=2)
    s.add(a)
    s.add(b)
    for _ in range(30):
        advance(s, s.schedule())
        if not s.running and not s.waiting:
            break
    assert len(a.generated) == 2 and len(b.generated) == 2 and alloc.num_used == 0


def test_custom_budget_sees_the_decodes():
    calls = []

    class Budget:
        def max_tokens_for(self, num_decodes, *, decode_context_tokens=0):
            calls.append((num_decodes, decode_context_tokens))
            return 2

    s = Scheduler(BlockAllocator(50), 4, SchedulerConfig(), Budget())
    a, b = seq("a", 3), seq("b", 5)
    s.add(a)
    s.add(b)
    chunks = s.schedule()
    assert [(ch.seq.request_id, ch.num_tokens) for ch in chunks] == [("a", 2)]
    advance(s, chunks)
    advance(s, s.schedule())  # a: 1 left -> completes
    s.schedule()
    assert calls[0] == (0, 0) and calls[-1][0] == 1 and calls[-1][1] == 4


def test_check_fits_rejects_what_never_fits():
    s = Scheduler(BlockAllocator(4), 4)
    s.check_fits(EngineRequest("ok", [1] * 8, SamplingParams(max_tokens=9)))  # 16 tokens cached at most
    with pytest.raises(InvalidRequest) as e:
        s.check_fits(EngineRequest("p", [1] * 17, SamplingParams(max_tokens=1)))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequest) as e:
        s.check_fits(EngineRequest("m", [1] * 8, SamplingParams(max_tokens=10)))
    assert e.value.field == "max_tokens"


def test_random_workloads_always_finish_and_free_everything():
    for seed in range(40):
        rng = random.Random(seed)
        bs = rng.choice([1, 2, 4, 8])
        seqs = [seq(f"r{i}", rng.randint(1, 30), rng.randint(1, 10), bs) for i in range(rng.randint(1, 10))]
        need = max(-(-(len(x.tokens) + x.request.sampling.max_tokens - 1) // bs) for x in seqs)
        alloc = BlockAllocator(need + rng.randint(0, 6))
        s = Scheduler(alloc, bs, SchedulerConfig(max_num_batched_tokens=rng.choice([1, 3, 16, 64]),
                                                 max_num_seqs=rng.choice([1, 3, 64]),
                                                 max_prefill_chunk=rng.choice([0, 5])))
        for x in seqs:
            s.add(x)
        for _ in range(5000):
            if not s.running and not s.waiting:
                break
            chunks = s.schedule()
            assert chunks, "no progress while work is queued"
            assert sum(ch.num_tokens for ch in chunks) <= s.config.max_num_batched_tokens
            assert alloc.num_used == sum(len(x.block_table) for x in s.running)
            advance(s, chunks)
        assert not s.running and not s.waiting, f"seed {seed}: stuck"
        assert alloc.num_used == 0
        assert all(len(x.generated) == x.request.sampling.max_tokens for x in seqs)


def test_fcfs_follows_arrival_time_then_add_order():
    s = Scheduler(BlockAllocator(100), 4, SchedulerConfig(max_num_batched_tokens=100))
    for x in (seq("late", 3, arrival=5.0), seq("early", 3, arrival=1.0), seq("tie", 3, arrival=5.0)):
        s.add(x)
    assert [x.request_id for x in s.waiting] == ["early", "late", "tie"]
    assert [ch.seq.request_id for ch in s.schedule()] == ["early", "late", "tie"]
