"""Admission control and liveness under overload, on a real local cluster (issue 12).

Starts a LocalCluster (embedded model), estimates its capacity (closed loop, or --capacity), then sends
open-loop Poisson arrivals at 2x, 5x and 10x that capacity for a bounded time each, with seeded random
token-id prompts (the same replay as `kunserve bench`). Per phase it reports accepted vs refused
(RESOURCE_EXHAUSTED), other errors, p99 TTFT of the accepted requests, the time to the first refusal and the
peak RSS of every process so far (VmHWM). Last, it freezes (SIGSTOP) the worker serving a few long streams
and measures the time from the freeze to each stream's next token from another worker, and after SIGCONT the
time until the worker serves again.

    python bench/overload.py --quick
    python bench/overload.py --duration 10 --out bench/results/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import time
from typing import Any

from harness import bench_cluster, run_on, write_json  # first: it puts the repository on sys.path

from kunserve import client  # noqa: E402
from kunserve.benchkit.replay import prompt_ids, replay  # noqa: E402
from kunserve.benchkit.stats import percentiles  # noqa: E402
from kunserve.benchkit.trace import TraceRequest, gamma_arrivals  # noqa: E402
from kunserve.cli.launcher import LocalCluster  # noqa: E402

REFUSED = "RESOURCE_EXHAUSTED"
MIB = 1024 * 1024


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes: resident now and its peak since the process started."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out.get("VmRSS", 0), out.get("VmHWM", 0)


def peak_rss_mib(c: LocalCluster) -> dict[str, float]:
    return {ch.name: round(memory(ch.proc.pid)[1] / MIB, 1) for ch in c.children if ch.proc.poll() is None}


async def estimate_capacity(address: str, args) -> float:
    """Requests per second the cluster completes with enough concurrency to keep every worker busy."""
    concurrency = 8 * args.workers
    deadline = time.monotonic() + args.capacity_s
    done = 0
    async with client.insecure_channel(address) as ch:
        async def loop(k: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() < deadline:
                req = client.make_request(prompt_ids(k * 10_000 + i, args.prompt, args.seed),
                                          max_tokens=args.output, ignore_eos=True)
                await client.generate(ch, req, timeout=120)
                done += 1
                i += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return done / (time.monotonic() - t0)


def phase_row(multiplier: float, rate: float, outcome, c: LocalCluster) -> dict[str, Any]:
    results = outcome.results
    refused = [r for r in results if r.error.startswith(REFUSED)]
    accepted = [r for r in results if not r.error.startswith(REFUSED)]
    completed = [r for r in accepted if r.ok and r.tokens == r.output_tokens]
    failed = [r for r in accepted if not r.ok]
    ttft = percentiles(r.ttft_s for r in accepted)
    return {
        "multiplier": multiplier, "rate_rps": rate, "sent": len(results), "accepted": len(accepted),
        "refused": len(refused), "completed": len(completed), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],  # distinct messages of the failed accepted requests
        "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "max_ttft_s": ttft["max"],
        "first_refusal_s": min((r.sent_s for r in refused), default=None),
        "duration_s": outcome.duration_s, "peak_rss_mib": peak_rss_mib(c),
    }


async def frozen_worker(c: LocalCluster, args) -> dict[str, Any]:
    """SIGSTOP the worker serving long streams: time from the freeze to each stream's next token elsewhere,
    and after SIGCONT the time until a request is served there again."""
    address = c.cfg.dispatcher.address
    n = args.freeze_tokens
    async with client.insecure_channel(address) as ch:
        events: dict[int, list[tuple[float, str]]] = {i: [] for i in range(args.freeze_streams)}

        def seen(i):
            return lambda ev: ev.token_id >= 0 and events[i].append((time.monotonic(), ev.worker_id))

        tasks = [asyncio.create_task(client.generate(
            ch, client.make_request(prompt_ids(900_000 + i, args.prompt, args.seed), max_tokens=n, ignore_eos=True),
            timeout=300, on_event=seen(i))) for i in range(args.freeze_streams)]
        while not all(len(e) >= 3 for e in events.values()):
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream finished before the freeze: raise --freeze-tokens")
            await asyncio.sleep(0.005)
        victim = events[0][-1][1]
        pid = c.child(victim).proc.pid
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            results = await asyncio.gather(*tasks)
            moved = []
            for e in events.values():
                if e[0][1] == victim:  # streams on the frozen worker: when did they continue elsewhere?
                    moved.append(next(t for t, w in e if t > frozen_at and w != victim) - frozen_at)
        finally:
            os.kill(pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        rejoin_s = None
        deadline = thawed_at + 60
        while rejoin_s is None and time.monotonic() < deadline:
            batch = await asyncio.gather(*(client.generate(
                ch, client.make_request(prompt_ids(950_000 + i, 16, args.seed), max_tokens=4, ignore_eos=True),
                timeout=60) for i in range(2 * args.workers)))
            if any(r.worker_id == victim for r in batch):
                rejoin_s = time.monotonic() - thawed_at
    complete = all(len(r.token_ids) == n for r in results)
    return {"worker": victim, "streams": args.freeze_streams, "streams_on_frozen_worker": len(moved),
            "freeze_to_running_elsewhere_s": {"max": max(moved, default=None),
                                              "mean": sum(moved) / len(moved) if moved else None},
            "all_streams_complete": complete, "sigcont_to_serving_again_s": rejoin_s}


async def main_async(args, c: LocalCluster) -> dict[str, Any]:
    address = c.cfg.dispatcher.address
    capacity = args.capacity
    if capacity is None:
        print(f"estimating capacity ({args.capacity_s:g} s closed loop) ...", flush=True)
        capacity = await estimate_capacity(address, args)
    print(f"capacity {capacity:.2f} req/s (prompt {args.prompt}, output {args.output} tokens)", flush=True)
    phases = []
    for k, m in enumerate(args.multipliers):
        rate = m * capacity
        arrivals = gamma_arrivals(rate, 1.0, args.duration, seed=args.seed + k)
        trace = [TraceRequest(a, args.prompt, args.output) for a in arrivals]
        outcome = await replay(trace, address, seed=args.seed + k, timeout_s=300, request_prefix=f"x{m:g}-")
        phases.append(phase_row(m, rate, outcome, c))
        p = phases[-1]
        print(f"  {m:g}x: {p['sent']} sent, {p['accepted']} accepted, {p['refused']} refused, "
              f"{p['failed']} failed", flush=True)
    print("freezing a worker (SIGSTOP) under long streams ...", flush=True)
    freeze = await frozen_worker(c, args)
    return {"capacity_rps": capacity, "phases": phases, "freeze": freeze, "peak_rss_mib": peak_rss_mib(c)}


def fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    print(f"\noverload: {report['meta']['workers']} workers, capacity {report['capacity_rps']:.2f} req/s, "
          f"{report['meta']['duration']:g} s per phase")
    hdr = (f"{'load':>5} {'req/s':>7} {'sent':>5} {'accepted':>9} {'refused':>8} {'completed':>10} {'failed':>7} "
           f"{'p99 TTFT s':>11} {'max TTFT s':>11} {'1st refusal s':>14}")
    print(hdr)
    print("-" * len(hdr))
    for p in report["phases"]:
        print(f"{p['multiplier']:>4g}x {p['rate_rps']:7.2f} {p['sent']:5d} {p['accepted']:9d} {p['refused']:8d} "
              f"{p['completed']:10d} {p['failed']:7d} {fmt(p['ttft_p99_s']):>11} {fmt(p['max_ttft_s']):>11} "
              f"{fmt(p['first_refusal_s'], digits=3):>14}")
    print("\npeak RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in report["peak_rss_mib"].items()))
    f = report["freeze"]
    el = f["freeze_to_running_elsewhere_s"]
    print(f"frozen worker ({f['worker']}, {f['streams_on_frozen_worker']} of {f['streams']} streams on it): "
          f"running elsewhere after {fmt(el['max'])} s (max), {fmt(el['mean'])} s (mean); all streams complete: "
          f"{f['all_streams_complete']}; serving again {fmt(f['sigcont_to_serving_again_s'])} s after SIGCONT")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 s per phase, short requests, 3 s capacity estimate")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=None, help="requests/s; default: estimated (closed loop)")
    ap.add_argument("--capacity-s", type=float, default=None, help="seconds of the capacity estimate (default 6)")
    ap.add_argument("--multipliers", default="2,5,10", help="arrival rates as multiples of the capacity")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per phase (default 10)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per request (default 64)")
    ap.add_argument("--output", type=int, default=None, help="output tokens per request (default 32)")
    ap.add_argument("--pool-mib", type=int, default=128, help="memory pool per worker")
    ap.add_argument("--auto-drop", action="store_true", help="let the monitor drop layers on overload "
                                                             "(off: measure admission control alone)")
    ap.add_argument("--freeze-streams", type=int, default=4)
    ap.add_argument("--freeze-tokens", type=int, default=None, help="tokens per frozen stream (default 600)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/overload.json")
    args = ap.parse_args()
    q = args.quick
    args.duration = args.duration or (3.0 if q else 10.0)
    args.capacity_s = args.capacity_s or (3.0 if q else 6.0)
    args.prompt = args.prompt or (32 if q else 64)
    args.output = args.output or (16 if q else 32)
    args.freeze_tokens = args.freeze_tokens or (300 if q else 600)
    try:
        args.multipliers = [float(m) for m in args.multipliers.split(",") if m.strip()]
    except ValueError:
        ap.error(f"--multipliers: expected numbers separated by commas, got {args.multipliers!r}")
    if args.workers < 2:
        ap.error("--workers: the frozen-worker measurement needs at least 2 workers")
    report = run_on(bench_cluster("overload", args.workers, args.pool_mib, auto_drop=args.auto_drop),
                    lambda c: main_async(args, c))
    report["meta"] = {k: getattr(args, k) for k in ("workers", "duration", "prompt", "output", "pool_mib",
                                                    "auto_drop", "seed", "quick", "multipliers")}
    report["meta"].update(host=platform.node(), cpus=os.cpu_count(), loadavg=os.getloadavg())
    print_table(report)
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
