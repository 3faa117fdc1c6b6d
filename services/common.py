"""Argument parsing and config loading shared by every service's entry point.

Every service takes `--config FILE` (or $KUNSERVE_CONFIG) plus `--host/--port/--bind` overrides, so
compose.yaml and the local launcher run the same console scripts with the same file.
"""

from __future__ import annotations

import argparse
import sys

import structlog

from kunserve.shared import rpc
from kunserve.shared.config import ClusterConfig, ConfigError, ServiceSection, load_config
from kunserve.shared.credentials import CredentialError, ServiceCredentials, service_credentials
from kunserve.shared.log import configure_logging
from kunserve.shared.process import die_with_parent_if_asked


def service_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", help="cluster config file (TOML); default $KUNSERVE_CONFIG or built-in defaults")
    p.add_argument("--host", help="override the address peers use to reach this service")
    p.add_argument("--port", type=int, help="override the port to listen on")
    p.add_argument("--bind", help="override the address to listen on (e.g. 0.0.0.0 in containers)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], help="override logging.format")
    return p


def load_service_config(args: argparse.Namespace, service: str, *, section: str | None = None,
                        worker_id: str | None = None) -> tuple[ClusterConfig, structlog.BoundLogger]:
    """Load config, apply this service's flag overrides, set up logging; exit with a one-line error."""
    die_with_parent_if_asked()
    try:
        cfg = load_config(args.config)
        target: ServiceSection = cfg.worker(worker_id) if worker_id is not None else getattr(cfg, section or service)
    except ConfigError as exc:
        print(f"{service}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.host:
        target.host = args.host
    if args.port is not None:
        target.port = args.port
    if args.bind:
        target.bind = args.bind
    if args.log_format:
        cfg.logging.format = args.log_format
    context = {"worker": worker_id} if worker_id else {}
    log = configure_logging(service, fmt=cfg.logging.format, level=cfg.logging.level, **context)
    return cfg, log


def load_service_credentials(cfg: ClusterConfig, service: str, *, admin: bool = False,
                             api_key: bool = False) -> ServiceCredentials:
    """This service's credentials (exit with a one-line error when one is missing); its channels carry
    the cluster secret and the cluster TLS from here on."""
    try:
        creds = service_credentials(cfg, admin=admin, api_key=api_key)
    except CredentialError as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    rpc.configure_client(creds.cluster_secret, creds.tls)
    return creds
