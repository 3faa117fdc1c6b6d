"""`kunserve bench compare` end to end: a few seconds of bursty trace through every baseline overload policy (a fresh
local cluster each) completes and writes the table, JSON and plots, and says when its trace never overloaded;
a calibrated comparison sizes its burst to the cluster and overloads it; `bench run` interrupted with Ctrl-C
writes what it measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"


def _compare(out, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kunserve.cli.main", "bench", "compare", "--repeats", "1",
                           "--settle", "0.3", "--request-timeout", "120", "--seed", "3", "--out", str(out), *argv],
                          capture_output=True, text=True, timeout=600)


# The baselines each in a fresh cluster of its own. kunserve runs in the calibrated comparison below, static-pp's
# pairs formed at start in tests/integration/test_drop.py, and that `bench compare` runs every policy by default is
# tests/unit/cli/test_bench_cli.py's.
BASELINES = ("recompute", "swap", "migrate", "queue")


def test_compare_every_baseline(tmp_path):
    # 15 small requests (under 1,000 tokens in all) never come near one instance's 2,048 tokens of KV: the
    # comparison must say so instead of printing ratios
    out = tmp_path / "cmp"
    proc = _compare(out, "--calibrate", "off", "--duration", "2", "--rate", "2", "--burst", "1:1:6",
                    "--length-scale", "0.12", "--max-output", "24", "--policies", ",".join(BASELINES))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for policy in BASELINES:
        assert policy in proc.stdout
        doc = json.loads((out / policy / "run-1" / "result.json").read_text())
        s = doc["summary"]
        assert s["failed"] == 0 and s["completed"] == s["requests"] == doc["trace"]["n"] > 0, (policy, s["errors"])
        assert s["ttft"]["p99"] > 0 and s["tpot"]["p50"] > 0
        assert all(r["tokens"] == r["output_tokens"] for r in doc["requests"])  # every token arrived
        assert doc["samples"], policy  # the admin sampler saw the cluster
        assert doc["overload"]["overloaded"] is False and doc["overload"]["max_kv_usage"] < 0.9
        for png in ("ttft_timeline.png", "latency_cdf.png"):
            assert (out / policy / "run-1" / png).read_bytes()[:8] == PNG
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["policies"] == list(BASELINES) and set(cmp["runs"]) == set(BASELINES)
    assert cmp["reference_p50"]["ttft_s"] > 0 and cmp["repeats"] == 1 and cmp["calibration"] is None
    assert cmp["overload"]["verdict"] == "never_overloaded" and cmp["ratios"] == {} and cmp["targets"] == {}
    assert (out / "compare.png").read_bytes()[:8] == PNG
    assert "TTFT p99" in proc.stdout and "NEVER OVERLOADED" in proc.stdout and "target" not in proc.stdout


def test_compare_calibrates_the_burst_to_the_cluster(tmp_path):
    # a cluster of its own is probed, the burst factor is chosen for a planned peak of 2x its KV capacity
    # (about 60 short requests on this CPU), and the runs then find the cluster overloaded
    out = tmp_path / "cal"
    proc = _compare(out, "--policies", "kunserve,recompute", "--overload", "2", "--duration", "4", "--rate", "1",
                    "--burst", "1:0.5:4", "--length-scale", "0.25", "--max-output", "64")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cmp = json.loads((out / "compare.json").read_text())
    cal = cmp["calibration"]
    assert cal["calibrated"] and cal["speeds"]["source"] == "probe"
    assert cal["speeds"]["prefill_tokens_per_s"] > 0 and cal["speeds"]["tpot_s"] > 0
    assert cal["planned_ratio"] == pytest.approx(2.0, rel=0.15) and cal["burst_factors"][0] > 4
    assert cmp["trace"]["n"] == cal["requests"] and cmp["trace"]["source"]["bursts"][0]["factor"] == cal["burst_factors"][0]
    for policy in ("kunserve", "recompute"):
        doc = json.loads((out / policy / "run-1" / "result.json").read_text())
        assert doc["summary"]["failed"] == 0, doc["summary"]["errors"]  # nothing refused: every request queues
        # the capacity calibration read is the one the sampler sees: every worker's undropped blocks
        assert cal["capacity"]["tokens"] == doc["samples"][0]["kv_blocks_undropped"] * cal["capacity"]["block_size"]
    assert cmp["overload"]["verdict"] == "overloaded", cmp["overload"]
    assert cmp["runs"]["kunserve"][0]["drops"] >= 1
    assert "calibration (probe)" in proc.stdout and "planned peak KV demand" in proc.stdout
    assert "ttft_p99_recompute_over_kunserve" in cmp["ratios"]


def test_run_interrupted_writes_partial_results(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kunserve.cli.main", "bench", "run", "--address", c.cfg.dispatcher.address,
         "--admin", c.cfg.memory_manager.address, "--duration", "60", "--rate", "3", "--no-burst",
         "--length-scale", "0.1", "--policy", "kunserve", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(5)  # requests of a few tokens at 3/s: several have completed
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout + stderr
    doc = json.loads((out / "result.json").read_text())
    assert doc["interrupted"] and doc["not_sent"] > 0
    assert doc["summary"]["completed"] > 0  # what finished before Ctrl-C is there
    assert all(r["ok"] or r["error"] == "interrupted" for r in doc["requests"])
    assert (out / "ttft_timeline.png").exists() and "interrupted" in stdout
