"""A worker's Prometheus metrics (label `worker`): its engine's queue, KV blocks, counters, bubbles and place in the
layout, read at scrape time from the same WorkerStats the monitor and the dispatcher get, plus what happens per
iteration (tokens scheduled, queue time), observed on the engine thread."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kunserve.shared.metrics import ITERATION_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS
from kunserve.shared.policy.batch_scheduler import ScheduledChunk
from kunserve.v1 import common_pb2

P = "kunserve:"


def worker_families(s: common_pb2.WorkerStats) -> list[Metric]:
    """Every family a worker exports from one WorkerStats snapshot (label worker = its id)."""
    labels = ["worker"]
    worker = [s.worker_id]
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float) -> None:
        family = GaugeMetricFamily(P + name, doc, labels=labels)
        family.add_metric(worker, value)
        out.append(family)

    def counter(name: str, doc: str, value: float) -> None:
        family = CounterMetricFamily(P + name, doc, labels=labels)
        family.add_metric(worker, value)
        out.append(family)

    gauge("num_requests_running", "Requests in the engine's running batch.", s.num_running)
    gauge("num_requests_waiting", "Requests queued in the engine, not scheduled yet.", s.num_waiting)
    gauge("num_offline_requests_running", "Offline requests among the running ones.", s.num_offline_running)
    gauge("num_offline_requests_waiting", "Offline requests among the waiting ones.", s.num_offline_waiting)
    gauge("kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
    gauge("kv_blocks_total", "KV cache blocks: the worker's KV capacity now (a drop raises it).", s.kv_blocks_total)
    gauge("kv_blocks_undropped", "KV cache blocks the worker has holding every layer.", s.kv_blocks_undropped)
    gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.",
          s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
    gauge("offline_kv_blocks_used", "KV cache blocks offline requests hold.", s.offline_kv_blocks_used)
    gauge("queued_demand_blocks", "KV blocks the waiting requests' prompts will need.", s.queued_demand_blocks)
    gauge("oldest_waiting_age_seconds", "How long the oldest request not started yet has waited; 0 when none waits.",
          s.oldest_waiting_age_s)
    counter("num_preemptions", "Requests preempted (KV memory ran out).", s.num_preemptions)
    counter("prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens_total)
    counter("generation_tokens", "Tokens generated.", s.generated_tokens_total)
    counter("busy_seconds", "Seconds spent computing iterations.", s.busy_seconds_total)
    counter("idle_seconds", "Seconds not computing.", s.idle_seconds_total)
    counter("bubble_seconds", "Idle seconds while requests were queued (a pipeline stage waiting for work).",
            s.bubble_seconds_total)
    gauge("bubble_ratio", "bubble / (busy + bubble) since the worker started (KunServe's pipeline bubbles).",
          s.bubble_ratio)
    gauge("serving", "1 when routable: a whole instance, or the head of a complete pipeline group.", float(s.serving))
    gauge("transitioning", "1 while a drop / restore holds the worker.", float(s.transitioning))
    gauge("layers_held", "Model layers the worker holds (fewer after a drop).", s.layer_end - s.layer_start)
    gauge("layout_epoch", "The layout epoch of the worker's latest transition.", s.epoch)
    return out


class IterationMetrics:
    """Histograms of what each iteration scheduled, fed by Engine.on_schedule on the engine thread (prometheus_client
    histograms take observations from any thread)."""

    def __init__(self, registry: CollectorRegistry, worker_id: str) -> None:
        self.tokens = Histogram(P + "iteration_tokens_total", "Tokens per engine iteration (a group head's: per "
                                "microbatch).", ["worker"], buckets=ITERATION_TOKEN_BUCKETS,
                                registry=registry).labels(worker_id)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Online requests' time from arrival at the "
                                    "worker to their first scheduling.", ["worker"], buckets=REQUEST_LATENCY_BUCKETS,
                                    registry=registry).labels(worker_id)

    def scheduled(self, chunks: list[ScheduledChunk], now: float | None = None) -> None:
        """One iteration's chunks, before they compute. A request's first chunk (nothing computed, never preempted)
        ends its queue time. Offline requests are left out: they wait for the capacity online work leaves, by
        design, and would swamp the online percentiles."""
        now = time.monotonic() if now is None else now
        self.tokens.observe(sum(c.num_tokens for c in chunks))
        for c in chunks:
            seq = c.seq
            if c.start == 0 and seq.num_preemptions == 0 and not seq.request.offline:
                self.queue_time.observe(max(0.0, now - seq.request.arrival_time))
