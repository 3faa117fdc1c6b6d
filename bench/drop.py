"""Cluster drop and restore latency on a real local cluster: from the decision to the group being ready.

Starts a local cluster (separate service processes, UCX between workers), loads it with requests that are
mid-decode (their KV must be exchanged), then asks the memory manager for a drop — exactly what the
monitor does once it detects overload — and later for a restore, several times. For each transition it
records the memory manager's split (plan, prepare = pause + snapshot, exchange = KV over UCX incl. the
remap on the slowest worker, remap alone) and the client-side wall time of the RPC. Detection itself adds
at most one stats interval plus one policy interval (both configurable, 0.1 + 0.2 s by default here).

At the moment of each drop's decision a new request (`--probe-tokens` tokens) is sent as well: "first
token" is the time from the decision to its first token (KunServe §4.2: it must not grow with the KV that
moves), and "moved resume" the time from the decision until every loaded request has produced a token again
(how long their KV took to land). Each `--modes` entry is a cluster of its own, run side by side:
`coordinated` (memory_manager.coordinated_exchange = true: the KV lands after the commit), `coordinated-cold`
(the same, engine.warm_staging = false: the outgoing KV's host buffer is allocated at each drop's Prepare) and
`blocking` (false: every member pauses until the exchange has landed). Each `--loads` entry (REQUESTSxPROMPT) sets how
much KV moves.

    python bench/drop.py --quick
    python bench/drop.py --loads 8x160,32x1500 --max-tokens 400 --pool-mib 320 --out bench/results/drop.json
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

# mode -> (memory_manager.coordinated_exchange, engine.warm_staging)
MODES = {"coordinated": (True, True), "coordinated-cold": (True, False), "blocking": (False, True)}


def apply_mode(cfg: ClusterConfig, mode: str) -> None:
    cfg.memory_manager.coordinated_exchange, cfg.engine.warm_staging = MODES[mode]


def make_cluster(args, mode: str) -> LocalCluster:
    def configure(cfg: ClusterConfig) -> None:
        cfg.dispatcher.route_timeout_s = 120.0
        apply_mode(cfg, mode)

    return bench_cluster(f"drop-{mode}", args.workers, args.pool_mib, configure=configure)  # this driver decides drops


async def load(c: LocalCluster, args, seed: int, progress: dict, requests: int, prompt: int) -> asyncio.Task:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 4000) for _ in range(prompt)] for _ in range(requests)]

    async def run_all():
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            async def one(i, p):
                def seen(ev):
                    progress[i] = progress.get(i, 0) + (ev.token_id >= 0)
                return await client.generate(ch, client.make_request(p, max_tokens=args.max_tokens), timeout=600,
                                             on_event=seen)
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    task = asyncio.create_task(run_all())
    while sum(1 for v in progress.values() if v >= 2) < requests:  # every request is decoding
        if task.done():
            task.result()
            raise RuntimeError("requests finished before the transition: raise --max-tokens")
        await asyncio.sleep(0.02)
    return task


async def probe(c: LocalCluster, args, t0: float) -> float:
    """A new request sent at t0: seconds from t0 to its first token."""
    first: list[float] = []
    async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
        await client.generate(ch, client.make_request(list(range(100, 132)), max_tokens=args.probe_tokens), timeout=600,
                              on_event=lambda ev: first.append(time.perf_counter()) if not first else None)
    return first[0] - t0


async def resumed(progress: dict, t0: float, load: asyncio.Task) -> float:
    """Seconds from t0 until every loaded request has produced a token since this is called (or the load ended:
    a request that finished meanwhile produces none)."""
    since = dict(progress)
    while any(progress.get(i, 0) <= n for i, n in since.items()) and not load.done():
        await asyncio.sleep(0.002)
    return time.perf_counter() - t0


def row(kind: str, rep: int, rpc_s: float, r: memory_manager_pb2.TransitionReport) -> dict[str, Any]:
    return {"op": kind, "repeat": rep, "completed": r.completed, "error": r.error, "epoch": r.epoch,
            "requests_moved": r.requests_moved, "kv_bytes_moved": r.kv_bytes_moved, "rpc_s": rpc_s,
            "plan_s": r.plan_seconds, "prepare_s": r.prepare_seconds, "exchange_s": r.exchange_seconds,
            "remap_s": r.remap_seconds, "total_s": r.total_seconds, "pause_s": r.pause_seconds}


async def main_async(args, c: LocalCluster, mode: str) -> list[dict[str, Any]]:
    rows = []
    creds = client.credentials_from(c.cfg, environ={})  # the admin token LocalCluster wrote
    async with client.admin_channel(c.cfg.memory_manager.address, creds) as ch:
        mm = memory_manager_pb2_grpc.MemoryManagerStub(ch)
        for requests, prompt in args.loads:
            for rep in range(args.repeats):
                progress: dict = {}
                task = await load(c, args, rep, progress, requests, prompt)
                t = time.perf_counter()
                first = asyncio.create_task(probe(c, args, t))
                drop = await mm.Drop(memory_manager_pb2.DropRequest(reason="bench"), timeout=300)
                rpc_s = time.perf_counter() - t
                rows.append(row("drop", rep, rpc_s, drop) |
                            {"mode": mode, "load": f"{requests}x{prompt}", "first_token_s": await first,
                             "moved_resume_s": rpc_s + await resumed(progress, time.perf_counter(), task)})
                await asyncio.sleep(args.serve_s)  # serve as pipeline groups for a while
                t = time.perf_counter()
                restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=300)
                rows.append(row("restore", rep, time.perf_counter() - t, restore) |
                            {"mode": mode, "load": f"{requests}x{prompt}"})
                await task
                d = rows[-2]
                print(f"  {mode} {requests}x{prompt} repeat {rep + 1}/{args.repeats}: drop {d['rpc_s'] * 1e3:.0f} ms "
                      f"({d['kv_bytes_moved'] / 2**20:.1f} MiB of KV), first token {d['first_token_s'] * 1e3:.0f} ms, "
                      f"moved resume {d['moved_resume_s'] * 1e3:.0f} ms, restore {rows[-1]['rpc_s'] * 1e3:.0f} ms",
                      flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in dict.fromkeys((r["mode"], r["load"], r["op"]) for r in rows):
        rs = [r for r in rows if (r["mode"], r["load"], r["op"]) == key and r["completed"]]
        if not rs:
            continue
        fields = ["rpc_s", "plan_s", "prepare_s", "exchange_s", "remap_s", "total_s", "pause_s", "kv_bytes_moved",
                  "requests_moved"]
        if key[2] == "drop":
            fields += ["first_token_s", "moved_resume_s"]
        med = {k: statistics.median(r[k] for r in rs) for k in fields}
        out.append({"mode": key[0], "load": key[1], "op": key[2], "runs": len(rs), **med})
    return out


def print_table(summary: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"\ncluster drop / restore — {meta['workers']} workers, requests mid-decode x prompt tokens as loaded, "
          f"medians over {meta['repeats']} runs (ms; first token and moved resume from the decision)")
    hdr = f"{'mode':12} {'load':>9} {'op':8} {'rpc':>7} {'plan':>6} {'prepare':>8} {'exchange':>9} {'remap':>6} " \
          f"{'total':>7} {'paused':>7} {'KV MiB':>7} {'requests':>8} {'1st token':>9} {'moved resume':>12}"
    print(hdr)
    print("-" * len(hdr))
    for s in summary:
        extra = (f" {s['first_token_s'] * 1e3:9.1f} {s['moved_resume_s'] * 1e3:12.1f}" if s["op"] == "drop" else "")
        print(f"{s['mode']:12} {s['load']:>9} {s['op']:8} {s['rpc_s'] * 1e3:7.1f} {s['plan_s'] * 1e3:6.1f} "
              f"{s['prepare_s'] * 1e3:8.1f} {s['exchange_s'] * 1e3:9.1f} {s['remap_s'] * 1e3:6.2f} "
              f"{s['total_s'] * 1e3:7.1f} {s['pause_s'] * 1e3:7.1f} {s['kv_bytes_moved'] / 2**20:7.2f} "
              f"{s['requests_moved']:8.0f}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="loads 8x160,16x400, 1 repeat")
    ap.add_argument("--workers", type=int, default=2, help="workers (default 2: the drop merges a pair)")
    ap.add_argument("--modes", default="coordinated,blocking", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--loads", default=None, help="REQUESTSxPROMPT, comma-separated: the requests decoding during "
                                                  "each transition and their prompt tokens (default 8x160,24x1000)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per loaded request (default 400; "
                                                                 "quick 160)")
    ap.add_argument("--probe-tokens", type=int, default=4, help="tokens of the request sent at the decision")
    ap.add_argument("--pool-mib", type=int, default=256, help="memory pool per worker")
    ap.add_argument("--repeats", type=int, default=None, help="drop + restore cycles per load (default 3; quick 1)")
    ap.add_argument("--serve-s", type=float, default=0.5, help="seconds served as groups between drop and restore")
    ap.add_argument("--out", default="bench/results/drop.json")
    args = ap.parse_args()
    q = args.quick
    args.repeats = args.repeats or (1 if q else 3)
    args.max_tokens = args.max_tokens or (160 if q else 400)
    try:
        args.loads = [tuple(int(x) for x in part.split("x")) for part in
                      (args.loads or ("8x160,16x400" if q else "8x160,24x1000")).split(",")]
        assert all(len(ld) == 2 and min(ld) > 0 for ld in args.loads)
    except (ValueError, AssertionError):
        ap.error("--loads: REQUESTSxPROMPT entries such as 8x160,24x1000")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: from {', '.join(MODES)}")
    if args.workers < 2:
        ap.error("--workers: a drop needs at least 2 workers")
    rows = [r for m in modes for r in run_on(make_cluster(args, m), lambda c, m=m: main_async(args, c, m))]
    meta = {k: getattr(args, k) for k in ("workers", "modes", "loads", "max_tokens", "probe_tokens", "pool_mib",
                                          "repeats", "serve_s", "quick")}
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
