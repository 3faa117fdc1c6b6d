"""How a worker picks its token budget: its profile (own_profile.py finds it) gives the SLO-aware budget, capped
at max_num_batched_tokens; engine.budget = "fixed" or no profile the fixed one, with a reason; config validation
of the budget keys."""

from __future__ import annotations

import pytest

from kunserve.services.worker.build import make_token_budget
from kunserve.shared.config import ConfigError, config_from_dict, validate
from kunserve.shared.policy.batch_scheduler import FixedTokenBudget
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.policy.token_budget import SLOTokenBudget
from kunserve.shared.profile_files import Profile, device_signature

CON = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)


def _config(**engine):
    cfg = config_from_dict({"engine": {"max_num_batched_tokens": 96, **engine}, "slo": {"tbt_ms": 50.0}})
    validate(cfg)
    return cfg


def _profile(layers=(0, 4), threads=1) -> Profile:
    return Profile(model="kunserve-tiny", dtype="float32", layers=layers, device=device_signature("cpu", threads),
                   kunserve=KunServeCostModel(1e-7, 1e-4, 1e-3), conserve=CON, fit={}, samples=[])


def test_fixed_mode_or_no_profile_uses_the_fixed_budget():
    budget, why = make_token_budget(_config(budget="fixed"), _profile(), "profile p")
    assert budget == FixedTokenBudget(96) and why.startswith("fixed")
    budget, why = make_token_budget(_config(), None, "fallback: engine.profile_cache is off")
    assert budget == FixedTokenBudget(96) and why.startswith("fallback") and "fixed 96" in why


def test_a_profile_gives_the_slo_budget_capped_at_max_num_batched_tokens():
    budget, why = make_token_budget(_config(budget_headroom=0.8), _profile(), "profile p from f")
    assert isinstance(budget, SLOTokenBudget) and why.startswith("slo: profile p from f")
    assert budget.model == CON and budget.target_s == pytest.approx(0.04) and budget.max_tokens == 96


@pytest.mark.parametrize("engine,slo", [({"budget": "slo-ish"}, {}), ({"budget_headroom": 0}, {}),
                                        ({"budget_headroom": 1.5}, {}), ({}, {"tbt_ms": 0})])
def test_config_validation_of_budget_keys(engine, slo):
    cfg = config_from_dict({"engine": engine, "slo": slo})
    with pytest.raises(ConfigError):
        validate(cfg)
