"""Scalers: where the autoscaler's extra instances come from (README "Discovery and autoscaling").

* ``LocalScaler`` (``autoscale.scaler = "local"``): the standby workers ``kunserve up --standby N`` started. They
  loaded the model and offered themselves to the memory manager; scaling up activates one (``Worker.Activate``,
  after which it registers as a member), scaling down leaves it back in standby (the drain did that).
* ``KubernetesScaler`` (``"kubernetes"``): patches the worker StatefulSet's ``spec.replicas`` through the Kubernetes
  API, with the pod's service-account token and CA at the standard paths (plain HTTPS: urllib in a thread, no
  client library). A new pod registers itself as any joining worker does. Scaling down gives back the highest
  ordinal (the pod a StatefulSet removes first). A worker drained back to standby whose pod could not be removed
  (the API refused) is activated before a new pod is asked for, and given back again while the cluster is calm
  (``left_over``). Every patch carries the ``resourceVersion`` its read saw, so a change made meanwhile by someone
  else (``kubectl scale``, an HPA) makes the API answer 409 instead of being overwritten. No replica is added while
  one already asked for has not joined (pending, not ready): a pod that cannot be scheduled is not joined by more.

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
    """What the scalers need from the memory manager: the standby workers that offered themselves, the members, and
    stubs."""

    def standby_ids(self) -> list[str]: ...

    def member_ids(self) -> list[str]: ...

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

    async def left_over(self) -> list[str]:
        """Standby workers a scale-down drained whose capacity it still holds (their give-back was refused), in the
        order they may be given back."""
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

    async def left_over(self) -> list[str]:
        return []  # standby is what its workers are for


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


@dataclass(frozen=True)
class Scale:
    """The StatefulSet's scale subresource as read: ``spec.replicas`` and the ``resourceVersion`` a patch names."""

    replicas: int
    resource_version: str = ""


class KubeApi:
    """The two calls the scaler makes: read and patch the StatefulSet's scale subresource."""

    def __init__(self, target: KubeTarget) -> None:
        self.target = target
        self._ssl: ssl.SSLContext | None = None
        if target.base_url.startswith("https://"):
            self._ssl = ssl.create_default_context(cafile=str(target.ca_path) if target.ca_path else None)

    def _token(self) -> str:
        """The service-account token, read at every call: bound service-account tokens rotate."""
        t = self.target
        assert t.token_path is not None
        try:
            return t.token_path.read_text().strip()
        except OSError as exc:
            raise ScalerError("UNAVAILABLE", f"cannot read the service-account token at {t.token_path}: {exc.strerror or exc}") from None

    def _request(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        t = self.target
        url = t.base_url + t.scale_path
        headers = {"Accept": "application/json"}
        if t.token_path is not None:
            headers["Authorization"] = "Bearer " + self._token()
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=t.timeout_s, context=self._ssl) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise _http_error(method, t, exc) from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ScalerError("UNAVAILABLE", f"the Kubernetes API at {t.base_url} is unreachable: {reason}") from None
        except json.JSONDecodeError as exc:
            raise ScalerError("UNAVAILABLE", f"the Kubernetes API at {t.base_url} answered no JSON: {exc}") from None

    async def scale(self) -> Scale:
        reply = await asyncio.to_thread(self._request, "GET")
        return Scale(int(reply.get("spec", {}).get("replicas", 0)), str(reply.get("metadata", {}).get("resourceVersion", "")))

    async def replicas(self) -> int:
        return (await self.scale()).replicas

    async def set_replicas(self, n: int, read: Scale) -> int:
        """Patch ``spec.replicas`` to n, on the condition that the scale is still the one `read` saw (its
        resourceVersion): a change made since by anyone else is answered 409 and raises ScalerError ABORTED."""
        body: dict[str, Any] = {"spec": {"replicas": n}}
        if read.resource_version:
            body["metadata"] = {"resourceVersion": read.resource_version}
        reply = await asyncio.to_thread(self._request, "PATCH", body)
        return int(reply.get("spec", {}).get("replicas", n))


def _http_error(method: str, t: KubeTarget, exc: urllib.error.HTTPError) -> ScalerError:
    """An HTTP error as a ScalerError: 401/403 PERMISSION_DENIED, 404 NOT_FOUND, 409 ABORTED (changed meanwhile),
    429 and 5xx UNAVAILABLE (transient: the need asks again after the cooldown), other 4xx FAILED_PRECONDITION."""
    detail = _status_message(exc)
    hint = ""
    if exc.code in (401, 403):
        code = "PERMISSION_DENIED"
        hint = " (does the memory manager's service account have the Role in deploy/k8s/base/rbac.yaml?)"
    elif exc.code == 404:
        code = "NOT_FOUND"
    elif exc.code == 409:
        code = "ABORTED"
        hint = " (the scale changed since it was read, e.g. kubectl scale or an HPA: nothing was changed; the autoscaler decides again)"
    elif exc.code == 429 or exc.code >= 500:
        code = "UNAVAILABLE"
    else:
        code = "FAILED_PRECONDITION"
    return ScalerError(code, f"the Kubernetes API refused {method} {t.scale_path}: HTTP {exc.code}: {detail}{hint}")


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

    def _pod(self, ordinal: int) -> str:
        return f"{self.api.target.statefulset}-{ordinal}"

    def _ordinal(self, worker_id: str) -> int | None:
        m = re.fullmatch(re.escape(self.api.target.statefulset) + r"-(\d+)", worker_id)
        return int(m.group(1)) if m is not None else None

    def not_joined(self, replicas: int) -> list[str]:
        """The pods `replicas` asks for that are neither members nor standby workers: pending, starting, not ready,
        or dead. While there is one, no replica is added (it would wait behind the same shortage)."""
        present = set(self.pool.member_ids()) | set(self.pool.standby_ids())
        return [self._pod(i) for i in range(replicas) if self._pod(i) not in present]

    async def available(self) -> int | None:
        standby = len(self.pool.standby_ids())
        try:
            scale = await self.api.scale()
        except ScalerError:
            return standby or None  # the scale-up itself reports what is wrong
        if self.not_joined(scale.replicas):
            return standby
        if not self.max_replicas:
            return None
        return standby + max(0, self.max_replicas - scale.replicas)

    async def scale_up(self, count: int) -> list[str]:
        done, errors = await activate_standby(self.pool, count)
        for e in errors:
            self.log.warning("standby_activation_failed", error=e)
        left = count - len(done)
        if left <= 0:
            return done
        sts = self.api.target.statefulset
        read = await self.api.scale()
        now = read.replicas
        want = now + left if not self.max_replicas else min(now + left, self.max_replicas)
        if want <= now:
            if done:
                return done
            raise ScalerError("RESOURCE_EXHAUSTED", f"statefulset {sts} is at autoscale.max_replicas = {self.max_replicas}")
        waiting = self.not_joined(now)
        if waiting:
            if done:
                return done
            raise ScalerError(
                "UNAVAILABLE",
                f"statefulset {sts} asks for {now} replicas and {', '.join(waiting)} has not joined yet (pending, "
                "starting or not ready): no replica is added until it joins",
            )
        got = await self.api.set_replicas(want, read)
        return done + [f"statefulset/{sts} replicas {now} -> {got}"]

    async def removable(self, candidates: Sequence[str]) -> list[str]:
        """Only the highest ordinal: the pod the StatefulSet removes when its replicas go down by one."""
        try:
            n = await self.api.replicas()
        except ScalerError:
            return []
        last = self._pod(n - 1)
        return [last] if last in candidates else []

    async def scale_down(self, worker_id: str) -> str:
        sts = self.api.target.statefulset
        ordinal = self._ordinal(worker_id)
        if ordinal is None:
            raise ScalerError("FAILED_PRECONDITION", f"{worker_id} is not a pod of statefulset {sts}")
        read = await self.api.scale()
        n = read.replicas
        if ordinal != n - 1:
            raise ScalerError(
                "FAILED_PRECONDITION",
                f"{worker_id} is not the highest ordinal of statefulset {sts} ({n} replicas): scaling down would remove another pod",
            )
        got = await self.api.set_replicas(n - 1, read)
        return f"statefulset/{sts} replicas {n} -> {got}"

    async def left_over(self) -> list[str]:
        """Standby pods of the StatefulSet that are not members (drained, their give-back refused), the highest
        ordinal first. Seeds never drain, so none is listed."""
        pods = [(o, w) for w in self.pool.standby_ids() if (o := self._ordinal(w)) is not None]
        return await self.removable([w for _, w in sorted(pods, reverse=True)]) if pods else []


def make_scaler(a: AutoscaleSection, pool: StandbyPool) -> Scaler | None:
    """The configured scaler (None for "none"). Raises ScalerError when the Kubernetes one cannot be set up."""
    if a.scaler == "local":
        return LocalScaler(pool)
    if a.scaler == "kubernetes":
        return KubernetesScaler(KubeApi(KubeTarget.from_config(a)), pool, a.max_replicas)
    return None
