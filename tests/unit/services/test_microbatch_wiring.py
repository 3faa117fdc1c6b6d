"""How a worker picks the way its engine cuts a long queue into microbatches when it heads a pipeline group:
lookahead under the KunServe cost model of a profile for exactly its model, dtype, layer range and device;
token chunking with engine.lookahead = false (the "kunserve-no-lookahead" ablation), without a profile, or
when none matches (with a reason saying why)."""

from __future__ import annotations

import pytest

from kunserve.services.worker.build import make_microbatch_former
from kunserve.shared.config import ConfigError, config_from_dict, load_config, validate
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.policy.microbatch import MicrobatchFormer
from kunserve.shared.profile_files import Profile, device_signature, write_profile

KUN = KunServeCostModel(1e-7, 1e-4, 1e-3, 2e-4)
ARGS = {"model": "kunserve-tiny", "dtype": "float32", "layers": (0, 4), "device": "cpu", "threads": 1}


def _config(**engine):
    cfg = config_from_dict({"engine": engine})
    validate(cfg)
    return cfg


def _write(path, layers=(0, 4)):
    write_profile(path, Profile(model="kunserve-tiny", dtype="float32", layers=layers, device=device_signature("cpu", 1),
                                kunserve=KUN, conserve=ConServeLatencyModel(1e-4, 1e-7, 0.0, 1e-6, 3e-3), fit={},
                                samples=[]))


def test_lookahead_is_on_by_default_and_uses_the_matching_profile(tmp_path):
    assert _config().engine.lookahead is True
    path = tmp_path / "p.json"
    _write(path)
    former, why = make_microbatch_former(_config(profile=str(path)), **ARGS)
    assert former == MicrobatchFormer(KUN) and why.startswith("lookahead")


def test_lookahead_off_is_token_chunking_whatever_the_profile(tmp_path):
    path = tmp_path / "p.json"
    _write(path)
    former, why = make_microbatch_former(_config(profile=str(path), lookahead=False), **ARGS)
    assert former == MicrobatchFormer(None, lookahead=False) and "engine.lookahead = false" in why


@pytest.mark.parametrize("case", ["no-profile", "missing-file", "other-layers"])
def test_without_a_matching_profile_the_head_chunks_by_tokens(tmp_path, case):
    path = tmp_path / "p.json"
    if case == "other-layers":
        _write(path, layers=(0, 2))
    cfg = _config() if case == "no-profile" else _config(profile=str(path))
    former, why = make_microbatch_former(cfg, **ARGS)
    assert former.model is None and former.lookahead and "token chunking" in why
    assert why.startswith("fallback") == (case != "no-profile")


def test_the_switch_comes_from_the_file_or_the_environment():
    assert config_from_dict({"engine": {"lookahead": False}}).engine.lookahead is False
    assert load_config(None, environ={"KUNSERVE__ENGINE__LOOKAHEAD": "false"}).engine.lookahead is False
    with pytest.raises(ConfigError, match="lookahead"):
        config_from_dict({"engine": {"lookahead": "sometimes"}})
