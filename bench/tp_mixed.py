"""The mixed trace of `python bench/tp.py --mixed` (after Gyges §6.2.4): short requests at a steady open-loop rate and
a few long-context requests at fixed times, replayed into a real 2-worker LocalCluster in three configurations.

- ``elastic``: two whole instances, ``dispatcher.elastic_tp = true``: a long request makes the memory manager merge them
  into one TP2 instance (a cold re-form: the members re-execute, running requests are handed over and re-prefill),
  which splits back into whole instances once it has held no request for ``memory_manager.tp_idle_split_s``.
- ``static-tp1``: two whole instances, elastic off: a long request is refused (INVALID_ARGUMENT: no instance holds it).
- ``static-tp2``: the two workers as one TP2 instance from the config (``[[tensor_parallel]]``) throughout.

The model is the embedded one saved as a checkpoint with an 8192-token context, in the integration tests' pools (26
MiB of 256 KiB pages): a whole instance keeps KV for fewer tokens than a long request needs, the TP2 instance for
several times more (``kv_tokens_by_degree``). Everything is measured at the client (TTFT from the call to its first
token) except the transformations, which are the memory manager's own ``tp_reform_done`` events (their ``ms``) in its
log.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from harness import bench_cluster  # first: it puts the repository on sys.path

from kunserve import client  # noqa: E402
from kunserve.benchkit.stats import percentiles  # noqa: E402
from kunserve.cli.launcher import LocalCluster  # noqa: E402
from kunserve.shared.config import ClusterConfig, TensorParallelSection  # noqa: E402
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig  # noqa: E402
from kunserve.shared.model.reference import reference_scores  # noqa: E402
from kunserve.shared.model.tp_capacity import kv_tokens_by_degree  # noqa: E402
from kunserve.shared.model.weights import Weights, random_weights, save_checkpoint  # noqa: E402

MEMBERS = ["worker-0", "worker-1"]
POOL_MIB, PAGE_KIB, BLOCK_SIZE = 26, 256, 16
CONTEXT = 8192
SHORT_PROMPT = (64, 200)
SHORT_OUTPUT = 32
LONG_OUTPUT = 16
NEAR_TIE = 1e-3  # the token-identity oracle's margin (DESIGN.md): below it a greedy divergence is legitimate
REQUEST_TIMEOUT_S = 300.0
SPLIT_WAIT_S = 90.0  # elastic: after the trace, how long to wait for the merged instance to split back


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    at_s: float  # since the trace's start
    prompt: tuple[int, ...]
    max_tokens: int
    long: bool


def capacity() -> dict[int, int]:
    """KV tokens of an instance of the bench's pools at each TP degree (1 and 2 for the embedded model)."""
    return kv_tokens_by_degree(
        TINY_CONFIG, num_pages=POOL_MIB * 1024 // PAGE_KIB, page_size=PAGE_KIB * 1024, block_size=BLOCK_SIZE, device_type="cpu"
    )


def make_trace(duration_s: float, rate: float, longs: int, seed: int, kv: dict[int, int]) -> list[TraceRequest]:
    """Shorts every 1/rate s from 0 to duration_s; `longs` long requests at even fractions of the duration, each
    prompt + output a little more than a whole instance's KV (kv[1]) and well within the TP2 instance's (kv[2])."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    n_short = int(duration_s * rate)
    for i in range(n_short):
        length = rng.randint(*SHORT_PROMPT)
        prompt = tuple(rng.randrange(10, TINY_CONFIG.vocab_size) for _ in range(length))
        out.append(TraceRequest(f"short-{i}", i / rate, prompt, SHORT_OUTPUT, False))
    for j in range(longs):
        length = kv[1] + 64 * (j + 1) - LONG_OUTPUT
        if length + LONG_OUTPUT > kv[2] // 2:
            raise ValueError(f"long request {j}: {length + LONG_OUTPUT} tokens leave too little of the TP2 KV ({kv[2]})")
        prompt = tuple(rng.randrange(10, TINY_CONFIG.vocab_size) for _ in range(length))
        out.append(TraceRequest(f"long-{j}", duration_s * (j + 1) / (longs + 1), prompt, LONG_OUTPUT, True))
    return sorted(out, key=lambda r: r.at_s)


def make_cluster(kind: str, model_dir: Path, idle_split_s: float) -> LocalCluster:
    def configure(cfg: ClusterConfig) -> None:
        cfg.model.path = str(model_dir)
        cfg.engine.page_kib = PAGE_KIB
        cfg.engine.block_size = BLOCK_SIZE
        cfg.engine.budget = "fixed"  # no cost-model profile to measure at start-up
        cfg.engine.lookahead = False
        # a request waits through a cold re-form (two re-executions and model loads) on a loaded machine
        cfg.dispatcher.route_timeout_s = 240.0
        cfg.dispatcher.queue_timeout_s = 240.0
        if kind == "elastic":
            cfg.dispatcher.elastic_tp = True
            cfg.memory_manager.tp_idle_split_s = idle_split_s
        elif kind == "static-tp2":
            cfg.tensor_parallel = [TensorParallelSection(members=list(MEMBERS))]

    return bench_cluster(f"tp-{kind}", len(MEMBERS), POOL_MIB, configure=configure)


@dataclass
class Outcome:
    req: TraceRequest
    sent_s: float = 0.0
    done_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: tuple[int, ...] = ()
    worker: str = ""
    code: str = ""  # "" = completed, else the gRPC status name
    details: str = ""


async def replay(address: str, trace: Sequence[TraceRequest]) -> tuple[float, list[Outcome]]:
    """Each request at its time (open loop, one task each). Returns (the trace's start on the wall clock, outcomes);
    every time in an outcome is seconds since the start."""
    async with client.insecure_channel(address) as ch:
        t0, wall0 = time.monotonic(), time.time()

        async def one(r: TraceRequest) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + r.at_s - time.monotonic()))
            out = Outcome(r, sent_s=time.monotonic() - t0)
            res = client.GenerationResult(request_id=r.request_id)
            req = client.make_request(list(r.prompt), request_id=r.request_id, max_tokens=r.max_tokens, ignore_eos=True)
            try:
                await client.generate(ch, req, timeout=REQUEST_TIMEOUT_S, into=res)
            except grpc.aio.AioRpcError as exc:
                out.code, out.details = exc.code().name, exc.details() or ""
            out.done_s = time.monotonic() - t0
            out.ttft_s, out.tpot_s = res.ttft_s, res.mean_tpot_s
            out.tokens, out.worker = tuple(res.token_ids), res.worker_id
            if not out.code and len(out.tokens) != r.max_tokens:
                out.code, out.details = "INCOMPLETE", f"{len(out.tokens)} of {r.max_tokens} tokens ({res.finish_reason})"
            return out

        outcomes = await asyncio.gather(*(one(r) for r in trace))
    return wall0, list(outcomes)


async def warm_up(address: str) -> None:
    """A short request per instance's first batch (kernels, allocator) before anything is measured."""
    async with client.insecure_channel(address) as ch:
        reqs = [client.make_request(list(range(20, 100)), request_id=f"warm-{i}", max_tokens=4, ignore_eos=True) for i in range(4)]
        await asyncio.gather(*(client.generate(ch, r, timeout=REQUEST_TIMEOUT_S) for r in reqs))


def log_events(path: Path, names: Sequence[str]) -> list[dict[str, Any]]:
    """The JSON log lines of `path` whose event is one of `names` (other lines skipped)."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") in names:
            out.append(ev)
    return out


def _epoch(ts: str) -> float:
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def transformations(mm_log: Path, wall0: float) -> list[dict[str, Any]]:
    """Every re-form the memory manager finished or gave up on: op ("tp" = scale-up, "tp-split"), its duration (the
    event's own ms, from the orchestration's start to every member serving) and its start in seconds since the trace's
    start."""
    out = []
    for ev in log_events(mm_log, ("tp_reform_done", "tp_reform_failed")):
        end = _epoch(ev["timestamp"]) - wall0
        if ev["event"] == "tp_reform_done":
            seconds = float(ev["ms"]) / 1e3
            out.append({"op": ev["op"], "members": ev["members"], "seconds": seconds, "start_s": end - seconds, "completed": True})
        else:
            out.append(
                {
                    "op": "failed",
                    "members": ev["members"],
                    "seconds": None,
                    "start_s": end,
                    "completed": False,
                    "error": ev.get("error", ""),
                }
            )
    return out


def wait_for_split(mm_log: Path, timeout_s: float) -> None:
    """Elastic: until every scale-up in the log has a split after it (the idle instance splitting back), or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ops = [ev["op"] for ev in log_events(mm_log, ("tp_reform_done",))]
        if ops.count("tp") <= ops.count("tp-split"):
            return
        time.sleep(0.5)


class ReferenceCheck:
    """Greedy tokens against the dense reference (teacher-forced: one forward per request, kunserve.shared.model.reference),
    each (prompt, tokens) pair computed once: the configurations mostly produce the same tokens for the same trace."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        self.cfg, self.weights = cfg, weights
        self._seen: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
        # One thread: this process shares the cores with the cluster's, and a many-threaded forward of the small
        # model is several times slower than a single-threaded one on a loaded machine.
        torch.set_num_threads(1)

    def __call__(self, prompt: tuple[int, ...], got: tuple[int, ...]) -> str:
        """ "equal", "near-tie" (a divergence where the reference's top-2 margin is below NEAR_TIE, legitimate) or
        "differs"."""
        key = (prompt, got)
        if key not in self._seen:
            ref, margins = reference_scores(self.cfg, self.weights, list(prompt), list(got))
            self._seen[key] = next(("near-tie" if m < NEAR_TIE else "differs" for g, r, m in zip(got, ref, margins) if g != r), "equal")
        return self._seen[key]


def summarize(kind: str, outcomes: Sequence[Outcome], reforms: list[dict[str, Any]], check: ReferenceCheck) -> dict[str, Any]:
    shorts = [o for o in outcomes if not o.req.long]
    done = [o for o in shorts if not o.code]
    longs = [o for o in outcomes if o.req.long]
    end = max((o.done_s for o in outcomes if o.done_s is not None), default=0.0)
    ends = [r["start_s"] + (r["seconds"] or 0.0) for r in reforms]
    wall = max([end, *ends])
    # the shorts' window: from the first arrival to the last short's end (open loop, so a config that falls behind
    # finishes later and its rate drops)
    window = max((o.done_s for o in done if o.done_s is not None), default=0.0)
    tokens = sum(len(o.tokens) for o in done)
    checks = [check(o.req.prompt, o.tokens) for o in done]
    long_rows = []
    for o in longs:
        row: dict[str, Any] = {
            "request_id": o.req.request_id,
            "arrival_s": round(o.req.at_s, 2),
            "tokens": len(o.req.prompt) + o.req.max_tokens,
            "status": "served",
            "ttft_s": o.ttft_s,
            "done_s": o.done_s,
            "worker": o.worker,
        }
        if o.code == "INVALID_ARGUMENT":
            row.update(status="refused", error=o.details)
        elif o.code:
            row.update(status="failed", error=f"{o.code}: {o.details}")
        else:
            row["reference"] = check(o.req.prompt, o.tokens)
        long_rows.append(row)
    served = [r for r in long_rows if r["status"] == "served"]
    ups = [r for r in reforms if r["op"] == "tp"]
    splits = [r for r in reforms if r["op"] == "tp-split"]
    reform_s = sum(r["seconds"] or 0.0 for r in reforms)
    merged_s, since = 0.0, None
    for r in sorted((r for r in reforms if r["completed"]), key=lambda r: r["start_s"]):
        if r["op"] == "tp" and since is None:
            since = r["start_s"] + r["seconds"]
        elif r["op"] == "tp-split" and since is not None:
            merged_s, since = merged_s + r["start_s"] - since, None
    if since is not None:
        merged_s += wall - since
    failures: dict[str, int] = {}
    for o in shorts:
        if o.code:
            failures[o.code] = failures.get(o.code, 0) + 1
    return {
        "config": kind,
        "wall_s": wall,
        "short": {
            "sent": len(shorts),
            "completed": len(done),
            "failed": failures,
            "window_s": window,
            "tokens": tokens,
            "tokens_per_s": tokens / window if window else None,
            "requests_per_s": len(done) / window if window else None,
            "ttft_s": percentiles(o.ttft_s for o in done),
            "tpot_s": percentiles(o.tpot_s for o in done),
            "reference": {k: checks.count(k) for k in ("equal", "near-tie", "differs")},
        },
        "long": {
            "sent": len(longs),
            "served": len(served),
            "refused": sum(r["status"] == "refused" for r in long_rows),
            "failed": sum(r["status"] == "failed" for r in long_rows),
            "requests": long_rows,
            "tokens_equal_reference": (all(r["reference"] != "differs" for r in served) if served else None),
        },
        "transformations": {
            "events": reforms,
            "scale_up_s": [r["seconds"] for r in ups],
            "split_s": [r["seconds"] for r in splits],
            "failed": sum(not r["completed"] for r in reforms),
            "total_s": reform_s,
            "share_of_wall": reform_s / wall if wall else None,
            # serving as the merged TP2 instance: from a scale-up's end to the next split's start
            "merged_s": merged_s,
        },
    }


def run_config(kind: str, model_dir: Path, trace: Sequence[TraceRequest], idle_split_s: float, check: ReferenceCheck) -> dict[str, Any]:
    c = make_cluster(kind, model_dir, idle_split_s)
    print(f"[{kind}] starting a {len(MEMBERS)}-worker cluster (logs in {c.run_dir}) ...", flush=True)
    c.start(timeout_s=180)
    try:
        address = c.cfg.dispatcher.address
        asyncio.run(warm_up(address))
        print(f"[{kind}] replaying {len(trace)} requests over {max(r.at_s for r in trace):.0f} s ...", flush=True)
        wall0, outcomes = asyncio.run(replay(address, trace))
        mm_log = c.run_dir / "memory-manager.log"
        if kind == "elastic":
            wait_for_split(mm_log, SPLIT_WAIT_S)
        reforms = transformations(mm_log, wall0)
    finally:
        c.stop()
    print(f"[{kind}] checking the tokens against the reference ...", flush=True)
    out = summarize(kind, outcomes, reforms, check)
    out["run_dir"] = str(c.run_dir)
    return out


def run_mixed(duration_s: float, rate: float, longs: int, idle_split_s: float, seed: int, configs: Sequence[str]) -> dict[str, Any]:
    kv = capacity()
    trace = make_trace(duration_s, rate, longs, seed, kv)
    weights = random_weights(TINY_CONFIG, seed=0)
    model_dir = save_checkpoint(
        Path(tempfile.mkdtemp(prefix="kunserve-bench-tp-model-")), TINY_CONFIG.replace(max_position_embeddings=CONTEXT), weights
    )
    check = ReferenceCheck(TINY_CONFIG.replace(max_position_embeddings=CONTEXT), weights)
    results = [run_config(kind, model_dir, trace, idle_split_s, check) for kind in configs]
    return {
        "trace": {
            "duration_s": duration_s,
            "short_rate_per_s": rate,
            "short_prompt_tokens": list(SHORT_PROMPT),
            "short_output_tokens": SHORT_OUTPUT,
            "long_requests": [{"at_s": r.at_s, "tokens": len(r.prompt) + r.max_tokens} for r in trace if r.long],
            "seed": seed,
        },
        "pool": {
            "pool_mib": POOL_MIB,
            "page_kib": PAGE_KIB,
            "block_size": BLOCK_SIZE,
            "kv_tokens_by_degree": {str(d): t for d, t in kv.items()},
        },
        "idle_split_s": idle_split_s,
        "configs": results,
    }
