"""Fixtures that start a real cluster (separate service processes on 127.0.0.1, free ports) and stop it.

Every wait is bounded; the cluster is stopped (SIGTERM, then SIGKILL) even when a test fails, and the
children die with the test process (PDEATHSIG) if pytest itself is killed.
"""

from __future__ import annotations

import pytest
from helpers import make_config

from kunserve.cli.launcher import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 2-worker cluster shared by the tests of a module (start-up costs a few seconds)."""
    c = LocalCluster(make_config(2), run_dir=tmp_path_factory.mktemp("cluster"))
    c.start(timeout_s=120)
    yield c
    c.stop()


@pytest.fixture
def fresh_cluster(tmp_path):
    """A private cluster for tests that kill or stop services."""
    clusters: list[LocalCluster] = []

    def start(num_workers: int = 2, env: dict[str, str] | None = None, **engine) -> LocalCluster:
        c = LocalCluster(make_config(num_workers, **engine), run_dir=tmp_path / f"c{len(clusters)}", env=env)
        clusters.append(c)
        c.start(timeout_s=120)
        return c

    yield start
    for c in clusters:
        c.stop()
