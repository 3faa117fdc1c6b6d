"""`kunserve-monitor`: the monitor process."""

from __future__ import annotations


from kunserve.services.common import load_service_config, service_arg_parser
from kunserve.services.monitor.servicer import MonitorServicer
from kunserve.shared import rpc
from kunserve.v1 import monitor_pb2_grpc


def main(argv: list[str] | None = None) -> None:
    parser = service_arg_parser("kunserve-monitor", "Collects worker stats and serves cluster status.")
    args = parser.parse_args(argv)
    cfg, log = load_service_config(args, "monitor", section="monitor")
    servicer = MonitorServicer(stale_after_s=cfg.monitor.stale_after_s)

    def register(server) -> None:
        monitor_pb2_grpc.add_MonitorServicer_to_server(servicer, server)

    rpc.run(lambda: rpc.run_service("kunserve.v1.Monitor", cfg.monitor.bind_address, register))


if __name__ == "__main__":
    main()
