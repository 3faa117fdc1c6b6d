"""`kunserve bench coserve --quick` end to end with a few seconds of trace, for online-only and conserve: each runs on a
fresh one-worker cluster, online-only first (conserve's SLOs come from it), conserve processes offline work beside
every online request, and the table, the targets, coserve.json, the per-run results and the figure are written. The
baselines differ from conserve only in engine.coserving (their scheduling and worker wiring are unit-tested:
tests/unit/policy/test_coserving_modes.py, tests/unit/cli/test_bench_coserve_cli.py); the targets that need them
come out as None here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kunserve.benchkit.coserve import CONSERVE, ONLINE_ONLY

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"
POLICIES = (ONLINE_ONLY, CONSERVE)


def test_quick_coserve(tmp_path):
    out = tmp_path / "cos"
    proc = subprocess.run([sys.executable, "-m", "kunserve.cli.main", "bench", "coserve", "--quick", "--duration", "2",
                           "--rate", "2", "--length-scale", "0.2", "--max-output", "24", "--offline-inflight", "4",
                           "--settle", "0.3", "--request-timeout", "120", "--seed", "5",
                           "--policies", ",".join(POLICIES), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "coserve.json").read_text())
    assert record["policies"] == list(POLICIES) and record["repeats"] == 1
    assert record["slo"]["ttft_ms"] > 0 and record["slo"]["tbt_ms"] > 0  # online-only's p99s
    targets = record["targets"]
    assert len(targets) == 5
    against_online_only = {k: v for k, v in targets.items() if "online-only" in k}
    assert len(against_online_only) == 2 and all(v in (True, False) for v in against_online_only.values())
    assert all(v is None for k, v in targets.items() if k not in against_online_only), targets
    for policy in POLICIES:
        doc = json.loads((out / policy / "run-1" / "result.json").read_text())
        s = doc["summary"]
        assert s["online"]["failed"] == 0 and s["online"]["completed"] == s["online"]["requests"] > 0, policy
        assert all(r["tokens"] == r["output_tokens"] for r in doc["online"])
        assert doc["timeline"] and doc["samples"], policy
        if policy == ONLINE_ONLY:
            assert s["offline"]["sent"] == 0 and doc["coserving"] == "non-preemptive"
        else:
            assert s["offline"]["tokens"] > 0 and s["offline"]["failed"] == 0, policy
            assert doc["coserving"] == policy
    assert (out / "coserve.png").read_bytes()[:8] == PNG
    assert "conserve's SLOs from it" in proc.stdout and "target online p99 TBT" in proc.stdout
