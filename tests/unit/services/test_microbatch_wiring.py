"""How a worker picks the way its engine cuts a long queue into microbatches when it heads a pipeline group:
lookahead under the KunServe cost model of its profile (own_profile.py finds it); token chunking with
engine.lookahead = false (the "kunserve-no-lookahead" ablation) or without a profile (with a reason saying why)."""

from __future__ import annotations

import pytest

from kunserve.services.worker.build import make_microbatch_former
from kunserve.shared.config import ConfigError, config_from_dict, load_config, validate
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.policy.microbatch import MicrobatchFormer
from kunserve.shared.profile_files import Profile, device_signature

KUN = KunServeCostModel(1e-7, 1e-4, 1e-3, 2e-4)


def _config(**engine):
    cfg = config_from_dict({"engine": engine})
    validate(cfg)
    return cfg


PROFILE = Profile(model="kunserve-tiny", dtype="float32", layers=(0, 4), device=device_signature("cpu", 1), kunserve=KUN,
                  conserve=ConServeLatencyModel(1e-4, 1e-7, 0.0, 1e-6, 3e-3), fit={}, samples=[])


def test_lookahead_is_on_by_default_and_uses_the_profile():
    assert _config().engine.lookahead is True
    former, why = make_microbatch_former(_config(), PROFILE, "profile p from f")
    assert former == MicrobatchFormer(KUN) and why == "lookahead: cost model of profile p from f"


def test_lookahead_off_is_token_chunking_whatever_the_profile():
    former, why = make_microbatch_former(_config(lookahead=False), PROFILE, "profile p from f")
    assert former == MicrobatchFormer(None, lookahead=False) and "engine.lookahead = false" in why


def test_without_a_profile_the_head_chunks_by_tokens_and_says_why():
    former, why = make_microbatch_former(_config(), None, "fallback: engine.profile_cache is off")
    assert former.model is None and former.lookahead and "token chunking" in why and why.startswith("fallback")


def test_the_switch_comes_from_the_file_or_the_environment():
    assert config_from_dict({"engine": {"lookahead": False}}).engine.lookahead is False
    assert load_config(None, environ={"KUNSERVE__ENGINE__LOOKAHEAD": "false"}).engine.lookahead is False
    with pytest.raises(ConfigError, match="lookahead"):
        config_from_dict({"engine": {"lookahead": "sometimes"}})
