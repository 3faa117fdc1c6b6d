"""The monitor's Prometheus metrics, read at scrape time: the cluster as the workers' stats streams show it (workers
reporting, the KV totals with a pipeline group counted once, overload, the newest layout epoch) and the overload
policy's counters. Per-worker numbers are the workers' own metrics: exported here too they would count twice."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kunserve.services.monitor.servicer import PolicyCounters
from kunserve.shared.policy.cluster_load import ClusterStatus

P = "kunserve:"


def monitor_families(status: ClusterStatus, counters: PolicyCounters | None) -> list[Metric]:
    """counters: the overload policy's, None when it does not run (monitor.auto_drop off, or a policy without
    monitor actions): its counters stay at 0."""
    c = counters if counters is not None else PolicyCounters()
    healthy = [w for w in status.workers if w.healthy]
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float) -> None:
        family = GaugeMetricFamily(P + name, doc)
        family.add_metric([], value)
        out.append(family)

    def counter(name: str, doc: str, value: float) -> None:
        family = CounterMetricFamily(P + name, doc)
        family.add_metric([], value)
        out.append(family)

    gauge("layout_epoch", "The newest layout epoch the workers report.",
          max((w.report.epoch for w in healthy), default=0))
    reporting = GaugeMetricFamily(P + "workers_reporting", "Workers whose stats stream the monitor hears, by health "
                                  "(stale: no report within monitor.stale_after_s).", labels=["health"])
    reporting.add_metric(["healthy"], len(healthy))
    reporting.add_metric(["stale"], len(status.workers) - len(healthy))
    out.append(reporting)
    gauge("cluster_kv_blocks_total", "KV capacity of the healthy units in blocks (a group counted once).",
          status.kv_blocks_total)
    gauge("cluster_kv_blocks_used", "KV blocks in use over the healthy units.", status.kv_blocks_used)
    gauge("cluster_queued_demand_blocks", "KV blocks the waiting requests will need, over the healthy units.",
          status.queued_demand_blocks)
    gauge("cluster_overloaded", "1 while some unit's online KV demand exceeds its capacity, or its queue waits past "
          "the TTFT SLO.", float(status.overloaded))
    actions = CounterMetricFamily(P + "policy_actions", "Actions the overload policy completed (drop: a drop or, "
                                  "with policy.overload = migrate, a migration; restore: a group restored).",
                                  labels=["action"])
    actions.add_metric(["drop"], c.drops)
    actions.add_metric(["restore"], c.restores)
    out.append(actions)
    counter("policy_failures", "Policy actions that failed (not completed, rolled back, or an RPC error).", c.failures)
    counter("policy_autoscale_needed", "Drops the policy asked for that reported that more instances are needed.",
            c.autoscale_needed)
    counter("policy_tick_errors", "Errors caught in the policy loop itself.", c.tick_errors)
    return out
