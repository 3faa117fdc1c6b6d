"""Online / offline co-serving benchmark (ConServe §6, Fig. 6/7): an online trace replayed open-loop while an
offline backlog of long prompts keeps the instance busy, under four policies.

- ``online-only``: the online trace alone on the vLLM-style engine (the fixed budget), the reference for online
  latency (ConServe's Online-Only); conserve's SLOs are set from its p99s (ConServe §6.2: SLO = s x Online-Only's
  P99), so it runs first;
- ``non-preemptive``: online + offline, the scheduler class-blind (engine.coserving = "non-preemptive"): offline
  requests scheduled exactly like online ones, nothing preempted for its class, the fixed budget — the upper
  bound on offline throughput;
- ``preemptive``: vLLM-style priority (engine.coserving = "preemptive"): online first, offline admitted greedily
  and preempted by recompute at iteration boundaries, the fixed budget, no layer-wise preemption;
- ``conserve``: everything as built (Algorithm 1 under the SLO-aware budget, layer-wise preemption).

The offline work is sent as gRPC requests of class OFFLINE, not through the batch API: a streamed request gives
each token's arrival time, which the offline tokens/s timeline needs (a batch's results carry no timing). A fixed
number of them is kept in flight (a closed loop: each one that ends is replaced by the next), so the backlog never
runs dry and the waiting queue stays bounded. Their lengths follow the paper's offline sets (Table 1: DuReader,
MultiNews, VCSUM, or a random mix of the three), scaled for a CPU and the embedded 4-layer model.

Offline throughput is ConServe's: tokens processed per second, prompt and output tokens (a prompt's tokens count
when its first token arrives, i.e. when its prefill is done; work thrown away by a recompute preemption does not
count twice), over the measurement window: from the start until the last online request has finished. Then the
offline requests still in flight are cancelled. Online TBT is every gap between two consecutive tokens of an
online request (its p99 is what a user feels), not the per-request mean (TPOT).

Everything but :func:`run_coserve` is pure (no clocks, no I/O), so the report is tested on synthetic results.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kunserve import client
from kunserve.benchkit.repeats import Spread, schedule, spread
from kunserve.benchkit.replay import CHANNELS, open_loop, prompt_ids, wait_reachable
from kunserve.benchkit.stats import RequestResult, percentiles
from kunserve.benchkit.trace import TraceRequest
from kunserve.v1 import admin_pb2_grpc, common_pb2

POLICIES: tuple[str, ...] = ("online-only", "non-preemptive", "preemptive", "conserve")
# engine.coserving of each policy's cluster. online-only sends no offline work: a baseline's mode makes its engine
# vLLM's (the fixed budget, no safepoints), whatever SLO it is then given.
POLICY_MODES: dict[str, str] = {"online-only": "non-preemptive", "non-preemptive": "non-preemptive",
                                "preemptive": "preemptive", "conserve": "conserve"}
ONLINE_ONLY, NON_PREEMPTIVE, PREEMPTIVE, CONSERVE = POLICIES

# Mean input / output tokens of the paper's offline sets (ConServe Table 1).
OFFLINE_DATASETS: dict[str, tuple[int, int]] = {"dureader": (21776, 166), "multinews": (6916, 394), "vcsum": (18803, 337)}
OFFLINE_PROFILES: tuple[str, ...] = ("mix", *OFFLINE_DATASETS)  # mix: each request from one of the three at random
# Scaled for a 2-core CPU and the embedded model (context 2048): prompts / 24 and outputs / 4 keep the sets'
# long-prompt, short-output shape (DuReader ~900 / 42, MultiNews ~290 / 99, VCSUM ~780 / 84), clamped.
OFFLINE_PROMPT_SCALE = 1 / 24
OFFLINE_OUTPUT_SCALE = 1 / 4
OFFLINE_PROMPT_RANGE = (256, 1024)
OFFLINE_OUTPUT_RANGE = (32, 128)
OFFLINE_SIGMA = 0.3  # lognormal spread: the sets' p99 is 1.3-1.8x their mean
OFFLINE_SEED_STREAM = 1_000_000_007  # offline prompts' token seed: apart from the online trace's

# The targets (ConServe §6.2: 82.3% of the optimal throughput, P99 TTFT / TBT within 25% / 19%).
TARGETS: dict[str, float] = {"offline_vs_non_preemptive": 0.8, "ttft_p99_vs_online_only": 1.25, "tbt_p99_vs_online_only": 1.2}

SAMPLE_INTERVAL_S = 0.5
FAILED_BACKOFF_S = 0.5  # an offline slot whose request failed waits this long before sending the next


def rounds(policies: Sequence[str], repeats: int) -> list[list[str]]:
    """The run order: `repeats` interleaved rounds with the order rotated (benchkit.repeats.schedule), except that
    online-only opens the first round: conserve's SLOs come from its p99s."""
    out = schedule(policies, repeats)
    if ONLINE_ONLY in policies:
        out[0] = [ONLINE_ONLY, *(p for p in out[0] if p != ONLINE_ONLY)]
    return out


def slo_from(reference: Mapping[str, Any], scale: float) -> dict[str, float] | None:
    """ConServe's SLOs from online-only's summary: `scale` x its online p99 TTFT and TBT, in ms (None when it
    measured neither)."""
    ttft, tbt = reference["online"]["ttft"]["p99"], reference["online"]["tbt"]["p99"]
    if ttft is None or tbt is None:
        return None
    return {"ttft_ms": scale * ttft * 1e3, "tbt_ms": scale * tbt * 1e3}


# -- the offline backlog ----------------------------------------------------------------------------------------
def offline_lengths(profile: str, n: int, *, seed: int) -> list[tuple[int, int]]:
    """``n`` (prompt, output) lengths of offline requests after the named set (or a random mix of the three):
    lognormal around the set's scaled means, clamped to OFFLINE_PROMPT_RANGE / OFFLINE_OUTPUT_RANGE.
    Deterministic for a seed."""
    if profile not in OFFLINE_PROFILES:
        raise ValueError(f"unknown offline profile {profile!r} (known: {', '.join(OFFLINE_PROFILES)})")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng([seed, 0x0FF])
    names = list(OFFLINE_DATASETS)
    picks = rng.integers(0, len(names), n) if profile == "mix" else np.full(n, names.index(profile))
    out = []
    for k in picks:
        mean_in, mean_out = OFFLINE_DATASETS[names[int(k)]]
        p = _lognormal(rng, mean_in * OFFLINE_PROMPT_SCALE, *OFFLINE_PROMPT_RANGE)
        o = _lognormal(rng, mean_out * OFFLINE_OUTPUT_SCALE, *OFFLINE_OUTPUT_RANGE)
        out.append((p, o))
    return out


def _lognormal(rng: np.random.Generator, mean: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - OFFLINE_SIGMA ** 2 / 2  # so that the mean (before clamping) is `mean`
    return int(min(hi, max(lo, round(float(rng.lognormal(mu, OFFLINE_SIGMA))))))


# -- one run ----------------------------------------------------------------------------------------------------
@dataclass
class CoserveOutcome:
    online: list[RequestResult]
    offline: list[RequestResult]     # every offline request sent (those cancelled at the end marked "interrupted")
    window_s: float                  # the measurement window: start to the last online request's end
    samples: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    not_sent: int = 0


async def _send(ch: grpc.aio.Channel, req: TraceRequest, index: int, t0: float, seed: int, timeout_s: float,
                request_id: str, offline: bool) -> RequestResult:
    """One streamed request; its RequestResult even when it fails or is cancelled (what arrived is kept)."""
    sent = time.monotonic()
    res = RequestResult(index=index, arrival_s=req.arrival_s, sent_s=sent - t0, prompt_tokens=req.prompt_tokens,
                        output_tokens=req.output_tokens)
    request = client.make_request(prompt_ids(index, req.prompt_tokens, seed), request_id=request_id,
                                  max_tokens=req.output_tokens, ignore_eos=True)
    if offline:
        request.request_class = common_pb2.REQUEST_CLASS_OFFLINE
    stream = client.GenerationResult()
    try:
        await client.generate(ch, request, timeout=timeout_s, into=stream)
        res.e2e_s = time.monotonic() - sent
        res.ok = stream.finish_reason not in ("", "aborted")
        if not res.ok:
            res.error = f"stream ended without finishing ({stream.finish_reason or 'no finish reason'})"
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    except asyncio.CancelledError:
        res.error = "interrupted"
    res.ttft_s, res.token_times_s = stream.ttft_s, stream.token_times_s
    res.worker_id, res.finish_reason = stream.worker_id, stream.finish_reason
    return res


def status_sample(status: Any, t_s: float) -> dict[str, Any]:
    """The workers' totals in one admin status: KV in use, preemptions, busy seconds."""
    ws = [w.stats for w in status.cluster.workers]
    return {"t_s": t_s, "kv_blocks_total": sum(s.kv_blocks_total for s in ws),
            "kv_blocks_used": sum(s.kv_blocks_used for s in ws), "num_running": sum(s.num_running for s in ws),
            "num_waiting": sum(s.num_waiting for s in ws), "num_preemptions": sum(s.num_preemptions for s in ws),
            "busy_seconds_total": sum(s.busy_seconds_total for s in ws)}


async def _sample(admin_address: str, creds: client.Credentials | None, t0: float, out: list[dict[str, Any]],
                  done: asyncio.Event, interval_s: float) -> None:
    """Poll the admin status until `done` (and once more after it: the totals at the end)."""
    async with client.admin_channel(admin_address, creds) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        while True:
            last = done.is_set()
            try:
                out.append(status_sample(await stub.GetStatus(common_pb2.Empty(), timeout=2.0), time.monotonic() - t0))
            except grpc.aio.AioRpcError:
                pass
            if last:
                return
            try:
                await asyncio.wait_for(done.wait(), interval_s)
            except TimeoutError:
                pass


async def run_coserve(trace: Sequence[TraceRequest], offline: Sequence[tuple[int, int]], address: str, *,
                      inflight: int, seed: int = 0, timeout_s: float = 600.0, admin_address: str | None = None,
                      stop: asyncio.Event | None = None, on_online_done: Callable[[RequestResult], None] | None = None,
                      creds: client.Credentials | None = None, request_prefix: str = "coserve-",
                      sample_interval_s: float = SAMPLE_INTERVAL_S) -> CoserveOutcome:
    """Replay `trace` (online) at its arrival times while `inflight` offline requests (lengths from `offline`,
    cycled; none when empty or `inflight` is 0) are kept in flight; when every online request has ended, cancel
    the offline ones still running and return both sides' results. `stop` interrupts the whole run."""
    await wait_reachable(address, creds=creds)
    channels = [client.dispatcher_channel(address, creds) for _ in range(CHANNELS)]
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    sampling_done = asyncio.Event()
    sampler = (asyncio.ensure_future(_sample(admin_address, creds, t0, samples, sampling_done, sample_interval_s))
               if admin_address else None)
    offline_results: list[RequestResult] = []
    counter = itertools.count()

    async def offline_loop(k: int) -> None:
        while True:
            i = next(counter)
            p, o = offline[i % len(offline)]
            req = TraceRequest(max(0.0, time.monotonic() - t0), p, o)
            offline_results.append(await _send(channels[k % CHANNELS], req, i, t0, seed + OFFLINE_SEED_STREAM,
                                               timeout_s, f"{request_prefix}off-{i}", offline=True))
            last = offline_results[-1]
            if last.error == "interrupted":
                return
            if not last.ok:  # refused or failed: do not spin on a cluster that refuses offline work
                await asyncio.sleep(FAILED_BACKOFF_S)

    async def send_online(index: int, req: TraceRequest, start: float) -> RequestResult:
        return await _send(channels[index % CHANNELS], req, index, start, seed, timeout_s, f"{request_prefix}on-{index}",
                           offline=False)

    loops = [asyncio.ensure_future(offline_loop(k)) for k in range(inflight if offline else 0)]
    try:
        outcome = await open_loop(trace, send_online, stop=stop, on_done=on_online_done, t0=t0)
        return CoserveOutcome(online=outcome.results, offline=offline_results, window_s=outcome.duration_s,
                              samples=samples, interrupted=outcome.interrupted, not_sent=outcome.not_sent)
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        sampling_done.set()
        if sampler is not None:
            await asyncio.gather(sampler, return_exceptions=True)
        for ch in channels:
            await ch.close()


# -- what a run measured ------------------------------------------------------------------------------------------
def offline_credits(results: Iterable[RequestResult]) -> list[tuple[float, int]]:
    """(time since the start, tokens) of the offline work done: a request's prompt tokens when its first token
    arrived (its prefill was done), then one token per output token."""
    out: list[tuple[float, int]] = []
    for r in results:
        times = r.token_times_s
        if not times:
            continue
        out.append((r.sent_s + times[0], r.prompt_tokens + 1))
        out.extend((r.sent_s + t, 1) for t in times[1:])
    return out


def tbt_gaps(results: Iterable[RequestResult]) -> list[tuple[float, float]]:
    """(time since the start of the later token, gap) for every two consecutive tokens of each request."""
    return [(r.sent_s + b, b - a) for r in results for a, b in zip(r.token_times_s, r.token_times_s[1:])]


def summarize_run(outcome_online: Sequence[RequestResult], outcome_offline: Sequence[RequestResult],
                  window_s: float, samples: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The numbers of one run: online TTFT / TBT percentiles over the completed online requests, online output
    tokens/s and offline tokens/s over the window, request counts, and (from the admin samples) preemptions and
    how busy the workers were."""
    window = max(window_s, 1e-9)
    done = [r for r in outcome_online if r.ok]
    credits = [(t, n) for t, n in offline_credits(outcome_offline) if t <= window_s]
    first, last = (samples[0], samples[-1]) if samples else (None, None)
    return {
        "window_s": window_s,
        "online": {"requests": len(outcome_online), "completed": len(done), "failed": len(outcome_online) - len(done),
                   "ttft": percentiles(r.ttft_s for r in done), "tbt": percentiles(g for _, g in tbt_gaps(done)),
                   "output_tokens_per_s": sum(r.tokens for r in done) / window},
        "offline": {"sent": len(outcome_offline), "completed": sum(1 for r in outcome_offline if r.ok),
                    "failed": sum(1 for r in outcome_offline if not r.ok and r.error != "interrupted"),
                    "tokens": sum(n for _, n in credits), "tokens_per_s": sum(n for _, n in credits) / window},
        "preemptions": None if first is None or last is None else last["num_preemptions"] - first["num_preemptions"],
        "busy_share": (None if first is None or last is None or last["t_s"] <= first["t_s"] else
                       (last["busy_seconds_total"] - first["busy_seconds_total"]) / (last["t_s"] - first["t_s"])),
    }


def timeline(outcome_online: Sequence[RequestResult], outcome_offline: Sequence[RequestResult], window_s: float,
             bin_s: float) -> list[dict[str, Any]]:
    """Per `bin_s` window of the measurement window (Fig. 7's x axis): the online requests sent in it (their
    TTFT p99), the online token gaps that ended in it (their p99: TBT) and the offline tokens processed in it per
    second."""
    if not (math.isfinite(bin_s) and bin_s > 0):
        raise ValueError(f"bin_s must be finite and > 0, got {bin_s}")
    n = max(1, math.ceil(window_s / bin_s))
    done = [r for r in outcome_online if r.ok]
    ttft: list[list[float]] = [[] for _ in range(n)]
    gaps: list[list[float]] = [[] for _ in range(n)]
    tokens = [0] * n

    def slot(t: float) -> int | None:
        k = math.floor(t / bin_s)
        return k if 0 <= k < n else None

    for r in done:
        k = slot(r.sent_s)
        if k is not None and r.ttft_s is not None:
            ttft[k].append(r.ttft_s)
    for t, g in tbt_gaps(done):
        k = slot(t)
        if k is not None:
            gaps[k].append(g)
    for t, c in offline_credits(outcome_offline):
        k = slot(t) if t <= window_s else None
        if k is not None:
            tokens[k] += c
    out = []
    for k in range(n):
        width = min(bin_s, window_s - k * bin_s)  # the last window may be shorter
        out.append({"t_s": k * bin_s, "online_requests": len(ttft[k]), "ttft_p99_s": percentiles(ttft[k])["p99"],
                    "tbt_p99_s": percentiles(gaps[k])["p99"], "offline_tokens_per_s": tokens[k] / max(width, 1e-9)})
    return out


# -- the comparison -------------------------------------------------------------------------------------------
METRICS: dict[str, Callable[[Mapping[str, Any]], float | None]] = {
    "ttft_p50_s": lambda s: s["online"]["ttft"]["p50"],
    "ttft_p99_s": lambda s: s["online"]["ttft"]["p99"],
    "tbt_p50_s": lambda s: s["online"]["tbt"]["p50"],
    "tbt_p99_s": lambda s: s["online"]["tbt"]["p99"],
    "online_tokens_per_s": lambda s: s["online"]["output_tokens_per_s"],
    "offline_tokens_per_s": lambda s: s["offline"]["tokens_per_s"],
    "offline_completed": lambda s: s["offline"]["completed"],
    "online_failed": lambda s: s["online"]["failed"],
    "preemptions": lambda s: s["preemptions"],
    "busy_share": lambda s: s["busy_share"],
}


def _median(medians: Mapping[str, Mapping[str, Spread]], policy: str, metric: str) -> float | None:
    row = medians.get(policy)
    return None if row is None else row[metric]["median"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare(summaries: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Every policy's metrics as median and range over its runs, the ratios to the references (online latency
    against online-only's, offline throughput against non-preemptive's), and the issue's targets for conserve:
    True (met), False (missed) or None (a policy it needs did not run, or measured nothing)."""
    medians = {p: {name: spread([read(s) for s in runs]) for name, read in METRICS.items()}
               for p, runs in summaries.items()}
    ratios = {p: {"ttft_p99_vs_online_only": _ratio(_median(medians, p, "ttft_p99_s"),
                                                   _median(medians, ONLINE_ONLY, "ttft_p99_s")),
                  "tbt_p99_vs_online_only": _ratio(_median(medians, p, "tbt_p99_s"),
                                                  _median(medians, ONLINE_ONLY, "tbt_p99_s")),
                  "offline_vs_non_preemptive": _ratio(_median(medians, p, "offline_tokens_per_s"),
                                                     _median(medians, NON_PREEMPTIVE, "offline_tokens_per_s"))}
              for p in medians}
    mine = ratios.get(CONSERVE, {})

    def at_most(value: float | None, bound: float) -> bool | None:
        return None if value is None else value <= bound

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    def less(a: float | None, b: float | None) -> bool | None:
        return None if a is None or b is None else a < b

    t = TARGETS
    targets = {
        f"offline throughput >= {t['offline_vs_non_preemptive']:.0%} of non-preemptive's":
            at_least(mine.get("offline_vs_non_preemptive"), t["offline_vs_non_preemptive"]),
        f"online p99 TTFT <= {t['ttft_p99_vs_online_only']:g}x online-only's":
            at_most(mine.get("ttft_p99_vs_online_only"), t["ttft_p99_vs_online_only"]),
        f"online p99 TBT <= {t['tbt_p99_vs_online_only']:g}x online-only's":
            at_most(mine.get("tbt_p99_vs_online_only"), t["tbt_p99_vs_online_only"]),
        "online p99 TTFT below preemptive's": less(_median(medians, CONSERVE, "ttft_p99_s"),
                                                   _median(medians, PREEMPTIVE, "ttft_p99_s")),
        "offline throughput above preemptive's": less(_median(medians, PREEMPTIVE, "offline_tokens_per_s"),
                                                      _median(medians, CONSERVE, "offline_tokens_per_s")),
    }
    return {"medians": medians, "ratios": ratios, "targets": targets}


def representative(docs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The run whose online TTFT p99 is the median of its policy's (the one the figure draws)."""
    ranked = sorted(docs, key=lambda d: (d["summary"]["online"]["ttft"]["p99"] is None,
                                         d["summary"]["online"]["ttft"]["p99"] or 0.0))
    return ranked[(len(ranked) - 1) // 2]


__all__ = ["CONSERVE", "CoserveOutcome", "METRICS", "NON_PREEMPTIVE", "OFFLINE_PROFILES", "ONLINE_ONLY", "POLICIES",
           "POLICY_MODES", "PREEMPTIVE", "TARGETS", "compare", "offline_credits", "offline_lengths", "representative",
           "rounds", "run_coserve", "slo_from", "status_sample", "summarize_run", "tbt_gaps", "timeline"]
