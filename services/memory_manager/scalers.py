"""Scalers: where the autoscaler's extra instances come from (README "Discovery and autoscaling").

* ``LocalScaler`` (``autoscale.scaler = "local"``): the standby workers ``kunserve up --standby N`` started. They
  loaded the model and offered themselves to the memory manager; scaling up activates one (``Worker.Activate``,
  after which it registers as a member), scaling down leaves it back in standby (the drain did that).
* ``KubernetesScaler`` (``"kubernetes"``): patches the worker StatefulSet's ``spec.replicas`` through the Kubernetes
  API, with the pod's service-account token and CA at the standard paths (plain HTTPS: urllib in a thread, no
  client library). A new pod registers itself as any joining worker does. Scaling down gives back the highest
  ordinal (the pod a StatefulSet removes first). A worker drained back to standby whose pod could not be removed
  (the API refused) is activated before a new pod is asked for.

Draining comes first in both cases and is the autoscaler's (services/memory_manager/autoscaler.py); a scaler only
adds and removes capacity. Failures raise ScalerError with a gRPC status name and a message that says what to fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kunserve.shared.config import AutoscaleSection
from kunserve.shared.log import get_logger
from kunserve.v1 import worker_pb2, worker_pb2_grpc

ACTIVATE_TIMEOUT_S = 30.0
SERVICE_ACCOUNT = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ScalerError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class StandbyPool(Protocol):
    """What the scalers need from the memory manager: the standby workers that offered themselves, and stubs."""

    def standby_ids(self) -> list[str]: ...

    def worker_stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub | None: ...


class Scaler(Protocol):
    name: str

    async def available(self) -> int | None:
        """Instances it can add now; None: no bound it knows of."""
        ...

    async def scale_up(self, count: int) -> list[str]:
        """Ask for `count` instances; returns what it did (worker ids, or a description). Raises ScalerError."""
        ...

    async def removable(self, candidates: Sequence[str]) -> list[str]:
        """Which of these added workers it can give back, preferred first."""
        ...

    async def scale_down(self, worker_id: str) -> str:
        """Give back a worker that has drained (it is in standby now). Raises ScalerError."""
        ...


async def activate_standby(pool: StandbyPool, count: int) -> tuple[list[str], list[str]]:
    """Activate up to `count` standby workers: (activated ids, errors)."""
    done: list[str] = []
    errors: list[str] = []
    for wid in pool.standby_ids():
        if len(done) >= count:
            break
        stub = pool.worker_stub(wid)
        if stub is None:
            continue
        try:
            await stub.Activate(worker_pb2.ActivateRequest(), timeout=ACTIVATE_TIMEOUT_S)
            done.append(wid)
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{wid}: {exc.code().name}: {exc.details()}")
    return done, errors


class LocalScaler:
    name = "local"

    def __init__(self, pool: StandbyPool) -> None:
        self.pool = pool

    async def available(self) -> int | None:
        return len(self.pool.standby_ids())

    async def scale_up(self, count: int) -> list[str]:
        done, errors = await activate_standby(self.pool, count)
        if not done:
            raise ScalerError(
                "UNAVAILABLE",
                "no standby worker could be activated: "
                + ("; ".join(errors) or "none has offered itself (start them with `kunserve up --standby N`)"),
            )
        return done

    async def removable(self, candidates: Sequence[str]) -> list[str]:
        return list(candidates)

    async def scale_down(self, worker_id: str) -> str:
        return f"{worker_id} is back in standby"


@dataclass(frozen=True)
class KubeTarget:
    """Where the API is and how to talk to it."""

    base_url: str
    namespace: str
    statefulset: str
    token_path: pathlib.Path | None
    ca_path: pathlib.Path | None
    timeout_s: float

    @classmethod
    def from_config(
        cls, a: AutoscaleSection, environ: dict[str, str] | os._Environ[str] = os.environ, service_account: pathlib.Path = SERVICE_ACCOUNT
    ) -> KubeTarget:
        """In cluster (api_url empty): https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT with the service
        account's token and CA; the namespace from autoscale.namespace, else the service account's."""
        namespace = a.namespace
        if not namespace:
            try:
                namespace = (service_account / "namespace").read_text().strip()
            except OSError:
                raise ScalerError(
                    "FAILED_PRECONDITION",
                    "autoscale.namespace is empty and there is no service "
                    f"account namespace at {service_account / 'namespace'}: set autoscale.namespace",
                ) from None
        if a.api_url:
            base = a.api_url.rstrip("/")
        else:
            host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
            base = f"https://{_bracket(host)}:{port}" if host else "https://kubernetes.default.svc"
        token = service_account / "token"
        ca = service_account / "ca.crt"
        return cls(base, namespace, a.statefulset, token if token.exists() else None, ca if ca.exists() else None, a.api_timeout_s)

    @property
    def scale_path(self) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{self.statefulset}/scale"


def _bracket(host: str | None) -> str:
    return f"[{host}]" if host and ":" in host else str(host)


class KubeApi:
    """The two calls the scaler makes: read and patch the StatefulSet's scale subresource."""

    def __init__(self, target: KubeTarget) -> None:
        self.target = target
        self._ssl: ssl.SSLContext | None = None
        if target.base_url.startswith("https://"):
            self._ssl = ssl.create_default_context(cafile=str(target.ca_path) if target.ca_path else None)

    def _request(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        t = self.target
        url = t.base_url + t.scale_path
        headers = {"Accept": "application/json"}
        if t.token_path is not None:  # read at every call: bound service-account tokens rotate
            headers["Authorization"] = "Bearer " + t.token_path.read_text().strip()
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=t.timeout_s, context=self._ssl) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = _status_message(exc)
            code = "PERMISSION_DENIED" if exc.code in (401, 403) else ("NOT_FOUND" if exc.code == 404 else "FAILED_PRECONDITION")
            raise ScalerError(
                code,
                f"the Kubernetes API refused {method} {t.scale_path}: HTTP {exc.code}: {detail}"
                + (
                    " (does the memory manager's service account have the Role in deploy/k8s/base/rbac.yaml?)"
                    if exc.code in (401, 403)
                    else ""
                ),
            ) from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ScalerError("UNAVAILABLE", f"the Kubernetes API at {t.base_url} is unreachable: {reason}") from None
        except json.JSONDecodeError as exc:
            raise ScalerError("UNAVAILABLE", f"the Kubernetes API at {t.base_url} answered no JSON: {exc}") from None

    async def replicas(self) -> int:
        reply = await asyncio.to_thread(self._request, "GET")
        return int(reply.get("spec", {}).get("replicas", 0))

    async def set_replicas(self, n: int) -> int:
        reply = await asyncio.to_thread(self._request, "PATCH", {"spec": {"replicas": n}})
        return int(reply.get("spec", {}).get("replicas", n))


def _status_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
        return str(body.get("message") or body.get("reason") or exc.reason)
    except (json.JSONDecodeError, OSError, ValueError):
        return str(exc.reason)


class KubernetesScaler:
    name = "kubernetes"

    def __init__(self, api: KubeApi, pool: StandbyPool, max_replicas: int = 0) -> None:
        self.api = api
        self.pool = pool
        self.max_replicas = max_replicas
        self.log = get_logger()

    async def available(self) -> int | None:
        standby = len(self.pool.standby_ids())
        if not self.max_replicas:
            return None
        try:
            return standby + max(0, self.max_replicas - await self.api.replicas())
        except ScalerError:
            return standby or None  # the scale-up itself reports what is wrong

    async def scale_up(self, count: int) -> list[str]:
        done, errors = await activate_standby(self.pool, count)
        for e in errors:
            self.log.warning("standby_activation_failed", error=e)
        left = count - len(done)
        if left <= 0:
            return done
        now = await self.api.replicas()
        want = now + left if not self.max_replicas else min(now + left, self.max_replicas)
        if want <= now:
            if done:
                return done
            raise ScalerError(
                "RESOURCE_EXHAUSTED", f"statefulset {self.api.target.statefulset} is at autoscale.max_replicas = {self.max_replicas}"
            )
        got = await self.api.set_replicas(want)
        return done + [f"statefulset/{self.api.target.statefulset} replicas {now} -> {got}"]

    async def removable(self, candidates: Sequence[str]) -> list[str]:
        """Only the highest ordinal: the pod the StatefulSet removes when its replicas go down by one."""
        try:
            n = await self.api.replicas()
        except ScalerError:
            return []
        last = f"{self.api.target.statefulset}-{n - 1}"
        return [last] if last in candidates else []

    async def scale_down(self, worker_id: str) -> str:
        sts = self.api.target.statefulset
        m = re.fullmatch(re.escape(sts) + r"-(\d+)", worker_id)
        if m is None:
            raise ScalerError("FAILED_PRECONDITION", f"{worker_id} is not a pod of statefulset {sts}")
        n = await self.api.replicas()
        if int(m.group(1)) != n - 1:
            raise ScalerError(
                "FAILED_PRECONDITION",
                f"{worker_id} is not the highest ordinal of statefulset {sts} ({n} replicas): scaling down would remove another pod",
            )
        got = await self.api.set_replicas(n - 1)
        return f"statefulset/{sts} replicas {n} -> {got}"


def make_scaler(a: AutoscaleSection, pool: StandbyPool) -> Scaler | None:
    """The configured scaler (None for "none"). Raises ScalerError when the Kubernetes one cannot be set up."""
    if a.scaler == "local":
        return LocalScaler(pool)
    if a.scaler == "kubernetes":
        return KubernetesScaler(KubeApi(KubeTarget.from_config(a)), pool, a.max_replicas)
    return None
