"""`kunserve bench coserve --quick` end to end with a few seconds of trace: every policy runs on a fresh one-worker
cluster, online-only first (conserve's SLOs come from it), the co-serving policies process offline work beside
every online request, and the table, the targets, coserve.json, the per-run results and the figure are written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kunserve.benchkit.coserve import POLICIES

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"


def test_quick_coserve(tmp_path):
    out = tmp_path / "cos"
    proc = subprocess.run([sys.executable, "-m", "kunserve.cli.main", "bench", "coserve", "--quick", "--duration", "3",
                           "--rate", "2", "--length-scale", "0.2", "--max-output", "24", "--offline-inflight", "4",
                           "--settle", "0.3", "--request-timeout", "120", "--seed", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "coserve.json").read_text())
    assert record["policies"] == list(POLICIES) and record["repeats"] == 1
    assert record["slo"]["ttft_ms"] > 0 and record["slo"]["tbt_ms"] > 0  # online-only's p99s
    assert len(record["targets"]) == 5 and all(v in (True, False) for v in record["targets"].values())
    for policy in POLICIES:
        doc = json.loads((out / policy / "run-1" / "result.json").read_text())
        s = doc["summary"]
        assert s["online"]["failed"] == 0 and s["online"]["completed"] == s["online"]["requests"] > 0, policy
        assert all(r["tokens"] == r["output_tokens"] for r in doc["online"])
        assert doc["timeline"] and doc["samples"], policy
        if policy == "online-only":
            assert s["offline"]["sent"] == 0 and doc["coserving"] == "non-preemptive"
        else:
            assert s["offline"]["tokens"] > 0 and s["offline"]["failed"] == 0, policy
            assert doc["coserving"] == policy
    assert (out / "coserve.png").read_bytes()[:8] == PNG
    assert "conserve's SLOs from it" in proc.stdout and "target online p99 TBT" in proc.stdout
