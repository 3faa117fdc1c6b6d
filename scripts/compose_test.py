#!/usr/bin/env python3
"""`make compose-test`: build the images, run compose.yaml for real, and check a generation end to end.

Not part of `make test`: it needs Docker (and root to start a private daemon). What it does:

 1. finds a Docker daemon; when none answers, starts a private `dockerd` (data in .cache/compose-test/docker,
    so a second run reuses images and build cache) and stops it at the end, by its PID;
 2. makes sure the Dockerfiles' base image exists: pulls it, and where no registry is reachable imports a
    local stand-in (a debootstrapped Debian bookworm with python3 3.11, tagged python:3.11-slim);
 3. fills a wheelhouse on the host (.cache/compose-test/wheelhouse: the CPU build of torch and the other
    dependencies, fetched with the host's pip settings) and serves it to the build over HTTP on the Docker
    bridge, passed as the Dockerfile's optional PIP_EXTRA_ARGS build argument — the Dockerfiles stay what
    a user builds;
 4. runs the reference: the same prompt through `kunserve up` (LocalCluster, same config, same engine);
 5. `compose build`, `compose up -d`, waits until every container is healthy, streams a generation from
    the host (the published client port) and from a client container (over the compose network), checks
    `kunctl status` on the admin port, checks the tokens equal the reference;
 6. `compose stop` (every service must exit 0 on SIGTERM), `compose down`, stops what it started.

Every wait is bounded. Exit status 0 only when everything passed.
Environment: KUNSERVE_COMPOSE_TEST_NO_APT=1 never apt-get installs missing tools;
DEBIAN_MIRROR for the stand-in base image (default: the Debian mirror this machine's own apt uses).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import ipaddress
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "compose-test"
SECRETS = CACHE / "secrets"
COMPOSE_FILE = ROOT / "compose.yaml"
CONFIG_FILE = ROOT / "configs" / "cluster.toml"
PROJECT = "kunserve-compose-test"
TAG = "compose-test"
BIN = pathlib.Path(sys.executable).parent  # the venv's console scripts (kunserve, kunctl)
PROMPT_IDS = "1,2,3"
MAX_TOKENS = 8
SERVICES = ["monitor", "worker-0", "worker-1", "memory-manager", "dispatcher"]
STANDIN_LABEL = "org.kunserve.compose-test.stand-in"

T0 = time.monotonic()


class Failure(RuntimeError):
    pass


def log(msg: str) -> None:
    try:
        print(f"[compose-test {time.monotonic() - T0:6.1f}s] {msg}", flush=True)
    except OSError:  # stdout gone (e.g. piped into head): keep going, the cleanup must still run
        pass


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, check: bool = True,
        capture: bool = False, quiet: bool = False, cwd: pathlib.Path = ROOT,
        log_file: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Run a command with a time limit; `log_file` sends its output there (its tail is shown on failure)."""
    if not quiet:
        log("$ " + shlex.join(str(c) for c in cmd) + (f"  > {log_file.relative_to(ROOT)}" if log_file else ""))
    out_fh = open(log_file, "w") if log_file else None
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, timeout=timeout, text=True,
                              stdin=subprocess.DEVNULL,
                              stdout=out_fh or (subprocess.PIPE if capture else None),
                              stderr=subprocess.STDOUT if (capture or out_fh) else None)
    except subprocess.TimeoutExpired:
        raise Failure(f"timed out after {timeout:.0f}s: {shlex.join(str(c) for c in cmd)}") from None
    finally:
        if out_fh:
            out_fh.close()
    if check and proc.returncode != 0:
        out = f"\n{proc.stdout.strip()}" if capture and proc.stdout else ""
        if log_file:
            out = "\n" + "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        raise Failure(f"exit {proc.returncode}: {shlex.join(str(c) for c in cmd)}{out}")
    return proc


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_zombie(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def stop_pid(pid: int, name: str, timeout: float = 30.0) -> None:
    """SIGTERM one process we started, SIGKILL it after `timeout`."""
    if not pid_alive(pid):
        return
    log(f"stopping {name} (pid {pid})")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid) or _is_zombie(pid):
            return
        time.sleep(0.2)
    log(f"{name} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# -- tools ----------------------------------------------------------------------------------------------
def apt_install(packages: list[str]) -> None:
    if os.environ.get("KUNSERVE_COMPOSE_TEST_NO_APT") or os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Failure(f"missing tools; install the Debian/Ubuntu packages {' '.join(packages)} "
                      "(apt-get install " + " ".join(packages) + ")")
    log(f"installing missing tools: apt-get install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], timeout=300, env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], timeout=900, env=env)


def docker_cli() -> str:
    # Debian's own client (docker.io) matches its daemon and can build; any client does for the rest.
    for cand in ("/usr/bin/docker", shutil.which("docker")):
        if cand and os.access(cand, os.X_OK):
            return cand
    apt_install(["docker.io"])
    return "/usr/bin/docker"


def compose_cli(docker: str, env: dict[str, str]) -> list[str]:
    """Compose v2 (`docker compose`) when present, else Compose v1 (`docker-compose`)."""
    for cand in [[docker, "compose"], [shutil.which("docker") or docker, "compose"]]:
        if run([*cand, "version"], timeout=30, env=env, check=False, capture=True, quiet=True).returncode == 0:
            return cand
    if not shutil.which("docker-compose"):
        apt_install(["docker-compose"])
    return ["docker-compose"]


# -- the daemon -----------------------------------------------------------------------------------------
class Daemon:
    """The Docker daemon to use: an already running one, or a private dockerd that we stop by PID."""

    def __init__(self, docker: str) -> None:
        self.docker = docker
        self.env = dict(os.environ)
        self.proc: subprocess.Popen | None = None
        self.tmp: str | None = None
        self.had_docker0 = pathlib.Path("/sys/class/net/docker0").exists()
        self.pidfile = CACHE / "dockerd.pid"
        self.data_root = CACHE / "docker"

    def answers(self, timeout: float = 15) -> bool:
        return run([self.docker, "info", "--format", "{{.ServerVersion}}"], timeout=timeout, env=self.env,
                   check=False, capture=True, quiet=True).returncode == 0

    def start(self) -> None:
        if self.answers():
            log(f"using the running Docker daemon ({self.env.get('DOCKER_HOST', 'default socket')})")
            return
        if os.geteuid() != 0:
            raise Failure("no Docker daemon answers and starting a private one needs root")
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            apt_install(["docker.io"])
            dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        self._stop_stale()
        self.tmp = tempfile.mkdtemp(prefix="kct-", dir="/tmp")  # short: socket paths live under it
        sock = f"unix://{self.tmp}/docker.sock"
        self.data_root.mkdir(parents=True, exist_ok=True)
        logf = open(CACHE / "dockerd.log", "ab")
        cmd = [dockerd, "--data-root", str(self.data_root), "--exec-root", f"{self.tmp}/exec",
               "--pidfile", str(self.pidfile), "-H", sock]
        log("starting a private Docker daemon: " + shlex.join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        logf.close()
        self.env["DOCKER_HOST"] = sock
        deadline = time.monotonic() + 60
        while not self.answers(timeout=5):
            if self.proc.poll() is not None:
                raise Failure(f"dockerd exited with {self.proc.returncode}; see {CACHE / 'dockerd.log'}")
            if time.monotonic() > deadline:
                raise Failure(f"dockerd did not answer within 60s; see {CACHE / 'dockerd.log'}")
            time.sleep(0.5)
        log(f"private dockerd is up (pid {self.proc.pid})")

    def _stop_stale(self) -> None:
        """A private dockerd left by an interrupted run holds the data root: stop it (its PID file says which)."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        if pid_alive(pid) and "dockerd" in cmdline(pid) and str(self.data_root) in cmdline(pid):
            log(f"a private dockerd from an interrupted run is still up (pid {pid})")
            stop_pid(pid, "stale dockerd")

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid, "private dockerd")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            # dockerd stops the containerd it started; should it have been killed, stop that one too.
            if self.tmp:
                for p in pathlib.Path("/proc").iterdir():
                    if p.name.isdigit() and f"{self.tmp}/" in cmdline(int(p.name)):
                        stop_pid(int(p.name), "containerd of the private dockerd", timeout=10)
            if not self.had_docker0 and pathlib.Path("/sys/class/net/docker0").exists():
                run(["ip", "link", "delete", "docker0"], timeout=30, check=False)
            self.proc = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


# -- base image -------------------------------------------------------------------------------------------
def base_images() -> list[str]:
    """The external images docker/Dockerfile starts from (not its own stages)."""
    out: list[str] = []
    stages: set[str] = set()
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].upper() == "FROM":
            if parts[1] not in stages and parts[1] not in out:
                out.append(parts[1])
            if len(parts) >= 4 and parts[2].upper() == "AS":
                stages.add(parts[3])
    return out


def ensure_base_image(d: Daemon, image: str) -> None:
    if run([d.docker, "image", "inspect", image], timeout=30, env=d.env, check=False, capture=True,
           quiet=True).returncode == 0:
        log(f"base image {image} is present")
        return
    if run([d.docker, "pull", image], timeout=300, env=d.env, check=False).returncode == 0:
        return
    if image != "python:3.11-slim":
        raise Failure(f"cannot pull {image} and there is no local stand-in for it")
    log(f"no registry reachable: importing a local stand-in for {image} (Debian bookworm, python3 3.11)")
    tarball = CACHE / "python-3.11-slim-standin.tar"
    if not tarball.exists():
        build_standin_rootfs(tarball)
    run([d.docker, "import",
         "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "--change", "ENV LANG=C.UTF-8",
         "--change", f"LABEL {STANDIN_LABEL}=true",
         "--change", 'CMD ["python3"]',
         str(tarball), image], timeout=300, env=d.env)


def apt_debian_mirror(apt_dir: pathlib.Path = pathlib.Path("/etc/apt")) -> str:
    """The Debian archive this machine's apt is configured with (deb822 ``*.sources`` or one-line
    ``sources.list``): a machine that can only reach its own mirror builds the stand-in image from it."""
    candidates: list[str] = []
    for f in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        for stanza in f.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in stanza.splitlines()
                          if ":" in line and not line.startswith(("#", " ")))
            suites = fields.get("Suites", "").split()
            if fields.get("Types", "").split().count("deb") and any(not x.endswith("-security") for x in suites):
                candidates.extend(fields.get("URIs", "").split())
    for f in [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]:
        if f.is_file():
            for line in f.read_text().splitlines():
                parts = [x for x in line.split() if not x.startswith("[")] if line.startswith("deb ") else []
                if len(parts) >= 3 and not parts[2].endswith("-security"):
                    candidates.append(parts[1])
    for uri in candidates:
        if uri.startswith(("http://", "https://")):
            return uri
    raise SystemExit(f"no Debian mirror in {apt_dir}/sources.list(.d): set DEBIAN_MIRROR")


def build_standin_rootfs(tarball: pathlib.Path) -> None:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        apt_install(["debootstrap"])
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    mirror = os.environ.get("DEBIAN_MIRROR") or apt_debian_mirror()
    with tempfile.TemporaryDirectory(prefix="kct-rootfs-", dir=CACHE) as tmp:
        rootfs = pathlib.Path(tmp) / "rootfs"
        run([debootstrap, "--variant=minbase",
             "--include=python3,python3-venv,python-is-python3,passwd,ca-certificates,netbase",
             "bookworm", rootfs, mirror], timeout=900, log_file=CACHE / "debootstrap.log")
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / sub).glob("*"):
                if f.is_file():
                    f.unlink()
        partial = tarball.with_suffix(".partial")
        run(["tar", "-C", rootfs, "--numeric-owner", "-cf", partial, "."], timeout=300)
        partial.rename(tarball)


# -- wheelhouse -------------------------------------------------------------------------------------------
def project_requirements() -> tuple[list[str], list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(data["project"]["dependencies"]), list(data["build-system"]["requires"])


def fill_wheelhouse() -> pathlib.Path:
    """The image's dependencies as wheels for Linux / CPython 3.11, fetched with the host's pip settings."""
    wh = CACHE / "wheelhouse"
    wh.mkdir(parents=True, exist_ok=True)
    deps, build_reqs = project_requirements()
    constraints = (ROOT / "constraints.txt").read_text()
    stamp_value = hashlib.sha256(json.dumps([deps, build_reqs, constraints]).encode()).hexdigest()
    stamp = wh / ".stamp"
    if stamp.exists() and stamp.read_text() == stamp_value:
        log(f"wheelhouse is up to date ({wh})")
        return wh
    log(f"filling the wheelhouse {wh.relative_to(ROOT)} with the image's dependencies (host pip settings)")
    pip = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--progress-bar", "off", "-d", str(wh),
           "-c", str(ROOT / "constraints.txt")]
    if sys.version_info[:2] != (3, 11):  # the image's Python is 3.11
        pip += ["--python-version", "3.11", "--only-binary=:all:"]
    torch = [r for r in deps if r.replace(" ", "").startswith("torch")]
    if torch:
        # The CPU build of torch: from the host's own find-links when it has one, else PyTorch's CPU index.
        got = run([*pip, "--no-deps", "--no-index", *torch], timeout=600, check=False, capture=True)
        if got.returncode != 0 or not any("+cpu" in f.name for f in wh.glob("torch-*.whl")):
            run([*pip, "--no-deps", "--index-url", "https://download.pytorch.org/whl/cpu", *torch], timeout=1800,
                capture=True)
    done = run([*pip, "--find-links", str(wh), *deps, *build_reqs], timeout=1800, capture=True)
    log(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "pip download: done")
    stamp.write_text(stamp_value)
    return wh


class WheelServer:
    """Serves the wheelhouse over HTTP on the Docker bridge's gateway, for the image build only.

    A fixed port where free: the URL is part of a build argument, and a build argument that changes
    invalidates the build cache of every RUN step after it.
    """

    PORT = 47611

    def __init__(self, directory: pathlib.Path, host: str) -> None:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        try:
            self.server = http.server.ThreadingHTTPServer((host, self.PORT), handler)
        except OSError:
            self.server = http.server.ThreadingHTTPServer((host, 0), handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


def bridge_gateway(d: Daemon) -> str:
    """The host's address on the default bridge, which build containers reach."""
    deadline = time.monotonic() + 20
    while True:
        out = run([d.docker, "network", "inspect", "bridge", "--format",
                   "{{range .IPAM.Config}}{{.Gateway}} {{.Subnet}}{{end}}"],
                  timeout=30, env=d.env, capture=True, quiet=True, check=False).stdout.split()
        if out and "." in out[0] and "/" not in out[0]:
            return out[0]
        if out and "/" in out[0]:  # a fresh daemon may list the subnet before the gateway: take its .1
            return str(next(ipaddress.ip_network(out[0], strict=False).hosts()))
        if time.monotonic() > deadline:
            raise Failure("cannot find the gateway address of the Docker bridge network")
        time.sleep(0.5)


# -- generation -------------------------------------------------------------------------------------------
def parse_generation(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise Failure(f"no JSON object in the output of kunserve generate:\n{text}")


def generate_cmd(address: str) -> list[str]:
    return ["generate", "--address", address, "--token-ids", PROMPT_IDS, "--max-tokens", str(MAX_TOKENS),
            "--json", "--timeout", "60"]


def generate_with_retries(cmd: list[str], env: dict[str, str], what: str, within_s: float = 90.0) -> dict:
    """Right after start-up the dispatcher may not have seen a healthy worker yet: retry for a while."""
    deadline = time.monotonic() + within_s
    while True:
        proc = run(cmd, timeout=120, env=env, check=False, capture=True)
        if proc.returncode == 0:
            res = parse_generation(proc.stdout)
            log(f"{what}: token ids {res.get('token_ids')} (worker {res.get('worker_id')}, "
                f"finish {res.get('finish_reason')})")
            return res
        if time.monotonic() > deadline:
            raise Failure(f"{what} failed (exit {proc.returncode}):\n{proc.stdout}")
        log(f"{what}: not yet ({proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.returncode}); retrying")
        time.sleep(2)


def reference_generation() -> dict:
    """The same prompt through `kunserve up`'s LocalCluster: same config file, same engine, on the host."""
    from kunserve.cli.launcher import LocalCluster, assign_free_ports
    from kunserve.shared.config import load_config

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNSERVE_")}
    cfg = load_config(CONFIG_FILE, environ=env)
    assign_free_ports(cfg)
    log(f"reference: starting the local cluster from {CONFIG_FILE.relative_to(ROOT)} on free ports")
    with tempfile.TemporaryDirectory(prefix="kct-ref-") as run_dir:
        cluster = LocalCluster(cfg, run_dir=run_dir, env=env)
        try:
            cluster.start(timeout_s=180)
            return generate_with_retries([BIN / "kunserve", *generate_cmd(cfg.dispatcher.address)],
                                         env, "reference (kunserve up on the host)", within_s=60)
        except BaseException:
            for log_path in sorted(pathlib.Path(run_dir).glob("*.log")):
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                log(f"reference: last lines of {log_path.name}:\n" + "\n".join(tail))
            raise
        finally:
            cluster.stop()


# -- compose ----------------------------------------------------------------------------------------------
class Compose:
    def __init__(self, cli: list[str], env: dict[str, str]) -> None:
        self.cli = [*cli, "-f", str(COMPOSE_FILE), "-p", PROJECT]
        self.env = env

    def __call__(self, *args: str, timeout: float, **kw) -> subprocess.CompletedProcess:
        return run([*self.cli, *args], timeout=timeout, env=self.env, **kw)


def wait_healthy(d: Daemon, compose: Compose, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        ids = compose("ps", "-q", timeout=60, capture=True, quiet=True).stdout.split()
        states = {}
        if ids:
            fmt = "{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}"
            out = run([d.docker, "inspect", "--format", fmt, *ids], timeout=60, env=d.env, capture=True,
                      quiet=True).stdout
            for line in out.split("\n"):
                if line.strip():
                    name, status, health = line.split()
                    states[name.lstrip("/")] = (status, health)
        summary = ", ".join(f"{n.removeprefix(PROJECT + '_').removeprefix(PROJECT + '-')}={h}"
                            for n, (_, h) in sorted(states.items()))
        if summary != last:
            log(f"health: {summary}")
            last = summary
        dead = [n for n, (s, _) in states.items() if s in ("exited", "dead")]
        if dead:
            raise Failure(f"containers exited: {', '.join(dead)}")
        if len(states) >= len(SERVICES) and all(h == "healthy" for _, h in states.values()):
            return
        if time.monotonic() > deadline:
            raise Failure(f"not every container was healthy within {timeout_s:.0f}s: {summary}")
        time.sleep(1)


def check_containers(d: Daemon, compose: Compose) -> None:
    """Non-root user, an init process as PID 1 (so SIGTERM reaches the service)."""
    uid = compose("exec", "-T", "dispatcher", "id", "-u", timeout=60, capture=True).stdout.strip()
    init = compose("exec", "-T", "dispatcher", "cat", "/proc/1/cmdline", timeout=60, capture=True).stdout
    init = init.replace("\0", " ").strip()
    log(f"dispatcher container: uid {uid}, PID 1 = {init!r}")
    if uid == "0":
        raise Failure("the services run as root")
    if "kunserve" in init.split()[0]:
        raise Failure("PID 1 is the service itself, not an init process")


def stop_and_check_exit_codes(d: Daemon, compose: Compose) -> None:
    ids = compose("ps", "-q", timeout=60, capture=True, quiet=True).stdout.split()
    compose("stop", "-t", "20", timeout=180)
    out = run([d.docker, "inspect", "--format", "{{.Name}} {{.State.ExitCode}}", *ids], timeout=60, env=d.env,
              capture=True, quiet=True).stdout
    codes = dict(line.split() for line in out.strip().splitlines())
    log("exit codes after SIGTERM: " + ", ".join(f"{k.lstrip('/')}={v}" for k, v in sorted(codes.items())))
    bad = {k: v for k, v in codes.items() if v != "0"}
    if bad:
        raise Failure(f"services did not exit cleanly on SIGTERM: {bad}")


def run_cluster(daemon: Daemon, compose: Compose, client_port: int, admin_port: int,
                stack: contextlib.ExitStack) -> None:
    env = compose.env
    # The reference first, alone, so that the host cluster and the containers do not share the CPU.
    reference = reference_generation()

    stack.callback(_safely(lambda: compose("down", "--remove-orphans", "--volumes", "-t", "20",
                                           timeout=300, check=False), "compose down"))
    try:
        compose("up", "-d", *SERVICES, timeout=420)
        wait_healthy(daemon, compose)
        check_containers(daemon, compose)
        from_host = generate_with_retries(
            [BIN / "kunserve", *generate_cmd(f"127.0.0.1:{client_port}")], env,
            f"compose, from the host (127.0.0.1:{client_port})")
        from_client = generate_with_retries(
            [*compose.cli, "run", "--rm", "--no-deps", "-T", "dispatcher", "kunserve",
             *generate_cmd("dispatcher:50051")], env, "compose, from a client container (dispatcher:50051)")
        status = run([BIN / "kunctl", "--address", f"127.0.0.1:{admin_port}", "--token-file",
                      SECRETS / "admin-token", "status"], timeout=60,
                     env=env, capture=True)
        print(status.stdout.rstrip(), flush=True)
        stop_and_check_exit_codes(daemon, compose)
    except BaseException:
        with contextlib.suppress(Exception):
            compose("logs", "--no-color", "--tail", "30", timeout=60, check=False)
        raise

    want = reference["token_ids"]
    for what, res in [("from the host", from_host), ("from a client container", from_client)]:
        if res["token_ids"] != want:
            raise Failure(f"compose generation {what} {res['token_ids']} != reference {want}")
    log(f"tokens match the reference engine (kunserve up on the host): {want}")


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup below


def _safely(fn, what: str):
    def call() -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - cleanup goes on with the next step
            log(f"cleanup: {what} failed: {exc}")
    return call


def main(argv: list[str]) -> int:
    build_only = "--build-only" in argv  # stop after building the images (while iterating on the Dockerfile)
    signal.signal(signal.SIGTERM, _on_sigterm)
    CACHE.mkdir(parents=True, exist_ok=True)
    lock = open(CACHE / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        log(f"FAILED: another compose-test run holds {CACHE / 'lock'}")
        return 1
    # The reference and the containers must see the same config: no KUNSERVE_* overrides from this shell.
    for key in sorted(k for k in os.environ if k.startswith("KUNSERVE")):
        log(f"ignoring {key} from the environment")
        del os.environ[key]
    ok = False
    with contextlib.ExitStack() as stack:
        try:
            docker = docker_cli()
            daemon = Daemon(docker)
            stack.callback(_safely(daemon.stop, "stopping the Docker daemon"))
            daemon.start()
            for image in base_images():
                ensure_base_image(daemon, image)
            wheelhouse = fill_wheelhouse()
            server = WheelServer(wheelhouse, bridge_gateway(daemon))
            stack.callback(_safely(server.stop, "stopping the wheelhouse server"))
            log(f"serving the wheelhouse to the build at {server.url}")

            from kunserve.cli.launcher import free_port

            client_port, admin_port = free_port(), free_port()
            env = {k: v for k, v in daemon.env.items() if not k.startswith("KUNSERVE")}
            env.update(KUNSERVE_TAG=TAG, KUNSERVE_CLIENT_PORT=str(client_port), KUNSERVE_ADMIN_PORT=str(admin_port),
                       KUNSERVE_SECRETS_DIR=str(SECRETS))
            from kunserve.cli.secrets import write_compose_secrets

            write_compose_secrets(SECRETS)  # the compose Secrets: cluster secret, admin token
            cli = compose_cli(docker, env)
            if cli == ["docker-compose"]:  # v1 builds through the API itself, with the classic builder
                env.update(COMPOSE_DOCKER_CLI_BUILD="0", DOCKER_BUILDKIT="0")
            compose = Compose(cli, env)
            compose("down", "--remove-orphans", "-t", "5", timeout=180)  # leftovers of an interrupted run

            host = server.url.split("//")[1].split(":")[0]
            compose("build", "--build-arg", "TORCH_INDEX_URL=",
                    "--build-arg", f"PIP_EXTRA_ARGS=--no-index --find-links {server.url} --trusted-host {host}",
                    *SERVICES, timeout=1800, log_file=CACHE / "build.log")
            if build_only:
                log("images built (--build-only)")
            else:
                run_cluster(daemon, compose, client_port, admin_port, stack)
            ok = True
        except Failure as exc:
            log(f"FAILED: {exc}")
        finally:
            log("cleaning up")
        # ExitStack: compose down, then the wheelhouse server, then the private daemon (by PID).
    log(f"{'PASSED' if ok else 'FAILED'} in {time.monotonic() - T0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
