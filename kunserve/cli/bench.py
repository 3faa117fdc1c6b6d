"""`kunserve bench run`, `compare` and `convert-trace`: replay a bursty trace and measure what users feel.

`run` replays a trace against a cluster that is already up (any policy) over gRPC, or with `--endpoint`
against any OpenAI-compatible server over HTTP, and writes result.json plus ttft_timeline.png and
latency_cdf.png. `compare` starts a fresh local cluster per overload policy (same config, trace and prompt
seed), runs the same replay on each, then on every `--external NAME=URL` server (a real vLLM, say), prints one
comparison table and writes compare.json and compare.png — the headline comparison of KunServe §5 in the same
system. `convert-trace` rewrites a trace between the BurstGPT CSV, vLLM timed_trace and Mooncake formats, so
`vllm bench serve` can replay the very trace this harness replays.

Errors are one line on stderr (exit 1); Ctrl-C writes what was measured so far and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kunserve import client
from kunserve.benchkit.openai_replay import EndpointError, list_models, normalize_base_url, replay_openai
from kunserve.benchkit.replay import ClusterUnreachable, ReplayOutcome, drop_periods, replay
from kunserve.benchkit.stats import RequestResult, best_p50, summarize
from kunserve.benchkit.trace import (
    LENGTH_PROFILES,
    MOONCAKE,
    TRACE_FORMATS,
    Burst,
    TraceError,
    TraceRequest,
    describe,
    generate_trace,
    load_trace,
    save_trace,
    scale_lengths,
    upscale,
)
from kunserve.cli.launcher import ClusterStartError, LocalCluster, assign_free_ports, with_workers
from kunserve.shared.config import ClusterConfig, ConfigError, load_config
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES
from kunserve.shared.rpc import health_check

RESULT_VERSION = 1
# Defaults sized for the embedded tiny model on a 2-core CPU with 2 workers and a 36 MiB pool (~2k tokens of
# KV per whole instance): BurstGPT-like lengths at half scale (mean ~320 in / ~130 out), 1 request/s, then
# 6x that rate for 20 s, which overflows the instances' KV memory for most of the window.
DEFAULT_RATE = 1.0
DEFAULT_DURATION_S = 40.0
DEFAULT_BURST = "5:20:6"
DEFAULT_LENGTH_SCALE = 0.5
DEFAULT_MAX_PROMPT = 1024
DEFAULT_MAX_OUTPUT = 384
COMPARE_POOL_MIB = 36
# The `kind` a loaded trace gets in the result's trace source, by format.
SOURCE_KINDS = {"csv": "burstgpt_csv", "timed_trace": "timed_trace", "mooncake": "mooncake"}
API_KEY_ENV = "OPENAI_API_KEY"  # what `vllm bench serve` and the openai SDK read
EXTERNAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TARGETS = {"ttft_p99_vs_recompute": 10.0, "ttft_p99_vs_swap": 10.0, "ttft_p99_vs_migrate": 5.0,
           "tpot_p50_penalty_max": 0.25}


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


def build_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], dict]:
    """The trace the arguments describe, and a JSON-able description of where it came from."""
    if args.limit is not None and args.limit < 1:
        raise BenchError("--limit must be >= 1")
    if args.trace:
        trace, skipped, fmt = load_trace(args.trace, args.trace_format, model=args.trace_model,
                                         log_type=args.trace_log_type, limit=args.limit)
        source = {"kind": SOURCE_KINDS[fmt], "path": str(args.trace), "skipped_rows": skipped}
        if args.length_scale != 1.0 or args.max_prompt or args.max_output:
            trace = scale_lengths(trace, args.length_scale, max_prompt=args.max_prompt, max_output=args.max_output)
    else:
        try:
            trace = generate_trace(rate=args.rate, cv=args.cv, duration_s=args.duration, profile=args.profile,
                                   seed=args.seed, scale=args.length_scale, burst=args.burst,
                                   max_prompt=args.max_prompt, max_output=args.max_output)
        except ValueError as exc:
            raise BenchError(f"bad trace parameters: {exc}") from None
        source = {"kind": "gamma", "rate": args.rate, "cv": args.cv, "duration_s": args.duration,
                  "profile": args.profile, "burst": None if args.burst is None else vars(args.burst)}
        if args.limit:
            trace = trace[: args.limit]
    if args.upscale != 1.0:
        try:
            trace = upscale(trace, args.upscale, seed=args.seed)
        except ValueError as exc:
            raise BenchError(f"bad --upscale: {exc}") from None
        source["upscale"] = args.upscale
    source.update(seed=args.seed, length_scale=args.length_scale, max_prompt=args.max_prompt,
                  max_output=args.max_output)
    if not trace:
        raise BenchError("the trace is empty: nothing to replay")
    if args.save_trace:
        save_trace(trace, args.save_trace, args.save_trace_format)
    return trace, source


# -- one replay ------------------------------------------------------------------------------------------------
def _progress(total: int, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), transient=False)


ReplayFn = Callable[[asyncio.Event, Callable[[RequestResult], None]], Awaitable[ReplayOutcome]]


def _with_progress(total: int, label: str, stop_flag: list[bool], run: ReplayFn) -> ReplayOutcome:
    """Run a replay (`run(stop, on_done)`) under a rich progress bar; `stop_flag[0]` turning True (a signal
    handler) sets `stop`, which interrupts it."""
    progress = _progress(total, label)
    task = progress.add_task(label, total=total, info="")
    failed = [0]

    def done(r: RequestResult) -> None:
        failed[0] += not r.ok
        progress.update(task, advance=1, info=f"failed {failed[0]}" if failed[0] else "")

    async def main() -> ReplayOutcome:
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
    return {
        "version": RESULT_VERSION,
        "policy": policy,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "python": platform.python_version(), "node": platform.node()},
        "cluster": cluster,
        "trace": {"source": trace_source, **describe(trace)},
        "interrupted": outcome.interrupted,
        "not_sent": outcome.not_sent,
        "summary": summarize(outcome.results, outcome.duration_s, reference_ttft_p50=reference_ttft_p50,
                             reference_tpot_p50=reference_tpot_p50),
        "drops": _drops(outcome),
        "epoch_changes": _epoch_changes(outcome),
        "drop_periods": drop_periods(outcome.samples),
        "samples": [s.to_dict() for s in outcome.samples],
        "requests": [r.to_dict() for r in outcome.results],
    }


def _drops(outcome: ReplayOutcome) -> int:
    """Drops seen by the sampler: rises of the number of pipeline groups."""
    units = [s.pipelined_units for s in outcome.samples]
    return sum(1 for a, b in zip(units, units[1:]) if b > a)


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
        console = Console(highlight=False, width=150)
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
    trace, source = build_trace(args)
    if args.endpoint:
        return _run_endpoint(args, console, trace, source)
    address, admin, creds = _addresses(args)
    if admin and not asyncio.run(health_check(admin, timeout=2.0, tls=creds.tls)):
        console.print(f"[yellow]warning[/]: the admin service at {admin} does not answer: no KV usage / drop "
                      "sampling (give --admin HOST:PORT, or --admin '' to silence this)")
        admin = None
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
    render_table(console, {label: doc})
    console.print(f"wrote {out / 'result.json'}, " + ", ".join(str(p) for p in plots))
    if outcome.interrupted:
        console.print(f"[yellow]interrupted[/]: {len(outcome.results)} requests measured, {outcome.not_sent} not sent")
        return 130
    return 0


def _addresses(args: argparse.Namespace) -> tuple[str, str | None, client.Credentials]:
    """The dispatcher and admin addresses, and the credentials the config (or the defaults) point to."""
    try:
        cfg = load_config(args.config)
        creds = client.credentials_from(cfg)
    except ConfigError as exc:  # CredentialError is one
        raise BenchError(f"config error: {exc}") from None
    address = args.address or cfg.dispatcher.address
    admin = args.admin if args.admin is not None else cfg.memory_manager.address
    return address, (admin or None), creds


# -- compare ---------------------------------------------------------------------------------------------------
def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise BenchError("--policies is empty")
    unknown = [p for p in policies if p not in OVERLOAD_POLICIES]
    if unknown:
        raise BenchError(f"unknown policy {unknown[0]!r} (known: {', '.join(OVERLOAD_POLICIES)})")
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
        if name in OVERLOAD_POLICIES:
            raise BenchError(f"--external {name}=...: {name!r} is an overload policy's name; pick another")
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise BenchError(f"--external names {dup!r} twice")


def compare_config(args: argparse.Namespace, policy: str) -> ClusterConfig:
    """The cluster every policy gets: the same config but for `policy.overload`."""
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise BenchError(f"config error: {exc}") from None
    with_workers(cfg, args.workers)
    assign_free_ports(cfg)
    if args.pool_mib:
        cfg.engine.pool_mib = args.pool_mib
    if args.threads is not None:
        cfg.engine.threads = args.threads
    cfg.policy.overload = policy
    cfg.monitor.auto_drop = True  # the monitor acts only for the policies that use it (kunserve, migrate)
    # Detection within ~0.2 s for every policy: stats reports and policy ticks at 0.1 s (what they cost on the
    # cluster is the same whichever policy runs; only kunserve and migrate act on them).
    cfg.monitor.stats_interval_s = min(cfg.monitor.stats_interval_s, 0.1)
    cfg.monitor.policy_interval_s = min(cfg.monitor.policy_interval_s, 0.1)
    cfg.dispatcher.route_timeout_s = max(cfg.dispatcher.route_timeout_s, args.request_timeout)
    cfg.logging.format = "json"
    return cfg


def compare_record(docs: dict[str, dict], policies: Sequence[str], externals: Sequence[str] = ()) -> dict:
    """SLO references (the best row's p50, external servers included), ratios against kunserve (every other
    row's TTFT p99 over kunserve's) and the issue's targets (for the policies that have one)."""
    done = {p: [r for r in d["requests"] if r["ok"]] for p, d in docs.items()}  # as summarize counts them
    ttft = {p: [r["ttft_s"] for r in rs if r.get("ttft_s") is not None] for p, rs in done.items()}
    tpot = {p: [r["tpot_s"] for r in rs if r.get("tpot_s") is not None] for p, rs in done.items()}
    ref_ttft, ref_tpot = best_p50(ttft), best_p50(tpot)
    summaries = {}
    for p, d in docs.items():
        results = [RequestResult.from_dict(r) for r in d["requests"]]
        d["summary"] = summarize(results, d["summary"]["duration_s"], reference_ttft_p50=ref_ttft,
                                 reference_tpot_p50=ref_tpot)
        summaries[p] = d["summary"]
    ratios: dict[str, float | None] = {}
    checks: dict[str, bool | None] = {}
    k = summaries.get("kunserve")
    if k is not None:
        k_p99 = k["ttft"]["p99"]
        for other, target in (("recompute", 10.0), ("swap", 10.0), ("migrate", 5.0), ("static-pp", None),
                              ("queue", None), *((name, None) for name in externals)):
            o = summaries.get(other)
            if o is None or k_p99 is None or o["ttft"]["p99"] is None:
                continue
            ratio = o["ttft"]["p99"] / k_p99
            ratios[f"ttft_p99_{other}_over_kunserve"] = ratio
            if target is not None:
                checks[f"ttft_p99_vs_{other}>={target:g}x"] = ratio >= target
        base = summaries.get("recompute")
        if base is not None and base["tpot"]["p50"] and k["tpot"]["p50"] is not None:
            penalty = k["tpot"]["p50"] / base["tpot"]["p50"] - 1
            ratios["tpot_p50_penalty_vs_recompute"] = penalty
            checks["tpot_p50_penalty<=25%"] = penalty <= 0.25
    return {"version": RESULT_VERSION, "policies": list(policies), "reference_p50": {"ttft_s": ref_ttft, "tpot_s": ref_tpot},
            "summaries": summaries, "ratios": ratios, "targets": checks,
            "drops": {p: d["drops"] for p, d in docs.items()},
            "epoch_changes": {p: d["epoch_changes"] for p, d in docs.items()},
            "drop_seconds": {p: sum(e - s for s, e in d["drop_periods"]) for p, d in docs.items()}}


def cmd_compare(args: argparse.Namespace) -> int:
    from kunserve.benchkit.plots import plot_compare, plot_run

    console = _console()
    policies = parse_policies(args.policies)
    if args.workers < 2:
        raise BenchError("--workers must be >= 2 (a drop merges instances; static-pp pairs them)")
    check_externals(args.external)
    trace, source = build_trace(args)
    # Asked before the first cluster starts: a wrong URL fails in a second, not after every policy has run.
    api_key = args.external_api_key or os.environ.get(API_KEY_ENV) or None
    endpoints = [probe_endpoint(name, url, None, api_key) for name, url in args.external]
    out = _out_dir(args, "compare")
    d = describe(trace)
    rows = ", ".join([*policies, *(f"{e.name} ({e.url}, model {e.model})" for e in endpoints)])
    console.print(f"[bold]kunserve bench compare[/]: {len(trace)} requests over {d['duration_s']:.1f} s "
                  f"(mean prompt {d['mean_prompt']:.0f}, output {d['mean_output']:.0f} tokens) on {args.workers} workers, "
                  f"rows: {rows} -> {out}")
    stop_flag = _interrupt_flag()
    docs: dict[str, dict] = {}
    interrupted = False
    for policy in policies:
        cfg = compare_config(args, policy)
        run_dir = out / policy / "cluster"
        cluster = LocalCluster(cfg, run_dir=run_dir)
        console.print(f"[bold]{policy}[/]: starting a fresh cluster (logs: {run_dir})")
        try:
            cluster.start(timeout_s=args.start_timeout)
        except ClusterStartError as exc:
            raise BenchError(f"{policy}: cluster failed to start: {exc}") from None
        except KeyboardInterrupt:
            interrupted = True
            break
        if stop_flag[0]:  # Ctrl-C while it started
            cluster.stop()
            interrupted = True
            break
        try:
            time.sleep(args.settle)  # the first stats reports reach the monitor; static-pp pairs form
            outcome = replay_with_progress(trace, cfg.dispatcher.address, cfg.memory_manager.address, label=policy,
                                           seed=args.seed, timeout_s=args.request_timeout, stop_flag=stop_flag,
                                           creds=client.credentials_from(cluster.cfg, environ={}))
        finally:
            cluster.stop()
        docs[policy] = run_record(outcome, policy=policy, trace_source=source, trace=trace,
                                  cluster={"workers": args.workers, "pool_mib": cfg.engine.pool_mib,
                                           "threads": cfg.engine.threads, "block_size": cfg.engine.block_size,
                                           "model": cfg.model.path or "embedded tiny model"})
        _write_json(out / policy / "result.json", docs[policy])
        s = docs[policy]["summary"]
        console.print(f"  {policy}: {s['completed']}/{s['requests']} completed, TTFT p99 {_ms(s['ttft']['p99'])} ms, "
                      f"TPOT p50 {_ms(s['tpot']['p50'])} ms")
        if outcome.interrupted:
            interrupted = True
            break
    for endpoint in endpoints:
        if interrupted:
            break
        console.print(f"[bold]{endpoint.name}[/]: replaying against {endpoint.url} (model {endpoint.model!r})")
        outcome = endpoint_with_progress(trace, endpoint, seed=args.seed, timeout_s=args.request_timeout,
                                         stop_flag=stop_flag)
        docs[endpoint.name] = run_record(outcome, policy=endpoint.name, trace_source=source, trace=trace,
                                         cluster={**endpoint.describe(), "external": True})
        _write_json(out / endpoint.name / "result.json", docs[endpoint.name])
        s = docs[endpoint.name]["summary"]
        console.print(f"  {endpoint.name}: {s['completed']}/{s['requests']} completed, TTFT p99 "
                      f"{_ms(s['ttft']['p99'])} ms, TPOT p50 {_ms(s['tpot']['p50'])} ms")
        interrupted = outcome.interrupted
    if not docs:
        console.print("[yellow]interrupted before any policy ran[/]")
        return 130
    ran_externals = [e.name for e in endpoints if e.name in docs]
    comparison = compare_record(docs, list(docs), ran_externals)
    comparison["external"] = {e.name: e.describe() for e in endpoints if e.name in docs}
    for policy, doc in docs.items():  # rewritten with the common SLO references
        _write_json(out / policy / "result.json", doc)
        plot_run(doc, out / policy)
    comparison["interrupted"] = interrupted
    comparison["trace"] = {"source": source, **d}
    _write_json(out / "compare.json", comparison)
    slo = {p: s["slo"] for p, s in comparison["summaries"].items()}
    png = plot_compare(docs, slo, out / "compare.png")
    render_table(console, docs, comparison)
    console.print(f"wrote {out / 'compare.json'}, {png}, per-row results under {out}/<policy or external name>/")
    if interrupted:
        console.print("[yellow]interrupted[/]: the results above are partial")
        return 130
    return 0


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


def render_table(console, docs: dict[str, dict], comparison: dict | None = None) -> None:
    from rich.table import Table

    t = Table(title="kunserve bench" + (" compare" if comparison else ""), show_lines=False)
    for col in ("policy", "done/sent", "failed", "TTFT p50", "TTFT p99", "TTFT p99.9", "TPOT p50", "TPOT p99",
                "E2E p99", "SLO 5x TTFT", "tok/s", "drops", "drop s", "epoch ch."):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for policy, doc in docs.items():
        s = doc["summary"]
        slo5 = (s.get("slo", {}).get("ttft") or {}).get("5")
        # Without cluster samples (an external server, or no admin address) drops were not observed, not zero.
        drops = ((str(doc["drops"]), f"{sum(e - b for b, e in doc['drop_periods']):.1f}", str(doc["epoch_changes"]))
                 if doc["samples"] else ("-", "-", "-"))
        t.add_row(policy, f"{s['completed']}/{s['requests']}", str(s["failed"]), _ms(s["ttft"]["p50"]),
                  _ms(s["ttft"]["p99"]), _ms(s["ttft"]["p999"]), _ms(s["tpot"]["p50"]), _ms(s["tpot"]["p99"]),
                  _ms(s["e2e"]["p99"]), "-" if slo5 is None else f"{100 * slo5:.0f}%",
                  f"{s['throughput']['output_tokens_per_s']:.0f}", *drops)
    console.print(t)
    console.print("latencies in ms; SLO 5x TTFT = share of requests whose TTFT <= 5 x the best policy's p50")
    if comparison and comparison["ratios"]:
        for name, value in comparison["ratios"].items():
            pretty = f"{100 * value:+.0f}%" if "penalty" in name else f"{value:.1f}x"
            console.print(f"  {name}: {pretty}")
        for name, ok in comparison["targets"].items():
            console.print(f"  target {name}: {'[green]met[/]' if ok else '[red]missed[/]'}")


# -- parser ------------------------------------------------------------------------------------------------------
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
    g.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="generator: trace length (s)")
    g.add_argument("--burst", type=parse_burst, default=parse_burst(DEFAULT_BURST),
                   help=f"generator: START:DURATION:FACTOR, rate x FACTOR in that window (default {DEFAULT_BURST})")
    g.add_argument("--no-burst", dest="burst", action="store_const", const=None, help="generator: no burst window")
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


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="replay a bursty trace and measure TTFT / TPOT (run, compare, convert-trace)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    run = bsub.add_parser("run", help="replay a trace against a running cluster, or any OpenAI-compatible server")
    _add_trace_args(run)
    run.add_argument("--address", help="dispatcher host:port (default: from the config)")
    run.add_argument("--admin", help="memory manager (admin) host:port for KV usage / drop sampling; '' = none")
    run.add_argument("--policy", help="label for the results (default: 'cluster', or 'endpoint' with --endpoint)")
    http = run.add_argument_group("OpenAI-compatible server", "replay over HTTP instead of the cluster's gRPC API")
    http.add_argument("--endpoint", metavar="URL",
                      help="base URL of an OpenAI API, e.g. http://127.0.0.1:8000/v1 (KunServe's front, vLLM, ...): "
                           "streams POST URL/completions with token-id prompts; no KV / drop sampling")
    http.add_argument("--model", help="--endpoint: the model to ask for (default: the first of GET URL/models)")
    http.add_argument("--api-key", help=f"--endpoint: sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    run.set_defaults(func=_guarded(cmd_run))
    cmp_ = bsub.add_parser("compare", help="run one trace through every overload policy, a fresh local cluster each")
    _add_trace_args(cmp_)
    cmp_.add_argument("--policies", default=",".join(OVERLOAD_POLICIES),
                      help=f"comma-separated, from: {', '.join(OVERLOAD_POLICIES)} (default: all)")
    cmp_.add_argument("--workers", type=int, default=2, help="workers per cluster (default 2)")
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
        except (BenchError, TraceError, ClusterUnreachable, EndpointError) as exc:
            print(f"kunserve: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        except OSError as exc:
            print(f"kunserve: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
            raise SystemExit(1) from None
        raise SystemExit(code)

    return run


__all__ = ["add_bench_parser", "build_trace", "check_externals", "compare_record", "parse_external", "parse_policies",
           "probe_endpoint", "run_record"]
