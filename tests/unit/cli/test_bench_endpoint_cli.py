"""`kunserve bench run --endpoint` end to end against a minimal OpenAI-compatible server in a thread of the
test (127.0.0.1): the CLI finds the model, sends the API key from $OPENAI_API_KEY, and writes the same
result.json and plots as the gRPC path (the integration test does this against a real cluster's front)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from fake_openai import FakeServer, ThreadedServer

KEY = "test-key"


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with ThreadedServer(FakeServer(key=KEY, models={"object": "list", "data": [{"id": "tiny", "object": "model"}]})) as s:
        yield s


def test_run_against_an_endpoint_writes_the_usual_results(server, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "kunserve.cli.main", "bench", "run", "--endpoint", server.url.removesuffix("/v1"),  # implied
         "--duration", "2", "--rate", "4", "--no-burst", "--length-scale", "0.02", "--seed", "2",
         "--request-timeout", "30", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OPENAI_API_KEY": KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((out / "result.json").read_text())
    s = doc["summary"]
    assert doc["policy"] == "endpoint" and s["failed"] == 0 and s["completed"] == s["requests"] == doc["trace"]["n"] > 0
    assert all(r["tokens"] == r["output_tokens"] and r["ok"] for r in doc["requests"])
    assert doc["cluster"] == {"endpoint": server.url, "model": "tiny", "api": "openai /v1/completions"}
    assert doc["samples"] == [] and doc["drop_periods"] == []
    assert len(server.bodies) == s["requests"] and server.auth == {f"Bearer {KEY}"}
    assert all(b["model"] == "tiny" and b["stream"] and b["ignore_eos"] for b in server.bodies.values())
    for png in ("ttft_timeline.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "endpoint" in proc.stdout and "TTFT p99" in proc.stdout
