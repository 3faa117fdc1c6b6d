"""`kunserve-worker --worker-id ID`: one worker process (one per GPU; on CPU one per process).

A worker whose id is one of the config's ``[[workers]]`` is a seed; any other id joins the cluster at run time
(README "Discovery and autoscaling"): its address and ports come from its flags, ``$KUNSERVE_WORKER_HOST``, or the
first ``[[workers]]`` entry (on Kubernetes every pod of the StatefulSet shares one template), and it serves once the
memory manager has accepted it. ``--standby`` loads the model and waits for the local scaler to activate it.
``--tp-members`` (with ``--tp-rank``, ``--tp-port``, ``--tp-host``) overrides the config's tensor-parallel
membership: the memory manager's cold re-form re-executes the worker with them (README "Elastic tensor parallelism
(Gyges)").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time

import structlog

from kunserve.services.common import load_service_config, load_service_credentials, service_arg_parser
from kunserve.services.worker.build import WorkerBuildError, build_worker
from kunserve.services.worker.cluster_membership import ClusterMembership, MembershipRefused
from kunserve.services.worker.metrics import IterationMetrics, worker_families
from kunserve.services.worker.reporter import report_stats_forever
from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.services.worker.tp_member import EXIT_BROKEN, TPArgs, TPMembership, reexec, reform_argv
from kunserve.shared import rpc
from kunserve.shared.config import ClusterConfig, ConfigError, WorkerSection, load_config
from kunserve.shared.credentials import internal_rules
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.faults import fault_armed
from kunserve.shared.log import configure_logging
from kunserve.shared.metrics import Lazy, MetricsServer, new_registry, serve_metrics
from kunserve.shared.model.fingerprint import model_fingerprint
from kunserve.shared.process import die_with_parent_if_asked
from kunserve.shared.transfer.service import TransferService
from kunserve.v1 import worker_pb2_grpc

ENGINE_STUCK_S = 120.0
TRANSFER_RETRY_S = 120.0  # how long a busy transfer port is tried again (TCP's TIME_WAIT is 60 s on Linux)
HOST_ENV = "KUNSERVE_WORKER_HOST"  # the address other services reach a joining worker at (Kubernetes: its DNS name)


def joining_section(cfg: ClusterConfig, worker_id: str, args: argparse.Namespace,
                    environ: dict[str, str] | os._Environ[str] = os.environ) -> WorkerSection:
    """The [[workers]] entry of a worker the config does not list: the first entry's ports and bind (one template),
    its own id, and its host from --host, $KUNSERVE_WORKER_HOST or the first entry's."""
    template = cfg.workers[0]
    return WorkerSection(
        id=worker_id, host=args.host or environ.get(HOST_ENV) or template.host,
        port=args.port if args.port is not None else template.port, bind=args.bind or template.bind,
        metrics_port=args.metrics_port if args.metrics_port is not None else template.metrics_port,
        transfer_port=args.transfer_port if args.transfer_port is not None else template.transfer_port)


def load_worker_config(args: argparse.Namespace) -> tuple[ClusterConfig, structlog.BoundLogger, bool]:
    """(config, logger, seed): a configured worker's config as every service loads it; for any other id the config
    with this worker's entry added (a joining or standby worker)."""
    configured: list[str] = []
    try:
        configured = [w.id for w in load_config(args.config).workers]
    except ConfigError:
        pass  # load_service_config reports it
    if not configured or args.worker_id in configured:
        if args.standby:
            print(f"worker {args.worker_id}: --standby needs an id the config does not list (a configured worker "
                  "is a seed: it always serves)", file=sys.stderr)
            raise SystemExit(2)
        cfg, log = load_service_config(args, "worker", worker_id=args.worker_id)
        return cfg, log, True
    die_with_parent_if_asked()
    cfg = load_config(args.config)
    cfg.workers.append(joining_section(cfg, args.worker_id, args))
    if args.log_format:
        cfg.logging.format = args.log_format
    log = configure_logging("worker", fmt=cfg.logging.format, level=cfg.logging.level, worker=args.worker_id)
    return cfg, log, False


def tp_args(args: argparse.Namespace) -> TPArgs | None:
    """The runtime tensor-parallel membership the --tp-* flags give (None: the config's)."""
    if args.tp_members is None:
        return None
    return TPArgs(tuple(m.strip() for m in args.tp_members.split(",")), args.tp_rank, args.tp_port, args.tp_host or "",
                  args.tp_rendezvous_timeout)


def build_or_fall_back(cfg: ClusterConfig, worker_id: str, runtime: TPArgs | None,
                       log: structlog.BoundLogger) -> tuple[EngineLoop, PooledInstance, WorkerIdentity, TPMembership | None]:
    """build_worker; a runtime tensor-parallel membership that cannot form (a member never came, the rendezvous port
    was taken) falls back to a whole instance, so that a failed re-form heals without a supervisor.

    The fallback is built outside the except block: the failure's traceback holds the failed build's frames, and with
    them its pool and weights, which a GPU needs back before the whole instance can allocate its own."""
    try:
        return build_worker(cfg, worker_id, runtime)
    except WorkerBuildError as exc:
        if runtime is None or len(runtime.members) == 1:
            raise
        why = str(exc)
    log.error("tensor_parallel_reform_failed", error=why, fallback="whole instance")
    gc.collect()  # whatever of the failed build only a reference cycle still holds
    return build_worker(cfg, worker_id, TPArgs((worker_id,)))


def main(argv: list[str] | None = None) -> None:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    parser = service_arg_parser("kunserve-worker", "A worker: holds a layer range of the model and runs the engine.")
    parser.add_argument("--worker-id", default=os.environ.get("KUNSERVE_WORKER_ID"),
                        help="which [[workers]] entry of the config this process is (or $KUNSERVE_WORKER_ID); an id "
                             "the config does not list joins the cluster at run time")
    parser.add_argument("--standby", action="store_true",
                        help="load the model and wait: the local scaler activates this worker when the cluster needs "
                             "another instance (an id the config does not list)")
    parser.add_argument("--transfer-port", type=int, help="a joining worker's UCX port (default: the first "
                        "[[workers]] entry's)")
    parser.add_argument("--metrics-port", type=int, help="a joining worker's /metrics port (default: the first "
                        "[[workers]] entry's; 0 = none)")
    parser.add_argument("--tp-members", metavar="W0,W1",
                        help="this worker's tensor-parallel instance, rank 0 first (overrides [[tensor_parallel]]; one "
                             "member: a whole instance). Set by the memory manager's re-form (kunctl tp)")
    parser.add_argument("--tp-rank", type=int, default=0, help="this worker's rank in --tp-members")
    parser.add_argument("--tp-port", type=int, default=0, help="the rendezvous port on rank 0's host")
    parser.add_argument("--tp-host", help="rank 0's host (default: its configured host)")
    parser.add_argument("--tp-rendezvous-timeout", type=float, default=0.0,
                        help="seconds the members wait for each other (default: [[tensor_parallel]]'s)")
    args = parser.parse_args(argv)
    if not args.worker_id:
        parser.error("--worker-id is required (or set KUNSERVE_WORKER_ID)")
    runtime_tp = tp_args(args)
    if runtime_tp is not None:
        try:
            runtime_tp.check(args.worker_id)
        except ValueError as exc:
            parser.error(str(exc))
    cfg, log, seed = load_worker_config(args)
    creds = load_service_credentials(cfg, f"worker {args.worker_id}")
    try:
        engine_loop, instance, identity, tp = build_or_fall_back(cfg, args.worker_id, runtime_tp, log)
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

    servicers: list[WorkerServicer] = []  # amain's, read after it returned

    async def amain() -> None:
        wsec = cfg.worker(args.worker_id)
        # Links only from members of the cluster (the config's workers, then the memory manager's member list),
        # each proving it holds the cluster secret.
        svc = TransferService(args.worker_id, host=wsec.host, secret=creds.cluster_secret.encode(),
                              members=[w.id for w in cfg.workers])
        transfer: TransferService | None = svc
        port_busy = False
        try:
            await svc.start(wsec.transfer_port)
        except Exception as exc:  # no UCX here: the worker still serves, but cannot join pipeline groups
            log.error("transfer_service_unavailable", error=f"{type(exc).__name__}: {exc}")
            transfer = None
            port_busy = any(s in str(exc).lower() for s in ("busy", "in use"))
        servicer = WorkerServicer(identity, engine_loop, instance, transfer,
                                  cfg.memory_manager.transition_timeout_s, tp=tp,
                                  whole_model=tp.whole if tp is not None and tp.whole is not None else instance.source,
                                  tp_mode=cfg.memory_manager.tp_mode)
        servicers.append(servicer)
        tasks: list[asyncio.Task] = []

        async def retry_transfer() -> None:
            """The transfer port still held by links of this worker's previous run (a restart or a re-form: their
            TCP connections linger in TIME_WAIT for up to a minute): serve meanwhile, listen once it is free."""
            nonlocal transfer
            deadline = time.monotonic() + TRANSFER_RETRY_S
            while time.monotonic() < deadline:
                await asyncio.sleep(2.0)
                try:
                    await svc.start(wsec.transfer_port)
                except Exception:  # still busy
                    continue
                transfer = svc
                servicer.attach_transfer(svc)
                return
            log.error("transfer_service_unavailable", error=f"port {wsec.transfer_port} still busy after "
                      f"{TRANSFER_RETRY_S:g}s", gave_up=True)

        if port_busy:
            tasks.append(asyncio.create_task(retry_transfer()))
        reporting: list[asyncio.Task] = []  # the stats stream to the monitor: only while in service
        registry.register(Lazy(lambda: worker_families(servicer.current_stats())))
        metrics: MetricsServer | None = None

        def start_reporting() -> None:
            if not reporting:
                reporting.append(asyncio.create_task(report_stats_forever(
                    cfg.monitor.address, cfg.monitor.stats_interval_s, servicer.current_stats)))

        def stop_reporting() -> None:
            while reporting:
                reporting.pop().cancel()

        def set_members(members: frozenset[str]) -> None:
            if transfer is not None:
                transfer.members = members

        src = servicer.whole_model or instance.source  # a tensor-parallel member serves the whole model
        membership = ClusterMembership(
            cfg.memory_manager.address, args.worker_id, wsec.address,
            model_fingerprint(src.config, src.name, src.path, src.seed), [w.id for w in cfg.workers],
            lambda: servicer.undropped_blocks, standby=args.standby, on_members=set_members,
            on_active=start_reporting, on_inactive=stop_reporting)
        servicer.cluster = membership

        def register(server) -> None:
            worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)

        async def started() -> None:
            nonlocal metrics
            where = (f"workers[{[w.id for w in cfg.workers].index(args.worker_id)}].metrics_port" if seed
                     else "--metrics-port")
            metrics = await serve_metrics(registry, wsec.metrics_bind, where)
            engine_loop.start()
            if tp is not None:
                tp.start(engine_loop)
            if servicer.transitions is not None and cfg.engine.warm_staging and tp is None:  # TP: no drops
                tasks.append(asyncio.create_task(servicer.transitions.keep_staging_warm()))
            if not seed:
                # A joining worker serves once the memory manager accepted it (health says SERVING only then); a
                # standby worker once it offered itself. Refused (another model): a one-line error, exit 2.
                try:
                    await membership.register_until_accepted()
                except MembershipRefused as exc:
                    log.error("membership_refused", code=exc.code.name, reason=str(exc))
                    print(f"worker {args.worker_id}: refused by the memory manager: {exc}", file=sys.stderr)
                    raise SystemExit(2) from None
                log.info("standby" if args.standby else "joined", memory_manager=cfg.memory_manager.address,
                         members_version=membership.version)
            if membership.in_service:
                start_reporting()
            tasks.append(asyncio.create_task(membership.heartbeat_forever()))

        async def stopping() -> None:
            for t in tasks:
                t.cancel()
            if servicer.tp is not None:  # the config's, or one formed in place since
                servicer.tp.cancel_tasks()
            stop_reporting()
            if not seed and (servicer.reform is None or servicer.reform_in_place):  # a cold re-form is back in a moment
                await membership.deregister("shutdown")
            await membership.close()
            if metrics is not None:
                await metrics.stop()
            await servicer.shutdown()
            if servicer.tp is not None:
                await asyncio.to_thread(servicer.tp.close, engine_loop)
            if transfer is not None:
                await transfer.close()

        await rpc.run_service("kunserve.v1.Worker", wsec.bind_address, register, on_started=started,
                              on_shutdown=stopping, auth=internal_rules(creds), tls=creds.tls,
                              require_client_cert=creds.tls is not None and creds.tls.mutual,
                              alive=lambda: (engine_loop.error is None and engine_loop.step_seconds() < stuck_s
                                             and (servicer.tp is None or servicer.tp.broken(engine_loop) is None)))

    rpc.run(amain)
    last = servicers[0] if servicers else None
    if last is not None and last.reform is not None and not last.reform_in_place:  # a cold re-form: same process
        reexec(reform_argv(raw_argv, last.reform))
    if last is not None and last.tp is not None and last.tp.exited_broken:  # its instance broke: start again
        raise SystemExit(EXIT_BROKEN)


if __name__ == "__main__":
    main()
