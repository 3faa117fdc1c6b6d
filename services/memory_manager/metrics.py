"""The memory manager's Prometheus metrics: the transitions it drove (drops, restores and migrations by outcome, their
durations, the KV and weight bytes they moved, "autoscale needed"), counted from their reports, and the layout it
keeps (epoch, units and their KV capacity, time spent with layers dropped), read at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kunserve.shared.metrics import TRANSITION_BUCKETS
from kunserve.v1 import memory_manager_pb2, worker_pb2

P = "kunserve:"
# report.op -> the noun of its metric names
OPS = {"drop": "drop", "restore": "restore", "migrate": "migration"}


def outcome(report: memory_manager_pb2.TransitionReport) -> str:
    """completed | rolled_back (a worker failed: the layout is back as it was) | noop (a restore with no dropped
    group) | no_plan (a drop with nothing left to merge: more instances are needed)."""
    if report.rolled_back:
        return "rolled_back"
    if report.completed:
        return "noop" if report.error else "completed"
    return "no_plan"


class DropClock:
    """Seconds the cluster has spent with at least one pipeline group (layers dropped), as seen at each refresh."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._total = 0.0
        self._since: float | None = None

    def observe(self, dropped: bool) -> None:
        now = self._clock()
        if dropped and self._since is None:
            self._since = now
        elif not dropped and self._since is not None:
            self._total += now - self._since
            self._since = None

    def seconds(self) -> float:
        return self._total + (self._clock() - self._since if self._since is not None else 0.0)

    @property
    def since(self) -> float | None:
        """When the current drop state began (None: no pipeline group now)."""
        return self._since


def units_of(infos: Iterable[worker_pb2.WorkerInfo]) -> dict[str, tuple[int, int]]:
    """unit (group) id -> (members, KV capacity in blocks) from the workers' GetInfo. A group's members share one
    block-id space: its capacity is its head's."""
    out: dict[str, tuple[int, int]] = {}
    for info in infos:
        members = list(info.group_members) or [info.worker_id]
        if members[0] == info.worker_id:
            out[info.group_id or info.worker_id] = (len(members), info.kv_blocks_total)
    return out


def layout_families(epoch: int, infos: Mapping[str, worker_pb2.WorkerInfo], configured: int, dropped_seconds: float,
                    transition_running: bool, joined: int = 0, standby: int = 0) -> list[Metric]:
    """The layout the memory manager keeps, as gauges (label group: the unit's id, a whole instance's is its worker's)."""
    units = units_of(infos.values())
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float) -> None:
        family = GaugeMetricFamily(P + name, doc)
        family.add_metric([], value)
        out.append(family)

    gauge("layout_epoch", "The cluster's layout epoch: it moves at every drop, restore and migration, and when a worker "
          "comes or goes.", epoch)
    gauge("workers_configured", "Workers in the config.", configured)
    gauge("workers_joined", "Members that joined at run time (not in the config).", joined)
    gauge("workers_standby", "Standby workers offering themselves to the local scaler.", standby)
    gauge("workers_reachable", "Workers that answered the latest GetInfo.", len(infos))
    gauge("num_groups", "Pipeline groups (units of more than one worker: layers dropped).",
          sum(1 for size, _ in units.values() if size > 1))
    gauge("transition_in_progress", "1 while a drop, restore or migration runs.", float(transition_running))
    size = GaugeMetricFamily(P + "group_size", "Workers in each unit (1: a whole instance).", labels=["group"])
    kv = GaugeMetricFamily(P + "group_kv_blocks_total", "Each unit's KV capacity in blocks (a group's: its head's "
                           "block space, shared by its members).", labels=["group"])
    for gid, (members, blocks) in sorted(units.items()):
        size.add_metric([gid], members)
        kv.add_metric([gid], blocks)
    dropped = CounterMetricFamily(P + "drop_state_seconds", "Seconds with at least one pipeline group (layers "
                                  "dropped), as seen by the layout refresh (every second).")
    dropped.add_metric([], dropped_seconds)
    out += [size, kv, dropped]
    return out


class TransitionMetrics:
    """Counters and histograms of the transitions the orchestrator reports (an Orchestrator observer)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.count = {op: Counter(P + f"{noun}s", f"{noun.capitalize()}s by outcome (completed, rolled_back, noop, "
                                  "no_plan, refused).", ["outcome"], registry=registry) for op, noun in OPS.items()}
        self.duration = {op: Histogram(P + f"{noun}_duration_seconds", f"How long a {noun} took, from the request to "
                                       "the new layout serving (or the rollback), by outcome.", ["outcome"],
                                       buckets=TRANSITION_BUCKETS, registry=registry) for op, noun in OPS.items()}
        self.pause = Histogram(P + "transition_pause_seconds", "The longest a member served nothing during a "
                               "completed transition, by op.", ["op"], buckets=TRANSITION_BUCKETS, registry=registry)
        self.kv_bytes = Counter(P + "kv_bytes_moved", "KV cache bytes the transitions exchanged between workers.",
                                ["op"], registry=registry)
        self.requests_moved = Counter(P + "requests_moved", "Requests the transitions moved to another unit.",
                                      ["op"], registry=registry)
        self.weight_bytes = Counter(P + "weight_bytes_restored", "Weight bytes restores loaded, by source (peer, host, "
                                    "checkpoint).", ["source"], registry=registry)
        self.autoscale_signals = Counter(P + "autoscale_signals", "Drops that reported no drop plan can meet the "
                                         "requirement: more instances are needed.", registry=registry)
        self.autoscale_needed = Gauge(P + "autoscale_needed", "1 while the latest drop said more instances are "
                                      "needed (until a drop meets its requirement or a restore completes).",
                                      registry=registry)
        for op in OPS:  # every outcome's series from the start, so that rate() sees the first one
            for label in ("completed", "rolled_back", "refused"):
                self.count[op].labels(label)

    def reported(self, report: memory_manager_pb2.TransitionReport) -> None:
        op = report.op if report.op in OPS else "drop"
        result = outcome(report)
        self.count[op].labels(result).inc()
        if result in ("completed", "rolled_back"):
            self.duration[op].labels(result).observe(report.total_seconds)
        if result == "completed":
            self.pause.labels(op).observe(report.pause_seconds)
            self.kv_bytes.labels(op).inc(report.kv_bytes_moved)
            self.requests_moved.labels(op).inc(report.requests_moved)
            for source, n in (("peer", report.weight_bytes_from_peers), ("host", report.weight_bytes_from_host),
                              ("checkpoint", report.weight_bytes_from_checkpoint)):
                if n:
                    self.weight_bytes.labels(source).inc(n)
        if op == "drop":
            if report.autoscale_needed:
                self.autoscale_signals.inc()
            self.autoscale_needed.set(float(report.autoscale_needed))
        elif op == "restore" and result == "completed":
            self.autoscale_needed.set(0.0)

    def refused(self, op: str, code: str) -> None:
        self.count[op if op in OPS else "drop"].labels("refused").inc()


class AutoscaleMetrics:
    """What the autoscaler did (README "Discovery and autoscaling")."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.scale_ups = Counter(P + "autoscale_scale_ups", "Instances the autoscaler asked its scaler for, by outcome: "
                                 "requested, failed (the scaler refused or was unreachable), timed_out (not serving "
                                 "within autoscale.scale_up_timeout_s), served.", ["outcome"], registry=registry)
        self.scale_downs = Counter(P + "autoscale_scale_downs", "Added instances the autoscaler gave back, by outcome: "
                                   "completed, failed.", ["outcome"], registry=registry)
        self.time_to_serving = Histogram(P + "autoscale_time_to_serving_seconds", "From the need for an instance "
                                         "(autoscale needed, or a drop held for autoscale.hold_s) to the instance "
                                         "asked for serving.", buckets=TRANSITION_BUCKETS, registry=registry)
        self.pending = Gauge(P + "autoscale_pending", "Instances asked for that do not serve yet.", registry=registry)
        for label in ("requested", "failed", "timed_out", "served"):
            self.scale_ups.labels(label)
        for label in ("completed", "failed"):
            self.scale_downs.labels(label)
