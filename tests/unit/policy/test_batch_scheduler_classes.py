"""Online / offline request classes in the scheduler (ConServe §4.2, Algorithm 1), as properties of the pure
policy under random mixes of arrivals, prompt lengths, cache sizes and budgets: online requests get exactly the
schedule they would get if no offline request existed, offline work only fills what the budget and the memory
leave, no offline request is admitted when memory is short, nothing is lost, and a workload without offline
requests is scheduled exactly as the class-blind scheduler does. Then the offline-optimised budget, and the
engine: offline greedy tokens are the same alone as mixed with online requests that preempt them."""

from __future__ import annotations

import copy
import random

import pytest
from engine_testing import check_greedy, one_torch_thread, weights_for  # noqa: F401 - fixture
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import advance

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable, blocks_needed
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.policy.batch_scheduler import (
    FixedTokenBudget,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    Sequence,
    TokenBudget,
)
from kunserve.shared.policy.costmodel import BatchShape, ConServeLatencyModel
from kunserve.shared.policy.token_budget import SLOTokenBudget, ThroughputTokenBudget

CON = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)


def mk(rid: str, n_prompt: int, max_tokens: int = 8, bs: int = 4, arrival: float = 0.0, offline: bool = False) -> Sequence:
    req = EngineRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), arrival, offline)
    return Sequence(req, list(req.prompt_token_ids), BlockTable(bs))


def ids(chunks: list[ScheduledChunk]) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in chunks]


class HostSwapper:
    """A swap target with nothing to copy: the scheduler only needs `swapped` set while the KV is away."""

    def swap_out(self, seq: Sequence) -> None:
        seq.swapped = seq.num_computed

    def swap_in(self, seq: Sequence) -> None:
        seq.swapped = None


class BlindScheduler(Scheduler):
    """The class-blind scheduler as it was before request classes (verbatim): the reference a workload without
    offline requests must be scheduled exactly like."""

    def _preempt_newest(self, newer_than: Sequence, protected: set[int]) -> bool:
        for victim in reversed(self.running):
            if victim.order <= newer_than.order:
                return False
            if id(victim) not in protected and id(victim) not in self.pinned:
                self.preempt(victim)
                return True
        return False

    def _swap_in(self, seq: Sequence) -> bool:
        need = blocks_needed(seq.swapped_tokens, self.block_size)
        keep_free = int(self.config.admission_watermark * self.allocator.num_blocks) if self.running else 0
        if need + keep_free > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        assert self.swapper is not None
        self.swapper.swap_in(seq)
        seq.num_computed = seq.swapped_tokens
        seq.swapped_tokens = 0
        return True

    def schedule(self, max_decodes: int | None = None, prompt_tokens: int | None = None) -> list[ScheduledChunk]:
        cfg = self.config
        out: list[ScheduledChunk] = []
        decodes = [s for s in self.running if s.remaining == 1]
        if max_decodes is not None:
            decodes = decodes[:max_decodes]
        budget = self.budget.max_tokens_for(len(decodes), decode_context_tokens=sum(len(s.tokens) for s in decodes))
        chunk_limit = getattr(self.budget, "chunk_limit", None)
        shape = BatchShape()
        used = 0
        in_batch: set[int] = set()
        preemptions_before = self.num_preemptions
        for seq in decodes:
            if seq.num_computed == 0:
                continue
            if used >= budget or len(out) >= cfg.max_num_seqs:
                break
            while not self._reserve(seq, 1):
                victim = next((v for v in reversed(self.running)
                               if id(v) not in self.pinned and (v is seq or id(v) not in in_batch)), None)
                if victim is None:
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                out.append(ScheduledChunk(seq, 1))
                in_batch.add(id(seq))
                shape.add(1, seq.num_computed)
                used += 1
        num_decodes_in_batch = len(out)
        if prompt_tokens is not None:
            budget = used + prompt_tokens
            chunk_limit = None
        partial = [s for s in self.running if id(s) not in in_batch and s.remaining > 1]
        for seq in partial + list(self.waiting):
            if used >= budget or len(out) >= cfg.max_num_seqs:
                break
            admitting = seq.num_computed == 0 and not seq.block_table
            if admitting and self.num_preemptions != preemptions_before:
                break
            if admitting and cfg.preemption == "none" and not self._fits_whole_life(seq):
                break
            if admitting and seq.swapped is not None:
                if not self._swap_in(seq):
                    break
                admitting = False
                self.waiting.remove(seq)
                self._insert(self.running, seq)
                if seq.remaining <= 0:
                    continue
            n = min(seq.remaining, budget - used)
            if cfg.max_prefill_chunk:
                n = min(n, cfg.max_prefill_chunk)
            if chunk_limit is not None and n > 0:
                n = min(n, chunk_limit(shape, seq.num_computed, n, first=len(out) == num_decodes_in_batch))
            if not admitting:
                while self._room(seq) < n and self._preempt_newest(seq, in_batch):
                    pass
            n = min(n, self._room(seq))
            if admitting and self.running:
                keep_free = int(cfg.admission_watermark * self.allocator.num_blocks)
                spare = self.allocator.num_free - seq.block_table.extra_blocks_for(n)
                if spare < keep_free:
                    n = min(n, max(0, (self.allocator.num_free - keep_free) * self.block_size))
            if n <= 0:
                break
            self._reserve(seq, n)
            if admitting:
                self.waiting.remove(seq)
                self._insert(self.running, seq)
            out.append(ScheduledChunk(seq, n))
            in_batch.add(id(seq))
            shape.add(n, seq.num_computed)
            used += n
        return out


# -- small deterministic cases ----------------------------------------------------------------------------------
def test_online_first_then_offline_fills_the_rest_of_the_budget():
    s = Scheduler(BlockAllocator(100), 4, SchedulerConfig(max_num_batched_tokens=10))
    off_run, on_run = mk("off-run", 3, offline=True, arrival=0.0), mk("on-run", 3, arrival=1.0)
    s.add(off_run)
    s.add(on_run)
    advance(s, s.schedule())  # both prefilled: each decodes next
    on_new, off_new = mk("on-new", 12, arrival=3.0), mk("off-new", 12, offline=True, arrival=2.0)
    s.add(off_new)
    s.add(on_new)
    # the online decode and 9 online prompt tokens use the budget up: the offline requests (one arrived before the
    # online prompt) wait
    chunks = s.schedule()
    assert ids(chunks) == [("on-run", 3, 1), ("on-new", 0, 9)]
    advance(s, chunks)
    # online decode and the online prompt's last 3 tokens, then the offline decode and 5 offline prompt tokens;
    # decodes come first in the batch
    assert ids(s.schedule()) == [("on-run", 4, 1), ("off-run", 3, 1), ("on-new", 9, 3), ("off-new", 0, 5)]


def test_online_request_takes_memory_from_the_newest_offline_request_first():
    alloc = BlockAllocator(8)  # 32 tokens
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=64, offline_free_watermark=0.0))
    on_old = mk("on-old", 8, max_tokens=20, arrival=0.0)
    off_a, off_b = mk("off-a", 8, max_tokens=20, arrival=1.0, offline=True), mk("off-b", 8, max_tokens=20, arrival=2.0,
                                                                                 offline=True)
    for x in (on_old, off_a, off_b):
        s.add(x)
    advance(s, s.schedule())
    assert alloc.num_free == 2  # 3 x 2 blocks used; each decode needs a third one next
    on_new = mk("on-new", 12, arrival=3.0)  # 3 blocks: more than free; the newest offline request gives its blocks
    s.add(on_new)
    chunks = s.schedule()
    assert off_b.num_preemptions == 1 and off_a.num_preemptions == 0 and on_old.num_preemptions == 0
    # off-a finds no block for its decode: it pauses with its KV (Algorithm 1) rather than preempting itself, and
    # off-b is not re-admitted in the step that preempted it
    assert ids(chunks) == [("on-old", 8, 1), ("on-new", 0, 12)] and s.num_offline_preemptions == 1
    assert off_b in s.waiting and off_a in s.running and off_a.block_table


def test_offline_decodes_only_take_from_offline_requests():
    alloc = BlockAllocator(4)
    s = Scheduler(alloc, 2, SchedulerConfig(max_num_batched_tokens=64, offline_free_watermark=0.0))
    off, on = mk("off", 2, max_tokens=6, bs=2, arrival=0.0, offline=True), mk("on", 6, max_tokens=6, bs=2, arrival=1.0)
    s.add(off)
    s.add(on)
    advance(s, s.schedule())  # off: 1 block; on: 3 blocks; nothing free
    assert alloc.num_free == 0
    chunks = s.schedule()  # on decodes into a new block: it takes it from the offline request, never the reverse
    assert off.num_preemptions == 1 and on.num_preemptions == 0 and ids(chunks) == [("on", 6, 1)]


def test_no_offline_admission_below_the_watermark_nor_while_an_online_request_waits():
    alloc = BlockAllocator(20)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=200, offline_free_watermark=0.25))
    s.add(mk("on", 64, max_tokens=4, arrival=0.0))  # 16 blocks: 4 stay free, below the watermark of 5
    s.add(mk("off", 8, arrival=1.0, offline=True))
    assert ids(s.schedule()) == [("on", 0, 64)]
    assert alloc.num_free == 4 and [x.request_id for x in s.waiting] == ["off"]
    # queue-only admission: an online request's whole life must fit beside the online requests' growth only (the
    # offline request's growth does not hold it back); a new offline one must fit beside everyone's growth
    s2 = Scheduler(BlockAllocator(10), 4, SchedulerConfig(max_num_batched_tokens=200, preemption="none",
                                                          offline_free_watermark=0.0))
    s2.add(mk("off-run", 8, max_tokens=9, offline=True, arrival=0.0))  # 2 blocks now, 4 over its life
    advance(s2, s2.schedule())
    s2.add(mk("on-big", 24, max_tokens=5, arrival=1.0))  # 7 blocks over its life: 7 <= 8 free
    s2.add(mk("off-small", 2, max_tokens=2, offline=True, arrival=2.0))  # 1 block beside 1 + 1 of growth: 2 free
    assert ids(s2.schedule()) == [("off-run", 8, 1), ("on-big", 0, 24)]
    assert [x.request_id for x in s2.waiting] == ["off-small"]


def test_an_offline_request_progresses_on_what_steady_online_load_leaves():
    s = Scheduler(BlockAllocator(200), 4, SchedulerConfig(max_num_batched_tokens=8))
    off = mk("off", 60, max_tokens=2, offline=True, arrival=0.0)
    s.add(off)
    steps = 0
    while off.num_computed < 60:
        # an online request arrives every step and decodes a while: online always uses part of the budget
        s.add(mk(f"on{steps}", 2, max_tokens=3, arrival=1.0 + steps))
        remaining = off.remaining
        chunks = s.schedule()
        online = sum(c.num_tokens for c in chunks if not c.seq.request.offline)
        assert 0 < online < 8 and sum(c.num_tokens for c in chunks if c.seq is off) == min(remaining, 8 - online)
        advance(s, chunks)
        steps += 1
    assert steps < 30


def test_preemption_none_never_lets_offline_work_block_an_online_request():
    """Queue-only admission ("none") is about online requests among themselves: an online request waits until its
    whole life fits beside the other online requests' growth, never for offline work. The offline requests' growth
    does not count against it and their blocks are taken (newest first) when it needs them, now or as it grows."""
    alloc = BlockAllocator(6)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=64, preemption="none", offline_free_watermark=0.0))
    off = mk("off", 12, max_tokens=8, offline=True)
    s.add(off)
    advance(s, s.schedule())
    on = mk("on", 8, max_tokens=4, arrival=1.0)  # whole life: 3 blocks, 3 free; off would grow into 2 of them
    s.add(on)
    assert ids(s.schedule()) == [("off", 12, 1), ("on", 0, 8)] and s.num_preemptions == 0
    while on in s.running:  # on's third block is off's fourth: off gives it back
        advance(s, s.schedule())
    assert off.num_preemptions == 1 and on.num_preemptions == 0 and len(on.generated) == 4

    # an online request bigger than what is free takes the offline requests' blocks at admission, newest first
    alloc = BlockAllocator(8)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=64, preemption="none", offline_free_watermark=0.0))
    off_a, off_b = mk("off-a", 8, max_tokens=4, offline=True), mk("off-b", 8, max_tokens=4, offline=True, arrival=0.5)
    s.add(off_a)
    s.add(off_b)
    advance(s, s.schedule())
    assert alloc.num_free == 4
    big = mk("on-big", 16, max_tokens=5, arrival=1.0)  # 5 blocks over its life
    s.add(big)
    chunks = s.schedule()
    assert ("on-big", 0, 16) in ids(chunks) and off_b.num_preemptions == 1 and off_a.num_preemptions == 0

    # online among online stays queue-only: a second online request whose life does not fit beside the first's
    # growth waits, and nothing online is ever preempted
    alloc = BlockAllocator(6)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=64, preemption="none", offline_free_watermark=0.0))
    first = mk("on-1", 8, max_tokens=9)  # 4 blocks over its life, 2 now
    s.add(first)
    advance(s, s.schedule())
    s.add(mk("on-2", 8, max_tokens=2, arrival=1.0))  # 3 blocks: 3 + first's growth of 2 > 4 free
    assert ids(s.schedule()) == [("on-1", 8, 1)] and s.num_preemptions == 0


def test_offline_only_iterations_use_the_throughput_budget():
    slo = SLOTokenBudget(CON, tbt_s=0.005, min_chunk_tokens=4)  # the TBT cap: a short fresh chunk
    cap_slo = slo.max_tokens_for(0)
    s = Scheduler(BlockAllocator(500), 4, SchedulerConfig(max_num_batched_tokens=512), slo)
    s.add(mk("off-a", 300, offline=True))
    s.add(mk("off-b", 300, offline=True))
    chunks = s.schedule()
    thr = slo.for_throughput(512)
    assert chunks[0].num_tokens == thr.chunk_limit(BatchShape(), 0, 300, first=True) > cap_slo
    assert sum(c.num_tokens for c in chunks) <= 512
    # an online arrival brings the SLO back: the next iteration's predicted time is under the TBT target
    # except the online prompt's progress floor, and offline work never exceeds it
    advance(s, chunks)
    s.add(mk("on", 100, arrival=1.0))
    chunks = s.schedule()
    assert chunks[0].seq.request_id == "on" and chunks[0].num_tokens <= max(4, cap_slo)
    assert slo.predict(BatchShape.of((c.num_tokens, c.start) for c in chunks)) <= slo.target_s or \
        all(not c.seq.request.offline for c in chunks)


# -- the offline-optimised budget -------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(k=st.tuples(st.floats(1e-6, 2e-4), st.floats(0, 1e-6), st.floats(0, 2e-6), st.floats(0, 4e-3)),
       chunks=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 500)), max_size=4),
       prefix=st.integers(0, 500), want=st.integers(0, 300), cap=st.integers(1, 600))
def test_throughput_chunk_maximises_tokens_per_second(k, chunks, prefix, want, cap):
    thr = ThroughputTokenBudget(ConServeLatencyModel(k1=k[0], k2=k[1], k4=k[2], k5=k[3]), cap, min_chunk_tokens=0)
    shape = BatchShape.of(chunks)
    n = thr.chunk_limit(shape, prefix, want, first=False)
    hi = min(want, max(0, cap - shape.tokens))
    assert 0 <= n <= hi
    rates = [thr.rate(shape.with_chunk(m, prefix)) for m in range(hi + 1)]
    assert rates[n] >= max(rates) * (1 - 1e-9)
    assert all(r < rates[n] * (1 + 1e-9) for r in rates[n + 1:]) or n == hi
    assert thr.max_tokens_for(3) == max(3, cap)


def test_throughput_budget_with_a_linear_model_is_the_cap():
    thr = SLOTokenBudget(ConServeLatencyModel(k1=1e-4, k2=0.0, k4=0.0, k5=1e-3), tbt_s=0.002).for_throughput(256)
    assert thr.max_tokens == 256 and thr.chunk_limit(BatchShape(), 0, 1000) == 256
    assert thr.chunk_limit(BatchShape.of([(200, 0)]), 0, 1000) == 56
    assert SLOTokenBudget(CON, tbt_s=0.01, max_tokens=100).for_throughput(256).max_tokens == 100
    with pytest.raises(ValueError):
        ThroughputTokenBudget(CON, 0)


# -- Algorithm 1 as properties --------------------------------------------------------------------------------
def _budget(kind: str, cap: int, tbt_ms: float, floor: int) -> TokenBudget:
    if kind == "fixed":
        return FixedTokenBudget(cap)
    return SLOTokenBudget(ConServeLatencyModel(k1=1e-4, k2=2e-6, k4=5e-6, k5=1e-3), tbt_s=tbt_ms / 1e3,
                          min_chunk_tokens=floor)


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(st.tuples(st.booleans(), st.integers(1, 60), st.integers(1, 10), st.integers(0, 25)),
                     min_size=1, max_size=12),
       bs=st.sampled_from([1, 4, 8]), slack=st.integers(0, 24), kind=st.sampled_from(["fixed", "slo"]),
       cap=st.sampled_from([3, 16, 64]), tbt_ms=st.sampled_from([2.0, 5.0, 20.0]), floor=st.sampled_from([1, 8]),
       max_seqs=st.sampled_from([2, 64]), chunk=st.sampled_from([0, 5]), wm=st.sampled_from([0.0, 0.1, 0.3]),
       preemption=st.sampled_from(["recompute", "recompute", "swap", "none"]))
def test_algorithm_1(reqs, bs, slack, kind, cap, tbt_ms, floor, max_seqs, chunk, wm, preemption):
    budget = _budget(kind, cap, tbt_ms, floor)
    largest = max(blocks_needed(n + m - 1, bs) for _, n, m, _ in reqs)
    alloc = BlockAllocator(largest + slack)
    cfg = SchedulerConfig(max_num_batched_tokens=cap, max_num_seqs=max_seqs, max_prefill_chunk=chunk,
                          offline_free_watermark=wm, preemption=preemption)
    sch = Scheduler(alloc, bs, cfg, budget)
    sch.swapper = HostSwapper()
    keep = int(max(wm, cfg.admission_watermark) * alloc.num_blocks)
    seqs = [mk(f"{'off' if off else 'on'}{i}", n, m, bs, float(i), off) for i, (off, n, m, _) in enumerate(reqs)]
    arrivals = sorted(zip((a for *_, a in reqs), range(len(reqs))))
    step = added = 0
    while added < len(seqs) or sch.running or sch.waiting:
        while added < len(seqs) and arrivals[added][0] <= step:
            sch.add(seqs[arrivals[added][1]])
            added += 1
        online = [s for s in sch.running + sch.waiting if not s.request.offline]
        offline_waiting = [s for s in sch.waiting if s.request.offline and s.num_computed == 0 and not s.block_table]
        free_before, preemptions_before = alloc.num_free, sch.num_preemptions
        decoding = {id(s) for s in sch.running if s.remaining == 1}
        idle = not sch.running
        # what the online requests would get if no offline request existed (running offline requests gave back
        # their memory)
        alone = copy.deepcopy(sch)
        for s in [x for x in alone.running + alone.waiting if x.request.offline]:
            alone.remove(s)
        expected_online = ids(alone.schedule()) if online else []

        chunks = sch.schedule()

        assert chunks or not (sch.running or sch.waiting), "no progress while work is queued"
        # (1) online never waits for offline: the online part of the batch is exactly what they get alone, and
        #     comes first among the decodes and among the prompt chunks
        assert ids([c for c in chunks if not c.seq.request.offline]) == expected_online
        kinds = [(id(c.seq) not in decoding, c.seq.request.offline) for c in chunks]
        assert kinds == sorted(kinds)
        # (2) the budget: the fixed cap; under the SLO the predicted iteration stays under the TBT target except
        #     for the first online prompt chunk's progress floor (and then no offline work at all); offline-only
        #     iterations at most the throughput cap
        total = sum(c.num_tokens for c in chunks)
        if isinstance(budget, FixedTokenBudget):
            assert total <= cap
        elif online:
            shape = BatchShape.of((c.num_tokens, c.start) for c in chunks)
            if budget.predict(shape) > budget.target_s:
                assert all(not c.seq.request.offline for c in chunks)
                prompt_chunks = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
                assert len(prompt_chunks) <= 1 and all(c.num_tokens <= floor for c in prompt_chunks)
        else:
            assert total <= max(cap, sum(1 for c in chunks if c.is_decode))
        # (3) a new offline request is admitted only when memory is not short: no preemption this step, no online
        #     request waiting, and the watermark still free after its chunk
        admitted = [s for s in offline_waiting if s in sch.running]
        if admitted:
            assert sch.num_preemptions == preemptions_before and free_before >= keep
            assert not any(not s.request.offline for s in sch.waiting)
            if preemption == "recompute":  # (the first admission into an idle engine may take everything)
                assert alloc.num_free >= keep or (idle and len(admitted) == 1)
        assert alloc.num_used == sum(len(x.block_table) for x in sch.running)
        advance(sch, chunks)
        step += 1
        assert step < 5000, "stuck"
    # (4) nothing is lost: every request ran to its end and every block is free
    assert alloc.num_used == 0
    assert all(len(x.generated) == x.request.sampling.max_tokens for x in seqs)


@settings(max_examples=100, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 10), st.integers(0, 20)), min_size=1, max_size=10),
       bs=st.sampled_from([1, 4, 8]), slack=st.integers(0, 20), kind=st.sampled_from(["fixed", "slo"]),
       cap=st.sampled_from([3, 16, 64]), tbt_ms=st.sampled_from([2.0, 5.0, 20.0]), max_seqs=st.sampled_from([2, 64]),
       chunk=st.sampled_from([0, 5]), preemption=st.sampled_from(["recompute", "swap", "none"]),
       planned=st.booleans(), seed=st.integers(0, 1000))
def test_without_offline_requests_the_schedule_is_the_class_blind_one(reqs, bs, slack, kind, cap, tbt_ms, max_seqs,
                                                                      chunk, preemption, planned, seed):
    """(5) byte-identical to the scheduler before request classes, also for a pipeline head's calls (a decode
    share and a planned number of prompt tokens)."""
    rng = random.Random(seed)
    largest = max(blocks_needed(n + m - 1, bs) for n, m, _ in reqs)
    cfg = SchedulerConfig(max_num_batched_tokens=cap, max_num_seqs=max_seqs, max_prefill_chunk=chunk,
                          preemption=preemption)
    pair = []
    for cls in (Scheduler, BlindScheduler):
        alloc = BlockAllocator(largest + slack)
        sch = cls(alloc, bs, cfg, _budget(kind, cap, tbt_ms, 4))
        sch.swapper = HostSwapper()
        pair.append((sch, alloc, [mk(f"r{i}", n, m, bs, float(i)) for i, (n, m, _) in enumerate(reqs)]))
    (new, new_alloc, new_seqs), (old, old_alloc, old_seqs) = pair
    for step in range(5000):
        for i, (*_, a) in enumerate(reqs):
            if a == step:
                new.add(new_seqs[i])
                old.add(old_seqs[i])
        if not (old.running or old.waiting) and step > max(a for *_, a in reqs):
            break
        args = (rng.randint(0, 4), rng.randint(0, 40)) if planned and rng.random() < 0.5 else (None, None)
        a, b = new.schedule(*args), old.schedule(*args)
        assert ids(a) == ids(b)
        assert [(x.request_id, x.num_computed, x.block_table.ids) for x in new.running] == \
            [(x.request_id, x.num_computed, x.block_table.ids) for x in old.running]
        assert [x.request_id for x in new.waiting] == [x.request_id for x in old.waiting]
        assert (new.num_preemptions, new_alloc.num_free) == (old.num_preemptions, old_alloc.num_free)
        advance(new, a)
        advance(old, b)
    assert not old.running and not old.waiting and new.num_offline_preemptions == 0


def test_prompt_work_lists_online_prompts_first():
    s = Scheduler(BlockAllocator(100), 4, SchedulerConfig(max_num_batched_tokens=4))
    s.add(mk("off", 10, offline=True, arrival=0.0))
    assert [w.request_id for w in s.prompt_work()] == ["off"]
    s.add(mk("on", 10, arrival=1.0))
    assert [w.request_id for w in s.prompt_work()] == ["on", "off"]


def test_watermark_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(offline_free_watermark=1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(offline_free_watermark=-0.1)


# -- in the engine: offline greedy tokens do not depend on what preempted them -----------------------------------
SMALL = TINY_CONFIG.replace(num_layers=2, name="small")


def test_offline_tokens_are_the_same_alone_and_preempted_by_online_requests():
    rng = random.Random(3)
    w = weights_for(SMALL)
    offline = [EngineRequest(f"off{i}", [rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(30, 60))],
                             SamplingParams(max_tokens=20, ignore_eos=True), offline=True) for i in range(5)]
    online = [EngineRequest(f"on{i}", [rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(30, 50))],
                            SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
    cfg = SchedulerConfig(max_num_batched_tokens=48, offline_free_watermark=0.1)

    def fresh(r: EngineRequest) -> EngineRequest:
        return EngineRequest(r.request_id, list(r.prompt_token_ids), r.sampling, offline=r.offline)

    alone = Engine(SMALL, w, num_kv_blocks=48, block_size=4, scheduler_config=cfg).generate([fresh(r) for r in offline])
    eng = Engine(SMALL, w, num_kv_blocks=48, block_size=4, scheduler_config=cfg)
    got: dict[str, list[int]] = {r.request_id: [] for r in offline + online}
    for r in offline:
        eng.add_request(fresh(r))
    step = 0
    arrivals = (6, 9, 12)  # once the offline requests hold the whole cache
    while eng.has_work() or step <= arrivals[-1]:
        if step in arrivals:
            eng.add_request(fresh(online[arrivals.index(step)]))
        for ev in eng.step():
            got[ev.request_id].append(ev.token_id)
        step += 1
        assert step < 2000
    assert eng.scheduler.num_offline_preemptions >= 1, "the online arrivals must preempt offline requests"
    assert eng.scheduler.num_preemptions == eng.scheduler.num_offline_preemptions, "online requests are never preempted"
    assert eng.allocator.num_used == 0
    for r in offline:
        tie = check_greedy(SMALL, w, r.prompt_token_ids, got[r.request_id])
        assert tie or got[r.request_id] == alone[r.request_id]
    for r in online:
        assert len(got[r.request_id]) == 6
        check_greedy(SMALL, w, r.prompt_token_ids, got[r.request_id])
