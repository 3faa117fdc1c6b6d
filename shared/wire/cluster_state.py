"""Conversions of the cluster's state between protobuf and plain data, both ways: a worker's report (and
the one a worker builds from its engine's stats), the monitor's cluster status and the memory manager's
layout. The services call these at their edge, so the policies (`kunserve.shared.policy`) never see a
wire message."""

from __future__ import annotations

import time
from typing import Any

from kunserve.shared.engine.accounting import BusyIdle
from kunserve.shared.engine.api import EngineStats
from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_layout import LayoutEntry, LayoutState
from kunserve.shared.policy.cluster_load import ClusterStatus
from kunserve.v1 import common_pb2, memory_manager_pb2, monitor_pb2, worker_pb2

# WorkerStats fields that WorkerReport carries under the same name
_REPORT_FIELDS = (
    "num_layers_model", "serving", "transitioning", "epoch", "address", "timestamp_unix_s", "kv_blocks_total",
    "kv_blocks_used", "kv_blocks_undropped", "queued_demand_blocks", "block_size", "num_running", "num_waiting",
    "num_preemptions", "prompt_tokens_total", "generated_tokens_total", "oldest_waiting_age_s",
    "busy_seconds_total", "idle_seconds_total", "bubble_seconds_total", "bubble_ratio", "num_offline_running",
    "num_offline_waiting", "offline_kv_blocks_used", "offline_queued_demand_blocks", "oldest_online_waiting_age_s",
    "tp_degree", "reforming",
)


def report_from_pb(pb: common_pb2.WorkerStats) -> WorkerReport:
    return WorkerReport(Member(pb.worker_id, pb.layer_start, pb.layer_end), unit_id=pb.group_id,
                        unit_members=tuple(pb.group_members), tp_members=tuple(pb.tp_members),
                        **{f: getattr(pb, f) for f in _REPORT_FIELDS})


def report_to_pb(r: WorkerReport) -> common_pb2.WorkerStats:
    m = r.member
    return common_pb2.WorkerStats(worker_id=m.worker_id, layer_start=m.layer_start, layer_end=m.layer_end,
                                  group_id=r.unit_id, group_members=list(r.unit_members),
                                  tp_members=list(r.tp_members), **{f: getattr(r, f) for f in _REPORT_FIELDS})


def status_to_pb(s: ClusterStatus) -> monitor_pb2.ClusterStatus:
    return monitor_pb2.ClusterStatus(
        timestamp_unix_s=s.timestamp_unix_s, kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used,
        queued_demand_blocks=s.queued_demand_blocks, overloaded=s.overloaded,
        workers=[monitor_pb2.WorkerStatus(
            stats=report_to_pb(w.report), healthy=w.healthy, last_report_age_s=w.last_report_age_s,
            kv_usage=w.kv_usage, prompt_tokens_per_s=w.prompt_tokens_per_s,
            generated_tokens_per_s=w.generated_tokens_per_s) for w in s.workers])


def layout_entry_from_info(info: worker_pb2.WorkerInfo) -> LayoutEntry:
    """What a worker's GetInfo says about its place in the layout."""
    return LayoutEntry(Member(info.worker_id, info.layer_start, info.layer_end, info.transfer_address),
                       address=info.address, unit_id=info.group_id, unit_members=tuple(info.group_members),
                       serving=info.serving, epoch=info.epoch)


def layout_entry_to_pb(e: LayoutEntry) -> memory_manager_pb2.WorkerLayout:
    m = e.member
    return memory_manager_pb2.WorkerLayout(
        worker_id=m.worker_id, address=e.address, layer_start=m.layer_start, layer_end=m.layer_end,
        group_id=e.unit_id, reachable=e.reachable, transfer_address=m.transfer_address, serving=e.serving)


def layout_to_pb(layout: LayoutState) -> memory_manager_pb2.ClusterLayout:
    return memory_manager_pb2.ClusterLayout(
        epoch=layout.epoch, num_layers_model=layout.num_layers_model,
        workers=[layout_entry_to_pb(e) for _, e in sorted(layout.workers.items())])


def busy_idle_fields(b: BusyIdle) -> dict[str, float]:
    """WorkerStats fields from an accounting.BusyIdle snapshot (pass them to engine_stats_to_pb as extras)."""
    return {"busy_seconds_total": b.busy_s, "idle_seconds_total": b.idle_s, "bubble_seconds_total": b.bubble_s,
            "bubble_ratio": b.bubble_ratio}


def engine_stats_to_pb(s: EngineStats, now: float | None = None, **extra: Any) -> common_pb2.WorkerStats:
    """`now`: the engine's clock (time.monotonic()) at which the oldest waiting requests' ages are taken; the
    default is the current time, so a snapshot the engine cached an iteration ago still reports the age now."""
    at = time.monotonic() if now is None else now

    def age(arrival: float | None) -> float:
        return 0.0 if arrival is None else max(0.0, at - arrival)

    return common_pb2.WorkerStats(
        kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used, block_size=s.block_size,
        num_running=s.num_running, num_waiting=s.num_waiting, queued_demand_blocks=s.queued_demand_blocks,
        num_preemptions=s.num_preemptions, prompt_tokens_total=s.prompt_tokens_total,
        generated_tokens_total=s.generated_tokens_total, oldest_waiting_age_s=age(s.oldest_waiting_arrival),
        num_offline_running=s.num_offline_running, num_offline_waiting=s.num_offline_waiting,
        offline_kv_blocks_used=s.offline_kv_blocks_used, offline_queued_demand_blocks=s.offline_queued_demand_blocks,
        oldest_online_waiting_age_s=age(s.oldest_online_waiting_arrival), **extra,
    )
