"""Decision -> first queued token and activation ITL during a drop's KV exchange, on a real local cluster.

Issue 15's targets: the time from a drop's decision to the first token of a request that was queued for memory must
not grow with the KV the drop moves (<= 50 ms whether 5 MiB or 200 MiB moves), and the inter-token latency (ITL) of
the requests that run during the exchange must stay within 1.5x of idle. Each `--modes` entry is a 2-worker cluster
of its own: `coordinated` (memory_manager.coordinated_exchange = true: members resume at Commit, the KV lands in the
background, only the moved requests wait), `coordinated-cold` (the same with engine.warm_staging = false: each drop
allocates the host buffer its outgoing KV is copied into at Prepare, page faults included) and `blocking` (false:
every member pauses until the exchange landed).
Each cluster first makes one unmeasured drop and restore while empty (a cluster's first transition also opens the
transfer links). Then each `--loads` entry (REQUESTSxPROMPT) runs `--repeats` times; one repeat:

1. **Fill.** REQUESTS requests of PROMPT tokens decode, their max_tokens chosen so that their whole-life KV fills
   each worker's KV (`kv_blocks_total`). The workers admit a request only when its whole life fits
   (policy.overload = "queue": the scheduler's preemption = none; no monitor drops, this driver does), so the load
   is never preempted and a request sent now genuinely waits for memory, as when the monitor decides to drop. The
   dispatcher balances by the KV in use, not by whole lives: requests it puts on a full worker wait, top-ups go
   until each worker is at most one request short, then the waiting ones are cancelled. The KV that moves is what
   the load holds at the drop (prompt + tokens so far): PROMPT sets it. With 2 workers merging into one pair every
   running request moves half of its layers' KV. engine.max_num_seqs is raised to hold every request in one head.
2. **Decision.** Once every loaded request is decoding: t0; `--queued` new requests (32-token prompts, greedy, a
   whole life longer than what a worker one request short keeps free) go to the dispatcher, and
   MemoryManager.Drop is called (as drop.py does).
3. Measured from t0: **first queued token** (the earliest and the latest first token of the queued requests), the
   Drop RPC and the report's split, and **moved resume**: when the last loaded request produced a token after the
   pause (which starts where the whole load falls silent, before the Drop returns); coordinated, a request resumes
   once its KV has landed. Also the load's decode step just before t0 (a whole instance's iteration: Prepare
   waits for the engine between iterations).
4. **Activation ITL**: the gaps between consecutive tokens of the queued requests, pooled over them and over the
   repeats, in three windows:
   - *exchange*: gaps that end by moved resume, while some moved request's KV was still in flight (the queued
     requests and the moved ones already landed are scheduled; blocking mode has none: nothing runs then);
   - *after*: the `--after-s` that follow, the whole landed load decoding beside them: the issue's "idle" (the
     same group and requests, no exchange), the ratio the target is about;
   - *alone*: after the load is cancelled, `--alone-s` of the queued requests alone in the same group, no exchange.
5. Cancel everything, MemoryManager.Restore (nothing left to move), wait for two empty whole instances.

    python bench/drop_first_token.py --quick
    python bench/drop_first_token.py --loads 112x8,112x800 --repeats 3 --out bench/results/drop_first_token.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from drop import MODES, apply_mode  # drop.py imports harness first, which puts the repository on sys.path
from harness import bench_cluster, run_on, write_json

from kunserve import client  # noqa: E402
from kunserve.benchkit.repeats import spread  # noqa: E402
from kunserve.benchkit.replay import prompt_ids  # noqa: E402
from kunserve.benchkit.stats import percentiles  # noqa: E402
from kunserve.cli.launcher import LocalCluster  # noqa: E402
from kunserve.shared.config import ClusterConfig  # noqa: E402
from kunserve.shared.engine.kv_blocks import blocks_needed  # noqa: E402
from kunserve.shared.model.weights import load_model_source  # noqa: E402
from kunserve.v1 import admin_pb2_grpc, common_pb2, memory_manager_pb2, memory_manager_pb2_grpc  # noqa: E402

WORKERS = 2  # every running request moves: the drop merges the two instances into one pair
QUEUED_PROMPT = 32
SETTLE_S = 0.3  # after cancelling the load, before the "alone" window: the cancellations reach the workers
WAIT_S = 120.0  # the load reaching decode, the moved requests resuming, the cluster emptying after a repeat
CALM_POLLS = 3  # status polls (0.2 s apart) that must agree before requests count as waiting for memory
FILL_ROUNDS = 8
WINDOWS = ("exchange", "after", "alone")
SCALARS = ("kv_bytes_moved", "requests_moved", "loaded", "drop_rpc_s", "plan_s", "prepare_s", "exchange_s", "pause_s",
           "first_token_s", "last_first_token_s", "moved_resume_s", "restore_rpc_s", "load_step_s")


@dataclass(frozen=True)
class Load:
    requests: int
    prompt: int

    @property
    def label(self) -> str:
        return f"{self.requests}x{self.prompt}"


@dataclass(eq=False)
class Stream:
    """One request in flight: its whole-life KV blocks, the perf_counter of each token as it arrives, and the
    worker that sent the last one."""

    life: int
    times: list[float] = field(default_factory=list)
    worker: str = ""
    task: asyncio.Task[Any] = field(init=False)


@dataclass
class Bench:
    """One cluster's connections and the sizes a fill is computed from."""

    args: argparse.Namespace
    ch: grpc.aio.Channel
    mm: memory_manager_pb2_grpc.MemoryManagerStub
    admin: admin_pb2_grpc.AdminStub
    capacity: dict[str, int]  # worker -> KV blocks holding every layer
    block_size: int
    context: int

    @property
    def max_life(self) -> int:
        """The longest whole life in blocks a request may have: prompt + max_tokens within the model context."""
        return (self.context - 1) // self.block_size

    def send(self, prompt: list[int], max_tokens: int) -> Stream:
        s = Stream(blocks_needed(len(prompt) + max_tokens - 1, self.block_size))

        def seen(ev: Any) -> None:
            if ev.token_id >= 0:
                s.times.append(time.perf_counter())
                s.worker = ev.worker_id

        req = client.make_request(prompt, max_tokens=max_tokens, ignore_eos=True)
        s.task = asyncio.create_task(client.generate(self.ch, req, timeout=600, on_event=seen))
        return s


def make_cluster(args: argparse.Namespace, mode: str) -> LocalCluster:
    def configure(cfg: ClusterConfig) -> None:
        apply_mode(cfg, mode)
        cfg.policy.overload = "queue"  # whole-life admission: the load fills memory without ever being preempted
        cfg.dispatcher.route_timeout_s = 120.0
        cfg.dispatcher.queue_timeout_s = 300.0  # the last loaded request waits for the others' prefill
        # after the drop one group head batches every request of both workers (and the dispatcher admits as many)
        cfg.engine.max_num_seqs = max(cfg.engine.max_num_seqs, max(ld.requests for ld in args.loads) + args.queued)

    return bench_cluster(f"first-token-{mode}", WORKERS, args.pool_mib, configure=configure)


async def cancel(streams: list[Stream]) -> None:
    """End the streams (the dispatcher cancels their worker calls, which frees their KV); a stream that failed
    before raises its error here."""
    for s in streams:
        s.task.cancel()
    for s in streams:
        try:
            await s.task
        except asyncio.CancelledError:
            pass


async def status(admin: admin_pb2_grpc.AdminStub) -> list[Any]:
    return [ws.stats for ws in (await admin.GetStatus(common_pb2.Empty(), timeout=10)).cluster.workers]


async def until_idle(admin: admin_pb2_grpc.AdminStub) -> list[Any]:
    """Wait until both workers are whole instances holding no KV and report them: a fill must start empty."""
    deadline = time.perf_counter() + WAIT_S
    while True:
        stats = await status(admin)
        if len(stats) == WORKERS and all(s.serving and not s.transitioning and s.kv_blocks_used == 0 and
                                         s.layer_end - s.layer_start == s.num_layers_model for s in stats):
            return stats
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the cluster did not become two empty whole instances within {WAIT_S:.0f} s: "
                               f"{[(s.worker_id, s.serving, s.kv_blocks_used, s.num_running) for s in stats]}")
        await asyncio.sleep(0.1)


@dataclass(frozen=True)
class Plan:
    """How a load fills the workers: its requests' max_tokens and whole lives, and the queued requests'."""

    max_tokens: int
    life: int  # KV blocks
    queued_life: int
    block_size: int

    @property
    def queued_max_tokens(self) -> int:
        return self.queued_life * self.block_size - QUEUED_PROMPT + 1


def plan(b: Bench, load: Load) -> Plan:
    """The loaded requests' whole lives fill each worker's KV, and a queued request's life is longer than what a
    worker keeps free even when the dispatcher put one request fewer on it (it balances by the KV in use, not
    by whole lives), so the queued requests wait for the drop."""
    capacity = min(b.capacity.values())
    per_worker = load.requests // WORKERS
    life = capacity // per_worker
    left = capacity - per_worker * life
    queued_life = life + left + 1
    if queued_life > b.max_life:
        raise SystemExit(f"load {load.label}: {per_worker} requests per worker have whole lives of {life} KV blocks; "
                         f"a queued request must have more than {life + left} (one request short), the model context "
                         f"allows {b.max_life}: more requests or a smaller --pool-mib")
    max_tokens = life * b.block_size - load.prompt + 1  # blocks_needed(prompt + max_tokens - 1) == life
    if max_tokens < 2:
        raise SystemExit(f"load {load.label}: {load.prompt}-token prompts leave no room to decode in {life} blocks: "
                         f"fewer requests or a larger --pool-mib")
    return Plan(max_tokens, life, queued_life, b.block_size)


async def settle(b: Bench, streams: list[Stream], label: str) -> list[Stream]:
    """Until every request decodes, or those still without a token wait for memory (a worker got more than it
    holds for whole lives). Returns the waiting ones."""
    deadline = time.perf_counter() + WAIT_S
    calm = 0
    while not all(len(s.times) >= 2 for s in streams):
        for s in streams:
            if s.task.done():
                s.task.result()
                raise RuntimeError(f"load {label}: a request ended before the drop: fewer prompt tokens")
        waiting = [s for s in streams if not s.times]
        on = Counter(s.worker for s in streams if s.times)
        if all(len(s.times) >= 2 for s in streams if s.times):
            stats = await status(b.admin)
            quiet = all(st.num_running == on[st.worker_id] for st in stats) and \
                sum(st.num_waiting for st in stats) == len(waiting)
            calm = calm + 1 if quiet else 0
            if calm >= CALM_POLLS:
                return waiting
        else:
            calm = 0
        if time.perf_counter() > deadline:
            raise RuntimeError(f"load {label}: {len(waiting)} requests without a token after {WAIT_S:.0f} s")
        await asyncio.sleep(0.2 if waiting else 0.02)
    return []


async def fill(b: Bench, load: Load, p: Plan, seed: int) -> list[Stream]:
    """The load, every request of it decoding and no worker with room for a queued request. The dispatcher
    balances by the KV in use, not by whole lives, so it can put more requests on one worker than that worker
    holds: those wait, and top-ups are sent for what the other worker still has room for; the waiting ones stay
    until the end (their queued prompts steer the dispatcher away from the full worker), then are cancelled
    (they hold no KV)."""
    streams = [b.send(prompt_ids(i, load.prompt, seed), p.max_tokens) for i in range(load.requests)]
    try:
        for _ in range(FILL_ROUNDS):
            waiting = await settle(b, streams, load.label)
            on = Counter(s.worker for s in streams if s.times)
            room = {w: (capacity - on[w] * p.life) // p.life for w, capacity in b.capacity.items()}
            if all(capacity - on[w] * p.life < p.queued_life for w, capacity in b.capacity.items()):
                await cancel(waiting)
                return [s for s in streams if s not in waiting]
            # one request short is within the plan; at least one more when capacities differ between workers
            top = sum(max(0, r - 1) for r in room.values()) or 1
            streams += [b.send(prompt_ids(len(streams) + i, load.prompt, seed), p.max_tokens) for i in range(top)]
    except BaseException:
        await cancel(streams)
        raise
    await cancel(streams)
    raise RuntimeError(f"load {load.label}: the workers were not full after {FILL_ROUNDS} rounds of top-ups")


def pause_start(streams: list[Stream], t0: float, t_ret: float) -> float:
    """When the drop paused the load: the last token of any loaded request before the longest silence of the
    whole load that began between t0 and the Drop's return (one request's own longest gap can be a slow step)."""
    ts = sorted(t for s in streams for t in s.times)
    i = max(0, bisect.bisect_right(ts, t0) - 1)
    return max(((a, b) for a, b in zip(ts[i:], ts[i + 1:]) if a < t_ret), key=lambda p: p[1] - p[0])[0]


def gaps(streams: list[Stream], lo: float, hi: float) -> list[float]:
    """Inter-token gaps of the streams that lie within [lo, hi]."""
    return [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if lo <= a and b <= hi]


async def resumed(streams: list[Stream], since: float) -> None:
    """Until every stream has produced a token after `since`."""
    deadline = time.perf_counter() + WAIT_S
    while not all(s.times and s.times[-1] > since for s in streams):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"moved requests produced nothing within {WAIT_S:.0f} s of the drop")
        await asyncio.sleep(0.002)


async def repeat(b: Bench, mode: str, load: Load, p: Plan, rep: int) -> dict[str, Any]:
    args = b.args
    loaded = await fill(b, load, p, seed=rep)
    t0 = time.perf_counter()
    queued = [b.send(prompt_ids(10_000 + i, QUEUED_PROMPT, rep), p.queued_max_tokens) for i in range(args.queued)]
    drop = await b.mm.Drop(memory_manager_pb2.DropRequest(reason="bench"), timeout=300)
    t_ret = time.perf_counter()
    if not drop.completed:
        await cancel(loaded + queued)
        raise RuntimeError(f"{mode} {load.label}: the drop did not complete: {drop.error}")
    await resumed(loaded, t_ret)
    await asyncio.sleep(args.after_s)
    t_cancel = time.perf_counter()
    await cancel(loaded)
    await asyncio.sleep(SETTLE_S + args.alone_s)
    t_end = time.perf_counter()
    await cancel(queued)
    t = time.perf_counter()
    restore = await b.mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=300)
    restore_rpc_s = time.perf_counter() - t
    if not restore.completed:
        raise RuntimeError(f"{mode} {load.label}: the restore did not complete: {restore.error}")
    await until_idle(b.admin)

    paused_from = pause_start(loaded, t0, t_ret)
    t_land = max(next(t for t in s.times if t > paused_from) for s in loaded)  # the last moved request resumed
    if not all(len(s.times) > 1 for s in queued):
        raise RuntimeError(f"{mode} {load.label}: a queued request got fewer than 2 tokens")
    firsts = [s.times[0] for s in queued]
    return {"mode": mode, "load": load.label, "repeat": rep, "max_tokens": p.max_tokens, "loaded": len(loaded),
            "queued_max_tokens": p.queued_max_tokens,
            "kv_bytes_moved": drop.kv_bytes_moved, "requests_moved": drop.requests_moved,
            "kv_in_background": drop.kv_in_background, "drop_rpc_s": t_ret - t0, "pause_s": drop.pause_seconds,
            "plan_s": drop.plan_seconds, "prepare_s": drop.prepare_seconds, "exchange_s": drop.exchange_seconds,
            "first_token_s": min(firsts) - t0, "last_first_token_s": max(firsts) - t0,
            "queued_before_pause": sum(f < paused_from for f in firsts), "moved_resume_s": t_land - t0,
            "restore_rpc_s": restore_rpc_s, "load_step_s": percentiles(gaps(loaded, t0 - 1.0, t0))["p50"],
            "itl_exchange_s": gaps(queued, t0, t_land), "itl_after_s": gaps(queued, t_land, t_cancel),
            "itl_alone_s": gaps(queued, t_cancel + SETTLE_S, t_end)}


async def warm_up(b: Bench) -> None:
    """An unmeasured drop and restore of the empty cluster: on this bench's fresh clusters the first drop also
    opened the workers' transfer links (~350 ms inside Prepare, although memory_manager.preconnect is on), a
    one-time cost that is not the exchange's."""
    for report in (await b.mm.Drop(memory_manager_pb2.DropRequest(reason="bench warm-up"), timeout=300),
                   await b.mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=300)):
        if not report.completed:
            raise RuntimeError(f"warm-up {report.op} did not complete: {report.error}")
    await until_idle(b.admin)


async def main_async(args: argparse.Namespace, c: LocalCluster, mode: str) -> list[dict[str, Any]]:
    rows = []
    context = load_model_source(c.cfg.model.path or None).config.max_position_embeddings
    creds = client.credentials_from(c.cfg, environ={})  # the admin token LocalCluster wrote
    async with client.admin_channel(c.cfg.memory_manager.address, creds) as adm, \
            client.insecure_channel(c.cfg.dispatcher.address) as ch:
        admin = admin_pb2_grpc.AdminStub(adm)
        stats = await until_idle(admin)
        b = Bench(args, ch, memory_manager_pb2_grpc.MemoryManagerStub(adm), admin,
                  {s.worker_id: s.kv_blocks_total for s in stats}, stats[0].block_size, context)
        await warm_up(b)
        for load in args.loads:
            p = plan(b, load)
            for rep in range(args.repeats):
                r = await repeat(b, mode, load, p, rep)
                rows.append(r)
                print(f"  {mode} {load.label} repeat {rep + 1}/{args.repeats}: {r['kv_bytes_moved'] / 2**20:.1f} MiB "
                      f"moved, drop {r['drop_rpc_s'] * 1e3:.0f} ms, first queued token {r['first_token_s'] * 1e3:.0f} ms, "
                      f"moved resume {r['moved_resume_s'] * 1e3:.0f} ms, ITL gaps exchange/after/alone "
                      f"{len(r['itl_exchange_s'])}/{len(r['itl_after_s'])}/{len(r['itl_alone_s'])}", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and load: median and range of each per-repeat number; ITL percentiles of the gaps pooled over
    the repeats (a single repeat's exchange window holds only a few)."""
    out = []
    for key in dict.fromkeys((r["mode"], r["load"]) for r in rows):
        rs = [r for r in rows if (r["mode"], r["load"]) == key]
        s: dict[str, Any] = {"mode": key[0], "load": key[1], "runs": len(rs),
                             "queued_before_pause": sum(r["queued_before_pause"] for r in rs)}
        s.update({k: spread([r[k] for r in rs]) for k in SCALARS})
        s.update({f"itl_{w}": percentiles(g for r in rs for g in r[f"itl_{w}_s"]) for w in WINDOWS})
        ex, after, alone = (s[f"itl_{w}"]["p99"] for w in WINDOWS)
        s["itl_p99_exchange_over_alone"] = ex / alone if ex is not None and alone else None
        s["itl_p99_exchange_over_after"] = ex / after if ex is not None and after else None
        out.append(s)
    return out


def ms(x: float | None, width: int) -> str:
    return f"{x * 1e3:{width}.1f}" if x is not None else f"{'-':>{width}}"


def print_table(summary: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"\ndrop decision -> first queued token, activation ITL during the exchange — {WORKERS} workers, "
          f"{meta['pool_mib']} MiB pools, {meta['queued']} queued requests; medians over {meta['repeats']} runs, "
          f"ms from the decision (first queued token: median [min-max]); step: the load's decode step before it; "
          f"ITL p50/p99 (n gaps) of the queued requests, "
          f"pooled over the runs")
    hdr = (f"{'mode':12} {'load':>8} {'KV MiB':>6} {'step':>5} {'drop':>6} {'prepare':>7} {'paused':>6} {'1st queued token':>20} "
           f"{'last':>6} {'moved resume':>12} {'ITL exchange':>18} {'ITL after':>18} {'ITL alone':>18} "
           f"{'p99 exch/after':>14} {'/alone':>6}")
    print(hdr)
    print("-" * len(hdr))

    def itl(d: dict[str, Any]) -> str:
        return f"{ms(d['p50'], 5)}/{ms(d['p99'], 6)} ({d['n']:3d})"

    def ratio(x: float | None, width: int) -> str:
        return f"{x:{width}.2f}" if x is not None else f"{'-':>{width}}"

    for s in summary:
        med = {k: s[k]["median"] for k in SCALARS}
        ft = s["first_token_s"]
        first = f"{ms(med['first_token_s'], 6)} [{ms(ft['min'], 5).strip()}-{ms(ft['max'], 5).strip()}]"
        print(f"{s['mode']:12} {s['load']:>8} {med['kv_bytes_moved'] / 2**20:6.1f} {ms(med['load_step_s'], 5)} {ms(med['drop_rpc_s'], 6)} "
              f"{ms(med['prepare_s'], 7)} {ms(med['pause_s'], 6)} {first:>20} {ms(med['last_first_token_s'], 6)} "
              f"{ms(med['moved_resume_s'], 12)} {itl(s['itl_exchange']):>18} {itl(s['itl_after']):>18} "
              f"{itl(s['itl_alone']):>18} {ratio(s['itl_p99_exchange_over_after'], 14)} "
              f"{ratio(s['itl_p99_exchange_over_alone'], 6)}")
    for s in summary:
        if s["queued_before_pause"]:
            print(f"note: {s['mode']} {s['load']}: {s['queued_before_pause']} queued requests got a token before the "
                  "load paused (they did not wait for the drop: the fill left room)")


def parse_loads(text: str) -> list[Load]:
    try:
        loads = [Load(*(int(x) for x in part.split("x", 1))) for part in text.split(",") if part]
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: REQUESTSxPROMPT entries such as 112x8,112x800") from None
    if not loads or any(ld.requests < WORKERS or ld.requests % WORKERS or ld.prompt < 1 for ld in loads):
        raise argparse.ArgumentTypeError(f"{text!r}: an even number of requests (>= {WORKERS}) and a prompt per load")
    return loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="loads 112x8,112x380, 1 repeat, 0.5 s windows")
    ap.add_argument("--modes", default="coordinated,coordinated-cold,blocking",
                    help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--loads", type=parse_loads, default=None,
                    help="REQUESTSxPROMPT, comma-separated: the requests decoding at the decision and their prompt "
                         "tokens, which set the KV moved (default 112x8,112x800: about 10-30 and 200 MiB; "
                         "the fill needs >= 78 requests, each holding what it decoded while the fill settles)")
    ap.add_argument("--pool-mib", type=int, default=320, help="memory pool per worker (default 320); the loads fill its KV")
    ap.add_argument("--queued", type=int, default=4, help="requests sent at the decision (default 4)")
    ap.add_argument("--after-s", type=float, default=None, help="ITL window after the landing (default 1; quick 0.5)")
    ap.add_argument("--alone-s", type=float, default=None, help="ITL window of the queued requests alone "
                                                                "(default 1; quick 0.5)")
    ap.add_argument("--repeats", type=int, default=None, help="drop + restore cycles per load (default 3; quick 1)")
    ap.add_argument("--out", default="bench/results/drop_first_token.json")
    args = ap.parse_args()
    q = args.quick
    args.loads = args.loads or parse_loads("112x8,112x380" if q else "112x8,112x800")
    args.repeats = args.repeats or (1 if q else 3)
    args.after_s = args.after_s if args.after_s is not None else (0.5 if q else 1.0)
    args.alone_s = args.alone_s if args.alone_s is not None else (0.5 if q else 1.0)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: from {', '.join(MODES)}")
    if args.queued < 1:
        ap.error("--queued: at least 1")

    def run_mode(mode: str) -> list[dict[str, Any]]:
        return run_on(make_cluster(args, mode), lambda c: main_async(args, c, mode))

    rows = [r for m in modes for r in run_mode(m)]
    meta: dict[str, Any] = {k: getattr(args, k) for k in ("modes", "pool_mib", "queued", "after_s", "alone_s",
                                                          "repeats", "quick")}
    meta.update(workers=WORKERS, loads=[ld.label for ld in args.loads], host=platform.node(), cpus=os.cpu_count())
    summary = summarize(rows)
    print_table(summary, meta)
    if args.out:
        write_json(args.out, {"meta": meta, "summary": summary, "runs": rows})


if __name__ == "__main__":
    main()
