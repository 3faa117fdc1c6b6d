"""The local launcher: every service as a child process on 127.0.0.1, from one cluster config.

`LocalCluster` is also what the integration tests use, so the README's `kunserve up` and the tests
exercise exactly the same process layout. Children get SIGTERM when the launcher dies (PDEATHSIG, set by each child),
so no test or Ctrl-C leaves a stray process behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kunserve.cli.supervisor import RestartPolicy, Supervisor
from kunserve.shared import credentials
from kunserve.shared.config import ClusterConfig, WorkerSection
from kunserve.shared.process import PARENT_PID_ENV
from kunserve.shared.rpc import health_check

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """An unused loopback port *outside* the kernel's ephemeral range: a port there, free when checked, can be
    taken by any outgoing connection (some service's client socket) before its service binds it — seen as a
    worker that never came up. Ports this process already handed out are not reused."""
    lo, hi = _ephemeral_range()
    ranges = [r for r in ((10000, min(lo, 30000)), (max(hi + 1, 61000), 65535)) if r[1] - r[0] > 100]
    rng = random.Random()
    for _ in range(200):
        a, b = rng.choice(ranges) if ranges else (1024, 65535)
        port = rng.randrange(a, b)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # everything busy: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assign_free_ports(cfg: ClusterConfig) -> None:
    """Give every service an unused loopback port (tests and side-by-side clusters), and its metrics endpoint one
    where it has one. Workers' UCX listeners get one too: an ephemeral one picked at start-up could take a port
    assigned here to a service that has not bound it yet."""
    for svc in [cfg.dispatcher, cfg.memory_manager, cfg.monitor, *cfg.workers]:
        svc.port = free_port()
        svc.host = "127.0.0.1"
        if svc.metrics_port:
            svc.metrics_port = free_port()
    if cfg.dispatcher.http_port:
        cfg.dispatcher.http_port = free_port()
    for w in cfg.workers:
        w.transfer_port = free_port()
    for tp in cfg.tensor_parallel:  # the rendezvous of each tensor-parallel instance
        tp.port = free_port()


def standby_sections(cfg: ClusterConfig, n: int, *, free_ports: bool = False) -> list[WorkerSection]:
    """n standby workers (``kunserve up --standby N``): ids after the configured ones (worker-2, worker-3, ... for two
    seeds), on the ports after theirs, or on unused ports; the first worker's model layout (the whole model)."""
    taken = {w.id for w in cfg.workers}
    template = cfg.workers[0]
    last = cfg.workers[-1]
    out: list[WorkerSection] = []
    i = len(cfg.workers)
    while len(out) < n:
        wid = f"worker-{i}"
        i += 1
        if wid in taken:
            continue
        k = len(out) + 1
        out.append(WorkerSection(
            id=wid, host=template.host, bind=template.bind,
            port=free_port() if free_ports else last.port + k,
            metrics_port=(free_port() if free_ports else last.metrics_port + k) if template.metrics_port else 0,
            transfer_port=(free_port() if free_ports else last.transfer_port + k) if template.transfer_port or free_ports
            else 0))
    return out


@dataclass
class Child:
    name: str
    address: str
    argv: list[str]
    log_path: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None

    def exit_code(self) -> int | None:
        """The exit status once the process has ended; None while it runs or before it was started."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ClusterStartError(RuntimeError):
    pass


class LocalCluster:
    """Start, health-check and stop a whole cluster of service processes."""

    def __init__(self, cfg: ClusterConfig, run_dir: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, standby: Sequence[WorkerSection] = ()) -> None:
        """`standby`: standby workers to start beside the configured ones (standby_sections); they load the model and
        wait for the local scaler (autoscale.scaler = "local") to activate them."""
        self.cfg = cfg
        self.standby = list(standby)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not run_dir:
            self._tmp = tempfile.TemporaryDirectory(prefix="kunserve-")
            run_dir = self._tmp.name
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "cluster.toml"
        self.env = {**os.environ, **(env or {})}
        self.children: list[Child] = []
        self.supervisor: Supervisor | None = None

    # -- layout -------------------------------------------------------------------------------------
    def _plan(self) -> list[Child]:
        py = sys.executable
        cfg_arg = ["--config", str(self.config_path)]
        logs = self.run_dir
        out = [
            Child("monitor", self.cfg.monitor.address, [py, "-m", "kunserve.services.monitor", *cfg_arg], logs / "monitor.log"),
        ]
        for w in self.cfg.workers:
            out.append(Child(w.id, w.address, [py, "-m", "kunserve.services.worker", *cfg_arg, "--worker-id", w.id],
                             logs / f"{w.id}.log"))
        for w in self.standby:
            out.append(Child(w.id, w.address, [
                py, "-m", "kunserve.services.worker", *cfg_arg, "--worker-id", w.id, "--standby", "--host", w.host,
                "--port", str(w.port), "--transfer-port", str(w.transfer_port), "--metrics-port", str(w.metrics_port)],
                logs / f"{w.id}.log"))
        out.append(Child("memory-manager", self.cfg.memory_manager.address,
                         [py, "-m", "kunserve.services.memory_manager", *cfg_arg], logs / "memory-manager.log"))
        out.append(Child("dispatcher", self.cfg.dispatcher.address,
                         [py, "-m", "kunserve.services.dispatcher", *cfg_arg], logs / "dispatcher.log"))
        return out

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    # -- lifecycle ------------------------------------------------------------------------------------
    def _child_env(self) -> dict[str, str]:
        env = dict(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.pop("KUNSERVE_CONFIG", None)  # the written file is the one truth for the children
        for kind in credentials.KINDS:  # ...and names every credential file (write_credentials)
            env.pop(kind.env, None)
        env[PARENT_PID_ENV] = str(os.getpid())
        return env

    def write_credentials(self) -> None:
        """Give the cluster its credentials: one the config names stays; else the one in the environment (so
        tools that read it agree), else a new one (not for the API key: without one the client API is open),
        written to a file in the run dir (mode 0600) that the config written for the children names. The
        user's default files (~/.kunserve) are never touched here: many clusters (the tests) run side by side."""
        sec = self.cfg.security
        for kind in credentials.KINDS:
            if getattr(sec, kind.config_key):
                continue
            token = self.env.get(kind.env) or (credentials.new_token() if kind.default_file else None)
            if token is None:
                continue
            path = self.run_dir / kind.name.lower().replace(" ", "-")
            path.unlink(missing_ok=True)  # a run dir used again gets fresh credentials
            credentials.write_token(path, token)
            setattr(sec, kind.config_key, str(path))

    @property
    def tls(self):
        """The cluster's TLS (None: plaintext), for this process's health checks."""
        return credentials.load_tls(self.cfg.security)

    def start(self, timeout_s: float = 120.0, progress=None) -> None:
        self.write_credentials()
        for tp in self.cfg.tensor_parallel:  # port 0: the launcher picks the instance's rendezvous port
            if tp.port == 0:
                tp.port = free_port()
        self.config_path.write_text(self.cfg.to_toml())
        env = self._child_env()
        # Any failure (a later Popen, a log file that cannot be opened, Ctrl-C, a child that never gets
        # healthy) stops every child started so far: nothing leaks.
        try:
            for c in self._plan():
                self.children.append(c)  # before Popen: stop() skips it while c.proc is None
                self._popen(c, env)
            asyncio.run(self._wait_healthy(timeout_s, progress))
        except BaseException:
            self.stop()
            raise

    async def _wait_healthy(self, timeout_s: float, progress) -> None:
        deadline = time.monotonic() + timeout_s
        tls = self.tls
        pending = {c.name: c for c in self.children}
        while pending:
            for c in list(pending.values()):
                code = c.exit_code()
                if code is not None:
                    raise ClusterStartError(f"{c.name} exited with code {code} while starting; "
                                            f"last lines of {c.log_path}:\n{c.log_tail()}")
            results = await asyncio.gather(*(health_check(c.address, timeout=0.5, tls=tls) for c in pending.values()))
            for c, ok in zip(list(pending.values()), results):
                if ok:
                    del pending[c.name]
                    if progress is not None:
                        progress(c)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(f"not healthy after {timeout_s:.0f}s: {', '.join(pending)} "
                                        f"(logs in {self.run_dir})")
            await asyncio.sleep(0.2)

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.exit_code() is not None]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Fault injection for tests: signal one service process."""
        c = self.child(name)
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(sig)
            c.proc.wait(timeout=30)

    @staticmethod
    def _popen(c: Child, env: dict[str, str]) -> None:
        with open(c.log_path, "ab") as fh:
            c.proc = subprocess.Popen(c.argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def spawn(self, name: str) -> None:
        """Start one (exited) service again with the same command, config and log file; does not wait."""
        self._popen(self.child(name), self._child_env())

    def supervise(self, policy: RestartPolicy | None = None, report: Callable[[str], None] = print) -> Supervisor:
        """Restart services that exit or stop answering SERVING (with backoff), until stop()."""
        self.supervisor = Supervisor(self, policy, report)
        self.supervisor.start()
        return self.supervisor

    def restart(self, name: str, timeout_s: float = 60.0, sig: int = signal.SIGKILL) -> None:
        """Kill one service (SIGKILL by default: a crash) and start it again with the same command and config,
        then wait until it is healthy: the way tests check that a service rebuilds its state."""
        c = self.child(name)
        self.kill(name, sig)
        self.spawn(name)
        deadline = time.monotonic() + timeout_s
        while not asyncio.run(health_check(c.address, timeout=0.5, tls=self.tls)):
            if (code := c.exit_code()) is not None:
                raise ClusterStartError(f"{name} exited with code {code} after a restart; "
                                        f"last lines of {c.log_path}:\n{c.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterStartError(f"{name} not healthy {timeout_s:.0f}s after a restart")
            time.sleep(0.2)

    def stop(self, grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM everything (dispatcher first so clients get a clear status), then SIGKILL stragglers. The grace
        outlasts a service's own bounded stop (a worker: its deregistration, the engine thread's last step, transfer
        links still opening and the gRPC server's grace, up to 5 s each), which is quick unless the machine is loaded
        or a peer is stopping too; only a process stuck beyond that is killed."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        for c in reversed(self.children):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=10)
            codes[c.name] = c.proc.returncode
        self.children = []
        return codes

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def with_workers(cfg: ClusterConfig, n: int) -> None:
    """Replace the configured workers with n identical ones on consecutive ports (metrics ports too, unless off)."""
    template = cfg.workers[0] if cfg.workers else WorkerSection(port=50061)
    base_port = template.port or 50061
    metrics = template.metrics_port
    cfg.workers = [dataclasses.replace(template, id=f"worker-{i}", port=base_port + i,
                                       metrics_port=metrics + i if metrics else 0) for i in range(n)]
