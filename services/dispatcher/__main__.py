"""`kunserve-dispatcher`: the client-facing process (Generate / Cancel, and the offline batches)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from kunserve.services.common import load_service_config, load_service_credentials, service_arg_parser
from kunserve.services.dispatcher.batch_http import BatchRoutes
from kunserve.services.dispatcher.batch_runner import BatchRunner, OpenAIItems, body_checker
from kunserve.services.dispatcher.batch_service import Batches, BatchesServicer
from kunserve.services.dispatcher.batch_store import BatchStore
from kunserve.services.dispatcher.http_front import HttpFront, ssl_context_of
from kunserve.services.dispatcher.limits import limits_from_config
from kunserve.services.dispatcher.metrics import DispatcherMetrics, admission_families
from kunserve.services.dispatcher.servicer import DispatcherServicer, WorkerPool
from kunserve.shared import rpc
from kunserve.shared.config import ConfigError
from kunserve.shared.credentials import dispatcher_rules
from kunserve.shared.metrics import Lazy, MetricsServer, new_registry, serve_metrics
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.chat_template import ChatTemplateError, chat_template_for
from kunserve.shared.model.generation_config import load_generation_defaults
from kunserve.shared.model.tokenizer import load_tokenizer
from kunserve.v1 import batch_pb2_grpc, generation_pb2_grpc

ROUTER_POLL_INTERVAL_S = 0.1
LAYOUT_POLL_INTERVAL_S = 0.5  # how often the memory manager's layout is read: workers that join, drain or leave
WORKER_WAIT_S = 60.0  # at start-up, wait this long for every worker before reporting SERVING


def main(argv: list[str] | None = None) -> None:
    parser = service_arg_parser("kunserve-dispatcher", "Client API: routes requests to workers and streams tokens "
                                "(gRPC, and the OpenAI-compatible HTTP front).")
    parser.add_argument("--http-port", type=int, help="override dispatcher.http_port (0 = no HTTP front)")
    parser.add_argument("--chat-template", metavar="FILE", help="override model.chat_template: a jinja chat template "
                        "used instead of the model's own")
    parser.add_argument("--served-model-name", help="override model.served_name: the model id on the HTTP front")
    args = parser.parse_args(argv)
    cfg, log = load_service_config(args, "dispatcher", section="dispatcher")
    if args.http_port is not None:
        cfg.dispatcher.http_port = args.http_port
    if args.chat_template:
        cfg.model.chat_template = args.chat_template
    if args.served_model_name:
        cfg.model.served_name = args.served_model_name
    creds = load_service_credentials(cfg, "dispatcher", api_key=True)
    try:
        tokenizer = load_tokenizer(cfg.model.path or None)
        generation = load_generation_defaults(cfg.model.path or None, embedded_eos=TINY_CONFIG.eos_token_id)
    except (OSError, ValueError) as exc:
        print(f"dispatcher: cannot load the tokenizer / generation_config of {cfg.model.path!r}: {exc}",
              file=sys.stderr)
        raise SystemExit(2) from None
    chat_template, chat_error = None, ""
    try:
        chat_template = chat_template_for(tokenizer, cfg.model.chat_template or None)
    except ChatTemplateError as exc:
        if cfg.model.chat_template:  # asked for by name: a broken override is a start-up error
            print(f"dispatcher: model.chat_template: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        chat_error = str(exc)  # the model simply has none: chat requests get this as their 400
    if generation.unsupported:
        log.warning("generation_config_keys_not_applied", keys=generation.unsupported,
                    reason="the sampler does not implement them")

    try:
        limits = limits_from_config(cfg)
    except ConfigError as exc:
        print(f"dispatcher: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    log.info("dispatcher_limits", **dataclasses.asdict(limits), max_message_bytes=limits.max_message_bytes)

    async def amain() -> None:
        pool = WorkerPool(cfg)
        registry = new_registry()
        servicer = DispatcherServicer(pool, tokenizer, route_timeout_s=cfg.dispatcher.route_timeout_s,
                                      limits=limits, generation=generation,
                                      metrics=DispatcherMetrics(registry, max_model_len=limits.context_len))
        registry.register(Lazy(lambda: admission_families(
            servicer.admission.inflight, servicer.admission.queued_tokens,
            sum(1 for w in pool.stubs if pool.router.routable(w)))))
        metrics: MetricsServer | None = None
        tasks: list[asyncio.Task] = []
        front = HttpFront(servicer, served_model=cfg.model.served_model, model_root=cfg.model.path or "embedded",
                          chat_template=chat_template, chat_template_error=chat_error, api_key=creds.api_key,
                          max_body_bytes=limits.max_message_bytes)
        store = BatchStore(cfg.dispatcher.batch_db)
        runner = BatchRunner(store, OpenAIItems(front, servicer), concurrency=cfg.dispatcher.batch_concurrency)
        batches = Batches(store, runner, max_bytes=cfg.dispatcher.batch_max_bytes,
                          max_requests=cfg.dispatcher.batch_max_requests, check_body=body_checker(cfg.model.served_model))
        front.batch_routes = BatchRoutes(batches, cfg.model.served_model)

        def register(server) -> None:
            generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
            batch_pb2_grpc.add_BatchesServicer_to_server(BatchesServicer(batches), server)

        async def started() -> None:
            nonlocal metrics
            metrics = await serve_metrics(registry, cfg.dispatcher.metrics_bind, "dispatcher.metrics_port")
            healthy = await pool.wait_for_workers(WORKER_WAIT_S)
            log.info("workers_reachable", healthy=healthy, configured=len(cfg.workers))
            tasks.append(asyncio.create_task(pool.poll_forever(ROUTER_POLL_INTERVAL_S)))
            tasks.append(asyncio.create_task(pool.discover_forever(LAYOUT_POLL_INTERVAL_S)))
            runner.start()  # resumes the batches that were in progress when the dispatcher last stopped
            if cfg.dispatcher.http_port:  # listening before the health check says SERVING
                host, port = cfg.dispatcher.http_bind
                tls = ssl_context_of(creds.tls.cert_chain, creds.tls.private_key) if creds.tls is not None else None
                try:
                    await front.start(host, port, tls)
                except OSError as exc:
                    log.error("bind_failed", address=f"{host}:{port}", error=str(exc))
                    raise SystemExit(f"dispatcher: cannot listen on {host}:{port} (dispatcher.http_port): {exc}") from None

        async def stopping() -> None:
            await runner.stop()  # first: its running requests stay pending (they run again after a restart)
            await servicer.shutdown()  # refuses new requests from here on, ends the in-flight ones
            for t in tasks:
                t.cancel()
            await front.stop()
            if metrics is not None:
                await metrics.stop()

        await rpc.run_service("kunserve.v1.Generation", cfg.dispatcher.bind_address, register,
                              on_started=started, on_shutdown=stopping, auth=dispatcher_rules(creds), tls=creds.tls,
                              options=limits.server_options())
        await pool.close()
        store.close()

    rpc.run(amain)


if __name__ == "__main__":
    main()
