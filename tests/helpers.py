"""Helpers shared by the tests: cluster configs, bounded async runs, reference tokens."""

from __future__ import annotations

import asyncio
import functools
import os
import pathlib
import re
import sys
import tempfile
from dataclasses import dataclass

import grpc

from kunserve import client
from kunserve.cli.launcher import assign_free_ports, with_workers
from kunserve.shared.config import load_config
from kunserve.v1 import common_pb2

TEST_POOL_MIB = 48
# Workers measure their cost-model profile once per machine (engine.profile_cache) and read it back after: the
# tests' clusters share one cache outside the user's home, kept between runs like a user's.
TEST_PROFILE_CACHE = os.path.join(tempfile.gettempdir(), f"kunserve-test-{os.getuid()}", "profiles.json")


def make_config(num_workers: int = 2, **engine):
    cfg = load_config(None, environ={})
    with_workers(cfg, num_workers)
    assign_free_ports(cfg)
    cfg.engine.pool_mib = engine.pop("pool_mib", TEST_POOL_MIB)
    cfg.engine.threads = 1
    cfg.engine.profile_cache = TEST_PROFILE_CACHE
    cfg.monitor.stats_interval_s = 0.1
    cfg.monitor.auto_drop = engine.pop("auto_drop", False)  # tests that want automatic drops ask for them
    cfg.logging.format = "json"
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return cfg


def kunctl_argv(cluster, *args) -> list[str]:
    """`python -m kunserve.cli.kunctl` against a LocalCluster with the credentials of its run dir (the
    config it wrote names them), as a user would with --config."""
    return [sys.executable, "-m", "kunserve.cli.kunctl", "--config", str(cluster.config_path), *args]


def internal_channel(cluster, address: str):
    """A channel that presents the cluster secret, as a service does (tests that call workers directly)."""
    from kunserve.shared import credentials, rpc

    return rpc.channel(address, token=credentials.read_token(cluster.cfg.security.cluster_secret_file,
                                                              credentials.CLUSTER_SECRET))


def worker_stats(cluster) -> common_pb2.WorkerStats:
    """GetStats of a one-worker cluster's worker (KV blocks in use, running requests), as the dispatcher sees it."""
    from kunserve.v1 import worker_pb2_grpc

    async def stats() -> common_pb2.WorkerStats:
        (w,) = cluster.cfg.workers
        async with internal_channel(cluster, w.address) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetStats(common_pb2.Empty(), timeout=5)

    return run(stats())


def admin_channel(cluster):
    """A channel to the admin port with the admin token, as kunctl opens it."""
    return client.admin_channel(cluster.cfg.memory_manager.address, client.credentials_from(cluster.cfg, environ={}))


async def rpc_outcome(call) -> tuple[grpc.StatusCode, str]:
    """Run one call (made by `call()`, unary or streaming) to its end: its status code and details, OK when it
    succeeded (tests of refusals assert on the code, not on an exception)."""
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def run(coro, timeout: float = 120.0):
    """Run a coroutine with a hard bound so a hung RPC fails the test instead of hanging CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def generate_many(address: str, requests, timeout: float = 120.0):
    async with client.insecure_channel(address) as ch:
        return await asyncio.gather(*(client.generate(ch, r, timeout=timeout) for r in requests),
                                    return_exceptions=True)


@functools.lru_cache(maxsize=1)
def _embedded_model():
    from kunserve.shared.model.architecture import TINY_CONFIG
    from kunserve.shared.model.weights import random_weights

    return TINY_CONFIG, random_weights(TINY_CONFIG, seed=0)


@functools.lru_cache(maxsize=256)
def _reference(prompt: tuple[int, ...], max_tokens: int):
    from kunserve.shared.model.reference import reference_greedy

    cfg, weights = _embedded_model()
    tokens, margins = reference_greedy(cfg, weights, list(prompt), max_tokens)
    return list(tokens), list(margins)


def reference_for(prompt, max_tokens: int):
    """Greedy tokens and top-2 margins of the embedded default model (what `kunserve up` serves)."""
    return _reference(tuple(prompt), max_tokens)


def check_against_reference(prompt, got: list[int], max_tokens: int) -> None:
    """Assert a greedy generation of the embedded model: all max_tokens tokens, each equal to the dense
    reference's wherever its top-2 margin is clear. Teacher-forced (one reference forward over prompt + got),
    which is the greedy reference up to the first divergence, so long generations stay cheap to check."""
    from oracle import compare_greedy

    from kunserve.shared.model.reference import reference_scores

    assert len(got) == max_tokens, f"{len(got)} tokens, expected {max_tokens}"
    cfg, weights = _embedded_model()
    ref, margins = reference_scores(cfg, weights, list(prompt), list(got))
    compare_greedy(list(got), ref, margins)


@dataclass(frozen=True)
class DocumentedMetric:
    kind: str                   # gauge | counter | histogram
    labels: frozenset[str]      # label names (histograms' `le` aside)
    services: frozenset[str]    # worker | dispatcher | memory manager | monitor


def readme_metrics() -> dict[str, DocumentedMetric]:
    """The README's "Metrics" table: every family the services export (counters with their `_total`)."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`kunserve:"):
            name, kind, labels, services, _ = cells
            assert name.strip("`") not in out, f"{name} is in the README's metrics table twice"
            out[name.strip("`")] = DocumentedMetric(kind, frozenset(re.findall(r"`(\w+)`", labels)),
                                                    frozenset(s.strip() for s in services.split(",")))
    return out
