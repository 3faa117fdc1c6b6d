"""LocalCluster.start never leaks a child: a failing later Popen stops the ones already started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kunserve.cli import launcher
from kunserve.cli.launcher import Child, LocalCluster
from kunserve.shared.config import load_config

pytestmark = pytest.mark.timeout(60)


def test_a_failing_popen_stops_the_children_already_started(tmp_path, monkeypatch):
    cluster = LocalCluster(load_config(None, environ={}), run_dir=tmp_path)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    plan = [Child(f"c{i}", "127.0.0.1:1", sleeper, tmp_path / f"c{i}.log") for i in range(4)]
    monkeypatch.setattr(cluster, "_plan", lambda: plan)
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        if len(started) == 2:
            raise OSError("no more processes")
        p = real_popen(*args, **kwargs)
        started.append(p)
        return p

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    try:
        with pytest.raises(OSError, match="no more processes"):
            cluster.start(timeout_s=5)
        assert len(started) == 2
        assert all(p.poll() is not None for p in started)  # stopped, not leaked
        assert cluster.children == []
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
