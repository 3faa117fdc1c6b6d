"""The [security] section and where credentials come from (shared/credentials.py), and epoch bounds."""

from __future__ import annotations

import os

import pytest

from kunserve.shared import credentials
from kunserve.shared.config import ConfigError, SecuritySection, load_config
from kunserve.shared.epochs import MAX_EPOCH, MAX_STEP, epoch_error

TOKEN = "0123456789abcdef0123456789abcdef"


def test_shipped_security_section_equals_the_defaults(repo_root):
    shipped = load_config(repo_root / "configs" / "cluster.toml", environ={}).security
    assert shipped == SecuritySection() == load_config(None, environ={}).security


def test_security_keys_parse_and_tls_files_come_in_pairs(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[security]\ncluster_secret_file = "/run/secrets/s"\n')
    assert load_config(p, environ={}).security.cluster_secret_file == "/run/secrets/s"
    env = {"KUNSERVE__SECURITY__ADMIN_TOKEN_FILE": "/x/admin"}
    assert load_config(None, environ=env).security.admin_token_file == "/x/admin"
    for text, msg in (('tls_cert_file = "c.pem"', "tls_key_file must be set together"),
                      ('tls_client_cert_file = "c.pem"\ntls_client_key_file = "k.pem"', "needs security.tls_cert_file"),
                      ('secret = "x"', "unknown key")):
        p.write_text("[security]\n" + text + "\n")
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(p, environ={})
        assert str(p) in str(e.value) and "security" in str(e.value)


def test_lookup_order_flag_env_config_default(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    files = {}
    for name in ("flag", "config", "default"):
        files[name] = tmp_path / name
        files[name].write_text(f"{name}-{TOKEN}\n")
    (home / "admin-token").write_text(f"default-{TOKEN}")
    sec = SecuritySection(admin_token_file=str(files["config"]))
    env = {"KUNSERVE_HOME": str(home), "KUNSERVE_ADMIN_TOKEN": f"env-{TOKEN}"}
    kind = credentials.ADMIN_TOKEN
    assert credentials.find(kind, sec, env, token_file=str(files["flag"])) == f"flag-{TOKEN}"
    assert credentials.find(kind, sec, env) == f"env-{TOKEN}"
    env.pop("KUNSERVE_ADMIN_TOKEN")
    assert credentials.find(kind, sec, env) == f"config-{TOKEN}"
    assert credentials.find(kind, SecuritySection(), env) == f"default-{TOKEN}"
    assert credentials.find(kind, SecuritySection(), {"KUNSERVE_HOME": str(tmp_path / "none")}) is None
    assert credentials.find(credentials.API_KEY, SecuritySection(), env) is None  # no default: the API is open
    with pytest.raises(credentials.CredentialError, match="no admin token.*admin_token_file.*KUNSERVE_ADMIN_TOKEN"):
        credentials.require(kind, SecuritySection(), {"KUNSERVE_HOME": str(tmp_path / "none")})


def test_unusable_credentials_are_errors_naming_where(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc")
    kind = credentials.CLUSTER_SECRET
    with pytest.raises(credentials.CredentialError, match=f"cluster secret file {short}.*at least 16"):
        credentials.read_token(short, kind)
    with pytest.raises(credentials.CredentialError, match="does not exist"):
        credentials.read_token(tmp_path / "missing", kind)
    with pytest.raises(credentials.CredentialError, match="environment KUNSERVE_CLUSTER_SECRET"):
        credentials.find(kind, SecuritySection(), {"KUNSERVE_CLUSTER_SECRET": "short"})
    with pytest.raises(credentials.CredentialError, match="security.tls_cert_file"):
        credentials.load_tls(SecuritySection(tls_cert_file=str(tmp_path / "no.pem"), tls_key_file="k"))


def test_default_files_are_private_and_kept(tmp_path):
    env = {"KUNSERVE_HOME": str(tmp_path / "home")}
    path = credentials.ensure_default(credentials.CLUSTER_SECRET, env)
    token = credentials.read_token(path, credentials.CLUSTER_SECRET)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert credentials.ensure_default(credentials.CLUSTER_SECRET, env) == path  # a second `kunserve up` reuses it
    assert credentials.read_token(path, credentials.CLUSTER_SECRET) == token


def test_local_cluster_writes_its_own_credentials_into_its_run_dir(tmp_path, monkeypatch):
    from helpers import make_config

    from kunserve.cli.launcher import LocalCluster

    monkeypatch.setenv("KUNSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KUNSERVE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("KUNSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.setenv("KUNSERVE_API_KEY", TOKEN)
    c = LocalCluster(make_config(1), run_dir=tmp_path / "run")
    c.write_credentials()
    sec = c.cfg.security
    for key in ("cluster_secret_file", "admin_token_file", "api_key_file"):
        path = getattr(sec, key)
        assert path.startswith(str(tmp_path / "run")) and os.stat(path).st_mode & 0o777 == 0o600
    assert credentials.read_token(sec.api_key_file, credentials.API_KEY) == TOKEN  # the env's, so tools agree
    assert not (tmp_path / "home").exists()  # the user's default files are untouched
    assert "KUNSERVE_API_KEY" not in c._child_env()  # the written config is the one truth


def test_epoch_bounds():
    assert epoch_error(5, 4) is None and epoch_error(4 + MAX_STEP, 4) is None
    assert "must be > 0" in epoch_error(0, 0)
    assert "2**62" in epoch_error(2**64 - 1, 3) and epoch_error(MAX_EPOCH, MAX_EPOCH - 1).startswith("epoch:")
    assert "ahead" in epoch_error(5 + MAX_STEP, 4)
    assert epoch_error(3, 4) is None  # not newer: the transition's own state check answers that
