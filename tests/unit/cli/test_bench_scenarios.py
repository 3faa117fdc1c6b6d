"""`kunserve bench compare --scenario fig16|fig17` and repeated bursts: the presets' argument resolution (explicit
flags win), the repeated-burst trace and its calibration, and the holds metric in the comparison record, table and
plots, without a cluster."""

from __future__ import annotations

import argparse
import math

import pytest
from rich.console import Console

from kunserve.benchkit.plots import plot_compare, plot_run
from kunserve.benchkit.replay import ClusterSample, ReplayOutcome
from kunserve.benchkit.scenarios import SCENARIOS
from kunserve.benchkit.stats import RequestResult
from kunserve.benchkit.trace import TraceRequest
from kunserve.cli import bench
from kunserve.cli.main import build_parser
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def windows(args: argparse.Namespace) -> list[tuple[float, float, float]]:
    return [(b.start_s, b.duration_s, b.factor) for b in args.burst]


# -- presets ---------------------------------------------------------------------------------------------------
def test_plain_defaults_without_a_scenario():
    for argv in (("compare",), ("run",)):
        args = parse(*argv)
        assert windows(args) == [(5.0, 20.0, 6.0)] and args.bursts == 1 and args.burst_gap == 0.0
        assert args.duration == 40.0
    args = parse("compare")
    assert args.scenario is None and args.policies == ",".join(OVERLOAD_POLICIES) and args.workers == 2
    with pytest.raises(SystemExit):
        parse("run", "--scenario", "fig16")  # a comparison's presets


def test_fig16_preset():
    args = parse("compare", "--scenario", "fig16")
    assert args.policies == "kunserve,kunserve-no-restore" and args.workers == 2 and args.duration == 70.0
    assert windows(args) == [(5.0, 8.0, 7.0), (56.0, 8.0, 7.0)] and args.bursts == 1 and args.burst_gap == 0.0
    # between the bursts there is time for the monitor's default restore rules: its cooldown after a drop and its
    # hold of low usage
    cfg = bench.compare_config(args, "kunserve")
    assert args.burst[1].start_s - args.burst[0].end_s > cfg.monitor.restore_cooldown_s + cfg.monitor.restore_hold_s
    assert bench.compare_config(args, "kunserve-no-restore").monitor.restore_hold_s == math.inf


def test_fig17_preset():
    args = parse("compare", "--scenario", "fig17")
    assert args.policies == "kunserve,recompute,swap,migrate" and args.workers == 4 and args.duration == 40.0
    assert windows(args) == [(5.0, 6.0, 7.0)] and args.bursts == 4 and args.burst_gap == 2.0
    assert len(bench.compare_config(args, "kunserve").workers) == 4
    plan = bench.burst_plan(args)
    assert [(b.start_s, b.end_s) for b in plan] == [(5, 11), (13, 19), (21, 27), (29, 35)]


def test_explicit_flags_beat_the_preset():
    args = parse("compare", "--scenario", "fig17", "--workers", "6", "--duration", "30", "--burst", "2:3:4",
                 "--policies", "kunserve,queue")
    assert (args.workers, args.duration, args.policies) == (6, 30.0, "kunserve,queue")
    assert windows(args) == [(2.0, 3.0, 4.0)] and args.bursts == 4 and args.burst_gap == 2.0  # the rest preset
    args = parse("compare", "--scenario", "fig17", "--bursts", "2", "--burst-gap", "0")
    assert args.bursts == 2 and args.burst_gap == 0.0
    # --no-burst means no window: the preset's copies go with its window
    args = parse("compare", "--scenario", "fig17", "--no-burst")
    assert args.burst == [] and args.bursts == 1 and bench.burst_plan(args) == []
    _, source = bench.build_trace(args, save=False)
    assert source["bursts"] == [] and source["repeat"] is None
    # scenarios are presets for every flag they name: each resolves to something the parser accepts
    for scenario in SCENARIOS.values():
        assert set(scenario.flags) <= set(bench.COMPARE_DEFAULTS)
    with pytest.raises(SystemExit):
        parse("compare", "--scenario", "fig99")
    with pytest.raises(SystemExit):
        parse("compare", "--burst", "1:2:3", "--no-burst")


# -- repeated bursts ---------------------------------------------------------------------------------------------
def test_repeated_burst_trace():
    args = parse("run", "--duration", "30", "--rate", "4", "--burst", "5:4:5", "--bursts", "4", "--burst-gap", "3")
    trace, source = bench.build_trace(args, save=False)
    # copies at 5, 12, 19 and 26 s; the one at 26 ends past the trace's end but starts within it
    assert [(w["start_s"], w["duration_s"], w["factor"]) for w in source["bursts"]] == [
        (5.0, 4.0, 5.0), (12.0, 4.0, 5.0), (19.0, 4.0, 5.0), (26.0, 4.0, 5.0)]
    assert source["repeat"] == {"copies": 4, "gap_s": 3.0}
    inside = sum(1 for r in trace if any(w["start_s"] <= r.arrival_s < w["start_s"] + 4 for w in source["bursts"]))
    assert inside > 2.5 * (len(trace) - inside)  # 16 s at 20/s against 14 s at 4/s
    short = parse("run", "--duration", "15", "--burst", "5:4:5", "--bursts", "4", "--burst-gap", "3")
    assert [w.start_s for w in bench.burst_plan(short)] == [5.0, 12.0]  # copies past the end add nothing
    several = parse("run", "--duration", "60", "--burst", "40:5:3", "--burst", "5:5:2")
    assert [(w.start_s, w.factor) for w in bench.burst_plan(several)] == [(5.0, 2.0), (40.0, 3.0)]


def test_repeated_burst_bad_input():
    cases = [
        (("--burst", "5:4:5", "--burst", "20:4:5", "--bursts", "2"), "--bursts 2 repeats one --burst window; 2 were"),
        (("--burst", "5:10:5", "--burst", "12:4:5"), "--burst: burst windows overlap: [5, 15) s and [12, 16) s"),
        (("--bursts", "0"), "--bursts must be >= 1"),
        (("--bursts", "2", "--burst-gap", "-1"), "--burst-gap must be >= 0"),
    ]
    for argv, message in cases:
        with pytest.raises(bench.BenchError) as err:
            bench.build_trace(parse("compare", *argv), save=False)
        assert message in str(err.value), (argv, str(err.value))


def test_burst_spans():
    assert bench.burst_spans(parse("compare", "--scenario", "fig16")) == [(5.0, 56.0), (56.0, math.inf)]
    assert bench.burst_spans(parse("compare", "--scenario", "fig17")) == [(5.0, 13.0)]  # to the second copy
    assert bench.burst_spans(parse("compare", "--no-burst")) == []


def _fake_cluster(monkeypatch, capacity_tokens: int = 4096) -> None:
    from kunserve.benchkit.calibrate import Speeds
    from kunserve.benchkit.probe import Capacity

    async def capacity(admin, creds, *, workers):
        return Capacity(tokens=capacity_tokens, workers=workers, block_size=16)

    async def probe(address, creds, *, prompt_tokens, concurrency, workers, seed, decode_tokens):
        return Speeds(prefill_tokens_per_s=5000.0, tpot_s=0.012, concurrency=concurrency, source="probe")

    monkeypatch.setattr(bench, "cluster_capacity", capacity)
    monkeypatch.setattr(bench, "probe_speeds", probe)


def _plan(args: argparse.Namespace):
    console = Console(record=True, width=400)
    trace, source, record = bench.plan_trace(args, console, address="a", admin="m", creds=None,
                                             cfg=bench.compare_config(args, "kunserve"), workers=args.workers,
                                             where="test")
    return trace, source, record, console.export_text()


def test_calibration_sizes_each_burst(monkeypatch):
    _fake_cluster(monkeypatch)
    args = parse("compare", "--scenario", "fig16", "--duration", "60", "--burst", "5:10:7", "--burst", "40:10:7",
                 "--seed", "2")
    trace, source, record, text = _plan(args)
    assert record["given"]["burst_factors"] == [7.0, 7.0] and len(record["burst_factors"]) == 2
    assert record["burst_ratios"] == pytest.approx([1.5, 1.5], rel=0.1)
    assert [w["factor"] for w in source["bursts"]] == record["burst_factors"]
    assert "burst factors 7, 7 -> " in text and "per burst" in text and "planned peak KV demand" in text
    assert len(trace) == record["requests"]


def test_calibration_of_a_repeated_burst_sizes_the_first_copy(monkeypatch):
    _fake_cluster(monkeypatch, capacity_tokens=8192)
    args = parse("compare", "--scenario", "fig17", "--seed", "1")
    _, source, record, text = _plan(args)
    assert len(record["burst_factors"]) == 1 and record["burst_ratios"][0] == pytest.approx(1.5, rel=0.15)
    # the copies stack up beyond what the first one reaches, and the line says both
    assert record["planned_ratio"] > record["burst_ratios"][0]
    assert f"per burst, to the next one's start: {record['burst_ratios'][0]:.2f}x" in text
    assert len(source["bursts"]) == 4 and {w["factor"] for w in source["bursts"]} == {record["burst_factors"][0]}
    assert source["repeat"] == {"copies": 4, "gap_s": 2.0}


# -- holds in the comparison -------------------------------------------------------------------------------------
BURSTS = [{"start_s": 2.0, "duration_s": 3.0, "factor": 5.0}, {"start_s": 7.0, "duration_s": 3.0, "factor": 5.0}]


def _doc(policy: str, slow_from: float | None, *, merges: tuple[int, ...] = (0,) * 12,
         full_from: float | None = None) -> dict:
    """A run over 12 s: one request every 0.25 s, TTFT 0.1 s until `slow_from` (then 2 s: queued), samples
    once a second with `merges[t]` merges in force on 4 workers and, from `full_from` on, prompts waiting beyond
    the KV capacity; the trace has the two BURSTS, repeated."""
    results = []
    for i in range(48):
        t = i * 0.25
        ttft = 2.0 if slow_from is not None and t >= slow_from else 0.1
        results.append(RequestResult(index=i, arrival_s=t, sent_s=t, prompt_tokens=10, output_tokens=3, ttft_s=ttft,
                                     token_times_s=[ttft, ttft + 0.01, ttft + 0.02], e2e_s=ttft + 0.02, ok=True))
    samples = [ClusterSample(t_s=float(t), kv_blocks_used=90, kv_blocks_total=100 * (1 + m),
                             queued_demand_blocks=500 if full_from is not None and t >= full_from else 0,
                             units=4 - m, pipelined_units=min(m, 2), workers=4, epoch=1 + t, kv_blocks_undropped=100)
               for t, m in enumerate(merges)]
    source = {"kind": "gamma", "bursts": BURSTS, "repeat": {"copies": 2, "gap_s": 2.0}}
    return bench.run_record(ReplayOutcome(results, 12.0, samples), policy=policy, trace_source=source,
                            trace=[TraceRequest(r.arrival_s, 10, 3) for r in results], cluster={})


def test_compare_record_holds_and_the_fig17_target(tmp_path):
    # kunserve drops at 3 s (pairs) and 8 s (a quad), restores at 11 s and queues from 9 s on; recompute from
    # 3 s, swap from 4 s; kunserve's hold (9 - 2 + 0.5 = 7.5 s) over the best baseline's (4 - 2 + 0.5 = 2.5 s): 3x
    kun = _doc("kunserve", 9.0, merges=(0, 0, 0, 2, 2, 2, 2, 2, 3, 3, 3, 2), full_from=9.0)
    runs = {"kunserve": [kun], "recompute": [_doc("recompute", 3.0, full_from=4.0)],
            "swap": [_doc("swap", 4.0, full_from=5.0)]}
    assert kun["drops"] == 2 and kun["restores"] == 1
    assert [(e["t_s"], e["op"]) for e in kun["layout_events"]] == [(3.0, "drop"), (8.0, "drop"), (11.0, "restore")]
    rec = bench.compare_record(runs, list(runs))
    assert rec["reference_p50"]["ttft_s"] == pytest.approx(0.1)
    h = rec["runs"]["kunserve"][0]["holds"]
    assert h["threshold_s"] == pytest.approx(0.5) and h["hold_s"] == pytest.approx(7.5) and not h["held_through"]
    assert h["drops_before_queueing"] == 2 and h["restores_before_queueing"] == 0
    assert [w["onset_s"] for w in h["windows"]] == [None, pytest.approx(2.5)]  # the second window from 9.5 s
    assert rec["medians"]["kunserve"]["hold_s"]["median"] == pytest.approx(7.5)
    assert rec["medians"]["recompute"]["hold_s"]["median"] == pytest.approx(1.5)
    assert rec["ratios"]["hold_kunserve_over_best_baseline"] == pytest.approx(3.0)
    # memory: full (beyond the capacity for a second) from 9 s against 4 and 5 s: 7 s over 3 s
    assert h["memory_hold_s"] == pytest.approx(7.0) and h["memory_held_through"] is False
    assert rec["ratios"]["memory_hold_kunserve_over_best_baseline"] == pytest.approx(7.0 / 3.0)
    assert not any("memory" in t for t in rec["targets"])
    assert rec["targets"]["hold_vs_best_baseline>=1.5x"] is True
    assert rec["medians"]["kunserve"]["restores"]["median"] == 1.0
    console = Console(record=True, width=250)
    bench.render_table(console, runs, rec)
    text = console.export_text()
    assert "holds s" in text and "restores" in text and "7.5" in text and "KV full s" in text
    assert "queueing per burst window" in text and "#1 [2-5 s] held (0/12)" in text and "#2 [7-10 s] 2.5 (4/12)" in text
    assert "2 drop(s), 0 restore(s) before queueing" in text
    assert "hold_kunserve_over_best_baseline: 3.0x" in text and "target hold_vs_best_baseline>=1.5x" in text
    # a plot with the bursts, the drops, the restore and the onsets marked
    png = plot_compare({p: d[0] for p, d in runs.items()}, {p: d[0]["summary"]["slo"] for p, d in runs.items()},
                       tmp_path / "compare.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(p.exists() for p in plot_run(kun, tmp_path / "run"))


def test_holds_without_queueing_and_without_a_repeated_burst():
    # a single-burst trace gets the hold ratio but no target; a run that never queued is marked in the table
    never = _doc("kunserve", None)
    for d in (never, base := _doc("recompute", 3.0)):
        d["trace"]["source"]["repeat"] = None
    rec = bench.compare_record({"kunserve": [never], "recompute": [base]}, ["kunserve", "recompute"])
    h = rec["runs"]["kunserve"][0]["holds"]
    assert h["held_through"] is True and h["hold_s"] == pytest.approx(11.75 + 0.5 - 2.0)
    assert "hold_kunserve_over_best_baseline" in rec["ratios"] and not any("hold" in t for t in rec["targets"])
    console = Console(record=True, width=250)
    bench.render_table(console, {"kunserve": [never], "recompute": [base]}, rec)
    assert "10.2+" in console.export_text()


def test_a_loaded_trace_has_no_windows():
    doc = _doc("kunserve", 3.0)
    doc["trace"]["source"] = {"kind": "burstgpt_csv"}
    rec = bench.compare_record({"kunserve": [doc]}, ["kunserve"])
    assert rec["runs"]["kunserve"][0]["holds"]["windows"] == [] and rec["medians"]["kunserve"]["hold_s"]["n"] == 0
