"""Optional TLS (shared/rpc.py TLS): a server with the cluster certificate, clients that verify it, and mutual
TLS that refuses a client without a certificate. The certificate is self-signed by the openssl CLI."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from kunserve.shared import credentials, rpc
from kunserve.shared.config import SecuritySection
from kunserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")]
SECRET = "tls-test-cluster-secret-0123456789"


class Info(worker_pb2_grpc.WorkerServicer):
    async def GetInfo(self, request, context):
        return worker_pb2.WorkerInfo(worker_id="w0")


def self_signed(tmp_path, name: str):
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kunserve",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


async def serve(tls: rpc.TLS, mutual: bool):
    server = grpc.aio.server(interceptors=[rpc.ServerInterceptor([rpc.AuthRule("", (rpc.Credential("cluster secret",
                                                                                                   SECRET),))])])
    worker_pb2_grpc.add_WorkerServicer_to_server(Info(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(require_client_auth=mutual))
    await server.start()
    return server, f"127.0.0.1:{port}"


async def worker_id(address: str, tls: rpc.TLS | None) -> str:
    async with rpc.channel(address, token=SECRET, tls=tls) as ch:
        return (await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=5,
                                                              wait_for_ready=False)).worker_id


def test_tls_and_mutual_tls(tmp_path):
    cert, key = self_signed(tmp_path, "cluster")
    sec = SecuritySection(tls_cert_file=str(cert), tls_key_file=str(key), tls_ca_file=str(cert))
    server_only = credentials.load_tls(sec)
    # mutual: the same self-signed certificate doubles as the services' client certificate (its CA is itself)
    mutual = credentials.load_tls(SecuritySection(**{**sec.__dict__, "tls_client_cert_file": str(cert),
                                                     "tls_client_key_file": str(key)}))
    assert mutual.mutual and not server_only.mutual

    async def main():
        server, addr = await serve(server_only, mutual=False)
        try:
            assert await worker_id(addr, server_only) == "w0"
            with pytest.raises(grpc.aio.AioRpcError) as e:  # plaintext to a TLS port
                await worker_id(addr, None)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
        server, addr = await serve(mutual, mutual=True)
        try:
            assert await worker_id(addr, mutual) == "w0"
            with pytest.raises(grpc.aio.AioRpcError) as e:  # no client certificate: refused
                await worker_id(addr, server_only)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await rpc.health_check(addr, tls=mutual)
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 50))
