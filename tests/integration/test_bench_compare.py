"""`kunserve bench compare` end to end: a few seconds of bursty trace through every overload policy (a fresh
local cluster each) completes and writes the table, JSON and plots; `bench run` interrupted with Ctrl-C
writes what it measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"


def test_compare_every_policy(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [sys.executable, "-m", "kunserve.cli.main", "bench", "compare", "--duration", "3", "--rate", "2",
         "--burst", "1:1:6", "--length-scale", "0.12", "--max-output", "48", "--seed", "3", "--settle", "0.3",
         "--request-timeout", "120", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for policy in OVERLOAD_POLICIES:
        assert policy in proc.stdout
        doc = json.loads((out / policy / "result.json").read_text())
        s = doc["summary"]
        assert s["failed"] == 0 and s["completed"] == s["requests"] == doc["trace"]["n"] > 0, (policy, s["errors"])
        assert s["ttft"]["p99"] > 0 and s["tpot"]["p50"] > 0
        assert all(r["tokens"] == r["output_tokens"] for r in doc["requests"])  # every token arrived
        assert doc["samples"], policy  # the admin sampler saw the cluster
        for png in ("ttft_timeline.png", "latency_cdf.png"):
            assert (out / policy / png).read_bytes()[:8] == PNG
    static = json.loads((out / "static-pp" / "result.json").read_text())
    assert static["samples"][0]["pipelined_units"] == 1  # paired from the start
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["policies"] == list(OVERLOAD_POLICIES) and set(cmp["summaries"]) == set(OVERLOAD_POLICIES)
    assert cmp["reference_p50"]["ttft_s"] > 0 and "ttft_p99_recompute_over_kunserve" in cmp["ratios"]
    assert (out / "compare.png").read_bytes()[:8] == PNG
    assert "TTFT p99" in proc.stdout and "target" in proc.stdout


def test_run_interrupted_writes_partial_results(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kunserve.cli.main", "bench", "run", "--address", c.cfg.dispatcher.address,
         "--admin", c.cfg.memory_manager.address, "--duration", "60", "--rate", "3", "--no-burst",
         "--length-scale", "0.1", "--policy", "kunserve", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)
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
