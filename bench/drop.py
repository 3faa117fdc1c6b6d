"""Cluster drop and restore latency on a real local cluster: from the decision to the group being ready.

Starts a local cluster (separate service processes, UCX between workers), loads it with requests that are
mid-decode (their KV must be exchanged), then asks the memory manager for a drop — exactly what the
monitor does once it detects overload — and later for a restore, several times. For each transition it
records the memory manager's split (plan, prepare = pause + snapshot, exchange = KV over UCX incl. the
remap on the slowest worker, remap alone) and the client-side wall time of the RPC. Detection itself adds
at most one stats interval plus one policy interval (both configurable, 0.1 + 0.2 s by default here).

    python bench/drop.py --quick
    python bench/drop.py --workers 4 --requests 32 --prompt 256 --repeats 5 --out bench/results/drop.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from typing import Any

from harness import bench_cluster, run_on, write_json  # first: it puts the repository on sys.path

from kunserve import client  # noqa: E402
from kunserve.cli.launcher import LocalCluster  # noqa: E402
from kunserve.shared.config import ClusterConfig  # noqa: E402
from kunserve.v1 import memory_manager_pb2, memory_manager_pb2_grpc  # noqa: E402


def make_cluster(args) -> LocalCluster:
    def configure(cfg: ClusterConfig) -> None:
        cfg.dispatcher.route_timeout_s = 120.0

    return bench_cluster("drop", args.workers, args.pool_mib, configure=configure)  # this driver decides drops


async def load(c: LocalCluster, args, seed: int, progress: dict) -> asyncio.Task:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 4000) for _ in range(args.prompt)] for _ in range(args.requests)]

    async def run_all():
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            async def one(i, p):
                def seen(ev):
                    progress[i] = progress.get(i, 0) + (ev.token_id >= 0)
                return await client.generate(ch, client.make_request(p, max_tokens=args.max_tokens), timeout=600,
                                             on_event=seen)
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    task = asyncio.create_task(run_all())
    while sum(1 for v in progress.values() if v >= 2) < args.requests:  # every request is decoding
        if task.done():
            task.result()
            raise RuntimeError("requests finished before the transition: raise --max-tokens")
        await asyncio.sleep(0.02)
    return task


def row(kind: str, rep: int, rpc_s: float, r: memory_manager_pb2.TransitionReport) -> dict[str, Any]:
    return {"op": kind, "repeat": rep, "completed": r.completed, "error": r.error, "epoch": r.epoch,
            "requests_moved": r.requests_moved, "kv_bytes_moved": r.kv_bytes_moved, "rpc_s": rpc_s,
            "plan_s": r.plan_seconds, "prepare_s": r.prepare_seconds, "exchange_s": r.exchange_seconds,
            "remap_s": r.remap_seconds, "total_s": r.total_seconds}


async def main_async(args, c: LocalCluster) -> list[dict[str, Any]]:
    rows = []
    creds = client.credentials_from(c.cfg, environ={})  # the admin token LocalCluster wrote
    async with client.admin_channel(c.cfg.memory_manager.address, creds) as ch:
        mm = memory_manager_pb2_grpc.MemoryManagerStub(ch)
        for rep in range(args.repeats):
            progress: dict = {}
            task = await load(c, args, rep, progress)
            t = time.perf_counter()
            drop = await mm.Drop(memory_manager_pb2.DropRequest(reason="bench"), timeout=300)
            rows.append(row("drop", rep, time.perf_counter() - t, drop))
            await asyncio.sleep(args.serve_s)  # serve as pipeline groups for a while
            t = time.perf_counter()
            restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=300)
            rows.append(row("restore", rep, time.perf_counter() - t, restore))
            await task
            print(f"  repeat {rep + 1}/{args.repeats}: drop {rows[-2]['rpc_s'] * 1e3:.0f} ms, "
                  f"restore {rows[-1]['rpc_s'] * 1e3:.0f} ms", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for op in ("drop", "restore"):
        rs = [r for r in rows if r["op"] == op and r["completed"]]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("rpc_s", "plan_s", "prepare_s", "exchange_s", "remap_s", "total_s", "kv_bytes_moved", "requests_moved")}
        out.append({"op": op, "runs": len(rs), **med})
    return out


def print_table(summary: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"\ncluster drop / restore — {meta['workers']} workers, {meta['requests']} requests mid-decode "
          f"(prompt {meta['prompt']}), medians over {meta['repeats']} runs")
    hdr = f"{'op':8} {'rpc ms':>8} {'plan':>7} {'prepare':>8} {'exchange':>9} {'remap':>7} {'total':>7} " \
          f"{'KV MiB':>7} {'requests':>9}"
    print(hdr)
    print("-" * len(hdr))
    for s in summary:
        print(f"{s['op']:8} {s['rpc_s'] * 1e3:8.1f} {s['plan_s'] * 1e3:7.1f} {s['prepare_s'] * 1e3:8.1f} "
              f"{s['exchange_s'] * 1e3:9.1f} {s['remap_s'] * 1e3:7.2f} {s['total_s'] * 1e3:7.1f} "
              f"{s['kv_bytes_moved'] / 2**20:7.2f} {s['requests_moved']:9.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 workers, 8 requests, 2 repeats")
    ap.add_argument("--workers", type=int, default=None, help="workers (default 4; quick 2)")
    ap.add_argument("--requests", type=int, default=None, help="requests decoding during each transition "
                                                               "(default 24; quick 8)")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pool-mib", type=int, default=64, help="memory pool per worker")
    ap.add_argument("--repeats", type=int, default=None, help="drop + restore cycles (default 5; quick 2)")
    ap.add_argument("--serve-s", type=float, default=0.5, help="seconds served as groups between drop and restore")
    ap.add_argument("--out", default="bench/results/drop.json")
    args = ap.parse_args()
    q = args.quick
    args.workers = args.workers or (2 if q else 4)
    args.requests = args.requests or (8 if q else 24)
    args.repeats = args.repeats or (2 if q else 5)
    if args.workers < 2:
        ap.error("--workers: a drop needs at least 2 workers")
    rows = run_on(make_cluster(args), lambda c: main_async(args, c))
    meta = {k: getattr(args, k) for k in ("workers", "requests", "prompt", "max_tokens", "pool_mib", "repeats",
                                          "serve_s", "quick")}
    meta.update(host=platform.node(), cpus=os.cpu_count())
    summary = summarize(rows)
    print_table(summary, meta)
    failed = [r for r in rows if not r["completed"]]
    for r in failed:
        print(f"not completed: {r['op']} run {r['repeat']}: {r['error']}")
    if args.out:
        write_json(args.out, {"meta": meta, "summary": summary, "runs": rows})


if __name__ == "__main__":
    main()
