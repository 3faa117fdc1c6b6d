"""The scalers (services/memory_manager/scalers.py): the local one activates standby workers, the Kubernetes one
patches a StatefulSet's replicas through the API, here a small fake API server (plain HTTP, and HTTPS with the
service account's CA and token at the paths a pod has) that accepts or refuses the patch."""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from kunserve.services.memory_manager.scalers import (
    KubeApi,
    KubernetesScaler,
    KubeTarget,
    LocalScaler,
    ScalerError,
    make_scaler,
)
from kunserve.shared.config import AutoscaleSection
from kunserve.v1 import worker_pb2

pytestmark = pytest.mark.timeout(60)
SCALE = "/apis/apps/v1/namespaces/kunserve/statefulsets/kunserve-worker/scale"


class FakeApi:
    """The scale subresource of one StatefulSet, with its resourceVersion (a PATCH naming another one is answered
    409, as the API server does). `refuse`: (HTTP status, message) for every PATCH; `refuse_get` for every GET;
    `after_get`: run after answering a GET (someone else scaling meanwhile)."""

    def __init__(self, replicas: int = 2) -> None:
        self.replicas = replicas
        self.version = 1
        self.refuse: tuple[int, str] | None = None
        self.refuse_get: tuple[int, str] | None = None
        self.after_get = lambda: None
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _record(self) -> bytes:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                api.requests.append((self.command, self.path, dict(self.headers), body))
                return body

            def do_GET(self) -> None:
                self._record()
                if self.path != SCALE:
                    self._answer(404, {"kind": "Status", "message": f"statefulsets {self.path} not found"})
                    return
                if api.refuse_get is not None:
                    code, message = api.refuse_get
                    self._answer(code, {"kind": "Status", "status": "Failure", "message": message})
                    return
                self._answer(200, api.scale())
                api.after_get()

            def do_PATCH(self) -> None:
                body = self._record()
                if api.refuse is not None:
                    code, message = api.refuse
                    self._answer(code, {"kind": "Status", "status": "Failure", "message": message})
                    return
                patch = json.loads(body)
                seen = patch.get("metadata", {}).get("resourceVersion")
                if seen is not None and seen != str(api.version):
                    self._answer(
                        409,
                        {
                            "kind": "Status",
                            "status": "Failure",
                            "reason": "Conflict",
                            "message": "the object has been modified; please apply your changes to the latest version",
                        },
                    )
                    return
                api.scale_to(patch["spec"]["replicas"])
                self._answer(200, api.scale())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]

    def scale(self) -> dict:
        return {"kind": "Scale", "metadata": {"resourceVersion": str(self.version)}, "spec": {"replicas": self.replicas}}

    def scale_to(self, n: int) -> None:
        self.replicas = n
        self.version += 1

    def start(self, tls: ssl.SSLContext | None = None) -> None:
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    fake.start()
    yield fake
    fake.stop()


def target(url: str, sa: pathlib.Path | None = None, statefulset: str = "kunserve-worker") -> KubeTarget:
    return KubeTarget(url, "kunserve", statefulset, sa / "token" if sa else None, sa / "ca.crt" if sa else None, 5.0)


class FakeStub:
    def __init__(self, fail: grpc.aio.AioRpcError | None = None) -> None:
        self.fail = fail
        self.activated = 0

    async def Activate(self, request, timeout=None):
        if self.fail is not None:
            raise self.fail
        self.activated += 1
        return worker_pb2.ActivateReply()


class FakePool:
    """Standby workers (their stubs) and members: by default the StatefulSet's first two pods (the seeds)."""

    def __init__(self, stubs: dict[str, FakeStub], members: tuple[str, ...] = ("kunserve-worker-0", "kunserve-worker-1")) -> None:
        self.stubs = stubs
        self.members = list(members)

    def standby_ids(self) -> list[str]:
        return list(self.stubs)

    def member_ids(self) -> list[str]:
        return list(self.members)

    def worker_stub(self, worker_id: str):
        return self.stubs.get(worker_id)


def run(coro):
    return asyncio.run(coro)


# -- Kubernetes ---------------------------------------------------------------------------------------------------
def test_scale_up_patches_replicas_with_a_merge_patch(api, tmp_path):
    (tmp_path / "token").write_text("sa-token\n")
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}", tmp_path)), FakePool({}))
    did = run(scaler.scale_up(1))
    assert api.replicas == 3 and did == ["statefulset/kunserve-worker replicas 2 -> 3"]
    method, path, headers, body = api.requests[-1]
    assert (method, path) == ("PATCH", SCALE)
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert headers["Authorization"] == "Bearer sa-token"
    assert json.loads(body) == {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}}


def test_a_refused_patch_is_an_error_naming_the_reason(api):
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), FakePool({}))
    api.refuse = (403, 'statefulsets.apps "kunserve-worker" is forbidden: cannot patch resource "statefulsets/scale"')
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "PERMISSION_DENIED"
    assert "HTTP 403" in str(err.value) and "forbidden" in str(err.value) and "rbac.yaml" in str(err.value)
    api.refuse = (422, "spec.replicas: Invalid value")
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "FAILED_PRECONDITION" and "Invalid value" in str(err.value)
    assert api.replicas == 2


def test_an_unreachable_api_is_unavailable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{port}")), FakePool({}))
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "UNAVAILABLE" and f"127.0.0.1:{port}" in str(err.value)


def test_a_missing_statefulset_is_not_found(api):
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}", statefulset="nope")), FakePool({}))
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "NOT_FOUND"


def test_max_replicas_caps_scale_up_and_what_is_available(api):
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), FakePool({}), max_replicas=3)
    assert run(scaler.available()) == 1
    run(scaler.scale_up(2))
    assert api.replicas == 3
    assert run(scaler.available()) == 0
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "RESOURCE_EXHAUSTED"
    joined = FakePool({}, members=("kunserve-worker-0", "kunserve-worker-1", "kunserve-worker-2"))
    assert run(KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), joined).available()) is None


def test_a_standby_pod_left_by_a_refused_scale_down_is_activated_before_a_new_pod(api):
    stub = FakeStub()
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), FakePool({"kunserve-worker-2": stub}))
    assert run(scaler.scale_up(1)) == ["kunserve-worker-2"]
    assert stub.activated == 1 and api.replicas == 2 and not [r for r in api.requests if r[0] == "PATCH"]


def test_scale_down_gives_back_only_the_highest_ordinal(api):
    api.replicas = 4
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), FakePool({}))
    assert run(scaler.removable(["kunserve-worker-2", "kunserve-worker-3"])) == ["kunserve-worker-3"]
    assert run(scaler.removable(["kunserve-worker-2"])) == []
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_down("kunserve-worker-2"))
    assert err.value.code == "FAILED_PRECONDITION" and "highest ordinal" in str(err.value)
    with pytest.raises(ScalerError):
        run(scaler.scale_down("other-3"))
    assert run(scaler.scale_down("kunserve-worker-3")) == "statefulset/kunserve-worker replicas 4 -> 3"
    assert api.replicas == 3


def test_a_change_made_between_the_read_and_the_patch_is_not_overwritten(api):
    """kubectl scale (or an HPA) sets 5 replicas after the scaler read 2: its patch to 3 names the version it read,
    the API answers 409, and the 5 stay."""
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), FakePool({}))

    def someone_scales() -> None:
        api.after_get = lambda: None
        api.scale_to(5)

    api.after_get = someone_scales
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "ABORTED" and "HTTP 409" in str(err.value) and "changed since it was read" in str(err.value)
    assert api.replicas == 5
    api.replicas = 3
    api.after_get = someone_scales
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_down("kunserve-worker-2"))
    assert err.value.code == "ABORTED" and api.replicas == 5


def test_throttling_and_server_errors_are_transient(api):
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), FakePool({}))
    for status in (429, 500, 503):
        api.refuse = (status, "try again later")
        with pytest.raises(ScalerError) as err:
            run(scaler.scale_up(1))
        assert err.value.code == "UNAVAILABLE" and f"HTTP {status}" in str(err.value)
    api.refuse = None
    api.refuse_get = (503, "etcd leader changed")
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "UNAVAILABLE"
    assert api.replicas == 2


def test_an_unreadable_token_is_a_scaler_error(api, tmp_path):
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}", tmp_path)), FakePool({}))  # no token file
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "UNAVAILABLE" and str(tmp_path / "token") in str(err.value)
    assert api.replicas == 2 and not api.requests


def test_no_replica_is_added_while_one_asked_for_has_not_joined(api):
    """Without max_replicas: a pod asked for that stays pending (no GPU free) is not followed by another at every
    scale-up timeout; once it joins, the next one may be asked for."""
    pool = FakePool({})
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), pool)
    assert run(scaler.available()) is None
    run(scaler.scale_up(1))
    assert api.replicas == 3
    assert run(scaler.available()) == 0
    with pytest.raises(ScalerError) as err:
        run(scaler.scale_up(1))
    assert err.value.code == "UNAVAILABLE" and "kunserve-worker-2 has not joined" in str(err.value)
    assert api.replicas == 3
    pool.members.append("kunserve-worker-2")
    assert run(scaler.available()) is None
    run(scaler.scale_up(1))
    assert api.replicas == 4


def test_a_standby_pod_left_by_a_refused_give_back_is_listed_for_another_try(api):
    api.replicas = 3
    pool = FakePool({"kunserve-worker-2": FakeStub()})
    scaler = KubernetesScaler(KubeApi(target(f"http://127.0.0.1:{api.port}")), pool)
    assert run(scaler.left_over()) == ["kunserve-worker-2"]
    assert run(scaler.scale_down("kunserve-worker-2")) == "statefulset/kunserve-worker replicas 3 -> 2"
    api.replicas = 4  # a newer pod runs above it: it cannot go first
    assert run(scaler.left_over()) == []
    assert run(LocalScaler(pool).left_over()) == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
def test_in_cluster_https_with_the_service_accounts_ca_token_and_namespace(tmp_path):
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=kubernetes",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(tmp_path / "key.pem"),
            "-out",
            str(sa / "ca.crt"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    (sa / "token").write_text("in-cluster-token")
    (sa / "namespace").write_text("kunserve\n")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(sa / "ca.crt", tmp_path / "key.pem")
    fake = FakeApi()
    fake.start(tls)
    try:
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(fake.port)}
        t = KubeTarget.from_config(AutoscaleSection(scaler="kubernetes"), environ=env, service_account=sa)
        assert t.base_url == f"https://127.0.0.1:{fake.port}" and t.namespace == "kunserve"
        scaler = KubernetesScaler(KubeApi(t), FakePool({}))
        run(scaler.scale_up(1))
        assert fake.replicas == 3 and fake.requests[-1][2]["Authorization"] == "Bearer in-cluster-token"
    finally:
        fake.stop()


def test_without_a_namespace_the_kubernetes_scaler_says_what_to_set(tmp_path):
    with pytest.raises(ScalerError) as err:  # no service account namespace file
        KubeTarget.from_config(AutoscaleSection(scaler="kubernetes"), environ={}, service_account=tmp_path)
    assert "autoscale.namespace" in str(err.value)
    t = KubeTarget.from_config(AutoscaleSection(scaler="kubernetes", namespace="ns"), environ={}, service_account=tmp_path)
    assert t.base_url == "https://kubernetes.default.svc" and t.token_path is None


# -- local ----------------------------------------------------------------------------------------------------------
def test_local_scaler_activates_standby_workers_in_order():
    a, b = FakeStub(), FakeStub()
    scaler = LocalScaler(FakePool({"worker-2": a, "worker-3": b}))
    assert run(scaler.available()) == 2
    assert run(scaler.scale_up(1)) == ["worker-2"]
    assert (a.activated, b.activated) == (1, 0)
    assert make_scaler(AutoscaleSection(scaler="none"), FakePool({})) is None


def test_local_scaler_without_a_standby_that_activates_fails_with_the_reasons():
    refused = grpc.aio.AioRpcError(
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="worker worker-2 is not a standby worker (it is active)",
    )
    with pytest.raises(ScalerError) as err:
        run(LocalScaler(FakePool({"worker-2": FakeStub(refused)})).scale_up(1))
    assert err.value.code == "UNAVAILABLE" and "worker-2: FAILED_PRECONDITION" in str(err.value)
    with pytest.raises(ScalerError) as err:
        run(LocalScaler(FakePool({})).scale_up(1))
    assert "--standby" in str(err.value)
