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
from kunserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2


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
                "queued demand", "prompt tok/s", "gen tok/s", "preempted", "bubble %"):
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
                  f"{ws.generated_tokens_per_s:.1f}", str(s.num_preemptions),
                  # idle while requests were queued / (busy + that), since the worker started
                  f"{100 * s.bubble_ratio:.1f}" if s.busy_seconds_total > 0 else "-")
    for wid, lay in sorted(layout.items()):
        if wid not in seen:
            t.add_row(wid, lay.address, f"{lay.layer_start}-{lay.layer_end}", lay.group_id,
                      "[red]no stats[/]", "-", "-", "-", "-", "-", "-", "-", "-", "-")
    console.print(t)
    usage = (cl.kv_blocks_used / cl.kv_blocks_total * 100) if cl.kv_blocks_total else 0.0
    console.print(f"cluster KV: {cl.kv_blocks_used}/{cl.kv_blocks_total} blocks ({usage:.1f}%), queued demand "
                  f"{cl.queued_demand_blocks} blocks, overloaded: {'[red]yes[/]' if cl.overloaded else 'no'}")
    if status.monitor_error:
        console.print(f"[yellow]warning[/]: {status.monitor_error}")


def cmd_status(args: argparse.Namespace) -> None:
    status = _rpc(_address(args), lambda stub: stub.GetStatus(common_pb2.Empty(), timeout=args.timeout))
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
    else:
        render_status(status)


def parse_layers(text: str) -> list[int]:
    """"2,3", "2-3" or "0-1,6-7" -> [2, 3] ..."""
    out: list[int] = []
    try:
        for part in text.replace(" ", "").split(","):
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layers like 2,3 or 2-3, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no layers given")
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def render_memory(m) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 220)
    console.print(f"[bold]{m.worker_id}[/]: layers [{m.layer_start}, {m.layer_end}) of {m.num_layers_model}, "
                  f"backend {m.backend} ({m.device}), {m.num_pages} pages x {_mib(m.page_size)}, "
                  f"{m.free_pages} free, remap generation {m.generation}")
    t = Table(title="per layer")
    for col in ("layer", "weight pages", "weight bytes", "KV pages", "KV blocks"):
        t.add_column(col, justify="right")
    for x in m.layers:
        t.add_row(str(x.layer), str(x.weight_pages), _mib(x.weight_bytes), str(x.kv_pages), str(x.kv_blocks))
    for g in m.groups:
        t.add_row(g.name, str(g.pages), _mib(g.bytes), "-", "-")
    console.print(t)
    runs = Table(title="physical pages")
    for col in ("pages", "count", "owner"):
        runs.add_column(col)
    for r in m.page_runs:
        runs.add_row(f"{r.first_page}-{r.first_page + r.count - 1}", str(r.count), r.owner)
    console.print(runs)
    console.print(f"KV capacity: {m.kv_blocks} blocks x {m.block_size} tokens = {m.kv_capacity_tokens} tokens "
                  f"({_mib(m.kv_capacity_bytes)}), {m.kv_blocks_used} blocks in use; weights {m.weight_pages} pages "
                  f"({_mib(m.weight_bytes)}); host copy {_mib(m.host_copy_bytes)}")


def render_change(c) -> None:
    print(f"{c.op} layers {list(c.layers)}: now holds [{c.layer_start}, {c.layer_end}); KV blocks "
          f"{c.kv_blocks_before} -> {c.kv_blocks_after}; pages unmapped {c.pages_unmapped}, mapped {c.pages_mapped}; "
          f"remap {c.remap_seconds * 1e3:.2f} ms" + (f", weights from {c.weight_source} {c.fill_seconds * 1e3:.1f} ms"
                                                     if c.op == "restore" else "")
          + (f", {c.compaction_moves} KV blocks compacted" if c.compaction_moves else ""))


def _print(msg, as_json: bool, render) -> None:
    if as_json:
        print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
    else:
        render(msg)


def cmd_memory(args: argparse.Namespace) -> None:
    m = _rpc(_address(args), lambda stub: stub.GetWorkerMemory(admin_pb2.WorkerRef(worker_id=args.worker),
                                                              timeout=args.timeout))
    _print(m, args.json, render_memory)


def cmd_drop_layers(args: argparse.Namespace) -> None:
    c = _rpc(_address(args), lambda stub: stub.DropWorkerLayers(
        admin_pb2.WorkerLayersRequest(worker_id=args.worker, layers=args.layers), timeout=max(args.timeout, 60)))
    _print(c, args.json, render_change)


def cmd_restore_layers(args: argparse.Namespace) -> None:
    c = _rpc(_address(args), lambda stub: stub.RestoreWorkerLayers(
        admin_pb2.WorkerLayersRequest(worker_id=args.worker, layers=args.layers, source=args.source or ""),
        timeout=max(args.timeout, 300)))
    _print(c, args.json, render_change)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kunctl", description="KunServe admin CLI.")
    p.add_argument("--config", help="cluster config file (TOML); default $KUNSERVE_CONFIG or built-in defaults")
    p.add_argument("--address", help="admin host:port (the memory manager; default: from the config)")
    p.add_argument("--timeout", type=float, default=5.0)
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="workers, KV usage, load and layout as a table")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.set_defaults(func=cmd_status)
    mem = sub.add_parser("memory", help="one worker's memory pool: pages per layer (weights, KV), free pages, capacity")
    mem.add_argument("worker", help="worker id, e.g. worker-0")
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(func=cmd_memory)
    dl = sub.add_parser("drop-layers", help="drop layers on one idle worker: their pages become KV cache")
    dl.add_argument("worker")
    dl.add_argument("layers", type=parse_layers, help="a prefix or suffix of the held range, e.g. 2-3")
    dl.add_argument("--json", action="store_true")
    dl.set_defaults(func=cmd_drop_layers)
    rl = sub.add_parser("restore-layers", help="restore dropped layers on one worker (KV pages go back to weights)")
    rl.add_argument("worker")
    rl.add_argument("layers", type=parse_layers, help="layers adjacent to the held range, e.g. 2-3")
    rl.add_argument("--source", choices=["host", "checkpoint"], help="where weights come from (default: host copy)")
    rl.add_argument("--json", action="store_true")
    rl.set_defaults(func=cmd_restore_layers)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
