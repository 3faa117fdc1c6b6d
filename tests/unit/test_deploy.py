"""Static checks of deploy/ (fast, offline): the Kubernetes manifests and the Grafana dashboard.

Kubernetes: each overlay is rendered the way `kubectl apply -k` does (a small renderer of the kustomize subset the
manifests use, so no kubectl is needed), every object is validated against the Kubernetes API schemas that
kubernetes-validate bundles (dev extra), and the objects are held to the cluster config: ports, names, probes,
the worker list. Grafana: the dashboard parses and queries only documented metrics. compose.yaml's observability
profile and the Prometheus scrape config are checked with the rest of compose.yaml in test_containers.py.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import readme_metrics

from kunserve.shared.config import ClusterConfig, ServiceSection, load_config
from kunserve.shared.credentials import ADMIN_TOKEN, CLUSTER_SECRET

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = ("cpu", "gpu")
K8S_CONFIG_FILE = BASE / "cluster.toml"
CONFIG_FILE = ROOT / "configs" / "cluster.toml"
CPU_IMAGE, CUDA_IMAGE = "kunserve:latest", "kunserve:latest-cuda"  # compose.yaml's images, untagged run
# Oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27, the StatefulSet's pod-index label
# since 1.28) and the newest whose schemas the validator bundles.
K8S_MIN_VERSION = "1.29"
COMPONENTS = {"dispatcher": "dispatcher", "memory-manager": "memory_manager", "monitor": "monitor", "worker": "worker"}

Obj = dict[str, Any]


def load_yaml_documents(text: str) -> list[Obj]:
    try:
        from ruamel.yaml import YAML  # a dependency of check-jsonschema (dev extra)

        docs = list(YAML(typ="safe", pure=True).load_all(text))
    except ImportError:
        yaml = pytest.importorskip("yaml", reason="needs ruamel.yaml or PyYAML (pip install -e '.[dev]')")
        docs = list(yaml.safe_load_all(text))
    return [d for d in docs if d]


# -- a kustomize renderer for the subset deploy/k8s uses --------------------------------------------------------
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "configMapGenerator", "secretGenerator"}
CLUSTER_SCOPED = {"Namespace"}
# Strategic-merge-patch keys of the lists the patches touch (everything else is replaced, as in kustomize).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    key = MERGE_KEYS.get(field)
    if isinstance(base, list) and isinstance(patch, list) and key is not None:
        out_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            match = [i for i, have in enumerate(out_list) if have.get(key) == item.get(key)]
            if match:
                out_list[match[0]] = strategic_merge(out_list[match[0]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _hashed(obj: Obj) -> str:
    """kustomize's content-hash suffix (the digest differs from kustomize's own; the behaviour is the same)."""
    digest = hashlib.sha256(json.dumps({k: obj.get(k) for k in ("kind", "data", "type")}, sort_keys=True).encode())
    return f"{obj['metadata']['name']}-{digest.hexdigest()[:10]}"


def _generated(kind: str, spec: Obj, directory: pathlib.Path, read: Callable[[pathlib.Path], bytes]) -> Obj:
    assert set(spec) <= {"name", "files", "type"}, f"{kind} generator: unsupported keys {set(spec) - {'name', 'files', 'type'}}"
    data = {}
    for entry in spec["files"]:
        key, _, path = entry.rpartition("=") if "=" in entry else (pathlib.PurePath(entry).name, "", entry)
        raw = read(directory / path)
        data[key] = base64.b64encode(raw).decode() if kind == "Secret" else raw.decode()
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}, "data": data}
    if kind == "Secret":
        obj["type"] = spec.get("type", "Opaque")
    return obj


def _rename_references(obj: Obj, names: dict[tuple[str, str], str]) -> None:
    """Point a pod template's ConfigMap / Secret references at the generated (hashed) names."""
    spec = obj.get("spec", {}).get("template", {}).get("spec")
    if spec is None:
        return
    for vol in spec.get("volumes", []):
        if "configMap" in vol:
            vol["configMap"]["name"] = names.get(("ConfigMap", vol["configMap"]["name"]), vol["configMap"]["name"])
        if "secret" in vol:
            vol["secret"]["secretName"] = names.get(("Secret", vol["secret"]["secretName"]), vol["secret"]["secretName"])
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        for env in container.get("env", []):
            for ref_key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                ref = env.get("valueFrom", {}).get(ref_key)
                if ref is not None:
                    ref["name"] = names.get((kind, ref["name"]), ref["name"])


def render(directory: pathlib.Path, read: Callable[[pathlib.Path], bytes] = pathlib.Path.read_bytes) -> list[Obj]:
    """What `kubectl kustomize DIRECTORY` prints, as objects; an unsupported kustomization field fails the test."""
    k = load_yaml_documents((directory / "kustomization.yaml").read_text())[0]
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert set(k) <= KUSTOMIZATION_KEYS, f"{directory}: the test's renderer lacks {set(k) - KUSTOMIZATION_KEYS}"
    objects: list[Obj] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        objects += render(path, read) if path.is_dir() else load_yaml_documents(path.read_text())
    names: dict[tuple[str, str], str] = {}
    for field_name, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in k.get(field_name, []):
            obj = _generated(kind, spec, directory, read)
            names[(kind, obj["metadata"]["name"])] = obj["metadata"]["name"] = _hashed(obj)
            objects.append(obj)
    for patch_spec in k.get("patches", []):
        assert set(patch_spec) == {"path"}, f"{directory}: patches by path only (strategic merge)"
        patch = load_yaml_documents((directory / patch_spec["path"]).read_text())[0]
        targets = [o for o in objects if (o["kind"], o["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
        assert len(targets) == 1, f"{patch_spec['path']}: patches no object of the base"
        objects[objects.index(targets[0])] = strategic_merge(targets[0], patch)
    for obj in objects:
        _rename_references(obj, names)
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
    return objects


def placeholder_secrets(path: pathlib.Path) -> bytes:
    """The generator's files are the operator's (never in the repo): a stand-in where they are absent."""
    return path.read_bytes() if path.exists() else b"test-placeholder-" + path.name.encode()


RENDERED = {overlay: render(K8S / "overlays" / overlay, placeholder_secrets) for overlay in OVERLAYS}


def objects_of(overlay: str, kind: str) -> list[Obj]:
    return [o for o in RENDERED[overlay] if o["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> Obj:
    found = [o for o in objects_of(overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: {kind}/{name}"
    return found[0]


def workloads(overlay: str) -> Iterator[tuple[str, Obj]]:
    """(component, Deployment or StatefulSet) of every KunServe service."""
    for obj in RENDERED[overlay]:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["labels"]["app.kubernetes.io/component"], obj


def container_of(workload: Obj) -> Obj:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: one container per pod (one service per process)"
    return containers[0]


def ports_of(container: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def service_for(overlay: str, workload: Obj) -> Obj:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    matches = [s for s in objects_of(overlay, "Service") if s["spec"]["selector"].items() <= labels.items()]
    assert len(matches) == 1, f"{workload['metadata']['name']}: one Service selects its pods"
    return matches[0]


def config_seen_by(overlay: str, workload: Obj) -> ClusterConfig:
    """The cluster config the pod's service loads: the ConfigMap's cluster.toml plus the container's KUNSERVE__ env."""
    container = container_of(workload)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    path = env.pop("KUNSERVE_CONFIG")
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    configmap = one(overlay, "ConfigMap", volume["configMap"]["name"])
    key = path.removeprefix(mount["mountPath"] + "/")
    assert configmap["data"][key] == K8S_CONFIG_FILE.read_text(), "the ConfigMap is deploy/k8s/base/cluster.toml"
    return load_config(K8S_CONFIG_FILE, environ={k: v for k, v in env.items() if k.startswith("KUNSERVE__")})


def section_for(cfg: ClusterConfig, component: str) -> ServiceSection:
    """The config section of a component's pods (the workers share one pod template, so the first stands for all)."""
    return cfg.workers[0] if component == "worker" else getattr(cfg, COMPONENTS[component])


# -- schemas ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_validate_against_the_kubernetes_api_schemas(overlay):
    validator = pytest.importorskip("kubernetes_validate.utils",
                                    reason="kubernetes-validate is in the dev extra: pip install -e '.[dev]'")
    bundled = {validator.major_minor(v) for v in validator.all_versions()}
    versions = sorted(v for v in {K8S_MIN_VERSION, validator.major_minor(validator.latest_version())} if v in bundled)
    assert versions, f"kubernetes-validate bundles none of Kubernetes {K8S_MIN_VERSION} or later"
    checked = set()
    for obj in RENDERED[overlay]:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: the bundled schemas lack it (structural checks below)
        for version in versions:
            try:
                validator.validate(obj, version, strict=True)  # strict: an unknown (misspelt) field fails too
            except validator.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} against Kubernetes {version}: "
                            f"{where}: {exc.message}")
        checked.add(obj["kind"])
    assert {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet",
            "PersistentVolumeClaim"} <= checked


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_metrics_port(overlay):
    (monitor,) = objects_of(overlay, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in objects_of(overlay, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {service_for(overlay, w)["metadata"]["name"]
                                                        for _, w in workloads(overlay)}, "one Service per service"
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}
        assert endpoint.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])
        for service in selected:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, service["metadata"]["name"]


# -- references inside the render --------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_reference_resolves(overlay):
    (namespace,) = objects_of(overlay, "Namespace")
    names = {(o["kind"], o["metadata"]["name"]) for o in RENDERED[overlay]}
    for obj in RENDERED[overlay]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace["metadata"]["name"], obj["metadata"]["name"]
    for component, workload in workloads(overlay):
        spec = workload["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        pod = spec["template"]["spec"]
        for vol in pod["volumes"]:
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names, vol
            if "secret" in vol:
                assert ("Secret", vol["secret"]["secretName"]) in names, vol
            if "persistentVolumeClaim" in vol:
                assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in names, vol
        container = container_of(workload)
        assert {m["name"] for m in container["volumeMounts"]} == {v["name"] for v in pod["volumes"]}, component
        service = service_for(overlay, workload)
        for port in service["spec"]["ports"]:
            assert ports_of(container)[port["targetPort"]] == port["port"], f"{component}: Service port {port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_the_files_kunserve_cli_secrets_writes(overlay):
    (secret,) = objects_of(overlay, "Secret")
    assert set(secret["data"]) == {CLUSTER_SECRET.default_file, ADMIN_TOKEN.default_file}
    ignore = (BASE / "secrets" / ".gitignore").read_text().split()
    assert "*" in ignore and "!.gitignore" in ignore, "the generated credentials are never committed"
    for component, workload in workloads(overlay):
        cfg = config_seen_by(overlay, workload)
        container = container_of(workload)
        pod = workload["spec"]["template"]["spec"]
        mount = next(m for m in container["volumeMounts"]
                     if any(v["name"] == m["name"] and "secret" in v for v in pod["volumes"]))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        files = {f"{mount['mountPath']}/{item['path']}" for item in volume["secret"]["items"]}
        wanted = {cfg.security.cluster_secret_file} | ({cfg.security.admin_token_file} if component == "memory-manager" else set())
        assert files == wanted, f"{component} mounts exactly the credentials it needs"
        assert volume["secret"]["defaultMode"] == 0o440, "credentials: read-only, for the service's group alone"


# -- agreement with the cluster config -------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_addresses_agree_with_the_cluster_config(overlay):
    seen = set()
    for component, workload in workloads(overlay):
        cfg = config_seen_by(overlay, workload)
        section = section_for(cfg, component)
        container = container_of(workload)
        ports = ports_of(container)
        assert ports["grpc"] == section.port, f"{component}: containerPort != the config's port"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == section.port, f"{component}: {probe} asks grpc.health.v1 there"
        assert section.bind == "0.0.0.0", f"{component}: probes and peers reach the pod's IP"
        if hasattr(section, "metrics_port"):
            assert ports["metrics"] == section.metrics_port, f"{component}: metrics containerPort"
        if component == "dispatcher":
            assert ports["http"] == cfg.dispatcher.http_port
        if component == "worker":
            assert {w.port for w in cfg.workers} == {section.port}, "one pod template: every worker on one port"
            assert {w.transfer_port for w in cfg.workers} == {ports["transfer"]}
        else:
            service = service_for(overlay, workload)
            assert section.host == service["metadata"]["name"], f"peers reach the {component} by its Service's name"
            assert workload["spec"]["replicas"] == 1, f"the cluster has one {component}"
        cmd = container["command"]
        assert cmd == [f"kunserve-{component}"], "the image's console script, configured by the mounted file"
        seen.add(component)
    assert seen == set(COMPONENTS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_list_is_the_statefulsets_stable_names(overlay):
    (sts,) = objects_of(overlay, "StatefulSet")
    cfg = config_seen_by(overlay, sts)
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    headless = one(overlay, "Service", service)
    assert headless["spec"]["clusterIP"] == "None", "a headless Service: one DNS name per worker pod"
    assert headless["spec"]["publishNotReadyAddresses"] is True, "a starting worker is reachable by name"
    assert service_for(overlay, sts) is headless
    assert sts["spec"]["replicas"] == len(cfg.workers), "replicas = the [[workers]] entries (README 'Kubernetes')"
    assert [w.id for w in cfg.workers] == [f"{name}-{i}" for i in range(len(cfg.workers))]
    assert [w.host for w in cfg.workers] == [f"{name}-{i}.{service}" for i in range(len(cfg.workers))]
    env = {e["name"]: e for e in container_of(sts)["env"]}
    assert env["KUNSERVE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", \
        "each worker pod runs the [[workers]] entry named after it"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscaler_may_patch_the_worker_statefulsets_scale_and_nothing_else(overlay):
    """README "Discovery and autoscaling": the memory manager runs the Kubernetes scaler under its own service
    account, bound to a Role that reads and patches the scale of the StatefulSet autoscale.statefulset names."""
    mm = next(w for c, w in workloads(overlay) if c == "memory-manager")
    cfg = config_seen_by(overlay, mm)
    assert cfg.autoscale.scaler == "kubernetes"
    (sts,) = objects_of(overlay, "StatefulSet")
    assert cfg.autoscale.statefulset == sts["metadata"]["name"]
    pod = mm["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert pod["automountServiceAccountToken"] is True
    one(overlay, "ServiceAccount", account)
    (binding,) = [b for b in objects_of(overlay, "RoleBinding")
                  if {"kind": "ServiceAccount", "name": account} in b["subjects"]]
    role = one(overlay, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                              "resourceNames": [sts["metadata"]["name"]], "verbs": ["get", "patch"]}]
    for component, workload in workloads(overlay):
        if component != "memory-manager":
            assert "serviceAccountName" not in workload["spec"]["template"]["spec"], f"{component}: no API access"
    env = {e["name"]: e.get("value") for e in container_of(sts)["env"]}
    assert env["KUNSERVE_WORKER_HOST"] == f"$(KUNSERVE_WORKER_ID).{sts['spec']['serviceName']}", \
        "a worker beyond the [[workers]] entries joins under its pod's DNS name"


def test_k8s_config_differs_from_configs_cluster_toml_only_in_addresses_credentials_and_paths():
    """Tuning keys (engine, monitor, SLO, ...) stay the ones `kunserve up` and compose run with."""
    k8s, local = load_config(K8S_CONFIG_FILE, environ={}), load_config(CONFIG_FILE, environ={})
    k8s_only = {("dispatcher", "batch_db"), ("logging", "format"), ("security", "cluster_secret_file")}
    for f in dataclasses.fields(ClusterConfig):
        if f.name in ("workers", "source"):
            continue
        if not dataclasses.is_dataclass(getattr(local, f.name)):  # a list of sections ([[tensor_parallel]])
            assert getattr(k8s, f.name) == getattr(local, f.name), f"[[{f.name}]] differs from configs/cluster.toml"
            continue
        mine, theirs = dataclasses.asdict(getattr(k8s, f.name)), dataclasses.asdict(getattr(local, f.name))
        for key, value in theirs.items():
            if key in ("host", "bind") or (f.name, key) in k8s_only:
                continue
            assert mine[key] == value, f"[{f.name}] {key}: {mine[key]!r} here, {value!r} in configs/cluster.toml"
    assert local.workers[0].port == k8s.workers[0].port
    for w in k8s.workers:
        assert (w.layer_start, w.layer_end) == (local.workers[0].layer_start, local.workers[0].layer_end)


# -- images, resources, security ----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_and_resources(overlay):
    for component, workload in workloads(overlay):
        container = container_of(workload)
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), f"{component}: requests for the scheduler"
        assert "cpu" not in resources.get("limits", {}), f"{component}: no CPU limit (throttling costs latency)"
        gpus = {k: v for part in ("requests", "limits") for k, v in resources.get(part, {}).items() if "gpu" in k}
        if component == "worker" and overlay == "gpu":
            assert container["image"] == CUDA_IMAGE
            assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["KUNSERVE__MODEL__DEVICE"] == "cuda"
        else:
            assert container["image"] == CPU_IMAGE, component
            assert not gpus, f"{overlay}: the {component} needs no GPU"
        assert container["imagePullPolicy"] == "IfNotPresent"


def test_pods_run_as_the_images_unprivileged_user():
    users = {rest for df in ("Dockerfile", "Dockerfile.cuda")
             for rest in re.findall(r"^USER\s+(\S+)", (ROOT / "docker" / df).read_text(), re.M)}
    assert len(users) == 1
    uid, gid = (int(x) for x in users.pop().split(":"))
    for overlay in OVERLAYS:
        for component, workload in workloads(overlay):
            pod = workload["spec"]["template"]["spec"]
            ctx = pod["securityContext"]
            assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (True, uid, gid, gid)
            assert pod["enableServiceLinks"] is False, f"{component}: no injected *_SERVICE_* variables"
            sec = container_of(workload)["securityContext"]
            assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
            if sec.get("readOnlyRootFilesystem"):
                mounted = {m["mountPath"] for m in container_of(workload)["volumeMounts"]}
                assert {"/tmp", "/home/kunserve"} <= mounted, f"{component}: writable home and /tmp"


def test_renderer_merges_like_kustomize():
    """The renderer's strategic merge: lists with a merge key merge by it, other lists and scalars are replaced."""
    base = {"spec": {"containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}],
                     "tolerations": [{"key": "t"}], "replicas": 2}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}],
                      "tolerations": [{"key": "u"}], "replicas": None}}
    assert strategic_merge(base, patch) == {"spec": {
        "containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}],
        "tolerations": [{"key": "u"}]}}


# -- the Grafana dashboard ----------------------------------------------------------------------------------------
DASHBOARD_FILE = ROOT / "deploy" / "grafana" / "kunserve-dashboard.json"
DATASOURCES_DIR = ROOT / "deploy" / "grafana" / "provisioning" / "datasources"
PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile", "label_values",
                    "clamp_min", "clamp_max", "max_over_time", "avg_over_time"}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
DASHBOARD = json.loads(DASHBOARD_FILE.read_text())


def documented_metrics() -> dict[str, str]:
    """Every metric family the services export, with its type: the README's metrics table."""
    return {name: m.kind for name, m in readme_metrics().items()}


def metric_references(expr: str) -> list[str]:
    """The metric names a PromQL expression selects; any other bare word (a misspelt function) fails the test."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    text = re.sub(r"(\blabel_values\([^,()]*),\s*\w+\)", r"\1)", text)  # label_values(metric, label)
    names = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = m.group(), text[m.end():].lstrip()
        if rest.startswith("("):
            assert word in PROMQL_FUNCTIONS, f"{expr}: unknown function {word}"
        elif word not in PROMQL_KEYWORDS:
            names.append(word)
    return names


def family_of(name: str, documented: dict[str, str]) -> tuple[str, str]:
    """(documented family, its type) of a selected series name: histograms select _bucket / _sum / _count."""
    if name in documented:
        return name, documented[name]
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and documented.get(base) == "histogram":
            return base, "histogram"
    raise AssertionError(f"{name} is not in the README's metrics table")


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query: panel targets, annotations, template variables."""
    for panel in DASHBOARD["panels"]:
        for t in panel.get("targets", []):
            yield f"panel {panel['title']!r} {t['refId']}", t["expr"]
    for ann in DASHBOARD["annotations"]["list"]:
        if "expr" in ann:
            yield f"annotation {ann['name']!r}", ann["expr"]
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']!r}", var["query"]["query"]


def test_dashboard_queries_only_documented_metrics_the_way_their_type_allows():
    documented = documented_metrics()
    used = set()
    for where, expr in dashboard_queries():
        assert expr.count("(") == expr.count(")"), f"{where}: unbalanced parentheses"
        names = metric_references(expr)
        assert names, f"{where}: selects no metric"
        for name in set(names):
            family, kind = family_of(name, documented)
            used.add(family)
            for m in re.finditer(re.escape(name) + r"(?![A-Za-z0-9_:])", expr):
                before = expr[:m.start()]
                if kind == "counter" or name.endswith("_bucket"):
                    assert re.search(r"\b(rate|increase)\($", before), f"{where}: {name} is a {kind}: rate() or increase()"
                else:
                    assert not re.search(r"\b(rate|increase)\($", before), f"{where}: {name} is a {kind}, not a counter"
                if name.endswith("_bucket"):
                    assert re.search(r"histogram_quantile\(\s*0?\.\d+\s*,\s*sum by \(le\b[^)]*\)\s*\(rate\($", before), \
                        f"{where}: quantiles of {family} sum its buckets by le"
    for family in ("kunserve:kv_cache_usage_perc", "kunserve:time_to_first_token_seconds",
                   "kunserve:inter_token_latency_seconds", "kunserve:num_requests_waiting", "kunserve:drops_total",
                   "kunserve:bubble_ratio"):
        assert family in used, f"the dashboard shows {family}"


def test_dashboard_is_a_well_formed_grafana_model():
    d = DASHBOARD
    assert d["uid"] == "kunserve" and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    (provisioned,) = [ds for f in sorted(DATASOURCES_DIR.glob("*.yaml"))
                      for ds in load_yaml_documents(f.read_text())[0]["datasources"]]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == provisioned["type"]
    assert variables["datasource"]["current"]["value"] == provisioned["uid"], "defaults to the provisioned Prometheus"
    ids, cells = set(), set()
    for panel in d["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat", "state-timeline", "bargauge", "gauge"), panel["type"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == panel["datasource"]
    for where, expr in dashboard_queries():
        for var in re.findall(r"\$\{?(\w+)", expr):
            assert var in variables or var in GRAFANA_VARIABLES, f"{where}: ${var} is not a dashboard variable"
    names = {a["name"] for a in d["annotations"]["list"]}
    assert {"Drops", "Restores"} <= names, "drop periods are marked on every time series"

