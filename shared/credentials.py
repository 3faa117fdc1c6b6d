"""Where the cluster's credentials come from: one lookup for every service and tool.

Three tokens (each a file with one line, or an environment variable):

- the cluster secret: every internal RPC (worker, monitor, memory manager) and the UCX transfer handshake;
- the admin token: kunctl on the admin port (the memory manager's Admin service and its
  GetLayout / PlanDrop / Drop / Restore / Migrate);
- the API key: clients' Generate / Cancel on the dispatcher, only when one is configured (otherwise the
  client API is open, as on a local `kunserve up`).

Lookup, first found wins: an explicit file (a tool's `--token-file`), the environment variable, the
config's `[security] *_file` path, the default file under $KUNSERVE_HOME (default ~/.kunserve) that
`kunserve up` writes. LocalCluster writes its own files into its run dir and names them in the config it
hands the services, so its clusters never touch the default files.
"""

from __future__ import annotations

import os
import pathlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from kunserve.shared.config import ClusterConfig, ConfigError, SecuritySection
from kunserve.shared.rpc import TLS, AuthRule, Credential

HOME_ENV = "KUNSERVE_HOME"
MIN_TOKEN_CHARS = 16


class CredentialError(ConfigError):
    """A credential is missing, unreadable or too short; the message names where it was looked for."""


@dataclass(frozen=True)
class Kind:
    name: str          # what messages call it
    env: str           # environment variable holding the token itself
    config_key: str    # [security] key holding the path of a file with it
    default_file: str  # file name under $KUNSERVE_HOME; "" = no default (the API key)


CLUSTER_SECRET = Kind("cluster secret", "KUNSERVE_CLUSTER_SECRET", "cluster_secret_file", "cluster-secret")
ADMIN_TOKEN = Kind("admin token", "KUNSERVE_ADMIN_TOKEN", "admin_token_file", "admin-token")
API_KEY = Kind("API key", "KUNSERVE_API_KEY", "api_key_file", "")
KINDS = (CLUSTER_SECRET, ADMIN_TOKEN, API_KEY)


def kunserve_home(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    environ = os.environ if environ is None else environ
    return pathlib.Path(environ.get(HOME_ENV) or pathlib.Path.home() / ".kunserve")


def default_path(kind: Kind, environ: Mapping[str, str] | None = None) -> pathlib.Path | None:
    return kunserve_home(environ) / kind.default_file if kind.default_file else None


def _check(token: str, kind: Kind, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise CredentialError(f"{where}: the {kind.name} must be at least {MIN_TOKEN_CHARS} characters "
                              f"(got {len(token)}); generate one with `openssl rand -hex 32`")
    return token


def read_token(path: str | os.PathLike[str], kind: Kind) -> str:
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CredentialError(f"{kind.name} file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialError(f"{kind.name} file {p}: {getattr(exc, 'strerror', None) or exc}") from None
    return _check(text, kind, f"{kind.name} file {p}")


def find(kind: Kind, security: SecuritySection, environ: Mapping[str, str] | None = None,
         token_file: str | None = None) -> str | None:
    """The token of `kind` by the lookup order of the module docstring; None when nowhere."""
    environ = os.environ if environ is None else environ
    if token_file:
        return read_token(token_file, kind)
    if environ.get(kind.env):
        return _check(environ[kind.env], kind, f"environment {kind.env}")
    configured = getattr(security, kind.config_key)
    if configured:
        return read_token(configured, kind)
    default = default_path(kind, environ)
    if default is not None and default.exists():
        return read_token(default, kind)
    return None


def require(kind: Kind, security: SecuritySection, environ: Mapping[str, str] | None = None,
            token_file: str | None = None) -> str:
    token = find(kind, security, environ, token_file)
    if token is None:
        default = default_path(kind, environ)
        raise CredentialError(f"no {kind.name}: set [security] {kind.config_key} in the config, ${kind.env}, or "
                              f"create {default} (`kunserve up` writes it)")
    return token


def new_token() -> str:
    return secrets.token_hex(32)


def write_token(path: str | os.PathLike[str], token: str | None = None) -> str:
    """Write a (new) token to a file readable by its owner only; the file must not exist yet."""
    token = token or new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def ensure_default(kind: Kind, environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """The default file of `kind`, created with a new token (directory 0700, file 0600) if missing.
    Only `kunserve up` calls this: the default location belongs to the user."""
    path = default_path(kind, environ)
    assert path is not None, f"the {kind.name} has no default file"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        write_token(path)
    except FileExistsError:
        read_token(path, kind)  # an existing file must be usable
    return path


def load_tls(security: SecuritySection) -> TLS | None:
    """The TLS material the config names, read now so a bad path fails at start naming the key."""
    if not security.tls_cert_file:
        return None

    def read(key: str) -> bytes | None:
        path = getattr(security, key)
        if not path:
            return None
        try:
            return pathlib.Path(path).read_bytes()
        except OSError as exc:
            raise CredentialError(f"security.{key}: cannot read {path}: {exc.strerror or exc}") from None

    cert_chain, private_key = read("tls_cert_file"), read("tls_key_file")
    if cert_chain is None or private_key is None:
        raise CredentialError("security.tls_cert_file is set, so security.tls_key_file must be too")
    return TLS(cert_chain=cert_chain, private_key=private_key, root_certs=read("tls_ca_file"),
               client_cert_chain=read("tls_client_cert_file"), client_private_key=read("tls_client_key_file"))


@dataclass(frozen=True)
class ServiceCredentials:
    """What one service process needs: the cluster secret (its channels and its server), the admin token
    (the memory manager), the API key (the dispatcher, when configured) and TLS."""

    cluster_secret: str
    admin_token: str | None = None
    api_key: str | None = None
    tls: TLS | None = None

    def internal(self) -> Credential:
        return Credential(CLUSTER_SECRET.name, self.cluster_secret)


def service_credentials(cfg: ClusterConfig, *, admin: bool = False, api_key: bool = False,
                        environ: Mapping[str, str] | None = None) -> ServiceCredentials:
    sec = cfg.security
    return ServiceCredentials(
        cluster_secret=require(CLUSTER_SECRET, sec, environ),
        admin_token=require(ADMIN_TOKEN, sec, environ) if admin else None,
        api_key=find(API_KEY, sec, environ) if api_key else None,
        tls=load_tls(sec))


# -- which method needs which credential -------------------------------------------------------------------
def internal_rules(creds: ServiceCredentials) -> list[AuthRule]:
    """Workers and the monitor: every method needs the cluster secret."""
    return [AuthRule("", (creds.internal(),))]


def memory_manager_rules(creds: ServiceCredentials) -> list[AuthRule]:
    """The admin port: the Admin and MemoryManager services take the admin token (kunctl) or the cluster
    secret (the monitor's automatic drops, services)."""
    assert creds.admin_token is not None
    return [AuthRule("", (creds.internal(), Credential(ADMIN_TOKEN.name, creds.admin_token)))]


def dispatcher_rules(creds: ServiceCredentials) -> list[AuthRule]:
    """The client API: open, unless an API key is configured."""
    return [AuthRule("", (Credential(API_KEY.name, creds.api_key),) if creds.api_key else ())]
