"""`kunserve bench run`, `compare`, `coserve` and `convert-trace`: replay a bursty trace and measure what users feel.

`run` replays a trace against a cluster that is already up (any policy) over gRPC, or with `--endpoint`
against any OpenAI-compatible server over HTTP, and writes result.json plus ttft_timeline.png and
latency_cdf.png. `compare` first sizes the generated trace to the machine (a probe or a cost-model profile,
and the cluster's undropped KV capacity: benchkit/calibrate.py), then starts a fresh local cluster per run of
every overload policy or ablation variant (same config, trace and prompt seed), runs the same replay on each and
on every `--external NAME=URL` server (a real vLLM, say), `--repeats` times interleaved, prints one table of
medians and ranges (or says the trace never overloaded) and writes compare.json and compare.png — the headline
comparison of KunServe §5 in the same system. `coserve` runs an online trace beside an offline backlog through
online-only, non-preemptive, preemptive and conserve (engine.coserving; benchkit/coserve.py), a fresh local cluster
per run, and writes coserve.json and coserve.png (ConServe Fig. 6/7). `convert-trace` rewrites a trace between
the BurstGPT CSV, vLLM timed_trace and Mooncake formats, so `vllm bench serve` can replay the very trace this harness
replays.

Errors are one line on stderr (exit 1); Ctrl-C writes what was measured so far and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kunserve import client
from kunserve.benchkit import cluster_metrics
from kunserve.benchkit.calibrate import (
    DEFAULT_OVERLOAD,
    NEVER_OVERLOADED,
    OVERLOADED,
    CalibrationError,
    Span,
    Speeds,
    calibrate,
    observed_overload,
    peak_kv_demand,
    speeds_from_cost_model,
    verdict,
)
from kunserve.benchkit.coserve import (
    CONSERVE,
    OFFLINE_PROFILES,
    ONLINE_ONLY,
    CoserveOutcome,
    offline_lengths,
    run_coserve,
    slo_from,
    summarize_run,
)
from kunserve.benchkit.coserve import POLICIES as COSERVE_POLICIES
from kunserve.benchkit.coserve import POLICY_MODES as COSERVE_MODES
from kunserve.benchkit.coserve import compare as compare_coserve
from kunserve.benchkit.coserve import representative as coserve_representative
from kunserve.benchkit.coserve import rounds as coserve_rounds
from kunserve.benchkit.coserve import timeline as coserve_timeline
from kunserve.benchkit.holds import (
    DROP,
    MEMORY_BOUND_S,
    QUEUE_FACTOR,
    RESTORE,
    burst_holds,
    count,
    layout_events,
    unloaded_ttft,
)
from kunserve.benchkit.openai_replay import EndpointError, list_models, normalize_base_url, replay_openai
from kunserve.benchkit.probe import ProbeError, cluster_capacity, probe_speeds
from kunserve.benchkit.repeats import Spread, schedule, spread
from kunserve.benchkit.replay import ClusterUnreachable, ReplayOutcome, drop_periods, replay
from kunserve.benchkit.scenarios import SCENARIOS, Scenario, resolve
from kunserve.benchkit.stats import RequestResult, best_p50, summarize
from kunserve.benchkit.trace import (
    LENGTH_PROFILES,
    MOONCAKE,
    TRACE_FORMATS,
    Burst,
    TraceError,
    TraceRequest,
    burst_windows,
    describe,
    generate_trace,
    load_trace,
    repeat_burst,
    save_trace,
    scale_lengths,
    upscale,
)
from kunserve.benchkit.variants import POLICY_VARIANTS, VariantUnavailable, apply_variant, base_policy
from kunserve.cli.launcher import ClusterStartError, LocalCluster, assign_free_ports, standby_sections, with_workers
from kunserve.shared.config import ClusterConfig, ConfigError, WorkerSection, load_config
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES
from kunserve.shared.rpc import health_check

RESULT_VERSION = 3
# Defaults sized for the embedded tiny model on a 2-core CPU with 2 workers and a 36 MiB pool (~2k tokens of
# KV per whole instance): BurstGPT-like lengths at half scale (mean ~320 in / ~130 out), 1 request/s, then a
# burst from 5 s to 25 s at 6x that rate, a factor calibration replaces with what overloads this machine.
DEFAULT_RATE = 1.0
DEFAULT_DURATION_S = 40.0
DEFAULT_BURST = "5:20:6"
DEFAULT_LENGTH_SCALE = 0.5
DEFAULT_MAX_PROMPT = 1024
DEFAULT_MAX_OUTPUT = 384
COMPARE_POOL_MIB = 36
DEFAULT_REPEATS = 3
UNBOUNDED = 1 << 40  # an admission bound no trace reaches
PROBE_MAX_PROMPT = 1024  # the calibration probe's prefills: the trace's mean prompt, at most this long
PROBE_DECODE_TOKENS = 32
PROBE_FILL = 0.75  # the probe's decoding requests fill at most this much of an instance's KV
# The `kind` a loaded trace gets in the result's trace source, by format.
SOURCE_KINDS = {"csv": "burstgpt_csv", "timed_trace": "timed_trace", "mooncake": "mooncake"}
API_KEY_ENV = "OPENAI_API_KEY"  # what `vllm bench serve` and the openai SDK read
EXTERNAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TARGETS = {"ttft_p99_vs_recompute": 10.0, "ttft_p99_vs_swap": 10.0, "ttft_p99_vs_migrate": 5.0,
           "tpot_p50_penalty_max": 0.25, "hold_vs_best_baseline": 1.5}


class BenchError(Exception):
    """A user-facing problem: printed as one line, exit 1."""


# -- trace ---------------------------------------------------------------------------------------------------
def parse_burst(text: str) -> Burst:
    try:
        start, duration, factor = (float(x) for x in text.split(":"))
        return Burst(start_s=start, duration_s=duration, factor=factor)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--burst takes START:DURATION:FACTOR (e.g. 6:4:8), got {text!r}"
                                         f"{': ' + str(exc) if ':' in text and text.count(':') == 2 else ''}") from None


def distinct_bursts(args: argparse.Namespace) -> list[Burst]:
    """The --burst windows that start within the trace (a window past --duration adds nothing), sorted by start;
    BenchError when two overlap."""
    try:
        windows = burst_windows(args.burst)
    except ValueError as exc:
        raise BenchError(f"--burst: {exc}") from None
    return [w for w in windows if w.start_s < args.duration]


def burst_plan(args: argparse.Namespace) -> list[Burst]:
    """Every burst window of the generated trace: the --burst windows, or --bursts copies of the one window
    --burst-gap seconds apart, those that start within the trace."""
    if args.bursts < 1:
        raise BenchError("--bursts must be >= 1")
    if not (math.isfinite(args.burst_gap) and args.burst_gap >= 0):
        raise BenchError(f"--burst-gap must be >= 0 seconds, got {args.burst_gap:g}")
    windows = distinct_bursts(args)
    if args.bursts == 1:
        return windows
    if len(args.burst) != 1:
        raise BenchError(f"--bursts {args.bursts} repeats one --burst window; {len(args.burst)} were given")
    return [w for w in repeat_burst(args.burst[0], args.bursts, args.burst_gap) if w.start_s < args.duration]


def burst_spans(args: argparse.Namespace) -> list[Span]:
    """Where calibration measures each distinct burst's peak demand: from its start to the next one's (a
    repeated burst: to its second copy's start, the copies then stacking up as they will), the last to the end."""
    windows = distinct_bursts(args)
    if args.bursts > 1:
        return [(w.start_s, w.end_s + args.burst_gap) for w in windows]
    return [(w.start_s, nxt.start_s) for w, nxt in zip(windows, windows[1:])] + [(w.start_s, math.inf)
                                                                                  for w in windows[-1:]]


def _generated(args: argparse.Namespace) -> list[TraceRequest]:
    """The generator's trace with --limit and --upscale applied (possibly empty)."""
    windows = burst_plan(args)
    try:
        trace = generate_trace(rate=args.rate, cv=args.cv, duration_s=args.duration, profile=args.profile,
                               seed=args.seed, scale=args.length_scale, burst=windows, max_prompt=args.max_prompt,
                               max_output=args.max_output)
    except ValueError as exc:
        raise BenchError(f"bad trace parameters: {exc}") from None
    if args.limit:
        trace = trace[: args.limit]
    if args.upscale != 1.0:
        try:
            trace = upscale(trace, args.upscale, seed=args.seed)
        except ValueError as exc:
            raise BenchError(f"bad --upscale: {exc}") from None
    return trace


def build_trace(args: argparse.Namespace, *, save: bool = True) -> tuple[list[TraceRequest], dict]:
    """The trace the arguments describe, and a JSON-able description of where it came from (a generated trace's
    burst windows among it: the holds metric reads them); with `save`, also written to --save-trace."""
    if args.limit is not None and args.limit < 1:
        raise BenchError("--limit must be >= 1")
    if args.trace:
        trace, skipped, fmt = load_trace(args.trace, args.trace_format, model=args.trace_model,
                                         log_type=args.trace_log_type, limit=args.limit)
        source = {"kind": SOURCE_KINDS[fmt], "path": str(args.trace), "skipped_rows": skipped}
        if args.length_scale != 1.0 or args.max_prompt or args.max_output:
            trace = scale_lengths(trace, args.length_scale, max_prompt=args.max_prompt, max_output=args.max_output)
        if args.upscale != 1.0:
            try:
                trace = upscale(trace, args.upscale, seed=args.seed)
            except ValueError as exc:
                raise BenchError(f"bad --upscale: {exc}") from None
    else:
        trace = _generated(args)
        source = {"kind": "gamma", "rate": args.rate, "cv": args.cv, "duration_s": args.duration,
                  "profile": args.profile, "bursts": [vars(w) for w in burst_plan(args)],
                  "repeat": {"copies": args.bursts, "gap_s": args.burst_gap} if args.bursts > 1 else None}
    if args.upscale != 1.0:
        source["upscale"] = args.upscale
    source.update(seed=args.seed, length_scale=args.length_scale, max_prompt=args.max_prompt,
                  max_output=args.max_output)
    if not trace:
        raise BenchError("the trace is empty: nothing to replay")
    if save and args.save_trace:
        save_trace(trace, args.save_trace, args.save_trace_format)
    return trace, source


# -- calibration ---------------------------------------------------------------------------------------------
def profile_speeds(cfg: ClusterConfig, *, prompt_tokens: int, concurrency: int,
                   context_tokens: int) -> tuple[Speeds | None, str]:
    """Speeds predicted by the cost-model profile of `engine.profile` when it holds one for this model, dtype,
    device and thread count over all layers (what a whole instance runs); else None and why not."""
    if not cfg.engine.profile:
        return None, "no engine.profile in the config"
    from kunserve.shared.model.weights import load_model_source
    from kunserve.shared.process import DeviceError, pick_device, thread_share
    from kunserve.shared.profile_files import ProfileError, device_signature, find_profile

    try:
        source = load_model_source(cfg.model.path or None, seed=cfg.model.seed, dtype=cfg.model.dtype)
        sig = device_signature(pick_device(cfg.model.device), thread_share(cfg))
        prof = find_profile(cfg.engine.profile, model=source.name, dtype=source.config.dtype,
                            layers=(0, source.config.num_layers), device_sig=sig)
    except (ProfileError, DeviceError, OSError, ValueError) as exc:
        return None, str(exc)
    return speeds_from_cost_model(prof.kunserve, prompt_tokens=prompt_tokens, concurrency=concurrency,
                                  context_tokens=context_tokens, source=f"profile {prof.key}"), prof.key


def _with_load(args: argparse.Namespace, rate: float, factors: Sequence[float]) -> argparse.Namespace:
    """`args` with this base rate and one factor per distinct burst window (same windows)."""
    out = copy.copy(args)
    out.rate = rate
    out.burst = [Burst(w.start_s, w.duration_s, f) for w, f in zip(distinct_bursts(args), factors)]
    return out


def plan_trace(args: argparse.Namespace, console, *, address: str, admin: str | None, creds: client.Credentials,
               cfg: ClusterConfig, workers: int | None, where: str) -> tuple[list[TraceRequest], dict, dict | None]:
    """The trace to replay on the cluster at `address` and where it came from, plus the calibration record (None
    with --calibrate off). Calibrating a generated trace sets its base rate and burst factor so its planned peak KV
    demand is --overload x the cluster's undropped capacity; a loaded trace is replayed as it is, with its planned
    demand reported."""
    trace, source = build_trace(args, save=False)
    if args.calibrate == "off":
        if args.save_trace:
            save_trace(trace, args.save_trace, args.save_trace_format)
        return trace, source, None
    if admin is None:
        raise BenchError("calibration needs the admin service (the workers' KV capacity): give --admin, or "
                         "--calibrate off")
    capacity = asyncio.run(cluster_capacity(admin, creds, workers=workers))
    d = describe(trace)
    footprint = d["mean_prompt"] + d["mean_output"] / 2  # a request's KV halfway through its decode
    prompt = max(1, min(PROBE_MAX_PROMPT, round(d["mean_prompt"])))
    # as many requests per instance as it holds when full, short of overloading it (which would time preemptions,
    # or on a running kunserve cluster trigger a drop)
    per_instance = max(1, min(round(capacity.per_instance_tokens / footprint),
                              int(PROBE_FILL * capacity.per_instance_tokens / (prompt + PROBE_DECODE_TOKENS))))
    speeds: Speeds | None = None
    if args.calibrate in ("auto", "profile"):
        speeds, why = profile_speeds(cfg, prompt_tokens=prompt, concurrency=per_instance,
                                     context_tokens=round(footprint))
        if speeds is None and args.calibrate == "profile":
            raise BenchError(f"--calibrate profile: {why}")
    if speeds is None:
        console.print(f"calibration: probing {where} ({prompt}-token prefills alone, then {per_instance} such "
                      "requests per instance decoding together)")
        speeds = asyncio.run(probe_speeds(address, creds, prompt_tokens=prompt, concurrency=per_instance,
                                          workers=capacity.workers, seed=args.seed, decode_tokens=PROBE_DECODE_TOKENS))
    record: dict = {"target": args.overload, "capacity": capacity.to_dict(), "speeds": speeds.to_dict()}
    if args.trace:
        peak = peak_kv_demand(trace, speeds)
        record.update(calibrated=False, planned_peak_tokens=peak.tokens, planned_peak_at_s=peak.at_s,
                      planned_ratio=peak.tokens / capacity.tokens)
    else:
        given = [w.factor for w in distinct_bursts(args)]
        try:
            cal = calibrate(lambda rate, factors: _generated(_with_load(args, rate, factors)), rate=args.rate,
                            burst_factors=given, spans=burst_spans(args), speeds=speeds,
                            capacity_tokens=capacity.tokens, target=args.overload)
        except CalibrationError as exc:
            raise BenchError(f"calibration: {exc}") from None
        chosen = {k: v for k, v in cal.to_dict().items() if k not in ("speeds", "capacity_tokens", "target")}
        record.update(calibrated=True, given={"rate": args.rate, "burst_factors": given}, **chosen)
        trace, source = build_trace(_with_load(args, cal.rate, cal.burst_factors), save=False)
    source["calibration"] = record
    if args.save_trace:
        save_trace(trace, args.save_trace, args.save_trace_format)
    console.print(calibration_line(record))
    return trace, source, record


def calibration_line(record: dict) -> str:
    """One line: the speeds and capacity measured, the load chosen, the demand planned."""
    sp, cap = record["speeds"], record["capacity"]
    how = "probe" if sp["source"] == "probe" else sp["source"]
    text = (f"calibration ({how}): prefill {sp['prefill_tokens_per_s']:,.0f} tok/s, TPOT {_ms(sp['tpot_s'])} ms at "
            f"{sp['concurrency']} requests per instance; undropped KV capacity {cap['tokens']:,} tokens "
            f"({cap['workers']} workers)")
    per_burst = ""
    if record["calibrated"]:
        given = record["given"]
        load = [f"rate {given['rate']:g} -> {record['rate']:.3g} req/s"] if record["rate"] != given["rate"] else []
        factors = record["burst_factors"]
        if factors:
            load.append(f"burst factor{'s' if len(factors) > 1 else ''} "
                        f"{', '.join(f'{f:g}' for f in given['burst_factors'])} -> {', '.join(f'{f:.3g}' for f in factors)}")
        ratios = record["burst_ratios"]
        if len(ratios) > 1 or (ratios and not math.isclose(ratios[0], record["planned_ratio"], rel_tol=1e-3)):
            # several bursts, or copies of one stacking up beyond what the first reaches
            per_burst = f"; per burst, to the next one's start: {', '.join(f'{r:.2f}x' for r in ratios)}"
        text += f"; {', '.join(load)} ({record['requests']} requests)"
    else:
        text += "; loaded trace replayed as it is (scale it with --upscale)"
    return (text + f": planned peak KV demand {record['planned_ratio']:.2f}x the capacity "
            f"(target {record['target']:g}x{' per burst' if per_burst else ''}, at {record['planned_peak_at_s']:.1f} s"
            f"{per_burst})")


# -- one replay ------------------------------------------------------------------------------------------------
def _progress(total: int, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), transient=False)


_Outcome = TypeVar("_Outcome")


def _with_progress(total: int, label: str, stop_flag: list[bool],
                   run: Callable[[asyncio.Event, Callable[[RequestResult], None]], Awaitable[_Outcome]]) -> _Outcome:
    """Run a replay (`run(stop, on_done)`) under a rich progress bar; `stop_flag[0]` turning True (a signal
    handler) sets `stop`, which interrupts it."""
    progress = _progress(total, label)
    task = progress.add_task(label, total=total, info="")
    failed = [0]

    def done(r: RequestResult) -> None:
        failed[0] += not r.ok
        progress.update(task, advance=1, info=f"failed {failed[0]}" if failed[0] else "")

    async def main() -> _Outcome:
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop_flag[0]:
                await asyncio.sleep(0.1)
            stop.set()

        watcher = asyncio.ensure_future(watch())
        try:
            return await run(stop, done)
        finally:
            watcher.cancel()

    with progress:
        return asyncio.run(main())


def replay_with_progress(trace: Sequence[TraceRequest], address: str, admin_address: str | None, *, label: str,
                         seed: int, timeout_s: float, stop_flag: list[bool],
                         creds: client.Credentials | None = None) -> ReplayOutcome:
    """The gRPC `replay` against a cluster's dispatcher, under a progress bar."""
    return _with_progress(len(trace), label, stop_flag, lambda stop, done: replay(
        trace, address, admin_address=admin_address, seed=seed, timeout_s=timeout_s, stop=stop, on_done=done,
        creds=creds))


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server to replay against: its base URL, the model to ask for, the API key."""

    name: str
    url: str
    model: str
    api_key: str | None

    def describe(self) -> dict:
        return {"endpoint": self.url, "model": self.model, "api": "openai /v1/completions"}


def probe_endpoint(name: str, url: str, model: str | None, api_key: str | None) -> Endpoint:
    """Check that `url` answers like an OpenAI server (GET /models) and settle the model: the given one, else
    the first listed. EndpointError (one line) when it does not answer, or does not answer like one."""
    base = normalize_base_url(url)
    listed = asyncio.run(list_models(base, api_key=api_key))
    if model is not None and model not in listed:
        _console().print(f"[yellow]warning[/]: {base}/models does not list {model!r} (it lists {', '.join(listed)})")
    return Endpoint(name, base, model or listed[0], api_key)


def endpoint_with_progress(trace: Sequence[TraceRequest], endpoint: Endpoint, *, seed: int, timeout_s: float,
                           stop_flag: list[bool]) -> ReplayOutcome:
    """The HTTP replay against an OpenAI-compatible server, under a progress bar."""
    return _with_progress(len(trace), endpoint.name, stop_flag, lambda stop, done: replay_openai(
        trace, endpoint.url, model=endpoint.model, api_key=endpoint.api_key, seed=seed, timeout_s=timeout_s,
        stop=stop, on_done=done))


def run_record(outcome: ReplayOutcome, *, policy: str, trace_source: dict, trace: Sequence[TraceRequest],
               cluster: dict, reference_ttft_p50: float | None = None,
               reference_tpot_p50: float | None = None) -> dict:
    """The JSON document of one replay (also the input of the plots)."""
    samples = [s.to_dict() for s in outcome.samples]
    events = layout_events(samples)
    drops = count(events, DROP)
    summary = summarize(outcome.results, outcome.duration_s, reference_ttft_p50=reference_ttft_p50,
                        reference_tpot_p50=reference_tpot_p50)
    requests = [r.to_dict() for r in outcome.results]
    d = describe(trace)
    return {
        "version": RESULT_VERSION,
        "policy": policy,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "python": platform.python_version(), "node": platform.node()},
        "cluster": cluster,
        "trace": {"source": trace_source, **d},
        "interrupted": outcome.interrupted,
        "not_sent": outcome.not_sent,
        "summary": summary,
        "drops": drops,
        "restores": count(events, RESTORE),
        "layout_events": events,
        "epoch_changes": _epoch_changes(outcome),
        "drop_periods": drop_periods(outcome.samples),
        "holds": burst_holds(requests, trace_source.get("bursts") or [],
                             unloaded_ttft(trace_source, d["mean_prompt"], summary["slo_reference"]["ttft_p50_s"]), samples),
        "overload": observed_overload(samples, drops).to_dict(),
        "samples": samples,
        "requests": requests,
    }


def _epoch_changes(outcome: ReplayOutcome) -> int:
    """Layout epoch bumps seen: drops and restores, migrations, and workers joining or leaving serving."""
    epochs = [s.epoch for s in outcome.samples]
    return sum(1 for a, b in zip(epochs, epochs[1:]) if b != a)


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}")


def _console():
    """A console wide enough for the comparison table even when stdout is a pipe or a log file."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=190)
    return console


def _interrupt_flag() -> list[bool]:
    """SIGINT / SIGTERM set the flag (the replay stops and what it measured is written) instead of raising."""
    flag = [False]

    def handler(*_):
        if flag[0]:  # a second Ctrl-C: stop waiting for cancellations
            raise KeyboardInterrupt
        flag[0] = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return flag


def _out_dir(args: argparse.Namespace, kind: str) -> Path:
    if args.out:
        return Path(args.out)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("kunserve-bench") / f"{kind}-{stamp}"


def cmd_run(args: argparse.Namespace) -> int:
    console = _console()
    if args.endpoint:
        if args.calibrate != "off":
            raise BenchError("--calibrate needs a cluster's admin service (its KV capacity); not with --endpoint")
        trace, source = build_trace(args)
        return _run_endpoint(args, console, trace, source)
    address, admin, creds, cfg = _addresses(args)
    if admin and not asyncio.run(health_check(admin, timeout=2.0, tls=creds.tls)):
        console.print(f"[yellow]warning[/]: the admin service at {admin} does not answer: no KV usage / drop "
                      "sampling (give --admin HOST:PORT, or --admin '' to silence this)")
        admin = None
    trace, source, _ = plan_trace(args, console, address=address, admin=admin, creds=creds, cfg=cfg, workers=None,
                                  where=f"the cluster at {address}")
    out = _out_dir(args, "run")
    label = args.policy or "cluster"
    console.print(f"Replaying {len(trace)} requests over {trace[-1].arrival_s:.1f} s against {address} "
                  f"(policy label: {label}) -> {out}")
    stop_flag = _interrupt_flag()
    outcome = replay_with_progress(trace, address, admin, label=label, seed=args.seed,
                                   timeout_s=args.request_timeout, stop_flag=stop_flag, creds=creds)
    return _finish_run(console, out, outcome, label, source, trace, {"dispatcher": address, "admin": admin})


def _run_endpoint(args: argparse.Namespace, console, trace: list[TraceRequest], source: dict) -> int:
    """`bench run --endpoint URL`: the same replay over HTTP against an OpenAI-compatible server (no KV / drop
    sampling: that needs the cluster's admin service)."""
    if args.address or args.admin is not None:
        raise BenchError("--endpoint replays over HTTP; --address / --admin belong to the gRPC replay of a cluster")
    label = args.policy or "endpoint"
    endpoint = probe_endpoint(label, args.endpoint, args.model, args.api_key or os.environ.get(API_KEY_ENV) or None)
    out = _out_dir(args, "run")
    console.print(f"Replaying {len(trace)} requests over {trace[-1].arrival_s:.1f} s against {endpoint.url} "
                  f"(model {endpoint.model!r}, label: {label}) -> {out}")
    stop_flag = _interrupt_flag()
    outcome = endpoint_with_progress(trace, endpoint, seed=args.seed, timeout_s=args.request_timeout,
                                     stop_flag=stop_flag)
    return _finish_run(console, out, outcome, label, source, trace, endpoint.describe())


def _finish_run(console, out: Path, outcome: ReplayOutcome, label: str, source: dict, trace: Sequence[TraceRequest],
                target: dict) -> int:
    from kunserve.benchkit.plots import plot_run

    doc = run_record(outcome, policy=label, trace_source=source, trace=trace, cluster=target)
    _write_json(out / "result.json", doc)
    plots = plot_run(doc, out)
    render_table(console, {label: [doc]})
    console.print(f"wrote {out / 'result.json'}, " + ", ".join(str(p) for p in plots))
    if outcome.interrupted:
        console.print(f"[yellow]interrupted[/]: {len(outcome.results)} requests measured, {outcome.not_sent} not sent")
        return 130
    return 0


def _addresses(args: argparse.Namespace) -> tuple[str, str | None, client.Credentials, ClusterConfig]:
    """The dispatcher and admin addresses, the credentials the config (or the defaults) point to, the config."""
    try:
        cfg = load_config(args.config)
        creds = client.credentials_from(cfg)
    except ConfigError as exc:  # CredentialError is one
        raise BenchError(f"config error: {exc}") from None
    address = args.address or cfg.dispatcher.address
    admin = args.admin if args.admin is not None else cfg.memory_manager.address
    return address, (admin or None), creds, cfg


# -- compare ---------------------------------------------------------------------------------------------------
def known_rows() -> tuple[str, ...]:
    """What --policies accepts: the overload policies and the kunserve ablation variants."""
    return (*OVERLOAD_POLICIES, *POLICY_VARIANTS)


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise BenchError("--policies is empty")
    unknown = [p for p in policies if p not in known_rows()]
    if unknown:
        raise BenchError(f"unknown policy {unknown[0]!r} (known: {', '.join(known_rows())})")
    if len(set(policies)) != len(policies):
        raise BenchError("--policies names a policy twice")
    return policies


def parse_external(text: str) -> tuple[str, str]:
    """``NAME=URL`` of `compare --external`: the row's name (a directory name under --out) and the base URL."""
    name, sep, url = text.partition("=")
    name = name.strip()
    if not sep or not url.strip():
        raise argparse.ArgumentTypeError(f"--external takes NAME=URL (e.g. vllm=http://127.0.0.1:8000/v1), got {text!r}")
    if not EXTERNAL_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"--external NAME must be letters, digits, '.', '_' or '-', got {name!r}")
    return name, url.strip()


def check_externals(externals: Sequence[tuple[str, str]]) -> None:
    """Every external row needs a name of its own: not a policy's (the result directories and table rows would
    collide), not another external's."""
    names = [n for n, _ in externals]
    for name in names:
        if name in known_rows():
            raise BenchError(f"--external {name}=...: {name!r} is an overload policy's name; pick another")
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise BenchError(f"--external names {dup!r} twice")


def _load(args: argparse.Namespace) -> ClusterConfig:
    try:
        return load_config(args.config)
    except ConfigError as exc:
        raise BenchError(f"config error: {exc}") from None


def compare_config(args: argparse.Namespace, row: str) -> ClusterConfig:
    """The cluster every row gets: the same config but for `policy.overload` (and a variant's switches)."""
    cfg = _load(args)
    with_workers(cfg, args.workers)
    assign_free_ports(cfg)
    if args.pool_mib:
        cfg.engine.pool_mib = args.pool_mib
    if args.threads is not None:
        cfg.engine.threads = args.threads
    if row in POLICY_VARIANTS:
        try:
            apply_variant(cfg, row)
        except VariantUnavailable as exc:
            raise BenchError(str(exc)) from None
    else:
        cfg.policy.overload = row
    cfg.monitor.auto_drop = True  # the monitor acts only for the policies that use it (kunserve, migrate)
    # Detection within ~0.2 s for every policy: stats reports and policy ticks at 0.1 s (what they cost on the
    # cluster is the same whichever policy runs; only kunserve and migrate act on them).
    cfg.monitor.stats_interval_s = min(cfg.monitor.stats_interval_s, 0.1)
    cfg.monitor.policy_interval_s = min(cfg.monitor.policy_interval_s, 0.1)
    cfg.dispatcher.route_timeout_s = max(cfg.dispatcher.route_timeout_s, args.request_timeout)
    # Every request queues until it is served, as in the paper's runs: the dispatcher's admission control would
    # refuse part of a burst (RESOURCE_EXHAUSTED) with bounds that follow each policy's own KV capacity and
    # routable units, turning one policy's queueing latency into another's failures.
    cfg.dispatcher.max_queued_prompt_tokens = UNBOUNDED
    cfg.dispatcher.max_inflight_per_worker = UNBOUNDED
    cfg.dispatcher.queue_timeout_s = max(cfg.dispatcher.queue_timeout_s, args.request_timeout)
    cfg.logging.format = "json"
    return cfg


# Per-run metrics a comparison reports as median and range: name -> how to read it from a run's record.
METRICS: dict[str, Callable[[dict], float | None]] = {
    "ttft_p50_s": lambda d: d["summary"]["ttft"]["p50"],
    "ttft_p99_s": lambda d: d["summary"]["ttft"]["p99"],
    "ttft_p999_s": lambda d: d["summary"]["ttft"]["p999"],
    "tpot_p50_s": lambda d: d["summary"]["tpot"]["p50"],
    "tpot_p99_s": lambda d: d["summary"]["tpot"]["p99"],
    "e2e_p99_s": lambda d: d["summary"]["e2e"]["p99"],
    "slo_ttft_5x": lambda d: (d["summary"].get("slo", {}).get("ttft") or {}).get("5"),
    "output_tokens_per_s": lambda d: d["summary"]["throughput"]["output_tokens_per_s"],
    "completed": lambda d: d["summary"]["completed"],
    "failed": lambda d: d["summary"]["failed"],
    # without cluster samples (an external server) drops were not observed, not zero
    "drops": lambda d: d["drops"] if d["samples"] else None,
    "drop_seconds": lambda d: sum(e - b for b, e in d["drop_periods"]) if d["samples"] else None,
    "restores": lambda d: d["restores"] if d["samples"] else None,
    "epoch_changes": lambda d: d["epoch_changes"] if d["samples"] else None,
    "hold_s": lambda d: d["holds"]["hold_s"],
    "memory_hold_s": lambda d: d["holds"]["memory_hold_s"],
    "peak_demand_ratio": lambda d: d["overload"]["peak_ratio"],
    "max_kv_usage": lambda d: d["overload"]["max_kv_usage"],
    # read from the cluster's /metrics before it stops (local rows only): see cluster_figures
    "queue_mean_s": lambda d: (d.get("queue_time") or {}).get("mean_s"),
    "queue_p99_s": lambda d: (d.get("queue_time") or {}).get("p99_s"),
    "autoscale_to_serving_s": lambda d: (d.get("autoscale") or {}).get("time_to_serving_s"),
    "drop_to_new_instance_s": lambda d: (cluster_metrics.drop_to_new_instance(d["samples"])
                                         if d.get("autoscale") is not None else None),
}


def cluster_figures(cfg: ClusterConfig, standby: Sequence[WorkerSection]) -> dict:
    """How long requests queued in the workers (every worker's histogram, standby ones included) and, with an
    autoscaler, what it did: read from the services' /metrics at the end of a run."""
    workers = [f"{w.host}:{w.metrics_port}" for w in [*cfg.workers, *standby] if w.metrics_port]
    out: dict = {"queue_time": cluster_metrics.queue_time(workers)}
    if cfg.autoscale.scaler != "none" and cfg.memory_manager.metrics_port:
        out["autoscale"] = cluster_metrics.autoscale(f"{cfg.memory_manager.host}:{cfg.memory_manager.metrics_port}")
    return out


def compare_record(runs: dict[str, list[dict]], rows: Sequence[str]) -> dict:
    """The comparison of every row's runs: SLO references (the best row's p50 over its pooled runs, external
    servers included; every run's summary is redone against them, and its holds where no calibration measured
    the unloaded TTFT), each metric's median and range,
    whether the trace overloaded anything (:func:`verdict`), and, when it did, ratios of the medians against
    kunserve (every other row's TTFT p99 over kunserve's; kunserve's hold over the best baseline's) and the
    issue's targets (for the policies that have one; the hold target for a repeated burst, Fig. 17)."""
    done = {p: [r for d in ds for r in d["requests"] if r["ok"]] for p, ds in runs.items()}  # as summarize counts
    ttft = {p: [r["ttft_s"] for r in rs if r.get("ttft_s") is not None] for p, rs in done.items()}
    tpot = {p: [r["tpot_s"] for r in rs if r.get("tpot_s") is not None] for p, rs in done.items()}
    ref_ttft, ref_tpot = best_p50(ttft), best_p50(tpot)
    for ds in runs.values():
        for d in ds:
            results = [RequestResult.from_dict(r) for r in d["requests"]]
            d["summary"] = summarize(results, d["summary"]["duration_s"], reference_ttft_p50=ref_ttft,
                                     reference_tpot_p50=ref_tpot)
            source = d["trace"]["source"]
            d["holds"] = burst_holds(d["requests"], source.get("bursts") or [],
                                     unloaded_ttft(source, d["trace"]["mean_prompt"], ref_ttft), d["samples"])
    medians = {p: {name: spread([read(d) for d in ds]) for name, read in METRICS.items()} for p, ds in runs.items()}
    overload = verdict({p: [d["overload"]["overloaded"] for d in ds] for p, ds in runs.items()})
    ratios: dict[str, float] = {}
    checks: dict[str, bool] = {}
    k = medians.get("kunserve")
    if k is not None and overload["verdict"] != NEVER_OVERLOADED:
        k_p99 = k["ttft_p99_s"]["median"]
        for other in (o for o in runs if o != "kunserve"):
            target = TARGETS.get(f"ttft_p99_vs_{other}")
            o_p99 = medians[other]["ttft_p99_s"]["median"]
            if k_p99 is None or o_p99 is None:
                continue
            ratio = o_p99 / k_p99
            ratios[f"ttft_p99_{other}_over_kunserve"] = ratio
            if target is not None:
                checks[f"ttft_p99_vs_{other}>={target:g}x"] = ratio >= target
        base_tpot = medians["recompute"]["tpot_p50_s"]["median"] if "recompute" in medians else None
        if base_tpot and k["tpot_p50_s"]["median"] is not None:
            penalty = k["tpot_p50_s"]["median"] / base_tpot - 1
            ratios["tpot_p50_penalty_vs_recompute"] = penalty
            checks[f"tpot_p50_penalty<={TARGETS['tpot_p50_penalty_max']:.0%}"] = penalty <= TARGETS["tpot_p50_penalty_max"]
        for metric, name in (("hold_s", "hold"), ("memory_hold_s", "memory_hold")):
            best = max((h for h in (medians[o][metric]["median"] for o in runs if base_policy(o) != "kunserve")
                        if h is not None), default=None)
            mine = k[metric]["median"]
            if mine is not None and best:
                ratios[f"{name}_kunserve_over_best_baseline"] = mine / best
        repeated = any((d["trace"]["source"].get("repeat") or {}).get("copies", 1) > 1 for d in runs["kunserve"])
        if repeated and "hold_kunserve_over_best_baseline" in ratios:
            target = TARGETS["hold_vs_best_baseline"]
            checks[f"hold_vs_best_baseline>={target:g}x"] = ratios["hold_kunserve_over_best_baseline"] >= target
    return {"version": RESULT_VERSION, "policies": list(rows), "repeats": max((len(ds) for ds in runs.values()), default=0),
            "reference_p50": {"ttft_s": ref_ttft, "tpot_s": ref_tpot},
            "medians": medians, "ratios": ratios, "targets": checks, "overload": overload,
            "runs": {p: [{"run": i + 1, "summary": d["summary"], "drops": d["drops"], "restores": d["restores"],
                          "epoch_changes": d["epoch_changes"], "drop_seconds": sum(e - b for b, e in d["drop_periods"]),
                          "holds": d["holds"], "overload": d["overload"]}
                         for i, d in enumerate(ds)] for p, ds in runs.items()}}


def representative(docs: Sequence[dict]) -> dict:
    """The run whose TTFT p99 is the median of its row's (the one the comparison figure draws)."""
    ranked = sorted(docs, key=lambda d: (d["summary"]["ttft"]["p99"] is None, d["summary"]["ttft"]["p99"] or 0.0))
    return ranked[(len(ranked) - 1) // 2]


@dataclass
class Row:
    """One row of a comparison: a policy (a fresh local cluster per run) or an external server."""

    name: str
    endpoint: Endpoint | None = None


def calibration_cluster(args: argparse.Namespace, console, out: Path) -> tuple[list[TraceRequest], dict, dict | None]:
    """Plan the comparison's trace on a cluster of its own, started for that alone: whole instances (recompute,
    the engine every whole-instance policy shares) and no automatic drop, so the probe measures an instance and
    changes nothing, and every run then starts on a fresh cluster no probe has touched."""
    cfg = compare_config(args, "recompute")
    cfg.monitor.auto_drop = False
    run_dir = out / "calibration" / "cluster"
    cluster = LocalCluster(cfg, run_dir=run_dir)
    console.print(f"[bold]calibration[/]: starting a cluster to measure (logs: {run_dir})")
    try:
        cluster.start(timeout_s=args.start_timeout)
    except ClusterStartError as exc:
        raise BenchError(f"calibration: cluster failed to start: {exc}") from None
    try:
        time.sleep(args.settle)
        return plan_trace(args, console, address=cfg.dispatcher.address, admin=cfg.memory_manager.address,
                          creds=client.credentials_from(cluster.cfg, environ={}), cfg=cfg, workers=args.workers,
                          where="it")
    finally:
        cluster.stop()


def cmd_compare(args: argparse.Namespace) -> int:
    from kunserve.benchkit.plots import plot_compare, plot_run

    console = _console()
    policies = parse_policies(args.policies)
    if args.workers < 2:
        raise BenchError("--workers must be >= 2 (a drop merges instances; static-pp pairs them)")
    if args.repeats < 1:
        raise BenchError("--repeats must be >= 1")
    check_externals(args.external)
    for policy in policies:
        compare_config(args, policy)  # a bad config or a variant this build cannot run fails before anything starts
    build_trace(args, save=False)
    # Asked before the first cluster starts: a wrong URL fails in a second, not after every policy has run.
    api_key = args.external_api_key or os.environ.get(API_KEY_ENV) or None
    endpoints = [probe_endpoint(name, url, None, api_key) for name, url in args.external]
    rows = {p: Row(p) for p in policies} | {e.name: Row(e.name, e) for e in endpoints}
    out = _out_dir(args, "compare")
    described = ", ".join([*policies, *(f"{e.name} ({e.url}, model {e.model})" for e in endpoints)])
    scenario = SCENARIOS.get(args.scenario or "")
    if scenario is not None:
        console.print(f"scenario {scenario.describe()}: {_preset_flags(scenario)} (explicit flags win)")
    console.print(f"[bold]kunserve bench compare[/] on {args.workers} workers, {args.repeats} run(s) per row, "
                  f"rows: {described} -> {out}")
    if args.calibrate == "off":
        trace, source = build_trace(args)
        calibration = None
    else:
        trace, source, calibration = calibration_cluster(args, console, out)
    d = describe(trace)
    windows = ", ".join(f"{w['start_s']:g}-{w['start_s'] + w['duration_s']:g} s x{w['factor']:.3g}"
                        for w in source.get("bursts") or [])
    console.print(f"trace: {len(trace)} requests over {d['duration_s']:.1f} s (mean prompt {d['mean_prompt']:.0f}, "
                  f"output {d['mean_output']:.0f} tokens){'; bursts ' + windows if windows else ''}")
    stop_flag = _interrupt_flag()
    runs: dict[str, list[dict]] = {}
    interrupted = False
    for round_rows in schedule(list(rows), args.repeats):
        for name in round_rows:
            row = rows[name]
            k = len(runs.get(name, [])) + 1
            run_dir = out / name / f"run-{k}"
            if row.endpoint is not None:
                console.print(f"[bold]{name}[/] run {k}: replaying against {row.endpoint.url} "
                              f"(model {row.endpoint.model!r})")
                outcome = endpoint_with_progress(trace, row.endpoint, seed=args.seed, timeout_s=args.request_timeout,
                                                 stop_flag=stop_flag)
                doc = run_record(outcome, policy=name, trace_source=source, trace=trace,
                                 cluster={**row.endpoint.describe(), "external": True})
            else:
                cfg = compare_config(args, name)
                standby = standby_sections(cfg, POLICY_VARIANTS[name].standby if name in POLICY_VARIANTS else 0,
                                           free_ports=True)
                cluster = LocalCluster(cfg, run_dir=run_dir / "cluster", standby=standby)
                console.print(f"[bold]{name}[/] run {k}: starting a fresh cluster (logs: {run_dir / 'cluster'})")
                try:
                    cluster.start(timeout_s=args.start_timeout)
                except ClusterStartError as exc:
                    raise BenchError(f"{name}: cluster failed to start: {exc}") from None
                except KeyboardInterrupt:
                    interrupted = True
                    break
                if stop_flag[0]:  # Ctrl-C while it started
                    cluster.stop()
                    interrupted = True
                    break
                try:
                    time.sleep(args.settle)  # the first stats reports reach the monitor; static-pp pairs form
                    outcome = replay_with_progress(trace, cfg.dispatcher.address, cfg.memory_manager.address,
                                                   label=f"{name} {k}", seed=args.seed, timeout_s=args.request_timeout,
                                                   stop_flag=stop_flag,
                                                   creds=client.credentials_from(cluster.cfg, environ={}))
                    figures = cluster_figures(cfg, standby)
                finally:
                    cluster.stop()
                doc = run_record(outcome, policy=name, trace_source=source, trace=trace,
                                 cluster={"workers": args.workers, "pool_mib": cfg.engine.pool_mib,
                                          "threads": cfg.engine.threads, "block_size": cfg.engine.block_size,
                                          "model": cfg.model.path or "embedded tiny model",
                                          "overload_policy": cfg.policy.overload,
                                          **({"variant": POLICY_VARIANTS[name].describe()} if name in POLICY_VARIANTS
                                             else {}), **({"standby": len(standby)} if standby else {})})
                doc.update(figures)
            doc["run"] = k
            runs.setdefault(name, []).append(doc)
            _write_json(run_dir / "result.json", doc)
            s = doc["summary"]
            console.print(f"  {name} run {k}: {s['completed']}/{s['requests']} completed, TTFT p99 "
                          f"{_ms(s['ttft']['p99'])} ms, TPOT p50 {_ms(s['tpot']['p50'])} ms"
                          + (f", drops {doc['drops']}" if doc["samples"] else ""))
            if outcome.interrupted:
                interrupted = True
                break
        if interrupted:
            break
    if not runs:
        console.print("[yellow]interrupted before any policy ran[/]")
        return 130
    ordered = {name: runs[name] for name in rows if name in runs}
    comparison = compare_record(ordered, list(ordered))
    comparison["external"] = {e.name: e.describe() for e in endpoints if e.name in runs}
    comparison["calibration"] = calibration
    comparison["scenario"] = args.scenario
    comparison["interrupted"] = interrupted
    comparison["trace"] = {"source": source, **describe(trace)}
    for name, docs in ordered.items():  # rewritten with the common SLO references
        for doc in docs:
            _write_json(out / name / f"run-{doc['run']}" / "result.json", doc)
            plot_run(doc, out / name / f"run-{doc['run']}")
    _write_json(out / "compare.json", comparison)
    shown = {name: representative(docs) for name, docs in ordered.items()}
    png = plot_compare(shown, {p: d["summary"]["slo"] for p, d in shown.items()}, out / "compare.png")
    render_table(console, ordered, comparison)
    render_queueing(console, comparison)
    console.print(f"wrote {out / 'compare.json'} (every run), {png} (each row's median run), per-run results under "
                  f"{out}/<row>/run-<n>/")
    if interrupted:
        console.print("[yellow]interrupted[/]: the results above are partial")
        return 130
    return 0


def render_queueing(console, comparison: dict) -> None:
    """Per local row: how long requests queued in the workers (mean, p99), and with an autoscaler the time from
    "autoscale needed" to the new instance serving (medians over the runs)."""
    lines = []
    for name, m in comparison["medians"].items():
        mean, p99, to_serving, after_drop = (m[k]["median"] for k in (
            "queue_mean_s", "queue_p99_s", "autoscale_to_serving_s", "drop_to_new_instance_s"))
        if mean is None and to_serving is None:
            continue
        text = f"  {name}: queue time in the workers mean {_ms(mean)} ms, p99 <= {_ms(p99)} ms"
        if to_serving is not None:
            text += f"; the need (autoscale needed, or the drop held) -> new instance serving {to_serving:.2f} s"
        if after_drop is not None:
            text += f"; first drop -> new instance in the layout {after_drop:.1f} s"
        lines.append(text)
    if lines:
        console.print("queueing (kunserve:request_queue_time_seconds, every worker merged; p99 is a bucket bound):")
        for line in lines:
            console.print(line)


def cmd_convert(args: argparse.Namespace) -> int:
    """`bench convert-trace IN OUT`: the same requests and arrival times in another format."""
    if args.limit is not None and args.limit < 1:
        raise BenchError("--limit must be >= 1")
    trace, skipped, src_fmt = load_trace(args.input, args.from_format, model=args.trace_model,
                                         log_type=args.trace_log_type, limit=args.limit)
    fmt = save_trace(trace, args.output, args.to_format)
    d = describe(trace)
    print(f"wrote {len(trace)} requests over {d['duration_s']:.3f} s to {args.output} ({fmt}), read from {args.input} "
          f"({src_fmt}{f', skipped rows: {skipped}' if skipped else ''})")
    if fmt != "csv":
        extra = (f" --timed-trace-sec-multiplier {1 / MOONCAKE.units_per_second:g} --timed-trace-chunk-hash-size "
                 f"{MOONCAKE.block_tokens}" if fmt == MOONCAKE.name else "")
        print(f"replay it with: kunserve bench run --trace {args.output} --endpoint URL, or vllm bench serve "
              f"--dataset-name timed_trace --dataset-path {args.output} --num-prompts {len(trace)} --self-timed "
              f"--disable-shuffle --ignore-eos{extra}")
    return 0


def _cell(x: Spread, fmt: Callable[[float], str]) -> str:
    """A table cell: the median, and under it the range when the runs differ."""
    if x["median"] is None:
        return "-"
    text = fmt(x["median"])
    lo, hi = x["min"], x["max"]
    if x["n"] > 1 and lo is not None and hi is not None and lo != hi:
        text += f"\n[dim]{fmt(lo)}-{fmt(hi)}[/]"
    return text


def _ratio(x: float) -> str:
    return f"{x:.2f}x"


# Table columns after policy / done/sent / failed: (header, metric, format).
COLUMNS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("TTFT p50", "ttft_p50_s", _ms), ("TTFT p99", "ttft_p99_s", _ms), ("TTFT p99.9", "ttft_p999_s", _ms),
    ("TPOT p50", "tpot_p50_s", _ms), ("TPOT p99", "tpot_p99_s", _ms), ("E2E p99", "e2e_p99_s", _ms),
    ("SLO 5x TTFT", "slo_ttft_5x", lambda v: f"{100 * v:.0f}%"), ("tok/s", "output_tokens_per_s", lambda v: f"{v:.0f}"),
    ("drops", "drops", lambda v: f"{v:g}"), ("restores", "restores", lambda v: f"{v:g}"),
    ("drop s", "drop_seconds", lambda v: f"{v:.1f}"), ("holds s", "hold_s", lambda v: f"{v:.1f}"),
    ("KV full s", "memory_hold_s", lambda v: f"{v:.1f}"),
    ("peak demand", "peak_demand_ratio", _ratio),
)
HELD_THROUGH = "+"  # after a holds cell: some run never queued, its value is a lower bound


def _print_holds(console, runs: dict[str, list[dict]]) -> None:
    """Per burst window of each row's median run (by TTFT p99): when its requests started queueing, and how
    many did; nothing when the trace has no burst windows."""
    shown = {row: representative(docs) for row, docs in runs.items()}
    if not any(d["holds"]["windows"] for d in shown.values()):
        return
    unloaded = next((d["holds"]["unloaded"] for d in shown.values() if d["holds"]["unloaded"]), None)
    bound = "-" if unloaded is None else (
        f"{QUEUE_FACTOR:g} x {_ms(unloaded['ttft_s'])} ms" + (", or x its own prefill time if longer, calibrated"
                                                             if unloaded["prefill_tokens_per_s"] else
                                                             ", the SLO reference: no calibration"))
    console.print("queueing per burst window (s from the window's start to the first request of it waiting "
                  f"> {bound} for its first token; queued / arrived), median run:")
    for row, d in shown.items():
        parts = []
        for i, w in enumerate(d["holds"]["windows"], start=1):
            onset = "held" if w["onset_s"] is None else f"{w['onset_s']:.1f}"
            parts.append(f"#{i} [{w['start_s']:g}-{w['end_s']:g} s] {onset} ({w['queued']}/{w['requests']})"
                         if w["requests"] is not None else f"#{i} -")
        hold = d["holds"]
        drops = "" if hold["drops_before_queueing"] is None else (
            f"; {hold['drops_before_queueing']} drop(s), {hold['restores_before_queueing']} restore(s) before queueing")
        console.print(f"  {row}: {', '.join(parts)}{drops}")


def render_table(console, runs: dict[str, list[dict]], comparison: dict | None = None) -> None:
    """Each row's metrics: the median over its runs with the range under it (one run: its value)."""
    from rich.panel import Panel
    from rich.table import Table

    t = Table(title="kunserve bench" + (" compare" if comparison else ""), show_lines=bool(comparison))
    for col in ("policy", "done/sent", "failed", *(c[0] for c in COLUMNS)):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col in ("policy", "done/sent"))
    for row, docs in runs.items():
        m = {name: spread([read(d) for d in docs]) for name, read in METRICS.items()}
        label = row if len(docs) == 1 else f"{row}\n[dim]{len(docs)} runs[/]"
        cells = {metric: _cell(m[metric], fmt) for _, metric, fmt in COLUMNS}
        for metric, flag in (("hold_s", "held_through"), ("memory_hold_s", "memory_held_through")):
            if any(d["holds"][flag] for d in docs):
                first, *rest = cells[metric].split("\n")
                cells[metric] = "\n".join([first + HELD_THROUGH, *rest])
        t.add_row(label, f"{sum(d['summary']['completed'] for d in docs)}/{sum(d['summary']['requests'] for d in docs)}",
                  str(sum(d["summary"]["failed"] for d in docs)), *(cells[metric] for _, metric, _ in COLUMNS))
    console.print(t)
    console.print("latencies in ms (median over runs, range below); SLO 5x TTFT = share of requests whose TTFT <= 5 x the "
                  "best row's p50; peak demand = max of (KV in use + prompts waiting at the workers) / the undropped "
                  "KV capacity, as sampled; drops / restores = layout changes the sampler saw; holds s = from the first "
                  f"burst's start until a request that arrived since waits > {QUEUE_FACTOR:g} x its unloaded TTFT "
                  f"for its first token; KV full s = from there until KV in use + waiting prompts stay above the KV "
                  f"capacity for {MEMORY_BOUND_S:g} s ({HELD_THROUGH}: a run never got there, a lower bound)")
    _print_holds(console, runs)
    if comparison is None:
        return
    cal = comparison.get("calibration")
    if cal is not None:
        console.print(f"planned peak KV demand: {cal['planned_ratio']:.2f}x the undropped capacity of "
                      f"{cal['capacity']['tokens']:,} tokens (target {cal['target']:g}x)")
    overload = comparison["overload"]
    if overload["verdict"] == NEVER_OVERLOADED:
        console.print(Panel(f"[bold]{overload['banner']}[/]", border_style="red", title="[bold red]no overload[/]"))
        return
    if overload["verdict"] == OVERLOADED and overload["overloaded_runs"] < overload["observed_runs"]:
        console.print(f"[yellow]overloaded in {overload['overloaded_runs']} of {overload['observed_runs']} observed runs "
                      f"(rows: {', '.join(overload['overloaded_rows'])})[/]")
    for name, value in comparison["ratios"].items():
        pretty = f"{100 * value:+.0f}%" if "penalty" in name else f"{value:.1f}x"
        console.print(f"  {name}: {pretty} (medians)")
    for name, ok in comparison["targets"].items():
        console.print(f"  target {name}: {'[green]met[/]' if ok else '[red]missed[/]'}")


# -- coserve -------------------------------------------------------------------------------------------------
# Sized for the embedded model on one worker with one torch thread of a 2-core CPU (ConServe §6.2's setting scaled
# down): Gamma arrivals at CV 0.5, BurstGPT-like online lengths at half scale, a 64 MiB pool (~8k tokens of KV: about
# ten offline requests with the online ones beside them, so memory is what the policies contend for), 512-token
# iterations (vLLM's chunked-prefill cap, scaled). conserve's SLOs: --slo-scale x online-only's p99s (ConServe §6.2).
COSERVE_RATE = 1.0
COSERVE_CV = 0.5
COSERVE_DURATION_S = 60.0
COSERVE_POOL_MIB = 64
COSERVE_MAX_BATCHED = 512
COSERVE_INFLIGHT = 16
COSERVE_SLO_SCALE = 1.0
COSERVE_STALL_TIMEOUT_S = 60.0
COSERVE_WINDOW_S = 5.0
OFFLINE_POOL = 4096  # offline lengths drawn per run, cycled (more than any run here sends)
# --quick: one run per policy of a short trace (about 1-2 minutes in all here); explicit flags win.
COSERVE_QUICK = Scenario("quick", "smoke run", "one short run per policy",
                         {"duration": 12.0, "repeats": 1, "window": 2.0})
COSERVE_DEFAULTS: dict[str, Any] = {"duration": COSERVE_DURATION_S, "burst": [], "bursts": 1, "burst_gap": 0.0,
                                    "repeats": DEFAULT_REPEATS, "window": COSERVE_WINDOW_S}


def complete_coserve(ns: argparse.Namespace) -> None:
    """The flags left unset: --quick's presets, then the plain defaults (no burst window unless --burst)."""
    values = vars(ns)
    if values.get("no_burst"):
        values["burst"] = []
    resolve(values, COSERVE_DEFAULTS, COSERVE_QUICK if values.get("quick") else None)


def parse_coserve_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise BenchError("--policies is empty")
    unknown = [p for p in policies if p not in COSERVE_POLICIES]
    if unknown:
        raise BenchError(f"unknown policy {unknown[0]!r} (known: {', '.join(COSERVE_POLICIES)})")
    if len(set(policies)) != len(policies):
        raise BenchError("--policies names a policy twice")
    return policies


def check_coserve_args(args: argparse.Namespace) -> list[str]:
    """The policies to run, after every check that needs no cluster (BenchError)."""
    policies = parse_coserve_policies(args.policies)
    for name, least in (("repeats", 1), ("workers", 1), ("offline_inflight", 1), ("threads", 1),
                        ("max_batched_tokens", 1), ("pool_mib", 1)):
        if getattr(args, name) < least:
            raise BenchError(f"--{name.replace('_', '-')} must be >= {least}")
    for name in ("ttft_slo_ms", "tbt_slo_ms", "window", "slo_scale"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {value:g}")
    if CONSERVE in policies and ONLINE_ONLY not in policies and (args.ttft_slo_ms is None or args.tbt_slo_ms is None):
        raise BenchError("conserve's SLOs are --slo-scale x online-only's p99s: add online-only to --policies, or give "
                         "both --ttft-slo-ms and --tbt-slo-ms")
    return policies


def coserve_slo(args: argparse.Namespace, reference: Mapping[str, Any] | None) -> dict[str, float] | None:
    """The SLOs conserve runs under: the explicit ones, the others from online-only's summary (None until it ran)."""
    derived = slo_from(reference, args.slo_scale) if reference is not None else None
    ttft = args.ttft_slo_ms if args.ttft_slo_ms is not None else (derived or {}).get("ttft_ms")
    tbt = args.tbt_slo_ms if args.tbt_slo_ms is not None else (derived or {}).get("tbt_ms")
    return None if ttft is None or tbt is None else {"ttft_ms": ttft, "tbt_ms": tbt}


def coserve_config(args: argparse.Namespace, policy: str, slo: Mapping[str, float] | None = None) -> ClusterConfig:
    """A policy's cluster: the same config for all (workers, pool, threads, iteration cap, SLOs when known) but for
    engine.coserving; no parameter drop (recompute, monitor off): this bench isolates co-serving."""
    cfg = _load(args)
    with_workers(cfg, args.workers)
    assign_free_ports(cfg)
    cfg.engine.pool_mib = args.pool_mib
    cfg.engine.threads = args.threads
    cfg.engine.max_num_batched_tokens = args.max_batched_tokens
    cfg.engine.coserving = COSERVE_MODES[policy]
    if slo is not None:
        cfg.slo.ttft_ms, cfg.slo.tbt_ms = slo["ttft_ms"], slo["tbt_ms"]
    cfg.policy.overload = "recompute"
    cfg.monitor.auto_drop = False
    cfg.dispatcher.route_timeout_s = max(cfg.dispatcher.route_timeout_s, args.request_timeout)
    # every request waits until it is served: admission control would refuse part of the offline backlog with
    # bounds that follow each policy's own queueing
    cfg.dispatcher.max_queued_prompt_tokens = UNBOUNDED
    cfg.dispatcher.max_inflight_per_worker = UNBOUNDED
    cfg.dispatcher.queue_timeout_s = max(cfg.dispatcher.queue_timeout_s, args.request_timeout)
    # a loaded 2-core machine can keep a worker from answering its stats polls for seconds; this bench measures
    # latency, not failover, so a slow worker is waited for instead of being declared stalled
    cfg.dispatcher.stall_timeout_s = max(cfg.dispatcher.stall_timeout_s, COSERVE_STALL_TIMEOUT_S)
    cfg.logging.format = "json"
    return cfg


def _coserve_with_progress(trace: Sequence[TraceRequest], offline: Sequence[tuple[int, int]], cfg: ClusterConfig,
                           creds: client.Credentials, args: argparse.Namespace, label: str,
                           stop_flag: list[bool]) -> CoserveOutcome:
    """One run (`run_coserve`) under a progress bar of the online requests; `stop_flag[0]` turning True stops it."""
    return _with_progress(len(trace), label, stop_flag, lambda stop, done: run_coserve(
        trace, offline, cfg.dispatcher.address, inflight=args.offline_inflight, seed=args.seed,
        timeout_s=args.request_timeout, admin_address=cfg.memory_manager.address, stop=stop, on_online_done=done,
        creds=creds))


def coserve_run_record(outcome: CoserveOutcome, *, policy: str, run: int, cfg: ClusterConfig, window_s: float) -> dict:
    """The JSON document of one run: its summary, its time windows, the admin samples and every request."""
    return {"version": RESULT_VERSION, "policy": policy, "run": run, "coserving": cfg.engine.coserving,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "interrupted": outcome.interrupted, "not_sent": outcome.not_sent,
            "summary": summarize_run(outcome.online, outcome.offline, outcome.window_s, outcome.samples),
            "timeline": coserve_timeline(outcome.online, outcome.offline, outcome.window_s, window_s),
            "samples": outcome.samples, "online": [r.to_dict() for r in outcome.online],
            "offline": [r.to_dict() for r in outcome.offline]}


def _slo_text(slo: Mapping[str, float] | None) -> str:
    return "-" if slo is None else f"TTFT {slo['ttft_ms']:.0f} ms, TBT {slo['tbt_ms']:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


# Table columns of `coserve` after policy and online done/sent: (header, metric, format).
COSERVE_COLUMNS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("TTFT p50", "ttft_p50_s", _ms), ("TTFT p99", "ttft_p99_s", _ms), ("TBT p50", "tbt_p50_s", _ms),
    ("TBT p99", "tbt_p99_s", _ms), ("online tok/s", "online_tokens_per_s", lambda v: f"{v:.0f}"),
    ("offline tok/s", "offline_tokens_per_s", lambda v: f"{v:.0f}"),
    ("offline done", "offline_completed", lambda v: f"{v:g}"), ("preempt.", "preemptions", lambda v: f"{v:g}"),
    ("busy", "busy_share", _pct),
)
COSERVE_RATIOS: tuple[tuple[str, str], ...] = (("TTFT p99 / online-only", "ttft_p99_vs_online_only"),
                                               ("TBT p99 / online-only", "tbt_p99_vs_online_only"),
                                               ("offline / non-preemptive", "offline_vs_non_preemptive"))


def render_coserve(console, summaries: Mapping[str, Sequence[dict]], comparison: dict) -> None:
    """The table (median over runs, range below), then the issue's targets as met / missed."""
    from rich.table import Table

    t = Table(title="kunserve bench coserve", show_lines=True)
    for col in ("policy", "online done/sent", *(c[0] for c in COSERVE_COLUMNS), *(c[0] for c in COSERVE_RATIOS)):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    for policy, runs in summaries.items():
        m = comparison["medians"][policy]
        ratios = comparison["ratios"][policy]
        label = policy if len(runs) == 1 else f"{policy}\n[dim]{len(runs)} runs[/]"
        done = f"{sum(s['online']['completed'] for s in runs)}/{sum(s['online']['requests'] for s in runs)}"
        t.add_row(label, done, *(_cell(m[metric], fmt) for _, metric, fmt in COSERVE_COLUMNS),
                  *("-" if ratios[key] is None else _ratio(ratios[key]) for _, key in COSERVE_RATIOS))
    console.print(t)
    console.print("latencies in ms, median over runs (range below); TBT = every gap between two tokens of an online "
                  "request; offline tok/s = prompt + output tokens of offline requests processed per second, until the "
                  "last online request ended; preempt. = the workers' preemptions in that time; busy = share of it the "
                  "workers spent computing; ratios of the medians")
    for name, ok in comparison["targets"].items():
        verdict = "[dim]n/a (a policy it compares with did not run)[/]" if ok is None else (
            "[green]met[/]" if ok else "[red]missed[/]")
        console.print(f"  target {name}: {verdict}")


def cmd_coserve(args: argparse.Namespace) -> int:
    from kunserve.benchkit.coserve_plots import plot_coserve

    console = _console()
    policies = check_coserve_args(args)
    model = coserve_config(args, policies[0]).model.path or "embedded tiny model"  # a bad config fails here
    trace, source = build_trace(args)
    try:
        offline = offline_lengths(args.offline_profile, OFFLINE_POOL, seed=args.seed)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    out = _out_dir(args, "coserve")
    d = describe(trace)
    mean_in, mean_out = (sum(x[i] for x in offline) / len(offline) for i in (0, 1))
    console.print(f"[bold]kunserve bench coserve[/] on {args.workers} worker(s) x {args.threads} thread(s) "
                  f"({platform.machine()}, {os.cpu_count()} cores), {args.repeats} run(s) per policy: "
                  f"{', '.join(policies)} -> {out}")
    console.print(f"online: {len(trace)} requests over {d['duration_s']:.1f} s (mean prompt {d['mean_prompt']:.0f}, "
                  f"output {d['mean_output']:.0f} tokens); offline: {args.offline_inflight} in flight, "
                  f"'{args.offline_profile}' lengths (mean prompt {mean_in:.0f}, output {mean_out:.0f}); "
                  f"{args.max_batched_tokens} tokens per iteration at most; pool {args.pool_mib} MiB per worker")
    slo = coserve_slo(args, None)
    console.print(f"conserve's SLOs: {_slo_text(slo)}" if slo is not None else
                  f"conserve's SLOs: {args.slo_scale:g} x online-only's p99 TTFT and TBT (measured first)")
    stop_flag = _interrupt_flag()
    docs: dict[str, list[dict]] = {}
    interrupted = False
    for round_policies in coserve_rounds(policies, args.repeats):
        for policy in round_policies:
            k = len(docs.get(policy, [])) + 1
            run_dir = out / policy / f"run-{k}"
            cfg = coserve_config(args, policy, slo)
            cluster = LocalCluster(cfg, run_dir=run_dir / "cluster")
            console.print(f"[bold]{policy}[/] run {k}: starting a fresh cluster (engine.coserving = "
                          f"{cfg.engine.coserving}; logs: {run_dir / 'cluster'})")
            try:
                cluster.start(timeout_s=args.start_timeout)
            except ClusterStartError as exc:
                raise BenchError(f"{policy}: cluster failed to start: {exc}") from None
            except KeyboardInterrupt:
                interrupted = True
                break
            if stop_flag[0]:
                cluster.stop()
                interrupted = True
                break
            try:
                time.sleep(args.settle)
                outcome = _coserve_with_progress(trace, offline if policy != ONLINE_ONLY else [], cfg,
                                                 client.credentials_from(cluster.cfg, environ={}), args,
                                                 f"{policy} {k}", stop_flag)
            finally:
                cluster.stop()
            doc = coserve_run_record(outcome, policy=policy, run=k, cfg=cfg, window_s=args.window)
            docs.setdefault(policy, []).append(doc)
            _write_json(run_dir / "result.json", doc)
            s = doc["summary"]
            console.print(f"  {policy} run {k}: online {s['online']['completed']}/{s['online']['requests']}, TTFT p99 "
                          f"{_ms(s['online']['ttft']['p99'])} ms, TBT p99 {_ms(s['online']['tbt']['p99'])} ms, "
                          f"offline {s['offline']['tokens_per_s']:.0f} tok/s")
            if policy == ONLINE_ONLY and slo is None:
                slo = coserve_slo(args, s)
                console.print(f"  conserve's SLOs from it: {_slo_text(slo)}" if slo is not None else
                              "  [yellow]online-only measured no p99: conserve keeps the config's SLOs[/]")
            if outcome.interrupted:
                interrupted = True
                break
        if interrupted:
            break
    if not docs:
        console.print("[yellow]interrupted before any policy ran[/]")
        return 130
    ordered = {p: docs[p] for p in policies if p in docs}
    summaries = {p: [d["summary"] for d in ds] for p, ds in ordered.items()}
    comparison = compare_coserve(summaries)
    record = {"version": RESULT_VERSION, "policies": list(ordered), "repeats": args.repeats,
              "host": {"machine": platform.machine(), "cores": os.cpu_count(), "node": platform.node()},
              "cluster": {"workers": args.workers, "threads": args.threads, "pool_mib": args.pool_mib,
                          "max_num_batched_tokens": args.max_batched_tokens, "model": model},
              "slo": slo, "slo_scale": args.slo_scale,
              "trace": {"source": source, **d},
              "offline": {"profile": args.offline_profile, "inflight": args.offline_inflight,
                          "mean_prompt": mean_in, "mean_output": mean_out},
              "window_s": args.window, "interrupted": interrupted, **comparison,
              "runs": {p: [{"run": doc["run"], "summary": doc["summary"]} for doc in ds] for p, ds in ordered.items()}}
    _write_json(out / "coserve.json", record)
    shown = {p: coserve_representative(ds) for p, ds in ordered.items()}
    png = plot_coserve(shown, comparison["medians"], slo or {}, out / "coserve.png")
    render_coserve(console, summaries, comparison)
    console.print(f"wrote {out / 'coserve.json'} (every run's summary), {png}, per-run results under "
                  f"{out}/<policy>/run-<n>/result.json")
    if interrupted:
        console.print("[yellow]interrupted[/]: the results above are partial")
        return 130
    return 0


# -- parser ------------------------------------------------------------------------------------------------------
def _overload(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--overload takes a multiple of the KV capacity > 0 (e.g. 1.5), got {text!r}")
    return value


def _preset_flags(scenario: Scenario) -> str:
    """A scenario's presets as the flags they stand for (help text, the compare header)."""
    out = []
    for key, value in scenario.flags.items():
        flag = "--" + key.replace("_", "-")
        if key == "burst":
            out += [f"{flag} {w.start_s:g}:{w.duration_s:g}:{w.factor:g}" for w in value]
        else:
            out.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(out)


def _add_calibration_args(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group("calibration", "size the generated trace to the cluster's speed and KV capacity")
    g.add_argument("--calibrate", choices=("auto", "probe", "profile", "off"), default=default,
                   help="how to measure the instance's prefill / decode speed: the cost-model profile of "
                        "engine.profile when it matches (profile), a few requests (probe), the profile else the probe "
                        f"(auto), or not at all: the trace as given (off). Default {default}")
    g.add_argument("--overload", type=_overload, default=DEFAULT_OVERLOAD,
                   help="peak KV demand of the calibrated trace, as a multiple of the cluster's undropped KV capacity "
                        f"(default {DEFAULT_OVERLOAD:g}: beyond what the instances hold, within what a drop frees); "
                        "the base rate and the --burst factor are chosen for it, the burst window stays")


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace", "a trace file (--trace) or the built-in generator (Gamma arrivals)")
    g.add_argument("--trace", help="a BurstGPT CSV (Timestamp,Model,Request tokens,Response tokens,Total tokens,Log "
                                   "Type), a vLLM timed_trace JSONL or a Mooncake JSONL (format told from the content)")
    g.add_argument("--trace-format", choices=TRACE_FORMATS,
                   help="the --trace file's format, when the content does not tell (timed_trace: seconds and 16-token "
                        "hash blocks, vLLM's defaults; mooncake: milliseconds and 512-token blocks)")
    g.add_argument("--trace-model", help="CSV: keep only rows of this Model (e.g. ChatGPT)")
    g.add_argument("--trace-log-type", help="CSV: keep only rows of this Log Type (e.g. 'Conversation log')")
    g.add_argument("--limit", type=int, help="replay only the first N requests")
    g.add_argument("--rate", type=float, default=DEFAULT_RATE, help="generator: mean arrival rate (requests/s)")
    g.add_argument("--cv", type=float, default=1.0, help="generator: coefficient of variation of the gaps (1 = Poisson)")
    g.add_argument("--duration", type=float, help=f"generator: trace length (s; default {DEFAULT_DURATION_S:g})")
    windows = g.add_mutually_exclusive_group()
    windows.add_argument("--burst", type=parse_burst, action="append",
                         help=f"generator: START:DURATION:FACTOR, rate x FACTOR in that window (default {DEFAULT_BURST}); "
                              "repeatable: several windows, each calibrated on its own")
    windows.add_argument("--no-burst", action="store_true", help="generator: no burst window")
    g.add_argument("--bursts", type=int, metavar="N",
                   help="generator: replay the one --burst window N times (KunServe Fig. 17), --burst-gap apart; the "
                        "copies share the factor calibrated on the first (default 1)")
    g.add_argument("--burst-gap", type=float, metavar="S", help="generator: seconds from one copy's end to the next "
                                                                "one's start (default 0)")
    g.add_argument("--profile", choices=sorted(LENGTH_PROFILES), default="burstgpt",
                   help="generator: length distribution means (burstgpt 642/262, sharegpt 1660/373, longbench 5900/499)")
    g.add_argument("--length-scale", type=float, default=DEFAULT_LENGTH_SCALE,
                   help=f"multiply prompt and output lengths (default {DEFAULT_LENGTH_SCALE}: short CPU runs)")
    g.add_argument("--max-prompt", type=int, default=DEFAULT_MAX_PROMPT, help="clamp prompt lengths (tokens)")
    g.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT, help="clamp output lengths (tokens)")
    g.add_argument("--upscale", type=float, default=1.0,
                   help="scale the arrival rate, keeping the temporal pattern (TraceUpscaler)")
    g.add_argument("--seed", type=int, default=0, help="trace and prompt seed (same seed = same requests)")
    g.add_argument("--save-trace", help="also write the replayed trace: .csv (BurstGPT), .jsonl (timed_trace), "
                                        "*mooncake*.jsonl (Mooncake), or see --save-trace-format")
    g.add_argument("--save-trace-format", choices=TRACE_FORMATS, help="--save-trace's format, whatever its name")
    p.add_argument("--out", help="output directory (default ./kunserve-bench/<kind>-<time>)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline (s)")


class _BenchParser(argparse.ArgumentParser):
    """An ArgumentParser that completes what it parsed with `complete(namespace)`. The flags whose default
    depends on other flags (a scenario's presets, --no-burst) are left None by argparse and filled in there,
    where it is still known which ones the user gave."""

    complete: Callable[[argparse.Namespace], None] | None = None

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        ns, rest = super().parse_known_args(*args, **kwargs)
        if self.complete is not None:
            self.complete(ns)
        return ns, rest


# The plain defaults of the flags that complete_args fills in (`run`, then `compare`'s with its own).
TRACE_DEFAULTS: dict[str, Any] = {"duration": DEFAULT_DURATION_S, "burst": [parse_burst(DEFAULT_BURST)], "bursts": 1,
                                  "burst_gap": 0.0}
COMPARE_DEFAULTS: dict[str, Any] = {**TRACE_DEFAULTS, "policies": ",".join(OVERLOAD_POLICIES), "workers": 2}


def complete_args(ns: argparse.Namespace, plain: Mapping[str, Any] = TRACE_DEFAULTS) -> None:
    """Fill in the flags left unset: --no-burst means no window (and one copy of nothing unless --bursts says
    otherwise), then the --scenario's presets, then the plain defaults. An explicit flag always stays."""
    values = vars(ns)
    if values.get("no_burst"):
        values["burst"] = []
        if values.get("bursts") is None:
            values["bursts"] = 1
    resolve(values, plain, SCENARIOS.get(values.get("scenario") or ""))


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="replay a bursty trace and measure TTFT / TPOT (run, compare, convert-trace)")
    bsub = bench.add_subparsers(dest="bench_command", required=True, parser_class=_BenchParser)
    run = bsub.add_parser("run", help="replay a trace against a running cluster, or any OpenAI-compatible server")
    run.complete = complete_args
    _add_trace_args(run)
    run.add_argument("--address", help="dispatcher host:port (default: from the config)")
    run.add_argument("--admin", help="memory manager (admin) host:port for KV usage / drop sampling; '' = none")
    run.add_argument("--policy", help="label for the results (default: 'cluster', or 'endpoint' with --endpoint)")
    _add_calibration_args(run, "off")
    http = run.add_argument_group("OpenAI-compatible server", "replay over HTTP instead of the cluster's gRPC API")
    http.add_argument("--endpoint", metavar="URL",
                      help="base URL of an OpenAI API, e.g. http://127.0.0.1:8000/v1 (KunServe's front, vLLM, ...): "
                           "streams POST URL/completions with token-id prompts; no KV / drop sampling")
    http.add_argument("--model", help="--endpoint: the model to ask for (default: the first of GET URL/models)")
    http.add_argument("--api-key", help=f"--endpoint: sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    run.set_defaults(func=_guarded(cmd_run))
    cmp_ = bsub.add_parser("compare", help="run one trace through every overload policy, a fresh local cluster each")
    cmp_.complete = lambda ns: complete_args(ns, COMPARE_DEFAULTS)
    cmp_.add_argument("--scenario", choices=sorted(SCENARIOS),
                      help="fill in the flags of one of the paper's experiments (flags given explicitly win): "
                           + "; ".join(f"{s.describe()}: {_preset_flags(s)}" for s in SCENARIOS.values()))
    _add_trace_args(cmp_)
    cmp_.add_argument("--policies",
                      help=f"comma-separated, from: {', '.join(OVERLOAD_POLICIES)} (default: all), and the ablation "
                           f"variants {', '.join(POLICY_VARIANTS)}")
    cmp_.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                      help=f"runs per row, interleaved round by round with the row order rotated; the table shows the "
                           f"median and the range (default {DEFAULT_REPEATS})")
    _add_calibration_args(cmp_, "auto")
    cmp_.add_argument("--workers", type=int, help="workers per cluster (default 2)")
    cmp_.add_argument("--pool-mib", type=int, default=COMPARE_POOL_MIB,
                      help=f"memory pool per worker (default {COMPARE_POOL_MIB}: ~2k tokens of KV per whole instance "
                           "of the embedded model, so a burst overloads it)")
    cmp_.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    cmp_.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for each cluster")
    cmp_.add_argument("--settle", type=float, default=1.0, help="seconds between cluster ready and the replay")
    cmp_.add_argument("--external", action="append", type=parse_external, default=[], metavar="NAME=URL",
                      help="also replay the trace against this OpenAI-compatible server (base URL, e.g. "
                           "vllm=http://127.0.0.1:8000/v1) after the policies: one more row; repeatable")
    cmp_.add_argument("--external-api-key", help=f"API key for the --external servers (default: ${API_KEY_ENV})")
    cmp_.set_defaults(func=_guarded(cmd_compare))
    cos = bsub.add_parser("coserve", help="online trace + offline backlog through online-only, non-preemptive, "
                                          "preemptive and conserve (ConServe Fig. 6/7), a fresh local cluster each")
    cos.complete = complete_coserve
    cos.add_argument("--quick", action="store_true",
                     help=f"smoke run, about 1-2 minutes on a 2-core CPU: {_preset_flags(COSERVE_QUICK)} (explicit "
                          "flags win)")
    _add_trace_args(cos)
    cos.set_defaults(rate=COSERVE_RATE, cv=COSERVE_CV)
    for action in cos._actions:  # the trace group's help names run / compare's defaults
        if action.dest == "duration":
            action.help = f"generator: trace length (s; default {COSERVE_DURATION_S:g})"
        elif action.dest == "burst":
            action.help = "generator: START:DURATION:FACTOR, rate x FACTOR in that window (default: none); repeatable"
        elif action.dest in ("rate", "cv"):
            action.help = f"{action.help} (default {COSERVE_RATE if action.dest == 'rate' else COSERVE_CV:g})"
    cos.add_argument("--policies", default=",".join(COSERVE_POLICIES),
                     help=f"comma-separated, from: {', '.join(COSERVE_POLICIES)} (default: all)")
    cos.add_argument("--repeats", type=int,
                     help=f"runs per policy, interleaved round by round with the order rotated (default {DEFAULT_REPEATS})")
    g = cos.add_argument_group("offline work", "offline requests (class OFFLINE over gRPC) kept in flight beside the "
                                               "online trace until its last request ends")
    g.add_argument("--offline-profile", choices=OFFLINE_PROFILES, default="mix",
                   help="lengths after ConServe's offline sets (Table 1) scaled for a CPU: dureader (~900 / 42), "
                        "multinews (~290 / 99), vcsum (~780 / 84), or a random mix of the three (default); prompts "
                        "256-1024, outputs 32-128 tokens")
    g.add_argument("--offline-inflight", type=int, default=COSERVE_INFLIGHT,
                   help=f"offline requests in flight at any time (default {COSERVE_INFLIGHT})")
    c = cos.add_argument_group("cluster", "the same for every policy but engine.coserving")
    c.add_argument("--workers", type=int, default=1, help="workers per cluster (default 1: one instance)")
    c.add_argument("--pool-mib", type=int, default=COSERVE_POOL_MIB,
                   help=f"memory pool per worker (default {COSERVE_POOL_MIB}: ~8k tokens of KV with the embedded model)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    c.add_argument("--max-batched-tokens", type=int, default=COSERVE_MAX_BATCHED,
                   help=f"engine.max_num_batched_tokens: the baselines' fixed budget, conserve's cap "
                        f"(default {COSERVE_MAX_BATCHED})")
    c.add_argument("--slo-scale", type=float, default=COSERVE_SLO_SCALE,
                   help="conserve's SLOs (slo.ttft_ms: when it preempts layer-wise; slo.tbt_ms: its token budget) are "
                        f"this many times online-only's p99 TTFT and TBT, measured first (default {COSERVE_SLO_SCALE:g})")
    c.add_argument("--ttft-slo-ms", type=float, help="conserve's slo.ttft_ms instead (ms)")
    c.add_argument("--tbt-slo-ms", type=float, help="conserve's slo.tbt_ms instead (ms)")
    c.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for each cluster")
    c.add_argument("--settle", type=float, default=1.0, help="seconds between cluster ready and the run")
    cos.add_argument("--window", type=float, help=f"seconds per time window of the figure (default {COSERVE_WINDOW_S:g})")
    cos.set_defaults(func=_guarded(cmd_coserve))
    conv = bsub.add_parser("convert-trace", help="rewrite a trace in another format (BurstGPT CSV, timed_trace, Mooncake)")
    conv.add_argument("input", metavar="IN", help="the trace to read (format told from the content, or --from)")
    conv.add_argument("output", metavar="OUT", help="the file to write (format from its name, or --to)")
    conv.add_argument("--from", dest="from_format", choices=TRACE_FORMATS, help="IN's format")
    conv.add_argument("--to", dest="to_format", choices=TRACE_FORMATS,
                      help="OUT's format (default from the name: .csv, .jsonl = timed_trace, *mooncake*.jsonl)")
    conv.add_argument("--limit", type=int, help="keep only the first N requests (a slice)")
    conv.add_argument("--trace-model", help="CSV: keep only rows of this Model")
    conv.add_argument("--trace-log-type", help="CSV: keep only rows of this Log Type")
    conv.set_defaults(func=_guarded(cmd_convert))


def _guarded(fn):
    def run(args: argparse.Namespace) -> None:
        try:
            code = fn(args)
        except (BenchError, TraceError, ClusterUnreachable, EndpointError, ProbeError) as exc:
            print(f"kunserve: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        except OSError as exc:
            print(f"kunserve: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
            raise SystemExit(1) from None
        raise SystemExit(code)

    return run


__all__ = ["add_bench_parser", "build_trace", "check_coserve_args", "check_externals", "compare_record", "coserve_config",
           "coserve_slo", "parse_external", "parse_policies", "probe_endpoint", "render_coserve", "run_record"]
