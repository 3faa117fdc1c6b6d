"""Decode speed of a live 2-stage pipeline group against a whole instance at the same per-instance load
(issue 15, item 5: KunServe's TPOT penalty after a drop should stay small).

Two real local clusters of the embedded model, one after the other: one worker serving alone (a whole
instance, `--streams` closed-loop streams), and two workers paired into one pipeline group from the start
(policy static-pp, 2 x `--streams` streams: the same load per worker). Every stream sends the same kind of
request again and again (a `--prompt`-token prompt, `--output` tokens, ignore_eos) over the dispatcher, as a
client would. After `--warmup` seconds the window opens; it closes `--duration` seconds later. Measured
in the window:

* TPOT: the gaps between consecutive tokens of a stream, at the client (p50, p90);
* per worker, from its busy / idle accounting (WorkerStats, through the admin status): the share of the
  window it computed (busy), and for a whole instance or a group's head the share it idled while requests
  were queued or in flight (bubble). A group's later stage computes only its microbatches; the rest of its
  window is idle;
* the token rate of each cluster, and the cores each process used (CPU seconds per second of the window:
  what the workers had to share the machine with).

LIMITATION, printed with the results: every process of a cluster (dispatcher, memory manager, monitor, the
workers) shares this machine's cores; on 2 cores the two workers of a group compete with each other and
with the dispatcher for them, which a group of separate machines or GPUs does not.

    python bench/pipeline_tpot.py --quick
    python bench/pipeline_tpot.py --streams 8 --duration 20 --out bench/results/pipeline_tpot.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from harness import bench_cluster, run_on, write_json  # first: it puts the repository on sys.path

from kunserve import client  # noqa: E402
from kunserve.benchkit.replay import prompt_ids  # noqa: E402
from kunserve.cli.kunctl import status_groups  # noqa: E402
from kunserve.cli.launcher import LocalCluster  # noqa: E402
from kunserve.shared.config import ClusterConfig  # noqa: E402
from kunserve.v1 import admin_pb2_grpc, common_pb2  # noqa: E402

LIMITATION = ("all processes of a cluster share this machine's cores: on 2 cores the group's two workers compete "
              "with each other and with the dispatcher, which workers on separate machines or GPUs do not")


async def _status(c: LocalCluster):
    creds = client.credentials_from(c.cfg, environ={})
    async with client.admin_channel(c.cfg.memory_manager.address, creds) as ch:
        return await admin_pb2_grpc.AdminStub(ch).GetStatus(common_pb2.Empty(), timeout=5.0)


async def _wait_for_units(c: LocalCluster, members: int, timeout_s: float = 60.0) -> None:
    """Until every unit has `members` members and serves (static-pp pairs the workers after the start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await _status(c)
        groups = status_groups(status)
        if groups and all(len(g.members) == members and g.serving and not g.transitioning for g in groups):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the cluster's units did not reach {members} member(s) within {timeout_s:g} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(c: LocalCluster) -> dict[str, float]:
    """CPU seconds so far of every service process and of this client."""
    out = {ch.name: cpu_seconds(ch.proc.pid) for ch in c.children if ch.proc is not None and ch.proc.poll() is None}
    out["bench client"] = time.process_time()
    return out


def _accounting(status) -> dict[str, tuple[float, float]]:
    return {ws.stats.worker_id: (ws.stats.busy_seconds_total, ws.stats.bubble_seconds_total)
            for ws in status.cluster.workers}


async def closed_loop(c: LocalCluster, streams: int, args) -> dict[str, Any]:
    creds = client.credentials_from(c.cfg, environ={})
    t0 = time.monotonic()
    opens, closes = t0 + args.warmup, t0 + args.warmup + args.duration
    gaps: list[float] = []
    tokens = 0
    before: dict[str, Any] = {}
    cores: dict[str, float] = {}  # CPU seconds per second of the window, per process

    async with client.dispatcher_channel(c.cfg.dispatcher.address, creds) as ch:
        async def stream(k: int) -> None:
            nonlocal tokens
            i = 0
            while time.monotonic() < closes:
                last: list[float] = []

                def seen(ev, last=last) -> None:
                    nonlocal tokens
                    if ev.token_id < 0:
                        return
                    now = time.monotonic()
                    if opens <= now <= closes:
                        tokens += 1
                        if last and last[0] >= opens:
                            gaps.append(now - last[0])
                    last[:] = [now]

                req = client.make_request(prompt_ids(k * 100_000 + i, args.prompt, args.seed), max_tokens=args.output,
                                          ignore_eos=True)
                await client.generate(ch, req, timeout=120, on_event=seen)
                i += 1

        async def snapshots() -> dict[str, Any]:
            await asyncio.sleep(max(0.0, opens - time.monotonic()))
            cpu0 = _cpu(c)
            before.update(_accounting(await _status(c)), t=time.monotonic())
            await asyncio.sleep(max(0.0, closes - time.monotonic()))
            after = _accounting(await _status(c))
            window = time.monotonic() - before["t"]
            cpu1 = _cpu(c)
            cores.update({k: (cpu1[k] - cpu0[k]) / window for k in cpu1 if k in cpu0})
            return {w: {"busy": (after[w][0] - before[w][0]) / window, "bubble": (after[w][1] - before[w][1]) / window}
                    for w in after if w in before}

        snap = asyncio.create_task(snapshots())
        await asyncio.gather(*(stream(k) for k in range(streams)))
        per_worker = await snap
    q = statistics.quantiles(gaps, n=10) if len(gaps) >= 10 else [float("nan")] * 9
    return {"streams": streams, "tpot_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "tpot_p90_ms": 1e3 * q[8], "tokens_per_s": tokens / args.duration, "gaps": len(gaps),
            "workers": per_worker, "cores_used": cores}


def measure(name: str, workers: int, streams: int, args) -> dict[str, Any]:
    def configure(cfg: ClusterConfig) -> None:
        cfg.policy.overload = "static-pp" if workers > 1 else "recompute"
        cfg.engine.max_num_batched_tokens = args.budget

    c = bench_cluster(name, workers, args.pool_mib, configure=configure)

    async def go(cl: LocalCluster) -> dict[str, Any]:
        await _wait_for_units(cl, workers)
        return await closed_loop(cl, streams, args)

    return run_on(c, go)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a shorter window (8 s)")
    ap.add_argument("--streams", type=int, default=8, help="closed-loop streams per worker")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--duration", type=float, default=0.0, help="measured window (s; default 15, quick 8)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--budget", type=int, default=256, help="engine.max_num_batched_tokens")
    ap.add_argument("--pool-mib", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/pipeline_tpot.json")
    args = ap.parse_args(argv)
    args.duration = args.duration or (8.0 if args.quick else 15.0)
    result: dict[str, Any] = {"args": vars(args), "limitation": LIMITATION, "loadavg_start": os.getloadavg()}
    whole = measure("tpot-whole", 1, args.streams, args)
    group = measure("tpot-group", 2, 2 * args.streams, args)
    result.update(whole=whole, group=group, loadavg_end=os.getloadavg())
    ratio = group["tpot_p50_ms"] / whole["tpot_p50_ms"] if whole["tpot_p50_ms"] and group["tpot_p50_ms"] else None
    result["tpot_p50_ratio"] = ratio
    for label, r in (("whole instance", whole), ("2-stage group", group)):
        per = ", ".join(f"{w} busy {100 * v['busy']:.0f}% bubble {100 * v['bubble']:.0f}%"
                        for w, v in sorted(r["workers"].items()))
        print(f"{label:15s} {r['streams']:3d} streams: TPOT p50 {r['tpot_p50_ms']:.2f} ms, p90 {r['tpot_p90_ms']:.2f} ms, "
              f"{r['tokens_per_s']:.0f} tok/s; {per}")
        print(f"{'':15s} cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cores_used"].items())))
    print(f"TPOT p50 group / whole: {ratio:.2f}x" if ratio else "TPOT: no tokens measured")
    print(f"note: {LIMITATION}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
