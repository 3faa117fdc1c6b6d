"""The benchmark harness over the OpenAI-compatible HTTP front of a real local cluster: a BurstGPT slice
converted to vLLM's timed_trace replays through `bench run --endpoint` with every request complete, the right
token count and the file's arrival schedule; the gRPC replay of the same file sends the same requests; and
`bench compare --external` adds the front as one more row next to a policy's fresh cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kunserve.benchkit.trace import load_trace

pytestmark = pytest.mark.integration

# A BurstGPT slice: absolute timestamps, a failed request (0 response tokens) and a row past the slice.
BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "100,ChatGPT,24,6,30,Conversation log\n"
            "100.3,ChatGPT,9,0,9,Conversation log\n"
            "100.4,GPT-4,40,4,44,Conversation log\n"
            "100.9,ChatGPT,13,8,21,API log\n"
            "101.2,ChatGPT,31,5,36,Conversation log\n"
            "101.3,ChatGPT,7,3,10,Conversation log\n")


def kunserve(*argv: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kunserve.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def timed_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    (d / "burstgpt.csv").write_text(BURSTGPT)
    kunserve("bench", "convert-trace", str(d / "burstgpt.csv"), str(d / "slice.jsonl"), "--limit", "4")
    return d / "slice.jsonl"


def result(out) -> dict:
    doc = json.loads((out / "result.json").read_text())
    s = doc["summary"]
    assert s["failed"] == 0 and s["completed"] == s["requests"], s["errors"]
    assert all(r["ok"] and r["tokens"] == r["output_tokens"] for r in doc["requests"]), doc["requests"]
    return doc


def test_timed_trace_over_the_http_front(cluster, timed_trace, tmp_path):
    trace, _, fmt = load_trace(timed_trace)
    assert fmt == "timed_trace" and len(trace) == 4
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.4, 0.9, 1.2])  # the slice's offsets, in seconds
    url = f"http://{cluster.cfg.dispatcher.http_address}/v1"
    kunserve("bench", "run", "--endpoint", url, "--trace", str(timed_trace), "--length-scale", "1", "--seed", "4",
             "--request-timeout", "120", "--out", str(tmp_path / "http"))
    http = result(tmp_path / "http")
    assert http["cluster"]["endpoint"] == url and http["cluster"]["model"] == cluster.cfg.model.served_model
    reqs = sorted(http["requests"], key=lambda r: r["index"])
    assert [(r["arrival_s"], r["prompt_tokens"], r["output_tokens"]) for r in reqs] == [
        (t.arrival_s, t.prompt_tokens, t.output_tokens) for t in trace]
    assert all(r["sent_s"] >= r["arrival_s"] and r["ttft_s"] > 0 and r["finish_reason"] == "length" for r in reqs)
    assert http["summary"]["tpot"]["p50"] > 0

    kunserve("bench", "run", "--address", cluster.cfg.dispatcher.address, "--admin", "", "--trace", str(timed_trace),
             "--length-scale", "1", "--seed", "4", "--request-timeout", "120", "--out", str(tmp_path / "grpc"))
    grpc_reqs = sorted(result(tmp_path / "grpc")["requests"], key=lambda r: r["index"])
    assert [(r["arrival_s"], r["prompt_tokens"], r["tokens"]) for r in grpc_reqs] == [
        (r["arrival_s"], r["prompt_tokens"], r["tokens"]) for r in reqs]


def test_compare_with_the_front_as_an_external_row(cluster, timed_trace, tmp_path):
    url = f"http://{cluster.cfg.dispatcher.http_address}/v1"
    out = tmp_path / "cmp"
    proc = kunserve("bench", "compare", "--policies", "kunserve", "--external", f"front={url}", "--trace",
                    str(timed_trace), "--length-scale", "1", "--settle", "0.3", "--request-timeout", "120",
                    "--repeats", "1", "--calibrate", "off", "--out", str(out), timeout=600)
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["policies"] == ["kunserve", "front"] and cmp["external"]["front"]["endpoint"] == url
    assert not cmp["interrupted"] and cmp["repeats"] == 1
    # the external row is a row like the policies (its repeats interleave with theirs: benchkit/repeats.py, unit-tested)
    assert [r["run"] for r in cmp["runs"]["front"]] == [1] and cmp["medians"]["front"]["ttft_p99_s"]["n"] == 1
    assert cmp["medians"]["front"]["drops"]["median"] is None  # no cluster samples: not observed
    # four requests never overload anything: no ratios, a banner instead
    assert cmp["overload"]["verdict"] == "never_overloaded" and cmp["ratios"] == {}
    for name in ("kunserve", "front"):
        assert result(out / name / "run-1")["trace"]["n"] == 4
    assert "front" in proc.stdout and "NEVER OVERLOADED" in proc.stdout and (out / "compare.png").exists()
