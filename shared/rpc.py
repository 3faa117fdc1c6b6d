"""gRPC plumbing every service shares: server start with the standard health service, uvloop,
signal-driven clean shutdown, channel options, and status helpers.

Services stay thin: they register servicers and call `run_service`.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kunserve.shared.log import get_logger

# Keepalive so a dead peer is noticed in seconds, not minutes; large messages for token-id prompts.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly when a peer (re)starts: the default backoff grows to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]

Register = Callable[[grpc.aio.Server], None]


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def health_check(address: str, timeout: float = 1.0, service: str = "") -> bool:
    """True when the server at `address` answers SERVING on the standard health service."""
    try:
        async with insecure_channel(address) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError):
        return False


async def run_service(
    name: str,
    bind_address: str,
    register: Register,
    *,
    on_started: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
) -> None:
    """Serve until SIGTERM/SIGINT, then: health NOT_SERVING, `on_shutdown` (services end their in-flight
    streams with a clear UNAVAILABLE there), and stop the server with a grace period."""
    log = get_logger()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    # grpc_health starts with "" SERVING; we only report SERVING once on_started has finished.
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server)
    try:
        port = server.add_insecure_port(bind_address)
    except RuntimeError as exc:  # grpc raises RuntimeError when it cannot bind
        log.error("bind_failed", address=bind_address, error=str(exc))
        raise SystemExit(f"{name}: cannot listen on {bind_address}: {exc}") from None
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_started is not None:
        await on_started()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("service_started", address=bind_address, port=port)
    await stop.wait()
    log.info("service_stopping")
    await health_servicer.enter_graceful_shutdown()
    if on_shutdown is not None:
        await on_shutdown()
    await server.stop(grace_s)
    log.info("service_stopped")


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's async main on uvloop (falls back to asyncio where uvloop is missing)."""
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a hard dependency, this is for exotic platforms
        asyncio.run(main())
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        pass
