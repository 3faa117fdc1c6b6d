"""`kunserve simulate` with elastic tensor parallelism: the scenario key and the flag, the re-forms in result.json,
and a scenario that cannot be simulated."""

from __future__ import annotations

import json

import pytest

from kunserve.benchkit.trace import TraceRequest, save_jsonl_trace
from kunserve.cli.main import main
from kunserve.shared.config import load_config
from kunserve.sim.scenario import ClusterSpec, ScenarioError, build_setup


def _scenario(tmp_path, elastic: str) -> str:
    """The embedded model on 3 instances with 26 MiB pools (1280 KV tokens whole, 5632 at TP2), short requests and
    one that needs TP2."""
    trace = tmp_path / "mixed.mooncake.jsonl"
    requests = sorted([TraceRequest(0.5 * i, 200, 20) for i in range(40)] + [TraceRequest(1.0, 1500, 100)], key=lambda r: r.arrival_s)
    save_jsonl_trace(requests, trace, "mooncake")
    path = tmp_path / "mixed.toml"
    path.write_text(
        f"""
[scenario]
name = "mixed"
[cluster]
instances = 3
model = "embedded"
{elastic}
tp_reform_s = 2.0
[trace]
trace = "{trace}"
length_scale = 1.0
max_prompt = 100000
[config.engine]
pool_mib = 26
page_kib = 256
[config.memory_manager]
tp_idle_split_s = 5.0
"""
    )
    return str(path)


def _run(tmp_path, profile_file, elastic: str, *flags: str) -> dict:
    out = tmp_path / "out"
    args = ["simulate", "--scenario", _scenario(tmp_path, elastic), "--profile-file", str(profile_file), "--out", str(out), *flags]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 0
    return json.loads((out / "result.json").read_text())


def test_the_scenario_key_turns_elastic_tp_on_and_the_result_shows_the_re_forms(tmp_path, profile_file):
    doc = _run(tmp_path, profile_file, "elastic_tp = true")
    assert doc["summary"]["completed"] == doc["summary"]["requests"] == 41
    assert doc["cluster"]["elastic_tp"] is True
    assert doc["tp_scale_ups"] == 1 and doc["tp_splits"] == 1
    ops = [t["op"] for t in doc["simulation"]["transitions"]]
    assert ops == ["tp", "tp-split"]


def test_the_flag_overrides_the_scenario(tmp_path, profile_file):
    doc = _run(tmp_path, profile_file, "elastic_tp = true", "--no-elastic-tp")
    assert doc["cluster"]["elastic_tp"] is False and "tp_scale_ups" not in doc
    assert doc["summary"]["completed"] == 40  # the long request is refused
    doc = _run(tmp_path, profile_file, "", "--elastic-tp")
    assert doc["cluster"]["elastic_tp"] is True and doc["tp_scale_ups"] == 1


def test_elastic_tp_needs_whole_single_gpu_instances():
    cfg = load_config(None, environ={})
    cfg.dispatcher.elastic_tp = True
    with pytest.raises(ScenarioError, match="tp must be 1"):
        build_setup(cfg, ClusterSpec(instances=4, model="llama-3.1-8b", accelerator="A100", tp=2), label="x")
    with pytest.raises(ScenarioError, match="tp_reform_s"):
        build_setup(cfg, ClusterSpec(instances=4, model="llama-3.1-8b", accelerator="A100", tp_reform_s=-1.0), label="x")


def test_a_merged_instance_steps_at_its_degree_on_the_roofline():
    cfg = load_config(None, environ={})
    cfg.dispatcher.elastic_tp = True
    setup = build_setup(cfg, ClusterSpec(instances=8, model="llama-3.1-8b", accelerator="A100"), label="x")
    assert setup.time_for(1) is setup.time
    assert setup.time_for(2).source == "roofline A100 x2" and setup.time_for(4).source == "roofline A100 x4"
