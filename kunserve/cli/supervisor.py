"""Supervision for the local launcher: a service that exits, or stops answering SERVING, is started again.

What compose's `restart: unless-stopped` and a Kubernetes liveness probe do for containers, `kunserve up`
does for its child processes, so a crash (a worker killed by the OOM killer, an engine that cannot continue
and reports NOT_SERVING, a monitor that died) is not the end of the cluster. Each restarted service
rebuilds its state from the others: the memory manager and the dispatcher from the workers, the monitor
from the workers' stats streams, a worker from its config and checkpoint.

`RestartPolicy.delay` is the pure part (exponential backoff, reset after a stable run); `Supervisor` is a
thread that applies it to a `LocalCluster`'s children. Liveness probes use the synchronous gRPC API: the
thread never shares an asyncio loop with its owner.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kunserve.shared.rpc import TLS

if TYPE_CHECKING:
    from kunserve.cli.launcher import Child, LocalCluster


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # the first restart waits this long, each one in a row twice as long...
    max_backoff_s: float = 30.0  # ...up to this
    stable_s: float = 60.0  # a child that ran this long counts as recovered: the next crash waits backoff_s again
    unhealthy_s: float = 10.0  # a child that was SERVING and has not answered SERVING for this long is restarted
    probe_interval_s: float = 1.0

    def delay(self, restarts_in_a_row: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** min(restarts_in_a_row, 16))


@dataclass
class _State:
    started_at: float
    restarts_in_a_row: int = 0
    restarts: int = 0
    due: float | None = None  # exited: when it will be started again
    last_serving: float | None = None  # last time its health answered SERVING (None: not yet since start)
    probed_at: float = 0.0


def probe(address: str, timeout_s: float = 1.0, tls: TLS | None = None) -> bool:
    """True when the service at `address` answers SERVING on the standard health service."""
    try:
        with (grpc.secure_channel(address, tls.channel_credentials()) if tls is not None
              else grpc.insecure_channel(address)) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class Supervisor:
    """Restarts the children of `cluster` that exit or stay unhealthy; `report` gets one line per action."""

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy | None = None,
                 report: Callable[[str], None] = print, probe_health: bool = True) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.report = report
        self.probe_health = probe_health
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._states: dict[str, _State] = {}
        self._tls = cluster.tls

    def start(self) -> None:
        now = time.monotonic()
        self._states = {c.name: _State(started_at=now, last_serving=now) for c in self.cluster.children}
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 45.0) -> None:  # longer than one kill's wait (30 s)
        """Stop supervising (before the cluster is stopped, so nothing is restarted while it stops)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def restarts(self, name: str) -> int:
        return self._states[name].restarts

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for child in list(self.cluster.children):
                # One child's trouble (a kill that timed out, a spawn that failed) is reported; the others
                # are still supervised, and the same child is tried again on the next round.
                try:
                    self._check(child, time.monotonic())
                except Exception as exc:
                    self.report(f"{child.name}: supervision step failed: {type(exc).__name__}: {exc}")

    def _check(self, child: Child, now: float) -> None:
        st = self._states.setdefault(child.name, _State(started_at=now))
        code = child.proc.poll() if child.proc is not None else None
        if child.proc is not None and code is None:
            if self.probe_health and now - st.probed_at >= self.policy.probe_interval_s:
                st.probed_at = now
                if probe(child.address, timeout_s=min(1.0, self.policy.probe_interval_s), tls=self._tls):
                    st.last_serving = now
                elif st.last_serving is not None and now - st.last_serving >= self.policy.unhealthy_s:
                    self.report(f"{child.name} has not answered SERVING for {now - st.last_serving:.0f} s; "
                                "killing it to restart it")
                    self.cluster.kill(child.name)
            return
        if st.due is None:
            if now - st.started_at >= self.policy.stable_s:
                st.restarts_in_a_row = 0
            delay = self.policy.delay(st.restarts_in_a_row)
            st.due = now + delay
            self.report(f"{child.name} exited with code {code}; restarting it in {delay:.1f} s "
                        f"(restart {st.restarts + 1}); log: {child.log_path}")
            return
        if now < st.due or self._stop.is_set():
            return
        self.cluster.spawn(child.name)
        st.restarts += 1
        st.restarts_in_a_row += 1
        st.started_at = now
        st.due = None
        st.last_serving = None  # probed as unhealthy only once it was SERVING again
        self.report(f"{child.name} restarted (pid {child.proc.pid if child.proc else '?'})")
