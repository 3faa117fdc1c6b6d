"""`kunserve-monitor`: the monitor process."""

from __future__ import annotations

import asyncio
import time

from kunserve.services.common import load_service_config, load_service_credentials, service_arg_parser
from kunserve.services.monitor.metrics import monitor_families
from kunserve.services.monitor.servicer import GrpcMemoryManager, MonitorServicer, OverloadController, overload_config_from
from kunserve.shared import rpc
from kunserve.shared.credentials import internal_rules
from kunserve.shared.metrics import Lazy, MetricsServer, new_registry, serve_metrics
from kunserve.shared.policy.overload_policies import overload_handling
from kunserve.v1 import monitor_pb2_grpc


def main(argv: list[str] | None = None) -> None:
    parser = service_arg_parser("kunserve-monitor", "Collects worker stats, serves cluster status and (monitor.auto_drop) "
                                                    "asks the memory manager to drop on overload / restore on underload.")
    args = parser.parse_args(argv)
    cfg, log = load_service_config(args, "monitor", section="monitor")
    creds = load_service_credentials(cfg, "monitor")

    async def amain() -> None:
        ttft_slo_s = cfg.slo.ttft_ms / 1000.0  # queue time beyond the TTFT SLO counts as overload
        servicer = MonitorServicer(stale_after_s=cfg.monitor.stale_after_s, max_head_wait_s=ttft_slo_s,
                                   seeds=[w.id for w in cfg.workers])
        tasks: list[asyncio.Task] = []
        controller: OverloadController | None = None
        action = overload_handling(cfg.policy.overload).monitor_action
        if cfg.monitor.auto_drop and action is not None:
            controller = OverloadController(servicer.load, GrpcMemoryManager(cfg.memory_manager.address),
                                            overload_config_from(cfg.monitor, ttft_slo_s),
                                            interval_s=cfg.monitor.policy_interval_s, mode=action)
        else:
            log.info("auto_drop_disabled", policy=cfg.policy.overload, auto_drop=cfg.monitor.auto_drop)
        registry = new_registry()
        registry.register(Lazy(lambda: monitor_families(servicer.load.status(time.monotonic(), time.time()),
                                                        controller.counters if controller is not None else None)))
        metrics: MetricsServer | None = None

        def register(server) -> None:
            monitor_pb2_grpc.add_MonitorServicer_to_server(servicer, server)

        async def started() -> None:
            nonlocal metrics
            metrics = await serve_metrics(registry, cfg.monitor.metrics_bind, "monitor.metrics_port")
            if controller is not None:
                controller.start()
            tasks.append(asyncio.create_task(servicer.follow_layout_forever(cfg.memory_manager.address)))

        async def stopping() -> None:
            for t in tasks:
                t.cancel()
            if controller is not None:
                await controller.stop()
            if metrics is not None:
                await metrics.stop()

        await rpc.run_service("kunserve.v1.Monitor", cfg.monitor.bind_address, register,
                              on_started=started, on_shutdown=stopping, auth=internal_rules(creds),
                              tls=creds.tls, require_client_cert=creds.tls is not None and creds.tls.mutual)

    rpc.run(amain)


if __name__ == "__main__":
    main()
