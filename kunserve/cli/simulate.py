"""`kunserve simulate`: replay a trace through a simulated cluster that runs the live policies (kunserve/sim/).

The trace comes from the same flags, generator, loaders and upscaling as `kunserve bench`; the cluster from a
scenario file (configs/scenarios/*.toml) and / or flags (instances, model shape, accelerator or profile, memory,
network); the policies are the overload policies and ablation variants `bench compare` knows. One policy writes what
`bench run` writes (result.json, ttft_timeline.png, latency_cdf.png), several what `bench compare` writes
(compare.json, compare.png, <policy>/run-1/...), each result with a "simulation" section (time model, transitions,
counters, simulated seconds per wall second). A scenario with a [sweep] runs ConServe's load sweep instead (online
trace at each rate beside an offline backlog, under online-only / non-preemptive / preemptive / conserve) and writes
sweep.json.

`--validate` replays the trace on a fresh real local cluster (`bench compare`'s machinery, one run) and through the
simulator with this machine's profile and the same config, and reports the simulator's error on p50 / p99 TTFT, p50
TPOT, throughput and the drops.

Bad input (a profile of another model, an unknown accelerator, a model that does not fit its memory, a trace a real
run would refuse to load, an unknown scenario key) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from kunserve.benchkit.calibrate import CalibrationError, calibrate, peak_kv_demand, speeds_from_cost_model
from kunserve.benchkit.probe import Capacity
from kunserve.benchkit.trace import TraceError, TraceRequest, describe, gamma_arrivals, generate_trace
from kunserve.cli import bench
from kunserve.shared.config import ClusterConfig, ConfigError, load_config
from kunserve.shared.profile_files import ProfileError
from kunserve.sim.elastic import GPUS_PER_HOST, TP_REFORM_S
from kunserve.sim.hardware import UnknownAccelerator
from kunserve.sim.scenario import (
    ClusterSpec,
    Scenario,
    ScenarioError,
    apply_config,
    build_setup,
    load_scenario,
    machine_profile,
)
from kunserve.sim.serving import fit_serving, probe_trace, with_serving

EXIT_BAD_INPUT = 2
CLUSTER_FLAGS = (
    "instances",
    "model",
    "accelerator",
    "profile_file",
    "profile_device",
    "tp",
    "memory_utilization",
    "gpu_memory_gib",
    "network_gbps",
    "iteration_overhead_ms",
    "sequence_overhead_ms",
    "request_latency_ms",
    "forward_scale",
    "elastic_tp",
    "tp_reform_s",
    "gpus_per_host",
)
VALIDATION_TARGETS = {"ttft_p50_s": 0.15, "tpot_p50_s": 0.15, "ttft_p99_s": 0.25, "output_tokens_per_s": 0.15}


class SimulateError(Exception):
    """A user-facing problem: one line, exit 2."""


# -- arguments -------------------------------------------------------------------------------------------------------
def _trace_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}


def resolve_args(args: argparse.Namespace, defaults: dict[str, Any], scenario: Scenario | None) -> None:
    """Scenario [trace] values fill every trace flag left at its default; then the bench's own completion
    (duration, burst windows). Explicit flags win."""
    values = vars(args)
    if scenario is not None:
        for key, value in scenario.trace.items():
            if key in values and values[key] == defaults.get(key):
                values[key] = [bench.parse_burst(v) for v in value] if key == "burst" else value
    bench.complete_args(args)


def cluster_spec(args: argparse.Namespace, scenario: Scenario | None, cfg: ClusterConfig) -> ClusterSpec:
    base: dict[str, Any] = {"instances": len(cfg.workers), "model": cfg.model.path or "embedded"}
    if scenario is not None:
        base.update({("profile_file" if k == "profile" else k): v for k, v in scenario.cluster.items()})
    for flag in CLUSTER_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            base[flag] = value
    if "profile_file" in base:
        base["profile"] = base.pop("profile_file")
    return ClusterSpec(**base)


def row_config(base: ClusterConfig, row: str, request_timeout: float) -> ClusterConfig:
    """The config every simulated row runs: `bench compare`'s (its policy or variant; detection every 0.1 s; every
    request queues until served, no admission bound or queue timeout turning latency into failures)."""
    from kunserve.benchkit.variants import POLICY_VARIANTS, VariantUnavailable, apply_variant

    cfg = copy.deepcopy(base)
    if row in POLICY_VARIANTS:
        try:
            apply_variant(cfg, row)
        except VariantUnavailable as exc:
            raise SimulateError(str(exc)) from None
    else:
        cfg.policy.overload = row
    cfg.monitor.auto_drop = True
    cfg.monitor.stats_interval_s = min(cfg.monitor.stats_interval_s, 0.1)
    cfg.monitor.policy_interval_s = min(cfg.monitor.policy_interval_s, 0.1)
    cfg.dispatcher.route_timeout_s = max(cfg.dispatcher.route_timeout_s, request_timeout)
    cfg.dispatcher.max_queued_prompt_tokens = bench.UNBOUNDED
    cfg.dispatcher.max_inflight_per_worker = bench.UNBOUNDED
    cfg.dispatcher.queue_timeout_s = max(cfg.dispatcher.queue_timeout_s, request_timeout)
    return cfg


# -- the trace ---------------------------------------------------------------------------------------------------------
def plan_trace(args: argparse.Namespace, setup: Any) -> tuple[list[TraceRequest], dict, dict | None]:
    """The trace and its source; calibrated to the simulated cluster (`--calibrate model`: its undropped KV capacity
    and the speeds its cost model predicts, `bench compare`'s rule) when generated."""
    trace, source = bench.build_trace(args, save=False)
    if args.calibrate == "off":
        if args.save_trace:
            bench.save_trace(trace, args.save_trace, args.save_trace_format)
        return trace, source, None
    d = describe(trace)
    capacity = Capacity(setup.memory.undropped_blocks * setup.shape.block_size * setup.instances, setup.instances, setup.shape.block_size)
    footprint = d["mean_prompt"] + d["mean_output"] / 2
    prompt = max(1, min(bench.PROBE_MAX_PROMPT, round(d["mean_prompt"])))
    per_instance = max(
        1,
        min(
            round(capacity.per_instance_tokens / footprint),
            int(bench.PROBE_FILL * capacity.per_instance_tokens / (prompt + bench.PROBE_DECODE_TOKENS)),
        ),
    )
    speeds = speeds_from_cost_model(
        setup.time.profile.kunserve,
        prompt_tokens=prompt,
        concurrency=per_instance,
        context_tokens=round(footprint),
        source=f"simulated {setup.time.source}",
    )
    record: dict = {"target": args.overload, "capacity": capacity.to_dict(), "speeds": speeds.to_dict()}
    if args.trace:
        peak = peak_kv_demand(trace, speeds)
        record.update(
            calibrated=False, planned_peak_tokens=peak.tokens, planned_peak_at_s=peak.at_s, planned_ratio=peak.tokens / capacity.tokens
        )
    else:
        given = [w.factor for w in bench.distinct_bursts(args)]
        try:
            cal = calibrate(
                lambda rate, factors: bench._generated(bench._with_load(args, rate, factors)),
                rate=args.rate,
                burst_factors=given,
                spans=bench.burst_spans(args),
                speeds=speeds,
                capacity_tokens=capacity.tokens,
                target=args.overload,
            )
        except CalibrationError as exc:
            raise SimulateError(f"calibration: {exc}") from None
        chosen = {k: v for k, v in cal.to_dict().items() if k not in ("speeds", "capacity_tokens", "target")}
        record.update(calibrated=True, given={"rate": args.rate, "burst_factors": given}, **chosen)
        trace, source = bench.build_trace(bench._with_load(args, cal.rate, cal.burst_factors), save=False)
    source["calibration"] = record
    if args.save_trace:
        bench.save_trace(trace, args.save_trace, args.save_trace_format)
    return trace, source, record


# -- one simulated run -------------------------------------------------------------------------------------------------
def simulate_row(
    setup: Any, trace: Sequence[TraceRequest], source: dict, args: argparse.Namespace, *, offline: Any = None
) -> tuple[dict, Any]:
    """Run the simulation of one row; its bench record (run_record) with a "simulation" section."""
    from kunserve.sim.cluster import Simulation

    t0 = time.perf_counter()
    sim = Simulation(setup, trace, offline=offline, request_timeout_s=args.request_timeout)
    outcome = sim.run()
    wall = time.perf_counter() - t0
    cluster = {
        "simulated": True,
        "instances": setup.instances,
        "model": setup.shape.name,
        "tp": setup.shape.tp,
        "pool_bytes": setup.memory.pool_bytes,
        "kv_blocks_per_instance": setup.memory.undropped_blocks,
        "block_size": setup.shape.block_size,
        "overload_policy": setup.cfg.policy.overload,
        "elastic_tp": setup.cfg.dispatcher.elastic_tp,
    }
    doc = bench.run_record(outcome.replay, policy=setup.label, trace_source=source, trace=trace, cluster=cluster)
    tp = outcome.counters.get("tp")
    if tp is not None:  # the elastic re-forms, beside the drops the samples show
        doc["tp_scale_ups"] = tp["scale_ups"]
        doc["tp_splits"] = tp["splits"]
    doc["simulation"] = {
        "time_model": setup.time.describe(),
        "transitions": outcome.transitions,
        "counters": outcome.counters,
        "wall_s": wall,
        "simulated_s": outcome.window_s,
        "simulated_s_per_wall_s": outcome.window_s / wall if wall > 0 else math.inf,
    }
    return doc, outcome


def _paper_lines(scenario: Scenario | None) -> list[str]:
    if scenario is None or not scenario.paper:
        return []
    out = [f"the paper ({scenario.figure or scenario.name}):"]
    out += [f"  {k}: {v}" for k, v in scenario.paper.items()]
    if scenario.leaves_out:
        out.append("the simulation leaves out: " + "; ".join(scenario.leaves_out))
    return out


def cmd_simulate(args: argparse.Namespace, defaults: dict[str, Any]) -> int:
    from kunserve.benchkit.plots import plot_compare, plot_run

    scenario = load_scenario(args.scenario) if args.scenario else None
    resolve_args(args, defaults, scenario)
    try:
        base = load_config(args.config)
    except ConfigError as exc:
        raise SimulateError(f"config error: {exc}") from None
    if scenario is not None:
        apply_config(base, scenario.config, scenario.path)
    if args.validate:
        if args.elastic_tp or args.tp_reform_s is not None or args.gpus_per_host is not None:
            raise SimulateError("--validate replays the default bench trace on a local cluster of whole instances; "
                                "--elastic-tp, --tp-reform-s and --gpus-per-host do not apply to it")
        return cmd_validate(args, base, scenario)
    spec = cluster_spec(args, scenario, base)
    if spec.elastic_tp is not None:
        base.dispatcher.elastic_tp = spec.elastic_tp
    path, device = machine_profile(base)
    rows = (
        bench.parse_policies(args.policies)
        if args.policies
        else list(scenario.policies if scenario and scenario.policies else [base.policy.overload])
    )
    if scenario is not None and scenario.sweep is not None:
        return cmd_sweep(args, base, spec, scenario, path, device)
    console = bench._console()
    first = build_setup(row_config(base, rows[0], args.request_timeout), spec, label=rows[0], local_profile=path, local_device=device)
    trace, source, calibration = plan_trace(args, first)
    out = bench._out_dir(args, "simulate")
    d = describe(trace)
    console.print(
        f"[bold]kunserve simulate[/]{' ' + scenario.name if scenario else ''}: {spec.instances} x "
        f"{first.shape.name} (tp {spec.tp}, {first.memory.undropped_blocks * first.shape.block_size:,} KV "
        f"tokens each), time model {first.time.source}; {len(trace)} requests over {d['duration_s']:.1f} s; "
        f"rows: {', '.join(rows)} -> {out}"
    )
    if first.time.source.startswith("profile") and not first.time.profile.loop.points:
        console.print(
            "note: the profile has no engine-loop overhead (written before it was measured): iterations cost their "
            "forward pass alone; re-run `kunserve profile` to measure it"
        )
    if calibration is not None:
        console.print(bench.calibration_line(calibration))
    runs: dict[str, list[dict]] = {}
    for row in rows:
        setup = (
            first
            if row == rows[0]
            else build_setup(row_config(base, row, args.request_timeout), spec, label=row, local_profile=path, local_device=device)
        )
        doc, _ = simulate_row(setup, trace, source, args)
        doc["run"] = 1
        runs[row] = [doc]
        s, sim = doc["summary"], doc["simulation"]
        console.print(
            f"  {row}: {s['completed']}/{s['requests']} completed, TTFT p99 {bench._ms(s['ttft']['p99'])} ms, "
            f"TPOT p50 {bench._ms(s['tpot']['p50'])} ms, drops {doc['drops']}"
            + (f", TP scale-ups {doc['tp_scale_ups']} / splits {doc['tp_splits']}" if "tp_scale_ups" in doc else "")
            + f"; {sim['simulated_s']:.0f} "
            f"simulated s in {sim['wall_s']:.1f} s ({sim['simulated_s_per_wall_s']:.0f}x)"
        )
    if len(rows) == 1:
        doc = runs[rows[0]][0]
        bench._write_json(out / "result.json", doc)
        plots = plot_run(doc, out)
        bench.render_table(console, runs)
        console.print(f"wrote {out / 'result.json'}, " + ", ".join(str(p) for p in plots))
    else:
        comparison = bench.compare_record(runs, rows)
        comparison.update(
            calibration=calibration,
            scenario=scenario.name if scenario else None,
            trace={"source": source, **describe(trace)},
            simulated=True,
            paper=dict(scenario.paper) if scenario else {},
        )
        for row, docs in runs.items():
            bench._write_json(out / row / "run-1" / "result.json", docs[0])
            plot_run(docs[0], out / row / "run-1")
        bench._write_json(out / "compare.json", comparison)
        png = plot_compare({r: d[0] for r, d in runs.items()}, {r: d[0]["summary"]["slo"] for r, d in runs.items()}, out / "compare.png")
        bench.render_table(console, runs, comparison)
        console.print(f"wrote {out / 'compare.json'}, {png}, per-row results under {out}/<row>/run-1/")
    for line in _paper_lines(scenario):
        console.print(line)
    return 0


# -- ConServe's load sweep ---------------------------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace, base: ClusterConfig, spec: ClusterSpec, scenario: Scenario, path: str | None, device: str) -> int:
    """ConServe §6.2: at each online rate, the online trace alone (online-only: the SLO reference), then beside an
    offline backlog under non-preemptive, preemptive and conserve (engine.coserving), conserve's SLOs slo_scale x
    online-only's p99s."""
    from kunserve.benchkit.coserve import POLICIES, POLICY_MODES, slo_from, summarize_run
    from kunserve.sim.cluster import OfflineLoad
    from kunserve.sim.scenario import offline_backlog

    assert scenario.sweep is not None
    console = bench._console()
    out = bench._out_dir(args, "simulate-sweep")
    rates = [float(r) for r in scenario.sweep.get("rates", [])]
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise SimulateError(f"{scenario.path}: [sweep] rates must be a non-empty list of rates > 0")
    scale = float(scenario.sweep.get("slo_scale", 1.0))
    off = dict(scenario.offline or {})
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "figure": scenario.figure,
        "paper": dict(scenario.paper),
        "slo_scale": scale,
        "rates": {},
    }
    for rate in rates:
        if "prompt_tokens" in scenario.sweep:  # ConServe's fixed lengths on Gamma arrivals
            lengths = (int(scenario.sweep["prompt_tokens"]), int(scenario.sweep.get("output_tokens", 256)))
            trace = [TraceRequest(t, *lengths) for t in gamma_arrivals(rate, args.cv, args.duration, seed=args.seed)]
        else:
            trace = generate_trace(
                rate=rate,
                cv=args.cv,
                duration_s=args.duration,
                profile=args.profile,
                seed=args.seed,
                scale=args.length_scale,
                max_prompt=args.max_prompt,
                max_output=args.max_output,
            )
        if not trace:
            raise SimulateError(f"rate {rate:g}: the trace is empty (raise --duration)")
        summaries: dict[str, dict] = {}
        slo: dict[str, float] | None = None
        for policy in POLICIES:
            cfg = row_config(base, "recompute", args.request_timeout)
            cfg.engine.coserving = POLICY_MODES[policy]
            if policy == "conserve" and slo is not None:
                cfg.slo.ttft_ms, cfg.slo.tbt_ms = slo["ttft_ms"], slo["tbt_ms"]
            setup = build_setup(cfg, spec, label=policy, local_profile=path, local_device=device)
            load = None
            if policy != "online-only":
                backlog = offline_backlog(
                    off.get("count", 4096),
                    seed=args.seed,
                    context=setup.shape.config.max_position_embeddings,
                    prompt_mean=off.get("prompt_mean"),
                    output_mean=off.get("output_mean"),
                )
                load = OfflineLoad(tuple(backlog), int(off.get("inflight", 16)))
            from kunserve.sim.cluster import Simulation

            t0 = time.perf_counter()
            outcome = Simulation(setup, trace, offline=load, request_timeout_s=args.request_timeout).run()
            wall = time.perf_counter() - t0
            summary = summarize_run(outcome.replay.results, outcome.offline, outcome.window_s)
            summary["wall_s"] = wall
            summaries[policy] = summary
            if policy == "online-only":
                slo = slo_from(summary, scale)
            on = summary["online"]
            console.print(
                f"  rate {rate:g} {policy}: TTFT p99 {bench._ms(on['ttft']['p99'])} ms, TBT p99 "
                f"{bench._ms(on['tbt']['p99'])} ms, offline {summary['offline']['tokens_per_s']:,.0f} tok/s "
                f"({wall:.1f} s wall)"
            )
        doc["rates"][f"{rate:g}"] = {"slo": slo, "policies": summaries}
    bench._write_json(out / "sweep.json", doc)
    console.print(f"wrote {out / 'sweep.json'}")
    for line in _paper_lines(scenario):
        console.print(line)
    return 0


# -- validation against the real local cluster ---------------------------------------------------------------------------
def _metric(doc: dict, name: str) -> float | None:
    value = bench.METRICS[name](doc)
    return None if value is None else float(value)


def validation_table(real: dict, sim: dict) -> dict[str, Any]:
    """Per metric: the real and simulated values and the relative error; the drops' count and times."""
    rows: dict[str, Any] = {}
    for name in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "output_tokens_per_s", "drops", "restores"):
        r, s = _metric(real, name), _metric(sim, name)
        err = None if r in (None, 0) or s is None else (s - r) / r
        rows[name] = {"real": r, "simulated": s, "error": err, "target": VALIDATION_TARGETS.get(name)}
    rows["drop_times_s"] = {
        "real": [e["t_s"] for e in real["layout_events"] if e["op"] == "drop"],
        "simulated": [e["t_s"] for e in sim["layout_events"] if e["op"] == "drop"],
    }
    return rows


def cmd_validate(args: argparse.Namespace, base: ClusterConfig, scenario: Scenario | None) -> int:
    """The trace through a fresh real local cluster (bench compare's config for the policy, one run) and through the
    simulator with this machine's profile and the very same config."""
    from kunserve.cli.launcher import ClusterStartError, LocalCluster

    console = bench._console()
    policy = (bench.parse_policies(args.policies) if args.policies else [base.policy.overload])[0]
    out = bench._out_dir(args, "simulate-validate")
    ns = copy.copy(args)
    ns.workers = args.instances or 2
    ns.pool_mib = args.pool_mib or bench.COMPARE_POOL_MIB
    ns.threads = 1
    cfg = bench.compare_config(ns, policy)
    trace, source = bench.build_trace(args, save=False)
    console.print(
        f"[bold]validate[/]: {len(trace)} requests, policy {policy}, {ns.workers} workers, pool "
        f"{ns.pool_mib} MiB: real cluster first (logs: {out / 'real' / 'cluster'})"
    )
    cluster = LocalCluster(cfg, run_dir=out / "real" / "cluster")
    try:
        cluster.start(timeout_s=180.0)
    except ClusterStartError as exc:
        raise SimulateError(f"the real cluster failed to start: {exc}") from None
    probe = probe_trace(ns.workers)
    try:
        time.sleep(1.0)
        from kunserve import client

        creds = client.credentials_from(cluster.cfg, environ={})
        before, outcome, after = (
            bench.replay_with_progress(
                t,
                cfg.dispatcher.address,
                cfg.memory_manager.address,
                label=label,
                seed=args.seed,
                timeout_s=args.request_timeout,
                stop_flag=[False],
                creds=creds,
            )
            for t, label in ((probe, "serving-overhead probe"), (trace, f"real {policy}"), (probe, "serving-overhead probe again"))
        )
    finally:
        cluster.stop()
    real = bench.run_record(
        outcome,
        policy=policy,
        trace_source=source,
        trace=trace,
        cluster={"workers": ns.workers, "pool_mib": cfg.engine.pool_mib, "real": True},
    )
    path, device = machine_profile(cfg)
    spec = ClusterSpec(
        instances=ns.workers,
        model=cfg.model.path or "embedded",
        profile=args.profile_file or path,
        profile_device=args.profile_device or device,
        iteration_overhead_ms=args.iteration_overhead_ms or 0.0,
        sequence_overhead_ms=args.sequence_overhead_ms or 0.0,
        request_latency_ms=args.request_latency_ms or 0.0,
    )
    setup = build_setup(cfg, spec, label=policy)
    try:
        serving = fit_serving(probe, [before.results, after.results], setup.time, setup.shape.num_layers)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None
    bare, _ = simulate_row(setup, trace, source, args)
    measured = dataclasses.replace(setup, time=with_serving(setup.time, serving))
    sim, _ = simulate_row(measured, trace, source, args)
    table, bare_table = validation_table(real, sim), validation_table(real, bare)
    doc = {
        "policy": policy,
        "trace": {"source": source, **describe(trace)},
        "serving_overhead": serving.to_dict(),
        "probe": {
            "trace": [r.__dict__ for r in probe],
            "before": [r.to_dict() for r in before.results],
            "after": [r.to_dict() for r in after.results],
        },
        "metrics": table,
        "metrics_profile_only": bare_table,
        "time_model": measured.time.describe(),
        "real": real,
        "simulated": sim,
        "simulated_profile_only": bare,
    }
    bench._write_json(out / "validate.json", doc)
    console.print(
        f"  serving overhead measured by the probe ({serving.decode_points + serving.first_token_points} points, "
        f"mean error {100 * serving.mean_rel_err:.0f}%): forward passes x{serving.forward_scale:.2f}, "
        f"{1e3 * serving.iteration_s:.2f} ms per iteration + {1e3 * serving.per_sequence_s:.3f} ms per sequence, request "
        f"latency {1e3 * serving.request_latency_s:.1f} ms"
    )
    for name, row in table.items():
        if name == "drop_times_s":
            console.print(f"  drops at (s): real {[round(t, 1) for t in row['real']]}, simulated {[round(t, 1) for t in row['simulated']]}")
            continue
        target = "" if row["target"] is None else f" (target <= {100 * row['target']:.0f}%)"
        console.print(
            f"  {name}: real {row['real']}, simulated {row['simulated']}, error {_err(row)}{target}; "
            f"profile only: {bare_table[name]['simulated']}, error {_err(bare_table[name])}"
        )
    console.print(f"wrote {out / 'validate.json'}")
    return 0


def _err(row: dict[str, Any]) -> str:
    return "-" if row["error"] is None else f"{100 * row['error']:+.0f}%"


# -- parser --------------------------------------------------------------------------------------------------------------
def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate", help="replay a trace through a simulated cluster running the live policies (paper-scale scenarios, capacity planning)"
    )
    p.add_argument(
        "--scenario",
        metavar="FILE",
        help="a scenario file (configs/scenarios/*.toml): cluster, trace, policies, config overrides; explicit flags win",
    )
    bench._add_trace_args(p)
    for action in p._actions:
        if action.dest == "out":
            action.help = "output directory (default ./kunserve-bench/simulate-<time>)"
    c = p.add_argument_group("simulated cluster")
    c.add_argument("--instances", type=int, help="instances (default: the config's workers)")
    c.add_argument(
        "--model",
        help="a shipped shape (qwen2.5-14b, qwen2.5-72b, llama-3.1-8b, llama-3.1-70b), a model "
        "directory or config.json, or 'embedded' (default: the config's model)",
    )
    c.add_argument("--accelerator", help="time model: the analytic roofline of H100, H200, A100 or A800")
    c.add_argument(
        "--profile-file",
        metavar="FILE",
        help="time model: a `kunserve profile` file (default: this machine's, engine.profile or the profile cache)",
    )
    c.add_argument("--profile-device", metavar="SIG", help="the profile's device signature when the file holds several")
    c.add_argument("--tp", type=int, help="GPUs per instance (tensor parallel; default 1)")
    c.add_argument(
        "--elastic-tp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="elastic tensor parallelism (sets dispatcher.elastic_tp): a request too long for every instance merges "
        "co-located ones into a TP2/TP4 instance by cold re-form; idle merged instances split back (default: the "
        "scenario's, else the config's)",
    )
    c.add_argument(
        "--tp-reform-s",
        type=float,
        help=f"a cold re-form's restart time per member, before its weight shard loads at the host-to-device "
        f"bandwidth (default {TP_REFORM_S:g})",
    )
    c.add_argument("--gpus-per-host", type=int, help=f"GPUs per host: a TP instance's members share one (default {GPUS_PER_HOST})")
    c.add_argument("--memory-utilization", type=float, help="share of each GPU's memory the pool takes (default 0.9)")
    c.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: the accelerator's)")
    c.add_argument("--network-gbps", type=float, help="bandwidth between instances (default 200 with an accelerator)")
    c.add_argument(
        "--iteration-overhead-ms",
        type=float,
        help="serving overhead added to every simulated iteration, beyond the profile's loop overhead (default 0; "
        "`--validate` measures it)",
    )
    c.add_argument(
        "--sequence-overhead-ms", type=float, help="serving overhead per sequence in an iteration (default 0; `--validate` measures it)"
    )
    c.add_argument(
        "--forward-scale",
        type=float,
        help="forward passes take this times the profile's prediction (default 1; `--validate` measures it)",
    )
    c.add_argument(
        "--request-latency-ms",
        type=float,
        help="a request's way from the client to the dispatcher and its first token's way back (default 0; `--validate` measures it)",
    )
    p.add_argument(
        "--policies", help="comma-separated overload policies / variants (default: the scenario's, else the config's policy.overload)"
    )
    p.add_argument(
        "--calibrate",
        choices=("model", "off"),
        default="off",
        help="size a generated trace to the simulated cluster: peak KV demand = --overload x its undropped "
        "capacity at the speeds its cost model predicts (model), or not (off, default)",
    )
    p.add_argument("--overload", type=bench._overload, default=bench.DEFAULT_OVERLOAD, help="--calibrate's target")
    p.add_argument(
        "--validate", action="store_true", help="replay the trace on a fresh real local cluster too and report the simulator's error"
    )
    p.add_argument("--pool-mib", type=int, help=f"--validate: memory pool per worker (default {bench.COMPARE_POOL_MIB})")
    p.add_argument("--log-level", default="error", help="the policies' log lines at this level and above (default error)")

    def run(args: argparse.Namespace) -> None:
        from kunserve.shared.log import configure_logging

        configure_logging("simulate", fmt="console", level=args.log_level)
        try:
            code = cmd_simulate(args, _trace_defaults(p))
        except (SimulateError, ScenarioError, TraceError, ProfileError, UnknownAccelerator, bench.BenchError, CalibrationError) as exc:
            print(f"kunserve: simulate: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        except OSError as exc:
            print(f"kunserve: simulate: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        raise SystemExit(code)

    p.set_defaults(func=run)


__all__ = ["cluster_spec", "plan_trace", "register", "resolve_args", "row_config", "simulate_row", "validation_table"]
