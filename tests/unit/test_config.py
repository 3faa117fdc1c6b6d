import pytest

from kunserve.shared.config import ConfigError, config_from_dict, load_config


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_shipped_config_loads(repo_root):
    cfg = load_config(repo_root / "configs" / "cluster.toml", environ={})
    assert [w.id for w in cfg.workers] == ["worker-0", "worker-1"]
    assert cfg.dispatcher.port == 50051 and cfg.engine.block_size == 16


def test_defaults_without_file():
    cfg = load_config(None, environ={})
    assert len(cfg.workers) == 2 and cfg.source == "<defaults>"


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, environ={})
    cfg.model.path = 'C:\\odd "path"'
    cfg.workers[1].port = 6001
    again = load_config(write(tmp_path, cfg.to_toml()), environ={})
    assert again.model.path == cfg.model.path and again.workers[1].port == 6001


def test_env_overrides(tmp_path):
    env = {"KUNSERVE__DISPATCHER__PORT": "6000", "KUNSERVE__WORKERS__1__HOST": "worker-1",
           "KUNSERVE__ENGINE__POOL_MIB": "64"}
    cfg = load_config(None, environ=env)
    assert cfg.dispatcher.port == 6000 and cfg.workers[1].host == "worker-1" and cfg.engine.pool_mib == 64


def test_env_config_path(tmp_path):
    p = write(tmp_path, "[dispatcher]\nport = 7000\n")
    assert load_config(None, environ={"KUNSERVE_CONFIG": str(p)}).dispatcher.port == 7000


@pytest.mark.parametrize("text, needle", [
    ("[dispatcher]\nport = 'abc'\n", "dispatcher.port: expected an integer"),
    ("[dispatcher]\nprot = 1\n", "dispatcher.prot: unknown key"),
    ("[nonsense]\nx = 1\n", "unknown section [nonsense]"),
    ("[engine]\nblock_size = 0\n", "engine.block_size must be > 0"),
    ("[model]\ndtype = 'int3'\n", "model.dtype"),
    ("this is not toml", "not valid TOML"),
    ("[[workers]]\nid='a'\nport=1\n[[workers]]\nid='a'\nport=2\n", "used twice"),
])
def test_malformed_config_names_the_field(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), environ={})
    assert needle in str(e.value)


def test_missing_file_and_bad_env():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/cluster.toml", environ={})
    with pytest.raises(ConfigError, match="worker index 5"):
        load_config(None, environ={"KUNSERVE__WORKERS__5__PORT": "1"})
    with pytest.raises(ConfigError, match="expected true/false|expected an integer"):
        load_config(None, environ={"KUNSERVE__ENGINE__THREADS": "many"})


def test_unknown_worker_id():
    cfg = config_from_dict({})
    with pytest.raises(ConfigError, match="no worker with id 'nope'"):
        cfg.worker("nope")
