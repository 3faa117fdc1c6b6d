"""Cluster load bookkeeping from worker reports: pure policy, no I/O (the monitor and tests share it).

Overload follows Llumnix/KunServe: an instance is overloaded when the KV blocks in use plus the
demand of its head-of-line queued requests exceed its capacity, or (what its clients see) when its oldest
request that has not started has waited longer than ``max_head_wait_s`` (the TTFT SLO). Online requests only,
as in `kunserve.shared.policy.overload`: offline ones run on what online ones leave, their blocks count as free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kunserve.shared.policy.cluster import WorkerReport


@dataclass(frozen=True)
class WorkerStatus:
    """One worker's latest report with what the monitor derives from it."""

    report: WorkerReport
    healthy: bool                      # reported within the staleness limit
    last_report_age_s: float
    kv_usage: float                    # used / total
    prompt_tokens_per_s: float
    generated_tokens_per_s: float


@dataclass(frozen=True)
class ClusterStatus:
    """Every worker's status and the cluster's KV totals (a pipeline group counted once)."""

    timestamp_unix_s: float
    workers: tuple[WorkerStatus, ...] = ()
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    queued_demand_blocks: int = 0
    overloaded: bool = False           # some unit's online used + head-of-line queued demand > capacity


@dataclass
class _WorkerTrack:
    report: WorkerReport
    received_at: float  # receiver clock (monotonic seconds)
    prompt_rate: float = 0.0
    generated_rate: float = 0.0


@dataclass
class ClusterLoad:
    stale_after_s: float = 3.0
    rate_smoothing: float = 0.5  # EWMA weight of the newest sample
    max_head_wait_s: float = math.inf  # queue time beyond this is overload (the TTFT SLO); inf = KV only
    _workers: dict[str, _WorkerTrack] = field(default_factory=dict)

    def observe(self, report: WorkerReport, now: float) -> None:
        prev = self._workers.get(report.worker_id)
        track = _WorkerTrack(report=report, received_at=now)
        if prev is not None:
            dt = report.timestamp_unix_s - prev.report.timestamp_unix_s
            if dt > 0:
                a = self.rate_smoothing
                p = max(0, report.prompt_tokens_total - prev.report.prompt_tokens_total) / dt
                g = max(0, report.generated_tokens_total - prev.report.generated_tokens_total) / dt
                track.prompt_rate = a * p + (1 - a) * prev.prompt_rate
                track.generated_rate = a * g + (1 - a) * prev.generated_rate
            else:
                track.prompt_rate, track.generated_rate = prev.prompt_rate, prev.generated_rate
        self._workers[report.worker_id] = track

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def fresh_reports(self, now: float) -> list[WorkerReport]:
        """The latest report of every worker that reported within ``stale_after_s`` (sorted by worker id)."""
        return [t.report for _, t in sorted(self._workers.items()) if now - t.received_at <= self.stale_after_s]

    def reported_since(self, t0: float, now: float, min_epoch: int = 0,
                       epoch_workers: Iterable[str] | None = None) -> bool:
        """True when every fresh worker's latest report arrived after ``t0`` and those of ``epoch_workers``
        (None: every worker) report layout epoch ``min_epoch`` or later: the snapshot reflects a layout change
        that finished at ``t0`` (only the workers a transition involved move to its epoch)."""
        need = None if epoch_workers is None else set(epoch_workers)
        return all(t.received_at > t0 and (t.report.epoch >= min_epoch or (need is not None and wid not in need))
                   for wid, t in self._workers.items() if now - t.received_at <= self.stale_after_s)

    def is_overloaded(self, s: WorkerReport) -> bool:
        return (s.online_kv_blocks_used + s.online_queued_demand_blocks > s.kv_blocks_total
                or s.online_waiting_age_s > self.max_head_wait_s)

    def status(self, now: float, wall_now: float) -> ClusterStatus:
        workers: list[WorkerStatus] = []
        total = used = queued = 0
        overloaded = False
        for wid in sorted(self._workers):
            t = self._workers[wid]
            r = t.report
            age = max(0.0, now - t.received_at)
            healthy = age <= self.stale_after_s
            workers.append(WorkerStatus(
                report=r, healthy=healthy, last_report_age_s=age,
                kv_usage=(r.kv_blocks_used / r.kv_blocks_total) if r.kv_blocks_total else 0.0,
                prompt_tokens_per_s=t.prompt_rate if healthy else 0.0,
                generated_tokens_per_s=t.generated_rate if healthy else 0.0,
            ))
            # A pipeline group's members share one block-id space: every request's KV spans all of them and
            # the head reports the group's numbers, so only the head adds to the cluster's KV totals; likewise a
            # tensor-parallel instance's rank 0.
            if healthy and not r.is_non_head_member and not r.is_tp_follower:
                total += r.kv_blocks_total
                used += r.kv_blocks_used
                queued += r.queued_demand_blocks
                overloaded = overloaded or self.is_overloaded(r)
        return ClusterStatus(wall_now, tuple(workers), total, used, queued, overloaded)
