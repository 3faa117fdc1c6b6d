"""Container HEALTHCHECK: ask this container's KunServe service for grpc.health.v1 SERVING.

One image runs every service, so the check finds out which one runs here: it reads the command line of
the `kunserve-*` process in this container (its --config/--port/--bind/--worker-id flags) and the cluster
config with the same environment overrides the service saw, and probes that service's port.

    python /opt/kunserve/healthcheck.py              # the service running in this container
    python /opt/kunserve/healthcheck.py HOST:PORT    # an explicit address (or $KUNSERVE_HEALTH_ADDRESS)

Exit 0 when SERVING, 1 otherwise (one line on stderr says why).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

SERVICES = {  # console script / module -> config section
    "kunserve-dispatcher": "dispatcher",
    "kunserve.services.dispatcher": "dispatcher",
    "kunserve-monitor": "monitor",
    "kunserve.services.monitor": "monitor",
    "kunserve-memory-manager": "memory_manager",
    "kunserve.services.memory_manager": "memory_manager",
    "kunserve-worker": "worker",
    "kunserve.services.worker": "worker",
}
WILDCARDS = ("", "0.0.0.0", "::", "[::]")
TIMEOUT_S = 3.0


def find_service(proc_root: str = "/proc") -> tuple[str, list[str]] | None:
    """(config section, the service's arguments) of the KunServe service process in this container."""
    me = os.getpid()
    for proc in sorted(pathlib.Path(proc_root).iterdir(), key=lambda p: (len(p.name), p.name)):
        if not proc.name.isdigit() or int(proc.name) == me:
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        for i, arg in enumerate(argv[:3]):
            section = SERVICES.get(os.path.basename(arg))
            if section is None and arg == "-m" and i + 1 < len(argv):
                section = SERVICES.get(argv[i + 1].removesuffix(".__main__"))
                i += 1
            if section is not None:
                return section, argv[i + 1:]
    return None


def tls_credentials():
    """The cluster's TLS from the config the services read (None: plaintext); health needs no token."""
    import grpc

    from kunserve.shared.config import load_config
    from kunserve.shared.credentials import load_tls

    tls = load_tls(load_config(None).security)
    if tls is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=tls.root_certs, private_key=tls.client_private_key,
                                        certificate_chain=tls.client_cert_chain)


def service_address() -> str:
    found = find_service()
    if found is None:
        raise LookupError("no kunserve-* service process runs in this container")
    section, args = found
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--config", "--host", "--bind", "--worker-id"):
        parser.add_argument(flag)
    parser.add_argument("--port", type=int)
    ns, _ = parser.parse_known_args(args)

    from kunserve.shared.config import load_config

    cfg = load_config(ns.config)
    if section == "worker":
        svc = cfg.worker(ns.worker_id or os.environ.get("KUNSERVE_WORKER_ID", ""))
    else:
        svc = getattr(cfg, section)
    port = ns.port if ns.port is not None else svc.port
    bind = ns.bind if ns.bind is not None else svc.bind
    host = ns.host or svc.host
    # A wildcard bind answers on loopback; otherwise probe the address the service listens on.
    probe = "127.0.0.1" if bind in WILDCARDS[1:] else (bind or host)
    return f"{probe}:{port}"


def main(argv: list[str]) -> int:
    try:
        address = argv[1] if len(argv) > 1 else os.environ.get("KUNSERVE_HEALTH_ADDRESS") or service_address()
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", reported in one line
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        creds = tls_credentials()
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", reported in one line
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    try:
        with (grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        print(f"healthcheck: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"healthcheck: {address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
