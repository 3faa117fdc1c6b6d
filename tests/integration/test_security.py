"""Issue 12, defects 3, 4 and 8 against a real cluster: what an outsider who can reach the ports can do.

Every method of every internal and admin service (enumerated from the protobuf descriptors, so none is
forgotten) refuses a call without the credential and with a wrong one, and nothing changes: the workers
keep serving, their epochs stay, and a request gets the same greedy tokens as before. Malformed bytes get
INVALID_ARGUMENT; epochs from the wire are bounded; the UCX transfer port refuses a peer without the
secret and a spoofed `worker-1` cannot replace the real link (a drop still works after); ConnectPeers
leaks no file descriptors; kunctl works with the run dir's credentials and fails in one line without.
One cluster for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from helpers import admin_channel, generate_many, internal_channel, kunctl_argv, make_config, rpc_outcome, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared import rpc
from kunserve.shared.transfer import TransferConfig, TransferError, TransferService
from kunserve.shared.transfer.ucx import ucx_available
from kunserve.v1 import admin_pb2, common_pb2, memory_manager_pb2, monitor_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

WRONG = "not-the-cluster-secret-0123456789abcdef"
SERVICES = {  # service descriptor -> which address serves it
    worker_pb2.DESCRIPTOR.services_by_name["Worker"]: "worker",
    monitor_pb2.DESCRIPTOR.services_by_name["Monitor"]: "monitor",
    memory_manager_pb2.DESCRIPTOR.services_by_name["MemoryManager"]: "memory_manager",
    admin_pb2.DESCRIPTOR.services_by_name["Admin"]: "memory_manager",
}
PROMPT = [11, 12, 13, 14]


def _address(c: LocalCluster, which: str) -> str:
    return c.cfg.workers[0].address if which == "worker" else getattr(c.cfg, which).address


async def _raw_call(ch: grpc.aio.Channel, service, method, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """Call one method with raw request bytes (no client-side parsing), as an outsider would."""
    path = f"/{service.full_name}/{method.name}"
    shape = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    callable_ = getattr(ch, shape)(path)
    request = iter([payload]) if method.client_streaming else payload
    return await rpc_outcome(lambda: callable_(request, timeout=10))


async def _state(c: LocalCluster) -> dict[str, tuple[int, bool, bool, list[str]]]:
    out = {}
    for w in c.cfg.workers:
        async with internal_channel(c, w.address) as ch:
            i = await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)
        out[w.id] = (i.epoch, i.serving, i.layer_end - i.layer_start, sorted(i.transfer_peers))
    return out


def _tokens(c: LocalCluster) -> list[int]:
    res = run(generate_many(c.cfg.dispatcher.address, [client.make_request(PROMPT, max_tokens=8, ignore_eos=True)]))[0]
    assert not isinstance(res, BaseException), res
    return res.token_ids


def _wait_linked(c: LocalCluster, timeout: float = 30.0) -> dict:
    """Until the memory manager's preconnect has linked the two workers (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        state = run(_state(c))
        if state["worker-0"][3] == ["worker-1"] and state["worker-1"][3] == ["worker-0"]:
            return state
        assert time.monotonic() < deadline, f"workers never linked: {state}"
        time.sleep(0.2)


def test_every_internal_and_admin_rpc_refuses_missing_and_wrong_credentials(cluster):
    before, tokens = _wait_linked(cluster), _tokens(cluster)
    admin_token = client.credentials_from(cluster.cfg, environ={}).admin_token

    async def probe():
        refused = []
        for service, which in SERVICES.items():
            address = _address(cluster, which)
            wrong = [None, WRONG] + ([admin_token] if which != "memory_manager" else [])
            for token in wrong:
                # token=None would fall back to this process's default token, which a test process has not set
                async with rpc.channel(address, token=token) as ch:
                    for method in service.methods:
                        code, details = await _raw_call(ch, service, method, b"")
                        assert code == grpc.StatusCode.UNAUTHENTICATED, (service.name, method.name, token, code, details)
                        assert ("missing" if token is None else "wrong") in details
                        refused.append(method.name)
        return refused

    refused = run(probe())
    assert {"PrepareTransition", "ConnectPeers", "ReportStats", "Drop", "GetLayout", "GetStatus",
            "DropWorkerLayers"} <= set(refused)
    assert run(_state(cluster)) == before  # nothing paused, no epoch moved, no layer dropped, links intact
    assert _tokens(cluster) == tokens


def test_health_is_open_and_the_client_api_is_open_without_an_api_key(cluster):
    for address in [cluster.cfg.dispatcher.address, cluster.cfg.monitor.address, cluster.cfg.memory_manager.address,
                    *(w.address for w in cluster.cfg.workers)]:
        assert run(rpc.health_check(address, timeout=5))
    assert len(_tokens(cluster)) == 8


def test_malformed_bytes_answer_invalid_argument_on_every_method(cluster):
    junk = b"\xff\xff\xff\xff\x0f"
    before = run(_state(cluster))

    async def probe():
        services = dict(SERVICES)
        from kunserve.v1 import generation_pb2
        services[generation_pb2.DESCRIPTOR.services_by_name["Generation"]] = "dispatcher"
        for service, which in services.items():
            async with (internal_channel(cluster, _address(cluster, which)) if which != "memory_manager"
                        else admin_channel(cluster)) as ch:
                for method in service.methods:
                    code, details = await _raw_call(ch, service, method, junk)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (service.name, method.name, code, details)
                    assert f"/{service.full_name}/{method.name}" in details

    run(probe())
    assert run(_state(cluster)) == before


def test_absurd_epochs_are_refused_and_status_keeps_working(cluster):
    before = run(_state(cluster))

    async def probe():
        async with internal_channel(cluster, cluster.cfg.workers[0].address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for call in (lambda e: stub.PrepareTransition(worker_pb2.TransitionSpec(epoch=e), timeout=10),
                         lambda e: stub.ExecuteTransition(worker_pb2.TransitionSpec(epoch=e), timeout=10),
                         lambda e: stub.CommitTransition(worker_pb2.TransitionRef(epoch=e), timeout=10),
                         lambda e: stub.AbortTransition(worker_pb2.TransitionRef(epoch=e), timeout=10)):
                for epoch in (2**64 - 1, 2**62, before["worker-0"][0] + 2**21):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call(epoch)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "epoch" in e.value.details()

    run(probe())
    assert run(_state(cluster)) == before
    out = subprocess.run(kunctl_argv(cluster, "status", "--json"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(json.loads(out.stdout)["layout"].get("epoch", 0)) < 2**62


def test_kunctl_uses_the_run_dirs_credentials_and_fails_in_one_line_without(cluster, tmp_path):
    ok = subprocess.run(kunctl_argv(cluster, "plan", "--json"), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNSERVE")}
    env["KUNSERVE_HOME"] = str(tmp_path / "empty-home")
    bare = [sys.executable, "-m", "kunserve.cli.kunctl", "--address", cluster.cfg.memory_manager.address]
    out = subprocess.run([*bare, "status"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "no admin token" in out.stderr, out.stderr
    wrong = tmp_path / "wrong-token"
    wrong.write_text(WRONG)
    out = subprocess.run([*bare, "--token-file", str(wrong), "status"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "UNAUTHENTICATED" in out.stderr and "Traceback" not in out.stderr


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_connect_peers_leaks_no_file_descriptors(cluster):
    _wait_linked(cluster)
    w0, w1 = cluster.cfg.workers

    async def transfer_address(w) -> str:
        async with internal_channel(cluster, w.address) as ch:
            return (await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)).transfer_address

    mine, theirs = run(transfer_address(w0)), run(transfer_address(w1))
    requests = [  # already linked; a peer's address under a wrong name; this worker's own address
        {"worker-1": theirs}, {"worker-9": theirs}, {"worker-8": mine}]

    async def connect_many(n: int) -> list[dict]:
        out = []
        async with internal_channel(cluster, w0.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for i in range(n):
                peers = requests[i % len(requests)]
                reply = await stub.ConnectPeers(worker_pb2.PeerAddresses(peers=[
                    worker_pb2.PeerAddress(worker_id=k, transfer_address=v) for k, v in peers.items()]), timeout=20)
                out.append(dict(reply.failed))
        return out

    pids = [cluster.child(w.id).proc.pid for w in (w0, w1)]
    run(connect_many(6), timeout=120)  # warm-up: whatever UCX opens once
    before = [_fds(p) for p in pids]
    failed = run(connect_many(30), timeout=300)
    time.sleep(0.5)  # the refused links' endpoints close in the background (bounded by close_timeout_s)
    after = [_fds(p) for p in pids]
    assert all(f == {} for f in failed[0::3]) and all("worker-9" in f for f in failed[1::3])
    assert all("worker-8" in f for f in failed[2::3])
    assert all(a - b <= 3 for a, b in zip(after, before)), (before, after)  # 30 calls: ~90 fds leaked before
    assert run(_state(cluster))["worker-0"][3] == ["worker-1"]


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_transfer_port_refuses_outsiders_and_a_spoofed_worker_1_cannot_replace_the_link(cluster):
    before = _wait_linked(cluster)

    async def info(w):
        async with internal_channel(cluster, w.address) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)

    host, port = run(info(cluster.cfg.workers[0])).transfer_address.rsplit(":", 1)

    class Forger(TransferService):
        """Skips checking the listener and answers with a made-up proof, as an attacker's code would."""

        async def _handshake_as_connector(self, ep, expect):
            import numpy as np

            from kunserve.shared.transfer.framing import FRAME_MAX
            from kunserve.shared.transfer.service import AUTH, HELLO, WELCOME
            buf = np.empty(FRAME_MAX, np.uint8)
            await self._send_control(ep, HELLO, nonce=os.urandom(32))
            await self._expect(ep, buf, HELLO)
            await self._send_control(ep, AUTH, mac=os.urandom(32))
            await self._expect(ep, buf, WELCOME)
            return "worker-0"

    async def spoof():
        for cls, secret in ((TransferService, WRONG.encode()), (Forger, WRONG.encode())):
            svc = cls("worker-1", config=TransferConfig(connect_timeout_s=5.0), secret=secret)
            try:
                with pytest.raises(TransferError):
                    await svc.connect(host, int(port), timeout=5.0)
                assert svc.peers == []
            finally:
                await svc.close()

    run(spoof(), timeout=60)
    assert run(_state(cluster)) == before  # the real link is still the one registered, nothing paused
    # ...and it carries a drop: the two workers form a pipeline group and serve the reference tokens.
    tokens = _tokens(cluster)
    drop = subprocess.run(kunctl_argv(cluster, "drop", "--group", "worker-0,worker-1", "--json"),
                          capture_output=True, text=True, timeout=120)
    assert drop.returncode == 0, drop.stdout + drop.stderr
    assert json.loads(drop.stdout)["completed"]
    assert _tokens(cluster) == tokens
    restore = subprocess.run(kunctl_argv(cluster, "restore", "--json"), capture_output=True, text=True, timeout=120)
    assert restore.returncode == 0, restore.stdout + restore.stderr
    assert _tokens(cluster) == tokens


def test_a_cluster_with_mutual_tls_serves_and_kunctl_reaches_it(tmp_path):
    """TLS end to end: every service serves it (mutual TLS inside), the launcher's health checks, the
    services' own channels, the client and kunctl all use the config's certificates. With an API key, the
    HTTP front serves HTTPS with the same certificate and refuses /v1 requests without the key."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    cert, key = tmp_path / "cluster.pem", tmp_path / "cluster.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kunserve",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    cfg = make_config(2)
    sec = cfg.security
    sec.tls_cert_file = sec.tls_client_cert_file = sec.tls_ca_file = str(cert)
    sec.tls_key_file = sec.tls_client_key_file = str(key)
    api_key = "k" * 32
    (tmp_path / "api_key").write_text(api_key)
    sec.api_key_file = str(tmp_path / "api_key")
    with LocalCluster(cfg, run_dir=tmp_path / "run") as c:
        c.start(timeout_s=120)
        creds = client.credentials_from(c.cfg, environ={})

        async def gen():
            async with client.dispatcher_channel(c.cfg.dispatcher.address, creds) as ch:
                return await client.generate(ch, client.make_request(PROMPT, max_tokens=4, ignore_eos=True), timeout=60)

        assert len(run(gen()).token_ids) == 4
        out = subprocess.run(kunctl_argv(c, "status", "--json"), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["cluster"]["workers"]) == 2  # the memory manager reached the monitor

        import http.client
        import ssl

        host, port = c.cfg.dispatcher.http_address.rsplit(":", 1)
        https = ssl.create_default_context(cafile=str(cert))
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                ({"Authorization": f"Bearer {api_key}"}, 200)):
            conn = http.client.HTTPSConnection(host, int(port), context=https, timeout=30)
            conn.request("GET", "/v1/models", headers=headers)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == status, body
            assert status == 200 or body["error"]["code"] == "invalid_api_key"
        conn.request("GET", "/health")  # open, like the gRPC health service
        assert conn.getresponse().status == 200
