"""What the cluster benchmarks share: a local cluster sized for the bench, run-then-stop, the JSON result.

Imported by the scripts beside it (`python bench/X.py` puts this folder on sys.path); it puts the repository
root there too, so a script may import it before anything of the project.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kunserve.cli.launcher import LocalCluster, assign_free_ports, with_workers  # noqa: E402
from kunserve.shared.config import ClusterConfig, load_config  # noqa: E402

T = TypeVar("T")


def bench_cluster(name: str, workers: int, pool_mib: int, *, auto_drop: bool = False,
                  configure: Callable[[ClusterConfig], None] | None = None) -> LocalCluster:
    """Built-in defaults, `workers` workers on free loopback ports, one torch thread each, fast stats, JSON
    logs in a fresh temp dir; `configure` adjusts anything else before the cluster is made."""
    cfg = load_config(None, environ={})
    with_workers(cfg, workers)
    assign_free_ports(cfg)
    cfg.engine.pool_mib = pool_mib
    cfg.engine.threads = 1
    cfg.monitor.auto_drop = auto_drop
    cfg.monitor.stats_interval_s = 0.1
    cfg.logging.format = "json"
    if configure is not None:
        configure(cfg)
    return LocalCluster(cfg, run_dir=tempfile.mkdtemp(prefix=f"kunserve-bench-{name}-"))


def run_on(c: LocalCluster, main_async: Callable[[LocalCluster], Awaitable[T]]) -> T:
    """Start the cluster, run the measurement against it, and stop it whatever happens."""
    print(f"starting a {len(c.cfg.workers)}-worker cluster (logs in {c.run_dir}) ...", flush=True)
    c.start(timeout_s=180)
    try:
        return asyncio.run(main_async(c))
    finally:
        c.stop()


def write_json(path: str, result: Any) -> None:
    """The result as strict JSON (a NaN is an error, not a value) at `path`, its folder made as needed."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, allow_nan=False))
    print(f"wrote {out}")
