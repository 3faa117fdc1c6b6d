"""The cluster's wire conversions: a worker's report, the cluster status and the layout lose nothing."""

from __future__ import annotations

from dataclasses import fields

from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_layout import LayoutEntry, LayoutState
from kunserve.shared.policy.cluster_load import ClusterLoad
from kunserve.shared.wire.cluster_state import (
    layout_entry_from_info,
    layout_entry_to_pb,
    layout_to_pb,
    report_from_pb,
    report_to_pb,
    status_to_pb,
)
from kunserve.v1 import common_pb2, worker_pb2


def _every_field_set() -> common_pb2.WorkerStats:
    """A WorkerStats with every field set to a distinct non-default value."""
    pb = common_pb2.WorkerStats()
    for i, f in enumerate(pb.DESCRIPTOR.fields, start=1):
        if f.is_repeated:
            getattr(pb, f.name).extend(["w-a", "w-b"])
        elif f.type == f.TYPE_STRING:
            setattr(pb, f.name, f"{f.name}-{i}")
        elif f.type == f.TYPE_BOOL:
            setattr(pb, f.name, True)
        elif f.type == f.TYPE_DOUBLE:
            setattr(pb, f.name, i + 0.5)
        else:
            setattr(pb, f.name, i)
    return pb


def test_every_worker_stats_field_survives_the_round_trip():
    pb = _every_field_set()
    report = report_from_pb(pb)
    assert report_to_pb(report) == pb
    assert report_from_pb(report_to_pb(report)) == report
    assert report.member == Member(pb.worker_id, pb.layer_start, pb.layer_end)
    assert (report.unit_id, report.unit_members) == (pb.group_id, ("w-a", "w-b"))


def test_every_report_field_has_a_wire_field():
    report = report_from_pb(_every_field_set())
    assert all(getattr(report, f.name) not in (0, 0.0, "", (), False) for f in fields(WorkerReport))


def test_cluster_status_carries_every_report_whole():
    load = ClusterLoad(stale_after_s=3.0)
    head = WorkerReport(Member("a", 0, 2), unit_id="g", unit_members=("a", "b"), serving=True,
                        kv_blocks_total=100, kv_blocks_used=40, queued_demand_blocks=70, busy_seconds_total=3.0)
    other = WorkerReport(Member("b", 2, 4), unit_id="g", unit_members=("a", "b"), kv_blocks_total=100,
                         kv_blocks_used=40)
    load.observe(head, now=0.0)
    load.observe(other, now=0.0)
    pb = status_to_pb(load.status(now=1.0, wall_now=12.5))
    assert pb.timestamp_unix_s == 12.5 and pb.overloaded
    assert (pb.kv_blocks_total, pb.kv_blocks_used, pb.queued_demand_blocks) == (100, 40, 70)  # the head only
    assert [report_from_pb(w.stats) for w in pb.workers] == [head, other]
    assert pb.workers[0].healthy and abs(pb.workers[0].kv_usage - 0.4) < 1e-9 and pb.workers[0].last_report_age_s == 1.0


def test_layout_entries_from_worker_info_to_the_cluster_layout():
    info = worker_pb2.WorkerInfo(worker_id="w1", address="h:1", layer_start=2, layer_end=4, num_layers_model=4,
                                 transfer_address="h:7", group_id="g", group_members=["w0", "w1"], epoch=5,
                                 serving=False)
    entry = layout_entry_from_info(info)
    assert entry == LayoutEntry(Member("w1", 2, 4, "h:7"), "h:1", "g", ("w0", "w1"), serving=False, epoch=5)
    lay = LayoutState()
    lay.observe(entry, info.num_layers_model)
    lay.observe(LayoutEntry(Member("w0", 0, 2, "h:6"), "h:0", "g", ("w0", "w1"), epoch=5), 4)
    lay.mark_unreachable("w0")
    pb = layout_to_pb(lay)
    assert (pb.epoch, pb.num_layers_model) == (lay.epoch, 4)
    assert [w.worker_id for w in pb.workers] == ["w0", "w1"]
    w0, w1 = pb.workers
    assert not w0.reachable and w0.serving and w0.transfer_address == "h:6"
    assert w1 == layout_entry_to_pb(entry)
    assert (w1.address, w1.layer_start, w1.layer_end, w1.group_id, w1.reachable, w1.serving) == \
        ("h:1", 2, 4, "g", True, False)
