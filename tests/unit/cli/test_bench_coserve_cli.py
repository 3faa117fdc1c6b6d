"""`kunserve bench coserve` without a cluster: its arguments (--quick's presets, the checks), each policy's cluster
config, the offline backlog, and the report computed from synthetic results (tokens credited, TBT gaps, time
windows, medians, ratios and the issue's targets), the table and the figure."""

from __future__ import annotations

import argparse
import io

import pytest
from rich.console import Console

from kunserve.benchkit import coserve
from kunserve.benchkit.coserve_plots import plot_coserve
from kunserve.benchkit.stats import RequestResult
from kunserve.cli import bench
from kunserve.cli.main import build_parser
from kunserve.v1 import admin_pb2, common_pb2, monitor_pb2

PNG = b"\x89PNG\r\n\x1a\n"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "coserve", *argv])


def result(index: int, sent: float, times: list[float], prompt: int = 10, ok: bool = True,
           error: str = "") -> RequestResult:
    return RequestResult(index=index, arrival_s=sent, sent_s=sent, prompt_tokens=prompt, output_tokens=len(times),
                         ttft_s=times[0] if times else None, token_times_s=times, ok=ok, error=error,
                         e2e_s=times[-1] if ok and times else None)


# -- arguments ------------------------------------------------------------------------------------------------
def test_defaults_quick_presets_and_explicit_flags():
    args = parse()
    assert (args.duration, args.repeats, args.window, args.burst, args.rate, args.cv) == (60.0, 3, 5.0, [], 1.0, 0.5)
    assert (args.workers, args.pool_mib, args.max_batched_tokens, args.offline_profile) == (1, 64, 512, "mix")
    assert args.slo_scale == 1.0 and args.ttft_slo_ms is None and bench.check_coserve_args(args) == list(coserve.POLICIES)
    quick = parse("--quick")
    assert (quick.duration, quick.repeats, quick.window) == (12.0, 1, 2.0)
    assert parse("--quick", "--duration", "4", "--repeats", "2").duration == 4.0
    assert parse("--quick", "--duration", "4", "--repeats", "2").repeats == 2
    assert parse("--burst", "2:3:4").burst[0].factor == 4.0  # a burst window only when asked for


@pytest.mark.parametrize("argv,match", [
    (("--policies", "conserve,vllm"), "unknown policy 'vllm'"),
    (("--policies", "conserve,conserve"), "twice"),
    (("--policies", " , "), "empty"),
    (("--repeats", "0"), "--repeats must be >= 1"),
    (("--offline-inflight", "0"), "--offline-inflight must be >= 1"),
    (("--window", "0"), "--window must be > 0"),
    (("--slo-scale", "-1"), "--slo-scale must be > 0"),
    (("--policies", "preemptive,conserve"), "add online-only"),
    (("--policies", "conserve", "--ttft-slo-ms", "100"), "add online-only"),
])
def test_bad_arguments_are_refused(argv, match):
    with pytest.raises(bench.BenchError, match=match):
        bench.check_coserve_args(parse(*argv))


def test_explicit_slos_need_no_online_only_run():
    args = parse("--policies", "conserve", "--ttft-slo-ms", "150", "--tbt-slo-ms", "20")
    assert bench.check_coserve_args(args) == ["conserve"]
    assert bench.coserve_slo(args, None) == {"ttft_ms": 150.0, "tbt_ms": 20.0}


def test_slos_follow_online_only_unless_given():
    reference = coserve.summarize_run([result(0, 0.0, [0.1, 0.12, 0.15])], [], 1.0)
    derived = bench.coserve_slo(parse("--slo-scale", "2"), reference)
    assert derived == pytest.approx({"ttft_ms": 200.0, "tbt_ms": 2 * reference["online"]["tbt"]["p99"] * 1e3})
    assert bench.coserve_slo(parse("--tbt-slo-ms", "9"), reference)["tbt_ms"] == 9.0
    assert bench.coserve_slo(parse(), None) is None
    assert coserve.slo_from(coserve.summarize_run([], [], 1.0), 1.0) is None


def test_each_policy_gets_its_mode_and_the_same_cluster():
    args = parse("--workers", "2", "--pool-mib", "48", "--max-batched-tokens", "300")
    configs = {p: bench.coserve_config(args, p, {"ttft_ms": 123.0, "tbt_ms": 17.0}) for p in coserve.POLICIES}
    assert {p: c.engine.coserving for p, c in configs.items()} == {
        "online-only": "non-preemptive", "non-preemptive": "non-preemptive", "preemptive": "preemptive",
        "conserve": "conserve"}
    for cfg in configs.values():
        assert len(cfg.workers) == 2 and cfg.engine.pool_mib == 48 and cfg.engine.max_num_batched_tokens == 300
        assert (cfg.slo.ttft_ms, cfg.slo.tbt_ms) == (123.0, 17.0) and not cfg.monitor.auto_drop
        assert cfg.policy.overload == "recompute" and cfg.dispatcher.stall_timeout_s >= bench.COSERVE_STALL_TIMEOUT_S


def test_rounds_open_with_online_only():
    assert coserve.rounds(["conserve", "online-only", "preemptive"], 3) == [
        ["online-only", "conserve", "preemptive"], ["online-only", "preemptive", "conserve"],
        ["preemptive", "conserve", "online-only"]]
    assert coserve.rounds(["conserve", "preemptive"], 2) == [["conserve", "preemptive"], ["preemptive", "conserve"]]


# -- the offline backlog --------------------------------------------------------------------------------------
def test_offline_lengths_follow_the_papers_sets_scaled():
    lo_in, hi_in = coserve.OFFLINE_PROMPT_RANGE
    lo_out, hi_out = coserve.OFFLINE_OUTPUT_RANGE
    mix = coserve.offline_lengths("mix", 600, seed=1)
    assert mix == coserve.offline_lengths("mix", 600, seed=1) != coserve.offline_lengths("mix", 600, seed=2)
    assert all(lo_in <= p <= hi_in and lo_out <= o <= hi_out for p, o in mix)
    mean = {name: sum(p for p, _ in coserve.offline_lengths(name, 400, seed=0)) / 400 for name in coserve.OFFLINE_DATASETS}
    assert mean["dureader"] > mean["vcsum"] > mean["multinews"]  # Table 1's order
    with pytest.raises(ValueError, match="unknown offline profile"):
        coserve.offline_lengths("longbench", 3, seed=0)


# -- the report -----------------------------------------------------------------------------------------------
def test_offline_tokens_are_credited_when_processed():
    off = [result(0, 1.0, [0.5, 0.6, 0.7], prompt=100), result(1, 2.0, [], prompt=50, ok=False, error="interrupted")]
    assert coserve.offline_credits(off) == [(1.5, 101), (pytest.approx(1.6), 1), (pytest.approx(1.7), 1)]
    s = coserve.summarize_run([result(0, 0.0, [0.1, 0.2])], off, window_s=1.65)
    # the last token came after the window: not counted
    assert s["offline"]["tokens"] == 102 and s["offline"]["tokens_per_s"] == pytest.approx(102 / 1.65)
    assert (s["offline"]["sent"], s["offline"]["completed"], s["offline"]["failed"]) == (2, 1, 0)


def test_online_ttft_and_every_token_gap():
    online = [result(0, 0.0, [0.1, 0.2, 0.5]), result(1, 1.0, [0.3, 0.31]),
              result(2, 2.0, [0.2], ok=False, error="UNAVAILABLE: x")]
    gaps = coserve.tbt_gaps(online)
    assert [round(g, 3) for _, g in gaps] == [0.1, 0.3, 0.01] and gaps[1][0] == pytest.approx(0.5)
    samples = [{"t_s": 0.0, "num_preemptions": 4, "busy_seconds_total": 1.0},
               {"t_s": 2.0, "num_preemptions": 9, "busy_seconds_total": 2.5}]
    s = coserve.summarize_run(online, [], window_s=2.0, samples=samples)
    on = s["online"]
    assert (on["requests"], on["completed"], on["failed"]) == (3, 2, 1)
    assert on["ttft"]["n"] == 2 and on["ttft"]["p50"] == pytest.approx(0.2) and on["tbt"]["n"] == 3
    assert on["output_tokens_per_s"] == pytest.approx(5 / 2.0)
    assert s["preemptions"] == 5 and s["busy_share"] == pytest.approx(0.75) and s["offline"]["tokens_per_s"] == 0


def test_time_windows():
    online = [result(0, 0.5, [0.2, 0.3, 1.9]), result(1, 2.5, [0.1, 0.2])]
    offline = [result(0, 0.0, [1.0, 3.5], prompt=9)]
    w = coserve.timeline(online, offline, window_s=3.0, bin_s=2.0)
    assert [x["t_s"] for x in w] == [0.0, 2.0]
    assert w[0]["online_requests"] == 1 and w[0]["ttft_p99_s"] == pytest.approx(0.2)
    assert w[0]["tbt_p99_s"] == pytest.approx(0.1) and w[1]["tbt_p99_s"] == pytest.approx(1.6, rel=0.01)
    assert w[0]["offline_tokens_per_s"] == 10 / 2.0 and w[1]["offline_tokens_per_s"] == 0  # 3.5 s is past the window
    with pytest.raises(ValueError):
        coserve.timeline(online, offline, 3.0, 0.0)


def _summary(ttft_p99: float, tbt_p99: float, offline: float) -> dict:
    return {"online": {"ttft": {"p50": ttft_p99 / 2, "p99": ttft_p99}, "tbt": {"p50": tbt_p99 / 2, "p99": tbt_p99},
                       "output_tokens_per_s": 100.0, "failed": 0, "completed": 10, "requests": 10},
            "offline": {"tokens_per_s": offline, "completed": 5}, "preemptions": 3, "busy_share": 0.9}


def test_medians_ratios_and_targets():
    summaries = {"online-only": [_summary(0.100, 0.020, 0.0), _summary(0.140, 0.010, 0.0), _summary(0.120, 0.012, 0.0)],
                 "non-preemptive": [_summary(3.0, 0.3, 3000.0)],
                 "preemptive": [_summary(0.4, 0.1, 2000.0), _summary(0.2, 0.1, 2600.0)],
                 "conserve": [_summary(0.140, 0.016, 2500.0)]}
    c = coserve.compare(summaries)
    assert c["medians"]["online-only"]["ttft_p99_s"] == {"median": 0.12, "min": 0.1, "max": 0.14, "n": 3}
    assert c["medians"]["preemptive"]["offline_tokens_per_s"]["median"] == 2300.0
    r = c["ratios"]["conserve"]
    assert r["ttft_p99_vs_online_only"] == pytest.approx(0.14 / 0.12)
    assert r["tbt_p99_vs_online_only"] == pytest.approx(0.016 / 0.012)
    assert r["offline_vs_non_preemptive"] == pytest.approx(2500 / 3000)
    assert list(c["targets"].values()) == [True, True, False, True, True]  # TBT 1.33x > 1.2x: missed
    assert c["ratios"]["online-only"]["offline_vs_non_preemptive"] == 0.0
    partial = coserve.compare({"online-only": summaries["online-only"], "conserve": summaries["conserve"]})
    assert list(partial["targets"].values()) == [None, True, False, None, None]


def test_status_samples_sum_the_workers():
    def stats(used: int, preempted: int, busy: float) -> monitor_pb2.WorkerStatus:
        return monitor_pb2.WorkerStatus(stats=common_pb2.WorkerStats(kv_blocks_used=used, kv_blocks_total=100,
                                                                     num_preemptions=preempted, num_running=2,
                                                                     busy_seconds_total=busy))
    status = admin_pb2.AdminStatus(cluster=monitor_pb2.ClusterStatus(workers=[stats(10, 1, 2.0), stats(30, 4, 1.5)]))
    sample = coserve.status_sample(status, 2.5)
    assert sample == {"t_s": 2.5, "kv_blocks_total": 200, "kv_blocks_used": 40, "num_running": 4, "num_waiting": 0,
                      "num_preemptions": 5, "busy_seconds_total": 3.5}


def test_table_and_figure(tmp_path):
    summaries = {"online-only": [_summary(0.1, 0.01, 0.0)], "preemptive": [_summary(0.5, 0.05, 900.0)],
                 "conserve": [_summary(0.11, 0.011, 1500.0), _summary(0.12, 0.013, 1400.0)]}
    comparison = coserve.compare(summaries)
    out = io.StringIO()
    bench.render_coserve(Console(file=out, width=250, color_system=None), summaries, comparison)
    text = out.getvalue()
    assert "conserve" in text and "2 runs" in text and "1.15x" in text  # median p99 0.115 s over 0.1 s
    assert "online p99 TTFT below preemptive's: met" in text and "80% of non-preemptive's: n/a" in text
    runs = {p: {"timeline": coserve.timeline([result(0, 0.2, [0.1, 0.2])], [result(0, 0.0, [0.5, 0.6])], 2.0, 1.0)}
            for p in summaries}
    path = plot_coserve(runs, comparison["medians"], {"ttft_ms": 110.0, "tbt_ms": 12.0}, tmp_path / "c.png")
    assert path.read_bytes()[:8] == PNG
