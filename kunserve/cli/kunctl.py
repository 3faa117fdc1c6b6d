"""`kunctl`: the admin CLI. Talks to the admin port (served by the memory manager)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from kunserve.shared.config import ConfigError, load_config
from kunserve.shared.rpc import insecure_channel
from kunserve.v1 import admin_pb2_grpc, common_pb2


def _address(args: argparse.Namespace) -> str:
    if args.address:
        return args.address
    try:
        return load_config(args.config).memory_manager.address
    except ConfigError as exc:
        raise SystemExit(f"kunctl: config error: {exc}") from None


async def _call(address: str, fn):
    async with insecure_channel(address) as ch:
        return await fn(admin_pb2_grpc.AdminStub(ch))


def _rpc(address: str, fn):
    try:
        return asyncio.run(_call(address, fn))
    except grpc.aio.AioRpcError as exc:
        print(f"kunctl: {exc.code().name}: {exc.details()} (admin address {address})", file=sys.stderr)
        raise SystemExit(1) from None


def render_status(status) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output (scripts, logs) gets a wide table instead of rich's 80-column default.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 220)
    layout = {w.worker_id: w for w in status.layout.workers}
    cl = status.cluster
    t = Table(title=f"KunServe cluster - layout epoch {status.layout.epoch}, "
                    f"{status.layout.num_layers_model} model layers")
    for col in ("worker", "address", "layers", "group", "healthy", "KV used/total", "KV %", "running", "waiting",
                "queued demand", "prompt tok/s", "gen tok/s", "preempted"):
        t.add_column(col, justify="right" if col not in ("worker", "address", "group") else "left")
    seen = set()
    for ws in cl.workers:
        s = ws.stats
        seen.add(s.worker_id)
        lay = layout.get(s.worker_id)
        t.add_row(s.worker_id, s.address, f"{s.layer_start}-{s.layer_end}", lay.group_id if lay else "?",
                  "[green]yes[/]" if ws.healthy else f"[red]no[/] ({ws.last_report_age_s:.0f}s)",
                  f"{s.kv_blocks_used}/{s.kv_blocks_total}", f"{100 * ws.kv_usage:.1f}", str(s.num_running),
                  str(s.num_waiting), str(s.queued_demand_blocks), f"{ws.prompt_tokens_per_s:.1f}",
                  f"{ws.generated_tokens_per_s:.1f}", str(s.num_preemptions))
    for wid, lay in sorted(layout.items()):
        if wid not in seen:
            t.add_row(wid, lay.address, f"{lay.layer_start}-{lay.layer_end}", lay.group_id,
                      "[red]no stats[/]", "-", "-", "-", "-", "-", "-", "-", "-")
    console.print(t)
    usage = (cl.kv_blocks_used / cl.kv_blocks_total * 100) if cl.kv_blocks_total else 0.0
    console.print(f"cluster KV: {cl.kv_blocks_used}/{cl.kv_blocks_total} blocks ({usage:.1f}%), queued demand "
                  f"{cl.queued_demand_blocks} blocks, overloaded: {'[red]yes[/]' if cl.overloaded else 'no'}")
    if status.monitor_error:
        console.print(f"[yellow]warning[/]: {status.monitor_error}")


def cmd_status(args: argparse.Namespace) -> None:
    status = _rpc(_address(args), lambda stub: stub.GetStatus(common_pb2.Empty(), timeout=args.timeout))
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True)))
    else:
        render_status(status)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kunctl", description="KunServe admin CLI.")
    p.add_argument("--config", help="cluster config file (TOML); default $KUNSERVE_CONFIG or built-in defaults")
    p.add_argument("--address", help="admin host:port (the memory manager; default: from the config)")
    p.add_argument("--timeout", type=float, default=5.0)
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="workers, KV usage, load and layout as a table")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
