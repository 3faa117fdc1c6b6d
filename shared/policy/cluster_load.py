"""Cluster load bookkeeping from worker stats: pure policy, no I/O (the monitor and tests share it).

Overload follows Llumnix/KunServe: an instance is overloaded when the KV blocks in use plus the
demand of its head-of-line queued requests exceed its capacity, or (what its clients see) when its oldest
request that has not started has waited longer than ``max_head_wait_s`` (the TTFT SLO).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kunserve.v1 import common_pb2, monitor_pb2


def _non_head_member(s: common_pb2.WorkerStats) -> bool:
    return len(s.group_members) > 1 and s.group_members[0] != s.worker_id


@dataclass
class _WorkerTrack:
    stats: common_pb2.WorkerStats
    received_at: float  # receiver clock (monotonic seconds)
    prompt_rate: float = 0.0
    generated_rate: float = 0.0


@dataclass
class ClusterLoad:
    stale_after_s: float = 3.0
    rate_smoothing: float = 0.5  # EWMA weight of the newest sample
    max_head_wait_s: float = math.inf  # queue time beyond this is overload (the TTFT SLO); inf = KV only
    _workers: dict[str, _WorkerTrack] = field(default_factory=dict)

    def observe(self, stats: common_pb2.WorkerStats, now: float) -> None:
        prev = self._workers.get(stats.worker_id)
        track = _WorkerTrack(stats=stats, received_at=now)
        if prev is not None:
            dt = stats.timestamp_unix_s - prev.stats.timestamp_unix_s
            if dt > 0:
                a = self.rate_smoothing
                p = max(0, stats.prompt_tokens_total - prev.stats.prompt_tokens_total) / dt
                g = max(0, stats.generated_tokens_total - prev.stats.generated_tokens_total) / dt
                track.prompt_rate = a * p + (1 - a) * prev.prompt_rate
                track.generated_rate = a * g + (1 - a) * prev.generated_rate
            else:
                track.prompt_rate, track.generated_rate = prev.prompt_rate, prev.generated_rate
        self._workers[stats.worker_id] = track

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def fresh_stats(self, now: float) -> list[common_pb2.WorkerStats]:
        """The latest stats of every worker that reported within ``stale_after_s`` (sorted by worker id)."""
        return [t.stats for _, t in sorted(self._workers.items()) if now - t.received_at <= self.stale_after_s]

    def reported_since(self, t0: float, now: float, min_epoch: int = 0,
                       epoch_workers: Iterable[str] | None = None) -> bool:
        """True when every fresh worker's latest stats arrived after ``t0`` and those of ``epoch_workers``
        (None: every worker) report layout epoch ``min_epoch`` or later: the snapshot reflects a layout change
        that finished at ``t0`` (only the workers a transition involved move to its epoch)."""
        need = None if epoch_workers is None else set(epoch_workers)
        return all(t.received_at > t0 and (t.stats.epoch >= min_epoch or (need is not None and wid not in need))
                   for wid, t in self._workers.items() if now - t.received_at <= self.stale_after_s)

    def is_overloaded(self, s: common_pb2.WorkerStats) -> bool:
        return (s.kv_blocks_used + s.queued_demand_blocks > s.kv_blocks_total
                or s.oldest_waiting_age_s > self.max_head_wait_s)

    def status(self, now: float, wall_now: float) -> monitor_pb2.ClusterStatus:
        out = monitor_pb2.ClusterStatus(timestamp_unix_s=wall_now)
        for wid in sorted(self._workers):
            t = self._workers[wid]
            s = t.stats
            age = max(0.0, now - t.received_at)
            healthy = age <= self.stale_after_s
            out.workers.append(monitor_pb2.WorkerStatus(
                stats=s, healthy=healthy, last_report_age_s=age,
                kv_usage=(s.kv_blocks_used / s.kv_blocks_total) if s.kv_blocks_total else 0.0,
                prompt_tokens_per_s=t.prompt_rate if healthy else 0.0,
                generated_tokens_per_s=t.generated_rate if healthy else 0.0,
            ))
            # A pipeline group's members share one block-id space: every request's KV spans all of them and
            # the head reports the group's numbers, so only the head adds to the cluster's KV totals.
            if healthy and not _non_head_member(s):
                out.kv_blocks_total += s.kv_blocks_total
                out.kv_blocks_used += s.kv_blocks_used
                out.queued_demand_blocks += s.queued_demand_blocks
                out.overloaded = out.overloaded or self.is_overloaded(s)
        return out
