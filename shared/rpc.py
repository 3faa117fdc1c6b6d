"""gRPC plumbing every service shares: server start with the standard health service, uvloop,
signal-driven clean shutdown, channel options, credentials, and status helpers.

Services stay thin: they register servicers and call `run_service`.

Credentials. Every server runs one `ServerInterceptor`: it checks the bearer token of each call
(`authorization: Bearer <token>` metadata) against the credentials its `AuthRule`s accept for that method
(constant-time compare) and answers UNAUTHENTICATED otherwise; the standard grpc.health.v1 service stays
open for probes. It also parses requests itself, so malformed protobuf bytes get INVALID_ARGUMENT naming
the method instead of UNKNOWN. Every channel is made by `channel()`, which attaches the process's token
(`configure_client`, set once by each service from the cluster secret) or the one a tool passes, and
TLS when configured.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

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


AUTH_METADATA = "authorization"
BEARER = "Bearer "
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes (compose, supervisors) need no credential
# Trailing metadata on a stream a worker itself ends with UNAVAILABLE (shutting down, the request lost to a layout
# change): the dispatcher resumes the request elsewhere without counting that worker as one that crashed under it.
WORKER_END = "kunserve-worker-end"
# Trailing metadata on a FAILED_PRECONDITION a worker gives while it re-forms its tensor-parallel instance (ReformTP):
# it answers nothing while it re-executes, and the dispatcher waits for it (bounded) rather than failing requests.
REFORMING = "kunserve-reforming"


@dataclass(frozen=True)
class Credential:
    """A bearer token a server accepts, with the name its refusals give ("cluster secret", "admin token")."""

    name: str
    token: str

    def __repr__(self) -> str:  # never in a log line
        return f"Credential({self.name!r})"


@dataclass(frozen=True)
class AuthRule:
    """Methods whose full name starts with `prefix` ("" = every method) accept any of `accept`;
    an empty `accept` leaves them open. The first matching rule applies."""

    prefix: str
    accept: tuple[Credential, ...]


@dataclass(frozen=True)
class TLS:
    """PEM bytes. Servers present cert_chain/private_key (requiring a client certificate signed by
    root_certs when require_client_auth); clients verify with root_certs (None = system roots) and
    present client_cert_chain/client_private_key when set (mutual TLS)."""

    cert_chain: bytes
    private_key: bytes
    root_certs: bytes | None = None
    client_cert_chain: bytes | None = None
    client_private_key: bytes | None = None

    @property
    def mutual(self) -> bool:
        return self.client_cert_chain is not None

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.root_certs,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certs, private_key=self.client_private_key,
                                            certificate_chain=self.client_cert_chain)


class _Process:
    """The token and TLS every `channel()` of this process uses unless the caller passes its own."""

    token: str | None = None
    tls: TLS | None = None


def configure_client(token: str | None, tls: TLS | None = None) -> None:
    """Set the credentials of this process's channels (a service: the cluster secret and the cluster TLS)."""
    _Process.token, _Process.tls = token, tls


class _BearerToken:
    """Adds `authorization: Bearer <token>` to every call of a channel (aio has no per-channel metadata)."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTH_METADATA, BEARER + token)

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


# One class per call shape: grpc.aio files an interceptor under the first shape it implements only.
class _BearerUnaryUnary(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _BearerStreamStream(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    return [cls(token) for cls in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary, _BearerStreamStream)]


def channel(address: str, token: str | None = None, tls: TLS | None = None) -> grpc.aio.Channel:
    """The one way to open a channel: with `token` (default: the process's, see `configure_client`) on
    every call, over TLS when `tls` (default: the process's) is set."""
    token = token if token is not None else _Process.token
    tls = tls if tls is not None else _Process.tls
    interceptors = bearer_interceptors(token) if token else None
    if tls is not None:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


class _Malformed:
    """What the request deserializer returns for bytes that do not parse: the method answers
    INVALID_ARGUMENT instead of the UNKNOWN a raising deserializer would give."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything a parser raises on hostile bytes
            return _Malformed(f"{type(exc).__name__}: {exc}")

    return parse


async def _respond(result: Any) -> AsyncIterator[Any]:
    """The responses of a streaming behavior (every servicer here is async): an async generator, or a
    coroutine that writes through the context."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


def _parsing_inside(method: str, h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, with malformed requests answered INVALID_ARGUMENT naming the method."""

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{method}: the request is not a valid protobuf message ({request.error})")
        return request

    async def requests(it: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for r in it:
            yield await check(r, context)

    parse, out = _safe(h.request_deserializer), h.response_serializer
    if h.unary_unary is not None:
        async def unary_unary(request, context):
            result = h.unary_unary(await check(request, context), context)
            return await result if inspect.isawaitable(result) else result
        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, out)
    if h.unary_stream is not None:
        async def unary_stream(request, context):
            async for item in _respond(h.unary_stream(await check(request, context), context)):
                yield item
        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, out)
    if h.stream_unary is not None:
        async def stream_unary(request_iterator, context):
            result = h.stream_unary(requests(request_iterator, context), context)
            return await result if inspect.isawaitable(result) else result
        return grpc.stream_unary_rpc_method_handler(stream_unary, parse, out)

    async def stream_stream(request_iterator, context):
        async for item in _respond(h.stream_stream(requests(request_iterator, context), context)):
            yield item
    return grpc.stream_stream_rpc_method_handler(stream_stream, parse, out)


def _refusal(h: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED without reading the request."""

    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, which streaming responses need

    if h.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if h.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if h.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


def _bearer(metadata: Sequence[Any] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_METADATA:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return text[len(BEARER):] if text.startswith(BEARER) else ""
    return None


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Credential check and safe request parsing for every method of a server (see the module docstring)."""

    def __init__(self, rules: Sequence[AuthRule]) -> None:
        self.rules = tuple(rules)
        self._parsing: dict[str, grpc.RpcMethodHandler] = {}

    def accepted(self, method: str) -> tuple[Credential, ...]:
        if method.startswith(OPEN_PREFIXES):
            return ()
        return next((r.accept for r in self.rules if method.startswith(r.prefix)), ())

    def refusal(self, method: str, metadata: Sequence[Any] | None) -> str | None:
        """Why a call with this metadata may not run `method` (None: it may)."""
        accept = self.accepted(method)
        if not accept:
            return None
        names = " or the ".join(c.name for c in accept)
        token = _bearer(metadata)
        if not token:
            return (f"{method}: missing credential: this method needs the {names} as "
                    f"'{AUTH_METADATA}: {BEARER}<token>' metadata")
        given = token.encode()
        # Every credential is compared, in constant time, so timing tells nothing about which was close.
        ok = [hmac.compare_digest(given, c.token.encode()) for c in accept]
        return None if any(ok) else f"{method}: wrong credential: this method needs the {names}"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
            return None
        method = handler_call_details.method
        why = self.refusal(method, handler_call_details.invocation_metadata)
        if why is not None:
            return _refusal(handler, why)
        wrapped = self._parsing.get(method)
        if wrapped is None:
            wrapped = self._parsing[method] = _parsing_inside(method, handler)
        return wrapped


async def health_check(address: str, timeout: float = 1.0, service: str = "", tls: TLS | None = None) -> bool:
    """True when the server at `address` answers SERVING on the standard health service (open to all:
    no credential needed; `tls` when the cluster serves TLS and this process is not configured for it)."""
    try:
        async with channel(address, tls=tls) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except (TimeoutError, grpc.aio.AioRpcError, OSError):
        return False


async def run_service(
    name: str,
    bind_address: str,
    register: Register,
    *,
    on_started: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    auth: Sequence[AuthRule] = (),
    tls: TLS | None = None,
    require_client_cert: bool = False,
    options: Sequence[tuple[str, Any]] = (),
    alive: Callable[[], bool] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then: health NOT_SERVING, `on_shutdown` (services end their in-flight
    streams with a clear UNAVAILABLE there), and stop the server with a grace period. `auth`: what each
    method needs (see ServerInterceptor); `tls`: serve TLS, demanding a client certificate when
    `require_client_cert` (mutual TLS between services). `alive`: polled twice a second once started; while
    it is False the health service answers NOT_SERVING (a worker whose engine cannot continue), so
    supervisors and probes see what the process cannot fix by itself."""
    log = get_logger()
    # `options` override SERVER_OPTIONS key by key (the dispatcher sizes its receive limit from its prompt limit)
    mine = {k for k, _ in options}
    server = grpc.aio.server(options=[o for o in SERVER_OPTIONS if o[0] not in mine] + list(options),
                             interceptors=[ServerInterceptor(auth)])
    health_servicer = health.aio.HealthServicer()
    # grpc_health starts with "" SERVING; we only report SERVING once on_started has finished.
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server)
    try:
        port = (server.add_secure_port(bind_address, tls.server_credentials(require_client_cert)) if tls is not None
                else server.add_insecure_port(bind_address))
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
    log.info("service_started", address=bind_address, port=port, tls=tls is not None,
             authenticated=sorted({c.name for r in auth for c in r.accept}))
    watch = asyncio.create_task(_follow_liveness(alive, health_servicer, name)) if alive is not None else None
    await stop.wait()
    log.info("service_stopping")
    if watch is not None:
        watch.cancel()
    await health_servicer.enter_graceful_shutdown()
    if on_shutdown is not None:
        await on_shutdown()
    await server.stop(grace_s)
    log.info("service_stopped")


async def _follow_liveness(alive: Callable[[], bool], health_servicer: health.aio.HealthServicer, name: str,
                           interval_s: float = 0.5) -> None:
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        now = alive()
        if now != serving:
            serving = now
            status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
            log = get_logger()
            (log.info if now else log.error)("health_changed", serving=now)
            for service in ("", name):
                await health_servicer.set(service, status)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a service's async main on uvloop (falls back to asyncio where uvloop is missing)."""
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a hard dependency, this is for exotic platforms
        asyncio.run(main())
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        pass
