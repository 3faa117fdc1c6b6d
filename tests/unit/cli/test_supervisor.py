"""The local launcher's supervision policy, driven tick by tick over fake children (the real processes are
exercised in tests/integration/test_crash_safety.py)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from kunserve.cli.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeProc:
    code: int | None = None
    pid: int = 1

    def poll(self) -> int | None:
        return self.code


@dataclass
class FakeChild:
    name: str
    address: str = "127.0.0.1:1"
    log_path: pathlib.Path = pathlib.Path("/tmp/x.log")
    proc: FakeProc = field(default_factory=FakeProc)


class FakeCluster:
    def __init__(self, *names: str) -> None:
        self.children = [FakeChild(n) for n in names]
        self.spawned: list[str] = []
        self.killed: list[str] = []
        self.tls = None

    def child(self, name: str) -> FakeChild:
        return next(c for c in self.children if c.name == name)

    def spawn(self, name: str) -> None:
        self.spawned.append(name)
        self.child(name).proc = FakeProc(pid=len(self.spawned) + 1)

    def kill(self, name: str) -> None:
        self.killed.append(name)
        self.child(name).proc.code = -9


def test_backoff_doubles_up_to_the_cap():
    p = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [p.delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert p.delay(10_000) == 30


def _supervisor(cluster: FakeCluster, **policy) -> tuple[Supervisor, list[str]]:
    lines: list[str] = []
    sup = Supervisor(cluster, RestartPolicy(**policy), lines.append, probe_health=False)  # type: ignore[arg-type]
    return sup, lines


def test_an_exited_child_is_restarted_after_its_backoff_and_a_crash_loop_backs_off():
    cluster = FakeCluster("monitor", "worker-0")
    sup, lines = _supervisor(cluster, backoff_s=1.0, stable_s=60.0)
    t = 100.0
    for c in cluster.children:
        sup._check(c, t)  # type: ignore[arg-type]
    cluster.child("monitor").proc.code = 1
    sup._check(cluster.child("monitor"), t + 1)  # type: ignore[arg-type]
    assert cluster.spawned == [] and "monitor exited with code 1; restarting it in 1.0 s" in lines[-1]
    sup._check(cluster.child("monitor"), t + 1.5)  # type: ignore[arg-type]
    assert cluster.spawned == []
    sup._check(cluster.child("monitor"), t + 2.0)  # type: ignore[arg-type]
    assert cluster.spawned == ["monitor"] and sup.restarts("monitor") == 1
    cluster.child("monitor").proc.code = 1  # dies again at once: the next wait doubles
    sup._check(cluster.child("monitor"), t + 3.0)  # type: ignore[arg-type]
    assert "restarting it in 2.0 s" in lines[-1]
    sup._check(cluster.child("monitor"), t + 5.0)  # type: ignore[arg-type]
    assert cluster.spawned == ["monitor", "monitor"]
    cluster.child("monitor").proc.code = 1  # ...but after a stable run it starts from the base delay again
    sup._check(cluster.child("monitor"), t + 70.0)  # type: ignore[arg-type]
    assert "restarting it in 1.0 s" in lines[-1]
    assert "worker-0" not in cluster.spawned


def test_a_child_that_stops_answering_serving_is_killed(monkeypatch):
    import kunserve.cli.supervisor as supervisor

    answers = iter([True, False, False, False])
    monkeypatch.setattr(supervisor, "probe", lambda address, timeout_s, tls: next(answers))
    cluster = FakeCluster("worker-0")
    lines: list[str] = []
    sup = Supervisor(cluster, RestartPolicy(unhealthy_s=2.0, probe_interval_s=1.0), lines.append)  # type: ignore[arg-type]
    w = cluster.child("worker-0")
    sup._check(w, 10.0)  # type: ignore[arg-type]  # SERVING
    sup._check(w, 11.0)  # type: ignore[arg-type]  # not SERVING for 1 s: patience
    sup._check(w, 11.5)  # type: ignore[arg-type]  # not probed again within the interval
    assert cluster.killed == []
    sup._check(w, 12.5)  # type: ignore[arg-type]  # not SERVING for 2.5 s: killed
    assert cluster.killed == ["worker-0"] and "has not answered SERVING" in lines[-1]
