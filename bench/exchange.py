"""Activation latency during a KV exchange, with and without the transfer service's priorities.

Two processes on 127.0.0.1 over UCX (ucxx, TCP): this driver and `python -m kunserve.shared.transfer.peer`.
Activations (``--act-kib``, one every ``--act-interval-ms``, like one pipeline stage's output) go from the
driver to the peer; latency is one-way, from the moment a producer thread (standing in for the engine
thread finishing a stage) hands the activation to the event loop — so time the loop is blocked counts —
to the whole message having arrived on the peer (both clocks are CLOCK_MONOTONIC on one host).
Scenarios:

1. idle               — activations alone;
2. kv + priorities    — while a ``--kv-mib`` KV_EXCHANGE is sent in chunks sized to take each chunk time
                        target of ``--targets`` (EWMA of measured throughput); activations overtake it
                        between chunks;
3. kv as one message  — the same exchange sent as one message (no chunking): activations wait behind it,
                        as they would on bare UCX, which has no priorities (over TCP loopback, UCX even
                        sends the whole message inside one progress call, blocking the sender's loop);
4. capacity           — the exchange alone, as one message (≈ raw loopback UCX throughput) and chunked,
                        to show what chunking costs in throughput.

The peer receives the exchange into a preallocated, pre-touched buffer (as a worker receives into its KV
cache; ``--no-kv-pool`` for a fresh tensor per message, which adds first-touch page faults).

    python bench/exchange.py --quick
    python bench/exchange.py --kv-mib 256 --targets 1,2,5 --out bench/results/exchange.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from harness import write_json

from kunserve.shared.transfer import ACTIVATION, CONTROL, KV_EXCHANGE, TransferConfig, TransferService
from kunserve.shared.transfer.peer import READY

MiB = 1 << 20
SECRET = "bench-exchange-cluster-secret-0123456789"  # the link handshake's; both processes are ours


def start_peer(kv_pool_mib: int = 0) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, OMP_NUM_THREADS="1", KUNSERVE_CLUSTER_SECRET=SECRET)
    for k, v in {"UCX_TLS": "tcp", "UCXPY_PROGRESS_MODE": "blocking", "UCX_WARN_UNUSED_ENV_VARS": "n"}.items():
        env.setdefault(k, v)
    proc = subprocess.Popen([sys.executable, "-m", "kunserve.shared.transfer.peer", "--name", "peer",
                             "--kv-pool-mib", str(kv_pool_mib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(60)
    line = got[0].decode() if got else ""
    if not line.startswith(READY):
        proc.kill()
        raise SystemExit(f"transfer peer did not start: {line!r}")
    return proc, json.loads(line[len(READY):])["port"]


async def report(svc: TransferService) -> dict[str, Any]:
    await svc.send("peer", CONTROL, b"", name="report", timeout=30)
    msg = await svc.recv(CONTROL, timeout=30)
    return json.loads(bytes(msg.data.numpy()))


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def scenario(port: int, name: str, config: TransferConfig, *, kv_bytes: int, acts: int | None,
                   act_bytes: int, interval_s: float) -> dict[str, Any]:
    """Send a KV exchange (if kv_bytes) and activations (a fixed count, or until the exchange ends)."""
    svc = TransferService(f"driver-{name}", config=config, secret=SECRET.encode())
    await svc.start()
    await svc.connect("127.0.0.1", port, timeout=10)
    await report(svc)  # clears the peer's trace
    kv_tensor = torch.ones(kv_bytes // 4) if kv_bytes else None
    act = torch.randn(act_bytes // 4)
    t0 = time.perf_counter()
    kv = svc.submit("peer", KV_EXCHANGE, kv_tensor, name="kv") if kv_bytes else None
    handles, due = [], {}
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    finished = asyncio.Event()

    def submit(t_ready: float) -> None:
        h = svc.submit("peer", ACTIVATION, act, name="act")
        due[h.message_id] = t_ready
        handles.append(h)

    def producer() -> None:
        # Like the engine thread: a stage finishes every interval_s and hands its activation to the event
        # loop. The latency counts from that hand-off, so time the loop is blocked counts too.
        k = 0
        while not stop.is_set() and (acts is None or k < acts):
            k += 1
            time.sleep(max(0.0, t0 + k * interval_s - time.perf_counter()))
            loop.call_soon_threadsafe(submit, time.perf_counter())
        loop.call_soon_threadsafe(finished.set)

    thread = threading.Thread(target=producer, daemon=True)
    if acts is None or acts > 0:
        thread.start()
    else:
        finished.set()
    if kv is not None:
        await kv.wait(timeout=300)
        if acts is None:
            stop.set()
    await asyncio.wait_for(finished.wait(), 300)
    for h in handles:
        await h.wait(timeout=300)
    submit_t = {e.message_id: e.t for e in svc.trace if e.op == "submit"}
    submit_t.update(due)
    sends = [e for e in svc.trace if e.op == "send" and kv is not None and e.message_id == kv.message_id]
    stats = svc.stats()["peer"]
    rep = await report(svc)
    await svc.close()
    arrived = {r[2]: r[0] for r in rep["recv"] if r[5]}
    lat = [(arrived[h.message_id] - submit_t[h.message_id]) * 1e3 for h in handles if h.message_id in arrived]
    kv_s = (arrived[kv.message_id] - submit_t[kv.message_id]) if kv is not None else None
    chunk_sizes = [e.nbytes for e in sends]
    return {
        "scenario": name, "activations": len(lat), "act_bytes": act_bytes,
        "act_p50_ms": pct(lat, 50), "act_p99_ms": pct(lat, 99), "act_max_ms": max(lat) if lat else None,
        "act_mean_ms": statistics.fmean(lat) if lat else None,
        "kv_bytes": kv_bytes, "kv_s": kv_s, "kv_gbps": (kv_bytes / kv_s / 1e9) if kv_s else None,
        "kv_chunks": len(chunk_sizes), "kv_chunk_median_bytes": statistics.median(chunk_sizes) if chunk_sizes else None,
        "throughput_ewma_gbps": stats["throughput_bps"] / 1e9, "elapsed_s": time.perf_counter() - t0,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    proc, port = start_peer(args.kv_mib if args.kv_pool else 0)
    try:
        kv_bytes = args.kv_mib * MiB
        act_bytes = args.act_kib * 1024
        interval = args.act_interval_ms / 1e3
        prio = {t: TransferConfig(target_chunk_s=t / 1e3, trace_len=1_000_000) for t in args.targets}
        one = TransferConfig(min_chunk_bytes=kv_bytes, max_chunk_bytes=kv_bytes, trace_len=1_000_000)
        results = []
        # warm-up: connection setup, page faults
        await scenario(port, "warmup", one, kv_bytes=kv_bytes // 4, acts=5, act_bytes=act_bytes, interval_s=0)
        results.append(await scenario(port, "idle", one, kv_bytes=0, acts=args.idle_acts, act_bytes=act_bytes,
                                      interval_s=interval))
        for _r in range(args.repeats):
            for t, cfg in prio.items():
                results.append(await scenario(port, f"kv + priorities, {t:g} ms chunks", cfg, kv_bytes=kv_bytes,
                                              acts=None, act_bytes=act_bytes, interval_s=interval))
            results.append(await scenario(port, "kv as one message (no priorities)", one, kv_bytes=kv_bytes,
                                          acts=None, act_bytes=act_bytes, interval_s=interval))
        for _r in range(args.repeats):
            results.append(await scenario(port, "capacity: one message", one, kv_bytes=kv_bytes, acts=0,
                                          act_bytes=act_bytes, interval_s=0))
            for t, cfg in prio.items():
                results.append(await scenario(port, f"capacity: {t:g} ms chunks", cfg, kv_bytes=kv_bytes, acts=0,
                                              act_bytes=act_bytes, interval_s=0))
        return {"results": results}
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge repeats of a scenario: latencies pooled by median of the per-run figures."""
    def med_of(rs: list[dict], k: str) -> float | None:
        values = [r[k] for r in rs if r[k] is not None]
        return statistics.median(values) if values else None

    out = []
    for name in dict.fromkeys(r["scenario"] for r in results):
        rs = [r for r in results if r["scenario"] == name]

        def med(k: str, rs: list[dict] = rs) -> float | None:
            return med_of(rs, k)

        out.append({"scenario": name, "runs": len(rs), "activations": sum(r["activations"] for r in rs),
                    "act_p50_ms": med("act_p50_ms"), "act_p99_ms": med("act_p99_ms"), "act_max_ms": med("act_max_ms"),
                    "kv_gbps": med("kv_gbps"), "kv_s": med("kv_s"), "kv_chunks": med("kv_chunks"),
                    "kv_chunk_median_bytes": med("kv_chunk_median_bytes")})
    return out


def print_table(summary: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console() if sys.stdout.isatty() else Console(width=200)
    t = Table(title=f"Activation latency (one-way) during a {meta['kv_mib']} MiB KV exchange "
                    f"({meta['act_kib']} KiB activations every {meta['act_interval_ms']} ms; UCX over TCP "
                    f"loopback; median of {meta['repeats']} runs)")
    for col in ("scenario", "acts", "p50 ms", "p99 ms", "max ms", "KV GB/s", "KV s", "chunks", "chunk MiB"):
        t.add_column(col, justify="left" if col == "scenario" else "right")
    f = lambda v, fmt: "–" if v is None or v != v else format(v, fmt)  # noqa: E731
    for s in summary:
        if s["scenario"] == "warmup":
            continue
        acts = s["activations"]
        t.add_row(s["scenario"], str(acts), f(s["act_p50_ms"] if acts else None, ".2f"),
                  f(s["act_p99_ms"] if acts else None, ".2f"), f(s["act_max_ms"] if acts else None, ".2f"),
                  f(s["kv_gbps"], ".2f"), f(s["kv_s"], ".3f"), f(s["kv_chunks"], ".0f"),
                  f(s["kv_chunk_median_bytes"] / MiB if s["kv_chunk_median_bytes"] else None, ".2f"))
    con.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 32 MiB exchange, fewer activations")
    ap.add_argument("--kv-mib", type=int, default=None, help="KV exchange size (default 128; quick 32)")
    ap.add_argument("--act-kib", type=int, default=64, help="activation size (default 64 KiB)")
    ap.add_argument("--act-interval-ms", type=float, default=2.0)
    ap.add_argument("--targets", default="2,5", help="chunk time targets in ms (about one stage), comma-separated")
    ap.add_argument("--idle-acts", type=int, default=None, help="activations in the idle run (default 300)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per scenario (default 3; quick 1)")
    ap.add_argument("--no-kv-pool", dest="kv_pool", action="store_false",
                    help="receive the exchange into a fresh tensor (page faults) instead of a preallocated "
                         "buffer like a KV cache")
    ap.add_argument("--out", default="bench/results/exchange.json")
    args = ap.parse_args()
    q = args.quick
    args.kv_mib = args.kv_mib or (32 if q else 128)
    args.idle_acts = args.idle_acts or (50 if q else 300)
    args.repeats = args.repeats or (1 if q else 3)
    args.targets = [float(x) for x in args.targets.split(",")]
    torch.set_num_threads(1)
    res = asyncio.run(main_async(args))
    meta = {"kv_mib": args.kv_mib, "act_kib": args.act_kib, "act_interval_ms": args.act_interval_ms,
            "targets_ms": args.targets, "kv_pool": args.kv_pool, "repeats": args.repeats, "quick": q, "host": platform.node(),
            "cpus": os.cpu_count(), "ucx_tls": os.environ.get("UCX_TLS", "tcp"),
            "progress_mode": os.environ.get("UCXPY_PROGRESS_MODE", "blocking")}
    res["summary"] = summarize(res["results"])
    res["meta"] = meta
    print_table(res["summary"], meta)
    if args.out:
        write_json(args.out, res)


if __name__ == "__main__":
    main()
