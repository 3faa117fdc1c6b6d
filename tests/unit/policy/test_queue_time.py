"""Queue time from the engine to the wire: the scheduler's oldest waiting arrival and the age WorkerStats
carries (taken when the stats are sent, so a snapshot cached an iteration ago still tells the age now)."""

from __future__ import annotations

import dataclasses

from test_scheduler import advance, seq

from kunserve.shared.engine.api import EngineStats
from kunserve.shared.engine.kv_blocks import BlockAllocator
from kunserve.shared.policy.batch_scheduler import Scheduler, SchedulerConfig
from kunserve.shared.wire.cluster_state import engine_stats_to_pb


def test_oldest_waiting_arrival_counts_requests_without_a_token():
    s = Scheduler(BlockAllocator(100), 4, SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=1))
    assert s.oldest_waiting_arrival() is None
    a, b = seq("a", 3, arrival=10.0), seq("b", 3, arrival=11.0)
    for x in (a, b):
        s.add(x)
    assert s.oldest_waiting_arrival() == 10.0
    advance(s, s.schedule())  # a runs (max_num_seqs = 1) and has its first token
    assert s.oldest_waiting_arrival() == 11.0
    s.preempt(a)  # back in the queue, but its client already has tokens
    assert a in s.waiting and s.oldest_waiting_arrival() == 11.0


def test_requests_without_an_arrival_stamp_are_not_counted():
    s = Scheduler(BlockAllocator(100), 4, SchedulerConfig())
    s.add(seq("unstamped", 3, arrival=0.0))
    assert s.oldest_waiting_arrival() is None


def test_stats_carry_the_age_at_send_time():
    base = EngineStats(kv_blocks_total=10, kv_blocks_used=1, block_size=16, num_running=1, num_waiting=1,
                       queued_demand_blocks=1, num_preemptions=0, prompt_tokens_total=5, generated_tokens_total=2)
    assert engine_stats_to_pb(base).oldest_waiting_age_s == 0.0
    waiting = dataclasses.replace(base, oldest_waiting_arrival=100.0)
    assert engine_stats_to_pb(waiting, now=107.5).oldest_waiting_age_s == 7.5
    assert engine_stats_to_pb(waiting, now=90.0).oldest_waiting_age_s == 0.0  # never negative
    assert engine_stats_to_pb(waiting, now=101.0, worker_id="w").worker_id == "w"
