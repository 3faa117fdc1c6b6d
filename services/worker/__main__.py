"""`kunserve-worker --worker-id ID`: one worker process (one per GPU; on CPU one per process)."""

from __future__ import annotations

import asyncio
import os
import sys

from kunserve.services.common import load_service_config, load_service_credentials, service_arg_parser
from kunserve.services.worker.build import WorkerBuildError, build_worker
from kunserve.services.worker.metrics import IterationMetrics, worker_families
from kunserve.services.worker.reporter import report_stats_forever
from kunserve.services.worker.servicer import WorkerServicer
from kunserve.shared import rpc
from kunserve.shared.credentials import internal_rules
from kunserve.shared.faults import fault_armed
from kunserve.shared.metrics import Lazy, MetricsServer, new_registry, serve_metrics
from kunserve.shared.transfer.service import TransferService
from kunserve.v1 import worker_pb2_grpc

ENGINE_STUCK_S = 120.0


def main(argv: list[str] | None = None) -> None:
    parser = service_arg_parser("kunserve-worker", "A worker: holds a layer range of the model and runs the engine.")
    parser.add_argument("--worker-id", default=os.environ.get("KUNSERVE_WORKER_ID"),
                        help="which [[workers]] entry of the config this process is (or $KUNSERVE_WORKER_ID)")
    args = parser.parse_args(argv)
    if not args.worker_id:
        parser.error("--worker-id is required (or set KUNSERVE_WORKER_ID)")
    cfg, log = load_service_config(args, "worker", worker_id=args.worker_id)
    creds = load_service_credentials(cfg, f"worker {args.worker_id}")
    try:
        engine_loop, instance, identity = build_worker(cfg, args.worker_id)
    except WorkerBuildError as exc:
        print(f"worker {args.worker_id}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    log.info("model_loaded", model=identity.model_name, layers=list(instance.layer_range),
             kv_blocks=engine_loop.stats().kv_blocks_total, device=identity.device, memory=repr(instance.layout))
    if fault_armed("engine_fails", args.worker_id):  # fault injection (tests): every forward pass raises
        def failing_forward(*_args, **_kwargs):
            raise RuntimeError("injected engine fault")

        engine_loop.engine.runner.forward = failing_forward  # type: ignore[method-assign]

    # NOT_SERVING once the engine died, or while one iteration has run far longer than any should (hung without
    # raising: a group head waits at most transition_timeout_s for a stage's result before it heals)
    stuck_s = max(ENGINE_STUCK_S, 2 * cfg.memory_manager.transition_timeout_s)
    registry = new_registry()
    engine_loop.engine.on_schedule = IterationMetrics(registry, args.worker_id).scheduled

    async def amain() -> None:
        wsec = cfg.worker(args.worker_id)
        # Links only from the configured workers, each proving it holds the cluster secret.
        svc = TransferService(args.worker_id, host=wsec.host, secret=creds.cluster_secret.encode(),
                              members=[w.id for w in cfg.workers])
        transfer: TransferService | None = svc
        try:
            await svc.start(wsec.transfer_port)
        except Exception as exc:  # no UCX here: the worker still serves, but cannot join pipeline groups
            log.error("transfer_service_unavailable", error=f"{type(exc).__name__}: {exc}")
            transfer = None
        servicer = WorkerServicer(identity, engine_loop, instance, transfer,
                                  cfg.memory_manager.transition_timeout_s)
        tasks: list[asyncio.Task] = []
        registry.register(Lazy(lambda: worker_families(servicer.current_stats())))
        metrics: MetricsServer | None = None

        def register(server) -> None:
            worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)

        async def started() -> None:
            nonlocal metrics
            index = [w.id for w in cfg.workers].index(args.worker_id)
            metrics = await serve_metrics(registry, wsec.metrics_bind, f"workers[{index}].metrics_port")
            engine_loop.start()
            if servicer.transitions is not None and cfg.engine.warm_staging:
                tasks.append(asyncio.create_task(servicer.transitions.keep_staging_warm()))
            tasks.append(asyncio.create_task(report_stats_forever(
                cfg.monitor.address, cfg.monitor.stats_interval_s, servicer.current_stats)))

        async def stopping() -> None:
            for t in tasks:
                t.cancel()
            if metrics is not None:
                await metrics.stop()
            await servicer.shutdown()
            if transfer is not None:
                await transfer.close()

        await rpc.run_service("kunserve.v1.Worker", wsec.bind_address, register, on_started=started,
                              on_shutdown=stopping, auth=internal_rules(creds), tls=creds.tls,
                              require_client_cert=creds.tls is not None and creds.tls.mutual,
                              alive=lambda: engine_loop.error is None and engine_loop.step_seconds() < stuck_s)

    rpc.run(amain)


if __name__ == "__main__":
    main()
