"""`kunserve`: start a local cluster (`up`) and talk to it (`generate`).

Errors are one line on stderr with a non-zero exit code: no tracebacks for a user's mistake.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import threading

import grpc

from kunserve import client
from kunserve.cli.launcher import ClusterStartError, LocalCluster, assign_free_ports, standby_sections, with_workers
from kunserve.shared import credentials
from kunserve.shared.config import ClusterConfig, ConfigError, load_config

DEMO_PROMPT = "KunServe keeps tail latency flat when"
STOP_POLL_S = 0.05


def _load(args: argparse.Namespace) -> ClusterConfig:
    try:
        return load_config(args.config)
    except ConfigError as exc:
        raise SystemExit(f"kunserve: config error: {exc}") from None


def _fail(msg: str) -> None:
    print(f"kunserve: {msg}", file=sys.stderr)
    raise SystemExit(1)


# -- up ---------------------------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False, highlight=False)
    cfg = _load(args)
    if args.model is not None:
        cfg.model.path = args.model
    if args.served_model_name:
        cfg.model.served_name = args.served_model_name
    if args.http_port is not None:
        cfg.dispatcher.http_port = args.http_port
    if args.chat_template:
        from kunserve.shared.model.chat_template import ChatTemplate, ChatTemplateError

        path = pathlib.Path(args.chat_template).resolve()
        try:  # refused here, before anything starts, rather than by the dispatcher after the workers loaded
            ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        except (OSError, ChatTemplateError) as exc:
            _fail(f"--chat-template: {exc}")
        cfg.model.chat_template = str(path)
    if args.workers is not None:
        if args.workers < 1:
            _fail("--workers must be >= 1")
        with_workers(cfg, args.workers)
    if args.free_ports:
        assign_free_ports(cfg)
    if args.standby < 0:
        _fail("--standby must be >= 0")
    if args.standby and cfg.autoscale.scaler == "none":
        cfg.autoscale.scaler = "local"  # standby workers are what the local scaler activates
    elif args.standby and cfg.autoscale.scaler != "local":
        _fail(f"--standby needs autoscale.scaler = \"local\" (the config says {cfg.autoscale.scaler!r})")
    standby = standby_sections(cfg, args.standby, free_ports=args.free_ports)
    try:
        _default_credentials(cfg)
    except (OSError, ConfigError) as exc:
        _fail(f"cannot set up the cluster's credentials: {exc}")
    cluster = LocalCluster(cfg, run_dir=args.run_dir, standby=standby)
    model = cfg.model.path or "embedded tiny model (seeded random weights)"
    extra = f" + {len(standby)} standby (autoscale.scaler = local)" if standby else ""
    console.print(f"[bold]Starting KunServe[/]: {len(cfg.workers)} workers{extra}, model: {model}")
    console.print(f"logs: {cluster.run_dir}")
    try:
        cluster.start(timeout_s=args.timeout,
                      progress=lambda c: console.print(f"  [green]healthy[/] {c.name:<16} {c.address}"))
    except ClusterStartError as exc:
        _fail(f"cluster failed to start: {exc}")
    except KeyboardInterrupt:  # LocalCluster.start already stopped what it had started
        print("kunserve: interrupted while starting; stopped", file=sys.stderr)
        raise SystemExit(130) from None
    # From here on Ctrl-C / SIGTERM only set a flag: the loop below stops the cluster cleanly.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    table = Table(title="KunServe local cluster", show_lines=False)
    table.add_column("service")
    table.add_column("address")
    table.add_column("log")
    standby_ids = {w.id for w in standby}
    for c in cluster.children:
        table.add_row(c.name + (" (standby)" if c.name in standby_ids else ""), c.address, str(c.log_path))
        if c.name == "dispatcher" and cfg.dispatcher.http_port:
            table.add_row("  OpenAI API", f"http://{cfg.dispatcher.http_address}/v1", f"model {cfg.model.served_model!r}")
    console.print(table)
    console.print(f"Generate: [bold]kunserve generate --address {cfg.dispatcher.address} \"Hello\"[/]   "
                  f"Status: [bold]kunctl --address {cfg.memory_manager.address} status[/]")
    if args.demo:
        console.print(f"\n[bold]Demo[/]: streaming {args.demo_tokens} tokens for the prompt {DEMO_PROMPT!r}")
        # Ctrl-C / SIGTERM during the demo end the generation at once (the handlers above only set `stop`,
        # which the generation watches) and then stop the cluster like Ctrl-C while serving does.
        code = _generate_to_terminal(cfg.dispatcher.address, client.make_request(
            DEMO_PROMPT, max_tokens=args.demo_tokens, ignore_eos=True), as_json=False, timeout=120, stop=stop,
            creds=client.credentials_from(cluster.cfg))
        if code or stop.is_set():
            _stop_cluster(cluster, console)
            raise SystemExit(code)
    if args.exit_after_demo:
        cluster.stop()
        return
    console.print("\nServing. Press Ctrl-C to stop.")
    if args.no_restart:
        reported: set[str] = set()
        while not stop.wait(0.5):
            for c in cluster.dead_children():
                if c.name not in reported:
                    reported.add(c.name)
                    console.print(f"[red]{c.name} exited with code {c.exit_code()}[/] (not restarted: "
                                  f"--no-restart); last log lines:\n{c.log_tail(10)}")
    else:
        cluster.supervise(report=lambda line: console.print(f"[yellow]supervisor[/]: {line}"))
        while not stop.wait(0.5):  # a timed wait: the signal handlers run between waits
            pass
    _stop_cluster(cluster, console)


def _default_credentials(cfg: ClusterConfig) -> None:
    """The cluster secret and admin token of a `kunserve up` that names none (config or environment): the
    default files under $KUNSERVE_HOME, created once, so kunctl and the client find them with no flags."""
    for kind in (credentials.CLUSTER_SECRET, credentials.ADMIN_TOKEN):
        if not getattr(cfg.security, kind.config_key) and not os.environ.get(kind.env):
            setattr(cfg.security, kind.config_key, str(credentials.ensure_default(kind)))


def _stop_cluster(cluster: LocalCluster, console) -> None:
    console.print("Stopping...")
    codes = cluster.stop()
    console.print("Stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()))


# -- generate ---------------------------------------------------------------------------------------------
def _generate_to_terminal(address: str, request, *, as_json: bool, timeout: float | None,
                          stop: threading.Event | None = None, creds: client.Credentials | None = None) -> int:
    """Stream one generation; 0 on success, 1 on an RPC error, 130 when interrupted (Ctrl-C, or `stop`
    set by a signal handler of the caller, which is checked every STOP_POLL_S)."""

    async def run() -> client.GenerationResult | None:
        async with client.dispatcher_channel(address, creds) as ch:
            def show(ev) -> None:
                if not as_json and ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            gen = asyncio.ensure_future(client.generate(ch, request, timeout=timeout, on_event=show))
            if stop is None:
                return await gen

            async def stopped() -> None:
                while not stop.is_set():
                    await asyncio.sleep(STOP_POLL_S)

            watcher = asyncio.ensure_future(stopped())
            await asyncio.wait({gen, watcher}, return_when=asyncio.FIRST_COMPLETED)
            watcher.cancel()
            if gen.done():
                return gen.result()
            gen.cancel()  # cancels the RPC: the dispatcher cancels it on the worker
            await asyncio.gather(gen, watcher, return_exceptions=True)
            return None

    try:
        res = asyncio.run(run())
    except grpc.aio.AioRpcError as exc:
        print(f"\nkunserve: generate failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        res = None
    if res is None:
        print("\nkunserve: interrupted", file=sys.stderr)
        return 130
    if as_json:
        print(json.dumps(res.to_dict()))
    else:
        ttft = f"{res.ttft_s * 1000:.1f} ms" if res.ttft_s is not None else "n/a"
        tpot = f"{res.mean_tpot_s * 1000:.1f} ms" if res.mean_tpot_s is not None else "n/a"
        if not res.text:
            print(f"token ids: {res.token_ids}", end="")
        print(f"\n[{len(res.token_ids)} tokens from {res.worker_id}, finish: {res.finish_reason}, "
              f"TTFT {ttft}, mean TPOT {tpot}]")
    return 0


def _int_list(value: str) -> list[int]:
    try:
        return [int(x) for x in value.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def cmd_generate(args: argparse.Namespace) -> None:
    if (args.prompt is None) == (args.token_ids is None):
        _fail("give either a text prompt or --token-ids")
    cfg = _load(args)
    address = args.address or cfg.dispatcher.address
    try:
        creds = client.credentials_from(cfg)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    prompt = args.token_ids if args.token_ids is not None else args.prompt
    request = client.make_request(prompt, request_id=args.request_id or "", max_tokens=args.max_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                  stop_token_ids=args.stop_token_ids or (), stop=args.stop or (),
                                  ignore_eos=args.ignore_eos)
    raise SystemExit(_generate_to_terminal(address, request, as_json=args.json, timeout=args.timeout, creds=creds))


# -- parser -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kunserve", description="KunServe: LLM serving that keeps tail latency flat under bursts.")
    p.add_argument("--config", help="cluster config file (TOML); default $KUNSERVE_CONFIG or built-in defaults")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole cluster as local processes and serve until Ctrl-C")
    up.add_argument("--model", help="local Hugging Face-format model directory (default: the embedded tiny model)")
    up.add_argument("--workers", type=int, help="number of workers (default: from the config, 2)")
    up.add_argument("--chat-template", metavar="FILE", help="jinja chat template for the HTTP front's chats, instead "
                    "of the model's own")
    up.add_argument("--served-model-name", help="the model id on the HTTP front (default: the model directory's name)")
    up.add_argument("--http-port", type=int, help="port of the OpenAI-compatible HTTP front (default 8000; 0 = none)")
    up.add_argument("--free-ports", action="store_true", help="pick unused loopback ports instead of the configured ones")
    up.add_argument("--standby", type=int, default=0, metavar="N",
                    help="also start N standby workers: they load the model and join when the autoscaler asks for an "
                         "instance (sets autoscale.scaler = local; README \"Discovery and autoscaling\")")
    up.add_argument("--run-dir", help="directory for logs and the effective config (default: a temp dir)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every service to be healthy")
    up.add_argument("--demo", action="store_true", help="stream one generation once the cluster is up")
    up.add_argument("--demo-tokens", type=int, default=48, help="tokens to generate in the demo")
    up.add_argument("--exit-after-demo", action="store_true", help="stop the cluster after the demo (scripts, CI)")
    up.add_argument("--no-restart", action="store_true",
                    help="do not restart a service that exits or stops answering SERVING (default: restart it "
                         "with backoff, 1 s doubling up to 30 s)")
    up.set_defaults(func=cmd_up)

    g = sub.add_parser("generate", help="send one prompt to the dispatcher and stream the output")
    g.add_argument("prompt", nargs="?", help="text prompt (needs a tokenizer; the embedded model has a byte-level one)")
    g.add_argument("--token-ids", type=_int_list, help="prompt as token ids, e.g. 1,2,3")
    g.add_argument("--address", help="dispatcher host:port (default: from the config)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float,
                   help="0 = greedy (default: the model's generation_config.json, else greedy)")
    g.add_argument("--top-k", type=int, help="0 = disabled (default: the model's generation_config.json, else 0)")
    g.add_argument("--top-p", type=float, help="default: the model's generation_config.json, else 1.0")
    g.add_argument("--seed", type=int, help="sampling seed (reproducible sampling)")
    g.add_argument("--stop-token-ids", type=_int_list)
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop string: the output ends before it (repeatable; needs a tokenizer)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    g.add_argument("--request-id", help="client-chosen id (for Cancel)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    g.add_argument("--json", action="store_true", help="print one JSON object (token ids, text, TTFT, TPOT)")
    g.set_defaults(func=cmd_generate)

    _register_extra_commands(sub)
    return p


def _register_extra_commands(sub) -> None:
    """Later subcommands (bench, profile) register here without touching the core parser."""
    from kunserve.cli import batch, bench, export_model, profile, simulate

    batch.register(sub)
    profile.register(sub)
    bench.add_bench_parser(sub)
    export_model.register(sub)
    simulate.register(sub)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
