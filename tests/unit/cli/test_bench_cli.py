"""`kunserve bench`: argument checks, trace selection, the comparison record, the cluster sampler and the plots,
without a cluster (the integration test runs `compare` for real)."""

from __future__ import annotations

import argparse
import json
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
from kunserve.v1 import admin_pb2, common_pb2, memory_manager_pb2, monitor_pb2


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def kunserve(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kunserve.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_policies_are_checked():
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
    assert trace == again and source["kind"] == "gamma" and source["burst"]["factor"] == 6.0
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


def test_bad_input_is_one_line(tmp_path):
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
    for argv, expected in cases:
        out = kunserve(*argv, "--out", str(tmp_path / "o"))
        assert out.returncode == 1, (argv, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kunserve: ") and expected in lines[0], (argv, out.stderr)


def _result(i: int, sent: float, ttft: float, tpot: float, n: int = 4, ok: bool = True) -> RequestResult:
    times = [ttft + k * tpot for k in range(n)] if ok else []
    return RequestResult(index=i, arrival_s=sent, sent_s=sent, prompt_tokens=10, output_tokens=n,
                         ttft_s=ttft if ok else None, token_times_s=times, e2e_s=times[-1] if ok else None, ok=ok,
                         error="" if ok else "UNAVAILABLE: gone", worker_id="worker-0", finish_reason="length")


def _doc(policy: str, ttfts: list[float], tpot: float, failed: int = 0) -> dict:
    from kunserve.benchkit.replay import ReplayOutcome

    results = [_result(i, float(i), t, tpot) for i, t in enumerate(ttfts)]
    results += [_result(len(ttfts) + j, 0.5, 0, 0, ok=False) for j in range(failed)]
    samples = [ClusterSample(t_s=t, kv_blocks_used=50, kv_blocks_total=100, queued_demand_blocks=0, units=2 - (1 <= t < 3),
                             pipelined_units=int(1 <= t < 3), epoch=1 + int(t >= 1) + int(t >= 3)) for t in range(5)]
    trace = [TraceRequest(float(i), 10, 4) for i in range(len(results))]
    return bench.run_record(ReplayOutcome(results, 10.0, samples), policy=policy, trace_source={"kind": "test"},
                            trace=trace, cluster={})


def test_compare_record_ratios_and_common_slo_reference():
    docs = {"kunserve": _doc("kunserve", [0.1] * 99 + [0.2], 0.012),
            "recompute": _doc("recompute", [0.05] * 90 + [3.0] * 10, 0.010, failed=1),
            "migrate": _doc("migrate", [0.08] * 99 + [0.9], 0.011)}
    rec = bench.compare_record(docs, list(docs))
    assert rec["reference_p50"]["ttft_s"] == pytest.approx(0.05)  # the best policy's p50
    assert rec["ratios"]["ttft_p99_recompute_over_kunserve"] == pytest.approx(3.0 / 0.101, rel=1e-3)  # p99 of 99 x 0.1 + 0.2 is 0.101
    assert rec["targets"]["ttft_p99_vs_recompute>=10x"] is True
    assert rec["targets"]["ttft_p99_vs_migrate>=5x"] is False  # 0.0882 / 0.101 < 5
    assert rec["ratios"]["tpot_p50_penalty_vs_recompute"] == pytest.approx(0.2)
    assert rec["targets"]["tpot_p50_penalty<=25%"] is True
    assert "ttft_p99_vs_swap>=10x" not in rec["targets"]  # swap did not run
    # SLO at scale 1 of the common reference (0.05 s): kunserve meets none, recompute 90 of its 101 requests
    assert rec["summaries"]["kunserve"]["slo"]["ttft"]["1"] == 0.0
    assert rec["summaries"]["recompute"]["slo"]["ttft"]["1"] == pytest.approx(90 / 101)
    assert rec["drops"]["kunserve"] == 1 and rec["epoch_changes"]["kunserve"] == 2 and rec["drop_seconds"]["kunserve"] == pytest.approx(2.0)
    json.dumps(rec)


def test_drop_periods_from_samples():
    mk = lambda t, p: ClusterSample(t, 0, 1, 0, 2 - p, p, 1)  # noqa: E731
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
    assert s.queued_demand_blocks == 7 and s.kv_usage == pytest.approx(320 / 768)


def test_prompts_are_seeded_and_in_range():
    assert prompt_ids(3, 50, seed=1) == prompt_ids(3, 50, seed=1) != prompt_ids(4, 50, seed=1)
    assert all(300 <= t < 4000 for t in prompt_ids(0, 500, seed=9))


def test_plots_are_written(tmp_path):
    docs = {"kunserve": _doc("kunserve", [0.1, 0.2, 0.15], 0.01), "recompute": _doc("recompute", [0.1, 2.0], 0.01, 1)}
    rec = bench.compare_record(docs, list(docs))
    paths = plot_run(docs["kunserve"], tmp_path / "run")
    paths.append(plot_compare(docs, {p: s["slo"] for p, s in rec["summaries"].items()}, tmp_path / "compare.png"))
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
    docs = {"kunserve": _doc("kunserve", [0.1] * 99 + [0.2], 0.012), "vllm": _doc("vllm", [0.05] * 90 + [2.0] * 10, 0.01)}
    rec = bench.compare_record(docs, list(docs), ["vllm"])
    assert rec["ratios"]["ttft_p99_vllm_over_kunserve"] == pytest.approx(2.0 / 0.101, rel=1e-3)
    assert rec["reference_p50"]["ttft_s"] == pytest.approx(0.05)  # the external row's p50 is the best
    assert not any("vllm" in t for t in rec["targets"])
    assert "ttft_p99_vllm_over_kunserve" not in bench.compare_record(docs, list(docs))["ratios"]


def test_convert_trace(tmp_path):
    src = tmp_path / "burstgpt.csv"
    src.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "10,ChatGPT,100,5,105,Conversation log\n10.5,GPT-4,20,0,20,Conversation log\n"
                   "12.25,ChatGPT,30,7,37,API log\n13,ChatGPT,40,9,49,Conversation log\n")
    out = kunserve("bench", "convert-trace", str(src), str(tmp_path / "slice.jsonl"), "--limit", "2")
    assert out.returncode == 0, out.stderr
    assert "wrote 2 requests" in out.stdout and "(timed_trace)" in out.stdout and "--num-prompts 2 --self-timed" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "slice.jsonl").read_text().splitlines()]
    assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in rows] == [(0.0, 100, 5), (2.25, 30, 7)]
    out = kunserve("bench", "convert-trace", str(tmp_path / "slice.jsonl"), str(tmp_path / "m.out"), "--to", "mooncake")
    assert out.returncode == 0 and "--timed-trace-sec-multiplier 0.001 --timed-trace-chunk-hash-size 512" in out.stdout
    assert [json.loads(line)["timestamp"] for line in (tmp_path / "m.out").read_text().splitlines()] == [0, 2250]


def test_new_bad_input_is_one_line(tmp_path):
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
    for argv, expected in cases:
        out = kunserve(*argv, "--out", str(tmp_path / "o")) if argv[1] != "convert-trace" else kunserve(*argv)
        assert out.returncode == 1, (argv, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kunserve: ") and expected in lines[0], (argv, out.stderr)
    assert not (tmp_path / "o").exists()  # nothing ran: the compare failed before its first cluster
