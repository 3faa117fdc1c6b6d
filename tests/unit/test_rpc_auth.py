"""The one server interceptor (shared/rpc.py): credentials per method, open health, malformed requests.

An in-process server with a fake worker servicer whose every call is recorded: a refused call must never
reach it. Calls go out as raw bytes on generic stubs, the way an outsider would send them.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers import rpc_outcome

from kunserve.shared import rpc
from kunserve.v1 import common_pb2, monitor_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SECRET = "cluster-secret-for-the-unit-test"
ADMIN = "admin-token-for-the-unit-test-000"


class Recorder(worker_pb2_grpc.WorkerServicer, monitor_pb2_grpc.MonitorServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def GetInfo(self, request, context):
        self.calls.append("GetInfo")
        return worker_pb2.WorkerInfo(worker_id="w0")

    async def Generate(self, request, context):
        self.calls.append("Generate")
        for i in range(3):
            yield worker_pb2.WorkerTokenEvent(request_id=request.request_id, token_id=i)

    async def Cancel(self, request, context):  # a coroutine-style behavior
        self.calls.append("Cancel")
        return common_pb2.CancelResponse(cancelled=True)

    async def ReportStats(self, request_iterator, context):
        async for stats in request_iterator:
            self.calls.append(f"ReportStats:{stats.worker_id}")
        return common_pb2.Empty()


@contextlib.asynccontextmanager
async def serving(rules):
    """The recorder behind the interceptor on a free port: (recorder, address), stopped on the way out."""
    rec = Recorder()
    server = grpc.aio.server(interceptors=[rpc.ServerInterceptor(rules)])
    worker_pb2_grpc.add_WorkerServicer_to_server(rec, server)
    monitor_pb2_grpc.add_MonitorServicer_to_server(rec, server)
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield rec, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


RULES = [rpc.AuthRule("/kunserve.v1.Monitor/", (rpc.Credential("cluster secret", SECRET),
                                                 rpc.Credential("admin token", ADMIN))),
         rpc.AuthRule("", (rpc.Credential("cluster secret", SECRET),))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_missing_or_wrong_credentials_are_refused_before_the_servicer_runs():
    async def main():
        async with serving(RULES) as (rec, addr):
            for token, word in ((None, "missing"), ("not-the-secret-at-all-000", "wrong"), (ADMIN, "wrong")):
                async with rpc.channel(addr, token=token) as ch:
                    stub = worker_pb2_grpc.WorkerStub(ch)
                    for call in (lambda: stub.GetInfo(common_pb2.Empty(), timeout=5),
                                 lambda: stub.Generate(worker_pb2.WorkerGenerateRequest(request_id="r"), timeout=5),
                                 lambda: stub.PrepareTransition(worker_pb2.TransitionSpec(epoch=2**64 - 1), timeout=5)):
                        code, details = await rpc_outcome(call)
                        assert code == grpc.StatusCode.UNAUTHENTICATED, (token, code, details)
                        assert word in details and "cluster secret" in details and "/kunserve.v1.Worker/" in details
                    # client streaming: refused without reading the stream
                    mon = monitor_pb2_grpc.MonitorStub(ch)
                    code, _ = await rpc_outcome(lambda: mon.ReportStats(
                        iter([common_pb2.WorkerStats(worker_id="x")]), timeout=5))
                    assert code == (grpc.StatusCode.OK if token == ADMIN else grpc.StatusCode.UNAUTHENTICATED)
            assert rec.calls == ["ReportStats:x"]  # only the admin token's call on the Monitor rule ran

    run(main())


def test_the_right_credential_passes_every_call_shape():
    async def main():
        async with serving(RULES) as (rec, addr):
            async with rpc.channel(addr, token=SECRET) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                assert (await stub.GetInfo(common_pb2.Empty(), timeout=5)).worker_id == "w0"
                events = [ev.token_id async for ev in stub.Generate(worker_pb2.WorkerGenerateRequest(request_id="r"),
                                                                     timeout=5)]
                assert events == [0, 1, 2]
                assert (await stub.Cancel(common_pb2.CancelRequest(request_id="r"), timeout=5)).cancelled
                await monitor_pb2_grpc.MonitorStub(ch).ReportStats(
                    iter([common_pb2.WorkerStats(worker_id="a"), common_pb2.WorkerStats(worker_id="b")]), timeout=5)
            assert rec.calls == ["GetInfo", "Generate", "Cancel", "ReportStats:a", "ReportStats:b"]

    run(main())


def test_process_default_token_is_used_when_none_is_passed():
    async def main():
        async with serving(RULES) as (_, addr):
            rpc.configure_client(SECRET)
            try:
                async with rpc.channel(addr) as ch:
                    assert (await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(),
                                                                        timeout=5)).worker_id == "w0"
            finally:
                rpc.configure_client(None)

    run(main())


def test_health_stays_open():
    async def main():
        async with serving(RULES) as (_, addr):
            async with rpc.channel(addr) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            assert await rpc.health_check(addr)

    run(main())


def test_malformed_requests_get_invalid_argument_naming_the_method():
    async def main():
        junk = b"\xff\xff\xff\xff"
        async with serving(RULES) as (rec, addr):
            async with rpc.channel(addr, token=SECRET) as ch:
                for path, shape in (("/kunserve.v1.Worker/GetInfo", "unary_unary"),
                                    ("/kunserve.v1.Worker/Generate", "unary_stream"),
                                    ("/kunserve.v1.Monitor/ReportStats", "stream_unary")):
                    method = getattr(ch, shape)(path)
                    request = iter([junk]) if shape.startswith("stream") else junk
                    code, details = await rpc_outcome(lambda: method(request, timeout=5))
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
                    assert path in details and "protobuf" in details
            assert rec.calls == []

    run(main())


def test_open_rules_and_refusal_messages():
    icpt = rpc.ServerInterceptor([rpc.AuthRule("/kunserve.v1.Generation/", ())])
    assert icpt.refusal("/kunserve.v1.Generation/Generate", ()) is None
    icpt = rpc.ServerInterceptor(RULES)
    assert icpt.refusal("/grpc.health.v1.Health/Check", ()) is None
    assert "missing" in icpt.refusal("/kunserve.v1.Worker/GetInfo", [("authorization", "Basic abc")])
    assert icpt.refusal("/kunserve.v1.Worker/GetInfo", [("authorization", f"Bearer {SECRET}")]) is None
    assert "admin token" in icpt.refusal("/kunserve.v1.Monitor/GetClusterStatus", ())
    assert repr(rpc.Credential("cluster secret", SECRET)).count(SECRET) == 0
