"""memory_manager.tp_mode in the cluster config: "cold" by default, "in-place" accepted from the file and the
environment, anything else refused with the choices named."""

from __future__ import annotations

import pytest

from kunserve.shared.config import ConfigError, config_from_dict, load_config, validate


def test_cold_is_the_default_and_in_place_loads(tmp_path):
    assert load_config(None, environ={}).memory_manager.tp_mode == "cold"
    path = tmp_path / "c.toml"
    path.write_text('[memory_manager]\ntp_mode = "in-place"\n')
    cfg = load_config(path, environ={})
    assert cfg.memory_manager.tp_mode == "in-place"
    again = tmp_path / "again.toml"  # travels to the children with the rest of the config
    again.write_text(cfg.to_toml())
    assert load_config(again, environ={}).memory_manager.tp_mode == "in-place"
    assert load_config(None, environ={"KUNSERVE__MEMORY_MANAGER__TP_MODE": "in-place"}).memory_manager.tp_mode == "in-place"


@pytest.mark.parametrize("mode", ["bogus", "", "In-Place", "in_place"])
def test_another_mode_is_refused_naming_the_choices(mode):
    cfg = config_from_dict({"memory_manager": {"tp_mode": mode}}, source="c.toml")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == f"c.toml: memory_manager.tp_mode must be one of cold, in-place, got {mode!r}"
