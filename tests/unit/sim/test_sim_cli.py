"""`kunserve simulate` end to end on a small trace, and the shipped scenario files."""

from __future__ import annotations

import json
import pathlib

import pytest

from kunserve.cli.main import main
from kunserve.cli.simulate import cluster_spec, row_config
from kunserve.shared.config import load_config
from kunserve.sim.scenario import apply_config, build_setup, load_scenario

SCENARIOS = sorted((pathlib.Path(__file__).resolve().parents[3] / "configs" / "scenarios").glob("*.toml"))


def test_one_policy_writes_the_bench_result(tmp_path, profile_file):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "simulate",
                "--model",
                "embedded",
                "--profile-file",
                str(profile_file),
                "--limit",
                "30",
                "--policies",
                "recompute",
                "--out",
                str(out),
            ]
        )
    assert exc.value.code == 0
    doc = json.loads((out / "result.json").read_text())
    assert doc["summary"]["completed"] == doc["summary"]["requests"] == 30
    assert doc["simulation"]["time_model"]["source"].startswith("profile ")
    assert doc["simulation"]["simulated_s_per_wall_s"] > 0
    assert (out / "ttft_timeline.png").exists() and (out / "latency_cdf.png").exists()


def test_several_policies_write_the_comparison(tmp_path, profile_file):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "simulate",
                "--model",
                "embedded",
                "--profile-file",
                str(profile_file),
                "--limit",
                "20",
                "--policies",
                "recompute,kunserve",
                "--out",
                str(out),
            ]
        )
    assert exc.value.code == 0
    comparison = json.loads((out / "compare.json").read_text())
    assert comparison["policies"] == ["recompute", "kunserve"] and comparison["simulated"]
    assert (out / "kunserve" / "run-1" / "result.json").exists() and (out / "compare.png").exists()


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_shipped_scenarios_describe_a_cluster_that_fits(path):
    scenario = load_scenario(path)
    cfg = load_config(None, environ={})
    apply_config(cfg, scenario.config, str(path))
    args = type(
        "Args",
        (),
        {
            f: None
            for f in (
                "instances",
                "model",
                "accelerator",
                "profile_file",
                "profile_device",
                "tp",
                "memory_utilization",
                "gpu_memory_gib",
                "network_gbps",
                "iteration_overhead_ms",
            )
        },
    )()
    spec = cluster_spec(args, scenario, cfg)
    setup = build_setup(row_config(cfg, (scenario.policies or ("recompute",))[0], 600.0), spec, label="x")
    assert setup.memory.undropped_blocks > 0 and setup.instances == spec.instances
    assert scenario.paper and scenario.figure
