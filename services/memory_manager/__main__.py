"""`kunserve-memory-manager`: the global memory manager, which also serves the admin port."""

from __future__ import annotations

import asyncio

from kunserve.services.common import load_service_config, load_service_credentials, service_arg_parser
from kunserve.services.memory_manager.autoscaler import Autoscaler
from kunserve.services.memory_manager.scalers import ScalerError, make_scaler
from kunserve.services.memory_manager.servicer import AdminServicer, MemoryManager, MemoryManagerServicer
from kunserve.shared import rpc
from kunserve.shared.credentials import memory_manager_rules
from kunserve.shared.metrics import MetricsServer, serve_metrics
from kunserve.shared.policy.overload_policies import overload_handling
from kunserve.v1 import admin_pb2_grpc, memory_manager_pb2_grpc


def main(argv: list[str] | None = None) -> None:
    parser = service_arg_parser("kunserve-memory-manager", "Cluster parameter layout and the admin API.")
    args = parser.parse_args(argv)
    cfg, log = load_service_config(args, "memory-manager", section="memory_manager")
    creds = load_service_credentials(cfg, "memory-manager", admin=True)

    async def amain() -> None:
        mm = MemoryManager(cfg)
        tasks: list[asyncio.Task] = []
        try:
            scaler = make_scaler(cfg.autoscale, mm)
        except ScalerError as exc:  # the cluster serves without autoscaling
            log.error("autoscaler_unavailable", scaler=cfg.autoscale.scaler, code=exc.code, error=str(exc))
            scaler = None
        if scaler is not None:
            mm.autoscaler = Autoscaler(mm, scaler, cfg.autoscale)
        metrics: MetricsServer | None = None

        def register(server) -> None:
            memory_manager_pb2_grpc.add_MemoryManagerServicer_to_server(MemoryManagerServicer(mm), server)
            admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(mm), server)

        async def started() -> None:
            nonlocal metrics
            metrics = await serve_metrics(mm.registry, cfg.memory_manager.metrics_bind, "memory_manager.metrics_port")
            tasks.append(asyncio.create_task(mm.refresh_forever()))
            if mm.autoscaler is not None:
                tasks.append(asyncio.create_task(mm.autoscaler.run_forever()))
            if mm.tp_placer.idle_split.idle_s > 0:  # dispatcher.elastic_tp: merged instances go back when idle
                tasks.append(asyncio.create_task(mm.tp_placer.split_idle_forever()))
            if overload_handling(cfg.policy.overload).static_pairs:
                # The static pipeline-parallel baseline: pairs hold half the layers each from the start.
                # Formed before this service reports SERVING, so a started cluster is already in that layout.
                await mm.orchestrator.form_static_pairs(timeout_s=cfg.memory_manager.transition_timeout_s)

        async def stopping() -> None:
            for t in tasks:
                t.cancel()
            if metrics is not None:
                await metrics.stop()
            await mm.close()

        await rpc.run_service("kunserve.v1.MemoryManager", cfg.memory_manager.bind_address, register,
                              on_started=started, on_shutdown=stopping, auth=memory_manager_rules(creds),
                              tls=creds.tls, require_client_cert=creds.tls is not None and creds.tls.mutual)

    rpc.run(amain)


if __name__ == "__main__":
    main()
