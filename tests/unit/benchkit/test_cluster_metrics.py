"""What `bench compare` reads from a cluster's /metrics: queue time merged over workers, the autoscaler's figures, and
the time from the first drop to an added instance in the sampled layout."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kunserve.benchkit import cluster_metrics
from kunserve.services.memory_manager.metrics import AutoscaleMetrics


def serve(registry: CollectorRegistry) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def endpoints() -> Iterator[list]:
    servers: list[ThreadingHTTPServer] = []
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def worker(endpoints: list, waits: list[float]) -> str:
    r = CollectorRegistry()
    h = Histogram("kunserve:request_queue_time_seconds", "", ["worker"], buckets=(0.5, 1.0, 5.0), registry=r)
    for w in waits:
        h.labels("w").observe(w)
    server, address = serve(r)
    endpoints.append(server)
    return address


def test_queue_time_merges_every_workers_histogram(endpoints):
    a = worker(endpoints, [0.1] * 98)
    b = worker(endpoints, [0.7, 3.0])
    q = cluster_metrics.queue_time([a, b, "127.0.0.1:1"])  # one that does not answer is left out
    assert q["requests"] == 100
    assert q["mean_s"] == pytest.approx((9.8 + 3.7) / 100)
    assert q["p99_s"] == 1.0  # 99 of 100 waited at most 1 s
    assert cluster_metrics.queue_time(["127.0.0.1:1"]) is None


def test_autoscale_figures_from_the_memory_managers_metrics(endpoints):
    r = CollectorRegistry()
    m = AutoscaleMetrics(r)
    m.scale_ups.labels("requested").inc(2)
    m.scale_ups.labels("served").inc(2)
    m.scale_downs.labels("completed").inc()
    m.time_to_serving.observe(1.0)
    m.time_to_serving.observe(3.0)
    server, address = serve(r)
    endpoints.append(server)
    a = cluster_metrics.autoscale(address)
    assert a["scale_ups"] == {"requested": 2, "served": 2, "failed": 0, "timed_out": 0}
    assert a["scale_downs"] == 1 and a["time_to_serving_s"] == 2.0


def test_drop_to_new_instance_from_the_samples():
    def s(t: float, workers: int, groups: int) -> dict:
        return {"t_s": t, "workers": workers, "pipelined_units": groups}

    assert cluster_metrics.drop_to_new_instance([s(0, 2, 0), s(1, 2, 1), s(6.5, 3, 1)]) == 5.5
    assert cluster_metrics.drop_to_new_instance([s(0, 2, 0), s(1, 2, 1)]) is None
    assert cluster_metrics.drop_to_new_instance([]) is None
