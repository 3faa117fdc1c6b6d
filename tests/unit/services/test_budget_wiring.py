"""How a worker picks its token budget from the cluster config: a profile for exactly its model,
dtype, layer range and device gives the SLO-aware budget; anything else falls back to the fixed one
with a reason; config validation of the new keys."""

from __future__ import annotations

import pytest

from kunserve.services.worker.build import make_token_budget
from kunserve.shared.config import ConfigError, config_from_dict, validate
from kunserve.shared.policy.batch_scheduler import FixedTokenBudget
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.policy.token_budget import SLOTokenBudget
from kunserve.shared.profile_files import Profile, device_signature, write_profile

CON = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)


def _config(**engine):
    cfg = config_from_dict({"engine": {"max_num_batched_tokens": 96, **engine}, "slo": {"tbt_ms": 50.0}})
    validate(cfg)
    return cfg


def _write(path, layers=(0, 4), threads=1):
    write_profile(path, Profile(model="kunserve-tiny", dtype="float32", layers=layers,
                                device=device_signature("cpu", threads), kunserve=KunServeCostModel(1e-7, 1e-4, 1e-3),
                                conserve=CON, fit={}, samples=[]))


def test_no_profile_or_fixed_mode_uses_the_fixed_budget(tmp_path):
    for cfg in (_config(), _config(profile=str(tmp_path / "p.json"), budget="fixed")):
        budget, why = make_token_budget(cfg, model="kunserve-tiny", dtype="float32", layers=(0, 4), device="cpu",
                                        threads=1)
        assert budget == FixedTokenBudget(96) and why.startswith("fixed")


def test_matching_profile_gives_the_slo_budget(tmp_path):
    path = tmp_path / "p.json"
    _write(path)
    budget, why = make_token_budget(_config(profile=str(path), budget_headroom=0.8), model="kunserve-tiny",
                                    dtype="float32", layers=(0, 4), device="cpu", threads=1)
    assert isinstance(budget, SLOTokenBudget) and why.startswith("slo")
    assert budget.model == CON and budget.target_s == pytest.approx(0.04)


@pytest.mark.parametrize("change", [{"layers": (0, 2)}, {"threads": 2}, {"model": "other"}, {"dtype": "bfloat16"},
                                    {"missing": True}])
def test_mismatch_or_missing_file_falls_back_with_a_reason(tmp_path, change):
    path = tmp_path / "p.json"
    if not change.get("missing"):
        _write(path)
    args = {"model": "kunserve-tiny", "dtype": "float32", "layers": (0, 4), "device": "cpu", "threads": 1}
    args.update({k: v for k, v in change.items() if k != "missing"})
    budget, why = make_token_budget(_config(profile=str(path)), **args)
    assert budget == FixedTokenBudget(96)
    assert why.startswith("fallback") and ("no profile" in why or "does not exist" in why)


@pytest.mark.parametrize("engine,slo", [({"budget": "slo-ish"}, {}), ({"budget_headroom": 0}, {}),
                                        ({"budget_headroom": 1.5}, {}), ({}, {"tbt_ms": 0})])
def test_config_validation_of_budget_keys(engine, slo):
    cfg = config_from_dict({"engine": engine, "slo": slo})
    with pytest.raises(ConfigError):
        validate(cfg)
