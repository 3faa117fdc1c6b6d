"""`kunserve bench`: argument checks, trace selection, the comparison record, the cluster sampler and the plots,
without a cluster (the integration test runs `compare` for real)."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys

import pytest

from kunserve.benchkit.plots import plot_compare, plot_run
from kunserve.benchkit.replay import ClusterSample, drop_periods, prompt_ids, sample_from_status
from kunserve.benchkit.stats import RequestResult, summarize
from kunserve.benchkit.trace import TraceRequest, save_trace_csv
from kunserve.cli import bench
from kunserve.cli.main import build_parser
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES
from kunserve.v1 import admin_pb2, common_pb2, memory_manager_pb2, monitor_pb2


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def kunserve(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kunserve.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout)


def kunserve_in_process(argvs: list[list[str]], capsys: pytest.CaptureFixture[str]) -> list[subprocess.CompletedProcess]:
    """`kunserve(*argv)` for every argv through the CLI's own `main` in this process (what a bad-input case checks is
    the exit code and the one stderr line; an interpreter start per case is what made these tests slow). The
    entry point itself runs as a process in `test_convert_trace`."""
    from kunserve.cli.main import main

    done = []
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for argv in argvs:
            capsys.readouterr()
            try:
                main(list(argv))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            out, err = capsys.readouterr()
            done.append(subprocess.CompletedProcess(argv, code, out, err))
    finally:  # a run installs its own Ctrl-C handlers: this process keeps pytest's
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return done


def test_policies_are_checked():
    assert bench.parse_policies(parse("compare").policies) == list(OVERLOAD_POLICIES)  # every policy by default
    assert bench.parse_policies("kunserve, recompute") == ["kunserve", "recompute"]
    with pytest.raises(bench.BenchError, match="unknown policy 'vllm'"):
        bench.parse_policies("kunserve,vllm")
    with pytest.raises(bench.BenchError, match="twice"):
        bench.parse_policies("swap,swap")
    with pytest.raises(bench.BenchError, match="empty"):
        bench.parse_policies(" , ")


def test_burst_argument():
    b = bench.parse_burst("2:3.5:6")
    assert (b.start_s, b.duration_s, b.factor) == (2.0, 3.5, 6.0)
    for bad in ("2:3", "a:b:c", "1:0:4", "1:2:0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_burst(bad)


def test_generated_trace_is_deterministic_and_scaled(tmp_path):
    args = parse("run", "--duration", "10", "--rate", "3", "--seed", "4", "--length-scale", "0.1",
                 "--save-trace", str(tmp_path / "t.csv"))
    trace, source = bench.build_trace(args)
    again, _ = bench.build_trace(args)
    assert trace == again and source["kind"] == "gamma" and source["repeat"] is None
    assert source["bursts"] == [{"start_s": 5.0, "duration_s": 20.0, "factor": 6.0}]
    assert all(r.prompt_tokens <= bench.DEFAULT_MAX_PROMPT and r.output_tokens <= bench.DEFAULT_MAX_OUTPUT for r in trace)
    # the saved trace replays as the same requests
    from_csv, _ = bench.build_trace(parse("run", "--trace", str(tmp_path / "t.csv"), "--length-scale", "1"))
    assert [(r.prompt_tokens, r.output_tokens) for r in from_csv] == [(r.prompt_tokens, r.output_tokens) for r in trace]
    up, src = bench.build_trace(parse("run", "--trace", str(tmp_path / "t.csv"), "--length-scale", "1", "--upscale", "2"))
    assert src["upscale"] == 2.0 and 1.5 * len(trace) <= len(up) <= 2.5 * len(trace)


def test_csv_trace_lengths_scale_and_clamp(tmp_path):
    save_trace_csv([TraceRequest(0.0, 1000, 400), TraceRequest(1.0, 100, 40)], tmp_path / "t.csv")
    trace, source = bench.build_trace(parse("run", "--trace", str(tmp_path / "t.csv"), "--length-scale", "0.5",
                                            "--max-prompt", "300"))
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [(300, 200), (50, 20)]
    assert source["kind"] == "burstgpt_csv" and source["skipped_rows"] == 0


def test_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "0,ChatGPT,10,5,15,Conversation log\n"
                   "1,ChatGPT,-3,5,2,Conversation log\n")
    cases = [
        (["bench", "run", "--trace", str(bad)], "bad.csv:3"),
        (["bench", "run", "--trace", str(tmp_path / "missing.csv")], "missing.csv"),
        (["bench", "compare", "--policies", "kunserve,vllm"], "unknown policy 'vllm'"),
        (["bench", "run", "--duration", "0.001", "--rate", "0.01", "--no-burst"], "empty"),
        (["bench", "run", "--address", "127.0.0.1:9", "--duration", "2", "--rate", "5"], "cannot reach the dispatcher"),
    ]
    outs = kunserve_in_process([[*argv, "--out", str(tmp_path / f"o{i}")] for i, (argv, _) in enumerate(cases)], capsys)
    for (argv, expected), out in zip(cases, outs, strict=True):
        assert out.returncode == 1, (argv, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kunserve: ") and expected in lines[0], (argv, out.stderr)


def _result(i: int, sent: float, ttft: float, tpot: float, n: int = 4, ok: bool = True) -> RequestResult:
    times = [ttft + k * tpot for k in range(n)] if ok else []
    return RequestResult(index=i, arrival_s=sent, sent_s=sent, prompt_tokens=10, output_tokens=n,
                         ttft_s=ttft if ok else None, token_times_s=times, e2e_s=times[-1] if ok else None, ok=ok,
                         error="" if ok else "UNAVAILABLE: gone", worker_id="worker-0", finish_reason="length")


def _doc(policy: str, ttfts: list[float], tpot: float, failed: int = 0, *, drop: bool = True, usage: int = 50) -> dict:
    """A run record: `drop` puts one drop (two epoch changes, 2 s of drop state) in its samples; `usage` is the KV
    blocks in use out of 100 (undropped capacity 100 too)."""
    from kunserve.benchkit.replay import ReplayOutcome

    results = [_result(i, float(i), t, tpot) for i, t in enumerate(ttfts)]
    results += [_result(len(ttfts) + j, 0.5, 0, 0, ok=False) for j in range(failed)]
    samples = [ClusterSample(t_s=t, kv_blocks_used=usage, kv_blocks_total=100, queued_demand_blocks=0,
                             units=2 - (drop and 1 <= t < 3), pipelined_units=int(drop and 1 <= t < 3), workers=2,
                             epoch=1 + drop * (int(t >= 1) + int(t >= 3)), kv_blocks_undropped=100) for t in range(5)]
    trace = [TraceRequest(float(i), 10, 4) for i in range(len(results))]
    return bench.run_record(ReplayOutcome(results, 10.0, samples), policy=policy, trace_source={"kind": "test"},
                            trace=trace, cluster={})


def test_compare_record_ratios_and_common_slo_reference():
    runs = {"kunserve": [_doc("kunserve", [0.1] * 99 + [0.2], 0.012)],
            "recompute": [_doc("recompute", [0.05] * 90 + [3.0] * 10, 0.010, failed=1)],
            "migrate": [_doc("migrate", [0.08] * 99 + [0.9], 0.011)]}
    rec = bench.compare_record(runs, list(runs))
    assert rec["reference_p50"]["ttft_s"] == pytest.approx(0.05)  # the best policy's p50
    assert rec["ratios"]["ttft_p99_recompute_over_kunserve"] == pytest.approx(3.0 / 0.101, rel=1e-3)  # p99 of 99 x 0.1 + 0.2 is 0.101
    assert rec["targets"]["ttft_p99_vs_recompute>=10x"] is True
    assert rec["targets"]["ttft_p99_vs_migrate>=5x"] is False  # 0.0882 / 0.101 < 5
    assert rec["ratios"]["tpot_p50_penalty_vs_recompute"] == pytest.approx(0.2)
    assert rec["targets"]["tpot_p50_penalty<=25%"] is True
    assert "ttft_p99_vs_swap>=10x" not in rec["targets"]  # swap did not run
    # SLO at scale 1 of the common reference (0.05 s): kunserve meets none, recompute 90 of its 101 requests
    k, r = rec["runs"]["kunserve"][0], rec["runs"]["recompute"][0]
    assert k["summary"]["slo"]["ttft"]["1"] == 0.0
    assert r["summary"]["slo"]["ttft"]["1"] == pytest.approx(90 / 101)
    assert k["drops"] == 1 and k["restores"] == 1 and k["epoch_changes"] == 2 and k["drop_seconds"] == pytest.approx(2.0)
    assert rec["medians"]["kunserve"]["drops"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    assert rec["overload"]["verdict"] == "overloaded" and rec["repeats"] == 1
    json.dumps(rec)


def test_repeats_give_median_and_range_and_ratios_of_medians():
    # three runs per row: kunserve's TTFT p99 is 0.1, 0.2 or 0.4 s, recompute's 2, 3 or 9 s
    runs = {"kunserve": [_doc("kunserve", [t] * 10, 0.01) for t in (0.4, 0.1, 0.2)],
            "recompute": [_doc("recompute", [t] * 10, 0.01) for t in (3.0, 9.0, 2.0)]}
    rec = bench.compare_record(runs, list(runs))
    assert rec["repeats"] == 3 and [r["run"] for r in rec["runs"]["recompute"]] == [1, 2, 3]
    assert rec["medians"]["kunserve"]["ttft_p99_s"] == pytest.approx({"median": 0.2, "min": 0.1, "max": 0.4, "n": 3})
    assert rec["medians"]["recompute"]["ttft_p99_s"]["median"] == pytest.approx(3.0)
    assert rec["ratios"]["ttft_p99_recompute_over_kunserve"] == pytest.approx(15.0)  # median over median
    assert bench.representative(runs["recompute"]) is runs["recompute"][0]  # the run with the median p99 (3 s)
    from rich.console import Console

    console = Console(record=True, width=200)
    bench.render_table(console, runs, rec)
    text = console.export_text()
    assert "3 runs" in text and "100-400" in text and "2000-9000" in text  # range under the median, in ms
    assert "ttft_p99_recompute_over_kunserve: 15.0x (medians)" in text


def test_a_trace_that_never_overloaded_says_so_instead_of_ratios():
    runs = {"kunserve": [_doc("kunserve", [0.1] * 10, 0.01, drop=False, usage=40)],
            "recompute": [_doc("recompute", [2.0] * 10, 0.01, drop=False, usage=85)]}
    rec = bench.compare_record(runs, list(runs))
    assert rec["overload"]["verdict"] == "never_overloaded" and "NEVER OVERLOADED" in rec["overload"]["banner"]
    assert rec["ratios"] == {} and rec["targets"] == {}
    assert rec["medians"]["recompute"]["max_kv_usage"]["median"] == pytest.approx(0.85)
    from rich.console import Console

    console = Console(record=True, width=200)
    bench.render_table(console, runs, rec)
    text = console.export_text()
    assert "NEVER OVERLOADED" in text and "over_kunserve" not in text and "target" not in text
    # near-full KV usage under a baseline is an overload, even without a drop
    runs["recompute"] = [_doc("recompute", [2.0] * 10, 0.01, drop=False, usage=95)]
    assert bench.compare_record(runs, list(runs))["overload"]["verdict"] == "overloaded"


def test_drop_periods_from_samples():
    mk = lambda t, p: ClusterSample(t, 0, 1, 0, 2 - p, p, 2, 1)  # noqa: E731
    assert drop_periods([mk(0, 0), mk(1, 1), mk(2, 1), mk(3, 0), mk(4, 1)]) == [(1, 3), (4, 4)]
    assert drop_periods([]) == []


def test_sample_counts_a_pipeline_group_once():
    def stats(wid, used, total, group, members):
        return monitor_pb2.WorkerStatus(stats=common_pb2.WorkerStats(
            worker_id=wid, kv_blocks_used=used, kv_blocks_total=total, group_id=group, group_members=members,
            layer_start=0, layer_end=4))
    status = admin_pb2.AdminStatus(
        cluster=monitor_pb2.ClusterStatus(workers=[stats("w0", 300, 640, "w0+w1", ["w0", "w1"]),
                                                   stats("w1", 300, 640, "w0+w1", ["w0", "w1"]),
                                                   stats("w2", 20, 128, "w2", [])], queued_demand_blocks=7),
        layout=memory_manager_pb2.ClusterLayout(epoch=3, workers=[
            memory_manager_pb2.WorkerLayout(worker_id="w0", layer_start=0, layer_end=2, group_id="w0+w1"),
            memory_manager_pb2.WorkerLayout(worker_id="w1", layer_start=2, layer_end=4, group_id="w0+w1"),
            memory_manager_pb2.WorkerLayout(worker_id="w2", layer_start=0, layer_end=4, group_id="w2")]))
    s = sample_from_status(status, 1.5)
    assert (s.kv_blocks_used, s.kv_blocks_total, s.units, s.pipelined_units, s.epoch) == (320, 768, 2, 1, 3)
    assert s.workers == 3 and s.to_dict()["workers"] == 3
    assert s.queued_demand_blocks == 7 and s.kv_usage == pytest.approx(320 / 768)


def test_prompts_are_seeded_and_in_range():
    assert prompt_ids(3, 50, seed=1) == prompt_ids(3, 50, seed=1) != prompt_ids(4, 50, seed=1)
    assert all(300 <= t < 4000 for t in prompt_ids(0, 500, seed=9))


def test_plots_are_written(tmp_path):
    docs = {"kunserve": _doc("kunserve", [0.1, 0.2, 0.15], 0.01), "recompute": _doc("recompute", [0.1, 2.0], 0.01, 1)}
    bench.compare_record({p: [d] for p, d in docs.items()}, list(docs))
    paths = plot_run(docs["kunserve"], tmp_path / "run")
    paths.append(plot_compare(docs, {p: d["summary"]["slo"] for p, d in docs.items()}, tmp_path / "compare.png"))
    for p in paths:
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
    # a run where every request failed still plots (nothing to scatter)
    plot_run(bench.run_record(__import__("kunserve.benchkit.replay", fromlist=["x"]).ReplayOutcome(
        [_result(0, 0.0, 0, 0, ok=False)], 1.0), policy="queue", trace_source={}, trace=[TraceRequest(0, 1, 1)],
        cluster={}), tmp_path / "failed")
    assert (tmp_path / "failed" / "ttft_timeline.png").exists()


def test_summary_counts_failures():
    s = summarize([_result(0, 0, 0.1, 0.01), _result(1, 0, 0, 0, ok=False)], 2.0)
    assert s["completed"] == 1 and s["failed"] == 1


# -- trace formats, --endpoint, --external, convert-trace ------------------------------------------------------
def test_trace_formats_load_and_save(tmp_path):
    trace = [TraceRequest(0.0, 600, 20), TraceRequest(1.25, 40, 8)]
    save_trace_csv(trace, tmp_path / "t.csv")
    base = ("run", "--length-scale", "1")
    loaded, source = bench.build_trace(parse(*base, "--trace", str(tmp_path / "t.csv"), "--save-trace",
                                             str(tmp_path / "t.jsonl")))
    assert loaded == trace and source["kind"] == "burstgpt_csv"
    again, source = bench.build_trace(parse(*base, "--trace", str(tmp_path / "t.jsonl"), "--save-trace",
                                            str(tmp_path / "out.txt"), "--save-trace-format", "mooncake"))
    assert again == trace and source["kind"] == "timed_trace"
    moon, source = bench.build_trace(parse(*base, "--trace", str(tmp_path / "out.txt")))
    assert moon == trace and source["kind"] == "mooncake"  # detected from its 512-token hash blocks
    forced, source = bench.build_trace(parse(*base, "--trace", str(tmp_path / "t.jsonl"), "--trace-format", "mooncake"))
    assert source["kind"] == "mooncake" and forced[1].arrival_s == 0.00125  # read in milliseconds, as told
    with pytest.raises(bench.BenchError, match="--limit must be >= 1"):
        bench.build_trace(parse(*base, "--trace", str(tmp_path / "t.jsonl"), "--limit", "0"))


def test_external_arguments():
    assert bench.parse_external("vllm=http://127.0.0.1:8000/v1") == ("vllm", "http://127.0.0.1:8000/v1")
    assert bench.parse_external(" v-2.x = http://h:1 ") == ("v-2.x", "http://h:1")
    for bad in ("vllm", "=http://h", "vllm=", "a b=http://h", "../x=http://h"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_external(bad)
    args = parse("compare", "--external", "a=http://h:1/v1", "--external", "b=http://h:2/v1")
    assert args.external == [("a", "http://h:1/v1"), ("b", "http://h:2/v1")] and parse("compare").external == []
    bench.check_externals(args.external)
    with pytest.raises(bench.BenchError, match="'swap' is an overload policy's name"):
        bench.check_externals([("swap", "http://h")])
    with pytest.raises(bench.BenchError, match="names 'a' twice"):
        bench.check_externals([("a", "http://h"), ("a", "http://i")])


def test_run_endpoint_arguments():
    args = parse("run", "--endpoint", "http://127.0.0.1:8000/v1", "--model", "m", "--api-key", "k")
    assert (args.endpoint, args.model, args.api_key, args.policy) == ("http://127.0.0.1:8000/v1", "m", "k", None)


def test_compare_record_has_a_ratio_for_external_rows():
    runs = {"kunserve": [_doc("kunserve", [0.1] * 99 + [0.2], 0.012)],
            "vllm": [_doc("vllm", [0.05] * 90 + [2.0] * 10, 0.01)]}
    runs["vllm"][0]["samples"] = []  # an external server: no cluster samples
    runs["vllm"][0]["overload"] = {"peak_ratio": None, "max_kv_usage": None, "drops": 0, "overloaded": None}
    rec = bench.compare_record(runs, list(runs))
    assert rec["ratios"]["ttft_p99_vllm_over_kunserve"] == pytest.approx(2.0 / 0.101, rel=1e-3)
    assert rec["reference_p50"]["ttft_s"] == pytest.approx(0.05)  # the external row's p50 is the best
    assert not any("vllm" in t for t in rec["targets"])
    assert rec["medians"]["vllm"]["drops"]["median"] is None  # not observed, not zero
    assert rec["overload"]["observed_runs"] == 1  # kunserve's only


def test_convert_trace(tmp_path, capsys):
    src = tmp_path / "burstgpt.csv"
    src.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "10,ChatGPT,100,5,105,Conversation log\n10.5,GPT-4,20,0,20,Conversation log\n"
                   "12.25,ChatGPT,30,7,37,API log\n13,ChatGPT,40,9,49,Conversation log\n")
    out = kunserve("bench", "convert-trace", str(src), str(tmp_path / "slice.jsonl"), "--limit", "2")
    assert out.returncode == 0, out.stderr
    assert "wrote 2 requests" in out.stdout and "(timed_trace)" in out.stdout and "--num-prompts 2 --self-timed" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "slice.jsonl").read_text().splitlines()]
    assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in rows] == [(0.0, 100, 5), (2.25, 30, 7)]
    (out,) = kunserve_in_process([["bench", "convert-trace", str(tmp_path / "slice.jsonl"), str(tmp_path / "m.out"),
                                   "--to", "mooncake"]], capsys)  # the entry point ran as a process above
    assert out.returncode == 0 and "--timed-trace-sec-multiplier 0.001 --timed-trace-chunk-hash-size 512" in out.stdout
    assert [json.loads(line)["timestamp"] for line in (tmp_path / "m.out").read_text().splitlines()] == [0, 2250]


def test_new_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n')
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    gen = ("--duration", "2", "--rate", "5")
    cases = [
        (["bench", "run", "--trace", str(bad)], "bad.jsonl:2: missing field 'output_length'"),
        (["bench", "convert-trace", str(bad), str(tmp_path / "x.csv")], "bad.jsonl:2: missing field 'output_length'"),
        (["bench", "convert-trace", str(tmp_path / "missing.csv"), str(tmp_path / "x.csv")], "missing.csv: file not found"),
        (["bench", "run", *gen, "--save-trace", str(tmp_path / "t.txt")], "cannot tell the trace format"),
        (["bench", "run", *gen, "--endpoint", f"http://127.0.0.1:{free}/v1"], "cannot reach the OpenAI endpoint"),
        (["bench", "run", *gen, "--endpoint", "127.0.0.1:8000"], "not an http(s) URL"),
        (["bench", "run", *gen, "--endpoint", "http://127.0.0.1:8000/v1", "--address", "127.0.0.1:1"],
         "--endpoint replays over HTTP"),
        (["bench", "compare", "--external", "queue=http://127.0.0.1:1/v1"], "'queue' is an overload policy's name"),
        (["bench", "compare", *gen, "--policies", "kunserve", "--external", f"v=http://127.0.0.1:{free}/v1"],
         "cannot reach the OpenAI endpoint"),
    ]
    outs = kunserve_in_process([[*argv, "--out", str(tmp_path / "o")] if argv[1] != "convert-trace" else argv
                                for argv, _ in cases], capsys)
    for (argv, expected), out in zip(cases, outs, strict=True):
        assert out.returncode == 1, (argv, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kunserve: ") and expected in lines[0], (argv, out.stderr)
    assert not (tmp_path / "o").exists()  # nothing ran: the compare failed before its first cluster


# -- calibration, repeats, policy variants ---------------------------------------------------------------------
def test_policy_variants_are_rows():
    assert bench.parse_policies("kunserve,kunserve-no-restore") == ["kunserve", "kunserve-no-restore"]
    args = parse("compare", "--policies", "kunserve-no-restore", "--request-timeout", "90")
    cfg = bench.compare_config(args, "kunserve-no-restore")
    assert cfg.policy.overload == "kunserve" and cfg.monitor.restore_hold_s == float("inf")
    assert bench.compare_config(args, "recompute").monitor.restore_hold_s == 10.0
    # every request queues in a comparison: no admission refusals sized by one policy's capacity
    assert cfg.dispatcher.max_queued_prompt_tokens == cfg.dispatcher.max_inflight_per_worker == bench.UNBOUNDED
    assert cfg.dispatcher.queue_timeout_s == 90.0
    with pytest.raises(bench.BenchError, match="'kunserve-no-restore' is an overload policy's name"):
        bench.check_externals([("kunserve-no-restore", "http://h")])


def test_a_variant_without_its_switch_is_refused(monkeypatch):
    from kunserve.benchkit.variants import Override, PolicyVariant

    fake = PolicyVariant("kunserve-no-magic", "kunserve", (Override("engine", "magic", False),), "the magic")
    monkeypatch.setitem(bench.POLICY_VARIANTS, fake.name, fake)
    assert bench.parse_policies("kunserve-no-magic") == ["kunserve-no-magic"]
    with pytest.raises(bench.BenchError, match=r"kunserve-no-magic needs the config switch engine\.magic.*refusing to "
                                                r"run it as plain kunserve"):
        bench.compare_config(parse("compare"), "kunserve-no-magic")


def _fake_cluster(monkeypatch, capacity_tokens: int = 4096, speeds=None):
    from kunserve.benchkit.calibrate import Speeds
    from kunserve.benchkit.probe import Capacity

    asked = {}

    async def capacity(admin, creds, *, workers):
        asked["workers"] = workers
        return Capacity(tokens=capacity_tokens, workers=2, block_size=16)

    async def probe(address, creds, *, prompt_tokens, concurrency, workers, seed, decode_tokens):
        asked.update(prompt_tokens=prompt_tokens, concurrency=concurrency)
        return speeds or Speeds(prefill_tokens_per_s=5000.0, tpot_s=0.012, concurrency=concurrency, source="probe")

    monkeypatch.setattr(bench, "cluster_capacity", capacity)
    monkeypatch.setattr(bench, "probe_speeds", probe)
    return asked


def test_calibration_sizes_the_burst_to_the_capacity(monkeypatch, tmp_path):
    from rich.console import Console

    from kunserve.benchkit.calibrate import Speeds, peak_kv_demand

    asked = _fake_cluster(monkeypatch)
    args = parse("compare", "--duration", "20", "--burst", "5:10:6", "--overload", "1.5",
                 "--save-trace", str(tmp_path / "t.csv"))
    cfg = bench.compare_config(args, "kunserve")
    console = Console(record=True, width=300)
    trace, source, record = bench.plan_trace(args, console, address="a", admin="m", creds=None, cfg=cfg, workers=2,
                                             where="test")
    speeds = Speeds(**record["speeds"])
    assert record["calibrated"] and source["calibration"] is record and asked["workers"] == 2
    # the probe's prompt is the trace's mean; its concurrency what an instance holds (2048 tokens / footprint),
    # short of overloading it with the probe's own requests
    uncalibrated, _ = bench.build_trace(args, save=False)
    d = bench.describe(uncalibrated)
    assert asked["prompt_tokens"] == round(d["mean_prompt"])
    assert asked["concurrency"] == min(round(2048 / (d["mean_prompt"] + d["mean_output"] / 2)),
                                       int(0.75 * 2048 / (asked["prompt_tokens"] + 32)))
    assert peak_kv_demand(trace, speeds).tokens / 4096 == pytest.approx(record["planned_ratio"])
    assert record["planned_ratio"] == pytest.approx(1.5, rel=0.1)
    assert record["base_ratio"] <= 0.5 and record["burst_factors"][0] > 1.0 and record["given"]["burst_factors"] == [6.0]
    assert source["bursts"] == [{"start_s": 5.0, "duration_s": 10.0, "factor": record["burst_factors"][0]}]
    saved, _ = bench.build_trace(parse("run", "--trace", str(tmp_path / "t.csv"), "--length-scale", "1"), save=False)
    assert len(saved) == len(trace) == record["requests"]  # --save-trace wrote the calibrated trace
    assert "planned peak KV demand 1.5" in console.export_text()
    # a faster machine holds each request for less time: it gets a bigger burst for the same overload
    _fake_cluster(monkeypatch, speeds=Speeds(50000.0, 0.003, 8, "probe"))
    _, _, fast = bench.plan_trace(args, Console(record=True), address="a", admin="m", creds=None, cfg=cfg, workers=2,
                                  where="test")
    assert fast["burst_factors"][0] > 2 * record["burst_factors"][0]
    assert fast["planned_ratio"] == pytest.approx(1.5, rel=0.1)


def test_calibration_of_a_loaded_trace_reports_its_plan_only(monkeypatch, tmp_path):
    from rich.console import Console

    _fake_cluster(monkeypatch, capacity_tokens=100)
    save_trace_csv([TraceRequest(0.0, 60, 10), TraceRequest(0.001, 60, 10)], tmp_path / "t.csv")
    args = parse("compare", "--trace", str(tmp_path / "t.csv"), "--length-scale", "1")
    trace, _, record = bench.plan_trace(args, Console(record=True), address="a", admin="m", creds=None,
                                        cfg=bench.compare_config(args, "kunserve"), workers=2, where="test")
    assert len(trace) == 2 and not record["calibrated"] and record["planned_ratio"] == pytest.approx(1.4, rel=0.05)
    off = parse("compare", "--calibrate", "off")
    assert bench.plan_trace(off, Console(record=True), address="a", admin=None, creds=None,
                            cfg=bench.compare_config(off, "kunserve"), workers=2, where="test")[2] is None
    with pytest.raises(bench.BenchError, match="calibration needs the admin service"):
        bench.plan_trace(parse("run", "--calibrate", "probe"), Console(), address="a", admin=None, creds=None,
                         cfg=bench.compare_config(off, "kunserve"), workers=None, where="test")


def test_calibration_that_cannot_reach_its_target_is_one_error(monkeypatch):
    from rich.console import Console

    _fake_cluster(monkeypatch, capacity_tokens=10**9)
    args = parse("compare", "--duration", "5", "--burst", "1:2:6")
    with pytest.raises(bench.BenchError, match="calibration: even a 1000x burst"):
        bench.plan_trace(args, Console(record=True), address="a", admin="m", creds=None,
                         cfg=bench.compare_config(args, "kunserve"), workers=2, where="test")


def test_calibration_from_a_matching_profile_needs_no_probe(monkeypatch, tmp_path):
    from rich.console import Console

    from kunserve.shared.model.weights import load_model_source
    from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
    from kunserve.shared.process import pick_device, thread_share
    from kunserve.shared.profile_files import Profile, device_signature, write_profile

    _fake_cluster(monkeypatch)

    async def no_probe(*a, **k):
        raise AssertionError("probed although a profile matches")

    args = parse("compare", "--duration", "20", "--burst", "5:10:6", "--calibrate", "profile")
    cfg = bench.compare_config(args, "kunserve")
    with pytest.raises(bench.BenchError, match="--calibrate profile: no engine.profile"):
        bench.plan_trace(args, Console(), address="a", admin="m", creds=None, cfg=cfg, workers=2, where="test")
    source = load_model_source(None, dtype=cfg.model.dtype)
    write_profile(tmp_path / "p.json", Profile(
        model=source.name, dtype=source.config.dtype, layers=(0, source.config.num_layers),
        device=device_signature(pick_device(cfg.model.device), thread_share(cfg)),
        kunserve=KunServeCostModel(alpha=0.0, beta=2e-4, gamma=1e-3), conserve=ConServeLatencyModel(0, 0, 0, 0, 0),
        fit={}, samples=[]))
    cfg.engine.profile = str(tmp_path / "p.json")
    monkeypatch.setattr(bench, "probe_speeds", no_probe)
    _, _, record = bench.plan_trace(args, Console(record=True), address="a", admin="m", creds=None, cfg=cfg, workers=2,
                                    where="test")
    assert record["speeds"]["source"].startswith("profile ") and record["planned_ratio"] == pytest.approx(1.5, rel=0.1)


def test_calibration_flags(tmp_path, capsys):
    assert parse("compare").calibrate == "auto" and parse("run").calibrate == "off"
    assert parse("compare").overload == 1.5 and parse("compare", "--overload", "2").overload == 2.0
    assert parse("compare").repeats == 3
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(SystemExit):
            parse("compare", "--overload", bad)
    probe, repeats = kunserve_in_process([
        ["bench", "run", "--endpoint", "http://127.0.0.1:1/v1", "--calibrate", "probe", "--duration", "2",
         "--out", str(tmp_path / "probe")],
        ["bench", "compare", "--repeats", "0", "--out", str(tmp_path / "repeats")],
    ], capsys)
    assert probe.returncode == 1 and "--calibrate needs a cluster's admin service" in probe.stderr
    assert repeats.returncode == 1 and "--repeats must be >= 1" in repeats.stderr
