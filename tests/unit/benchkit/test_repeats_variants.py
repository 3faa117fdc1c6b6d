"""Repeated runs (interleaved schedule, median and range) and the kunserve ablation variants of `bench compare`."""

import math

import pytest

from kunserve.benchkit.repeats import schedule, spread
from kunserve.benchkit.variants import (
    POLICY_VARIANTS,
    Override,
    PolicyVariant,
    VariantUnavailable,
    apply_variant,
    base_policy,
    check_variant,
    missing_switches,
)
from kunserve.services.monitor.servicer import overload_config_from
from kunserve.shared.config import load_config
from kunserve.shared.policy.overload import OverloadPolicy, UnitLoad


def test_schedule_interleaves_and_rotates():
    assert schedule(["a", "b", "c"], 3) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert schedule(["a"], 2) == [["a"], ["a"]]
    rounds = schedule(["a", "b"], 5)
    assert all(sorted(r) == ["a", "b"] for r in rounds) and [r[0] for r in rounds] == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError):
        schedule(["a"], 0)


def test_spread():
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([1.0, 4.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 2}
    assert spread([None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_no_restore_is_real_and_survives_the_config_file(tmp_path):
    cfg = load_config(None, environ={})
    apply_variant(cfg, "kunserve-no-restore")
    assert cfg.policy.overload == "kunserve" and math.isinf(cfg.monitor.restore_hold_s)
    # the launcher hands the services cfg.to_toml(): the switch must parse back and pass validation
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    back = load_config(str(tmp_path / "c.toml"), environ={})
    assert math.isinf(back.monitor.restore_hold_s) and back.policy.overload == "kunserve"
    # and the monitor's policy then never restores a group, however long it idles below the threshold
    policy = OverloadPolicy(overload_config_from(back.monitor))
    idle = UnitLoad("w0+w1", used_blocks=1, total_blocks=500, undropped_total_blocks=200, members=2)
    assert {policy.observe(t, [idle]).action for t in (0.0, 60.0, 3600.0, 1e9)} == {"none"}
    plain = OverloadPolicy(overload_config_from(load_config(None, environ={}).monitor))
    assert {plain.observe(t, [idle]).action for t in (0.0, 60.0)} == {"none", "restore"}
    assert base_policy("kunserve-no-restore") == "kunserve" and base_policy("swap") == "swap"


def test_every_variant_runs_for_real_or_is_refused_by_name():
    for name, variant in POLICY_VARIANTS.items():
        cfg = load_config(None, environ={})
        missing = missing_switches(variant, cfg)
        if missing:
            with pytest.raises(VariantUnavailable, match=f"{name} needs the config switch {missing[0]}"):
                apply_variant(cfg, name)
            assert cfg.policy.overload == "kunserve"  # untouched: nothing half-applied
        else:
            apply_variant(cfg, name)
            for o in variant.overrides:
                assert getattr(getattr(cfg, o.section), o.key) == o.value
        assert variant.policy == "kunserve" and (name.startswith("kunserve-no-") if not variant.adds else
                                                 name.startswith("kunserve+"))


def test_a_missing_switch_is_named():
    cfg = load_config(None, environ={})
    ghost = PolicyVariant("kunserve-no-ghost", "kunserve",
                          (Override("engine", "ghost", False), Override("nowhere", "x", 1), Override("engine", "threads", 2)),
                          "ghosts")
    assert missing_switches(ghost, cfg) == ["engine.ghost", "nowhere.x"]
    assert "threads = 2" in ghost.describe()
    with pytest.raises(KeyError):
        check_variant("kunserve-no-ghost", cfg)  # not in the table
