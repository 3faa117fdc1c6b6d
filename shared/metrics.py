"""Prometheus metrics: every service answers `GET /metrics` on its metrics port (`<service>.metrics_port`, 0 = none).

Names follow vLLM's with the prefix `kunserve:` instead of `vllm:` (vllm:num_requests_running is
kunserve:num_requests_running), and so do the histograms' buckets, so a dashboard built for vLLM ports by a prefix
change; the README's "Metrics" table lists every family. Most values are read from the service's own state when
Prometheus scrapes (`Lazy`): serving pays nothing between scrapes, and nothing can drift from what `kunctl status`
shows. Only what happens per event (a token, a finished request, a transition) is counted as it happens.

The endpoint runs on the service's event loop, so a scrape reads that state on the thread that owns it. It is plain
HTTP without credentials, on the service's bind host: it carries counts and timings, never prompts, tokens or secrets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "kunserve:"
# The classic text format: what vLLM serves and every Prometheus version reads (the names need no escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so that the same quantile queries mean the same resolution.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A drop or restore: tens of milliseconds on a small model, minutes when weights come from disk.
TRANSITION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def token_count_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets): prompt and generation lengths."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_len:
                return out
            out.append(float(value))
        exponent += 1


def new_registry() -> CollectorRegistry:
    """A registry of one service's metrics. Counters and histograms export no `_created` series: Prometheus
    derives resets itself, and vLLM's dashboards do not use them."""
    disable_created_metrics()
    return CollectorRegistry()


class Lazy(Collector):
    """Families computed when Prometheus scrapes, from a function of the service's current state."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not read state that is not there yet

    def collect(self) -> Iterable[Metric]:
        return list(self._families())


class MetricsServer:
    """`GET /metrics` (the Prometheus text format) of one registry, served on the running event loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.port = 0  # the bound port once started
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE})

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


async def serve_metrics(registry: CollectorRegistry, bind: tuple[str, int], key: str) -> MetricsServer | None:
    """Start the endpoint at bind = (host, metrics_port); None when the port is 0 (metrics off). A port that is
    taken is a start-up error naming the config key (`key`, e.g. "dispatcher.metrics_port")."""
    host, port = bind
    if not port:
        return None
    server = MetricsServer(registry)
    try:
        await server.start(host, port)
    except OSError as exc:
        raise SystemExit(f"cannot serve /metrics on {host}:{port} ({key}): {exc}") from None
    return server
