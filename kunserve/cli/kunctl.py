"""`kunctl`: the admin CLI. Talks to the admin port (served by the memory manager: the Admin and
MemoryManager services share it) with the admin token, found in this order: --token-file,
$KUNSERVE_ADMIN_TOKEN, the config's [security] admin_token_file (--config / $KUNSERVE_CONFIG), the file
`kunserve up` writes ($KUNSERVE_HOME/admin-token, default ~/.kunserve/admin-token).

Output is for people (tables) and machines (`--json`: 64-bit integers as JSON numbers). Piped into a reader
that stops early (`kunctl status | head -1`) it exits quietly."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from kunserve import client
from kunserve.shared.config import ConfigError, load_config
from kunserve.shared.credentials import ADMIN_TOKEN, default_path
from kunserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, memory_manager_pb2, memory_manager_pb2_grpc

if TYPE_CHECKING:
    from rich.console import Group


@dataclass(frozen=True)
class Target:
    """The admin port and what to present there."""
    address: str
    creds: client.Credentials


def _target(args: argparse.Namespace) -> Target:
    """The admin address (--address, else the config) and the credentials (see the module docstring); no
    admin token anywhere is a one-line error."""
    try:
        cfg = load_config(args.config)
        creds = client.credentials_from(cfg, admin_token_file=args.token_file)
    except ConfigError as exc:  # CredentialError is one
        raise SystemExit(f"kunctl: config error: {exc}") from None
    if creds.admin_token is None:
        raise SystemExit(f"kunctl: no admin token: give --token-file, set ${ADMIN_TOKEN.env}, set [security] "
                         f"admin_token_file in --config, or start the cluster with `kunserve up` (it writes "
                         f"{default_path(ADMIN_TOKEN)})")
    return Target(args.address or cfg.memory_manager.address, creds)


async def _call(target: Target, fn, stub_cls=admin_pb2_grpc.AdminStub):
    async with client.admin_channel(target.address, target.creds) as ch:
        return await fn(stub_cls(ch))


def _rpc(target: Target, fn, stub_cls=admin_pb2_grpc.AdminStub):
    """Run one call; a gRPC error becomes a one-line message (status code name, details) and exit code 1."""
    try:
        return asyncio.run(_call(target, fn, stub_cls))
    except grpc.aio.AioRpcError as exc:
        hint = (" (is the admin token the one this cluster was started with?)"
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED else "")
        print(f"kunctl: {exc.code().name}: {exc.details()}{hint} (admin address {target.address})", file=sys.stderr)
        raise SystemExit(1) from None


@dataclass
class GroupView:
    """One unit of the layout as `kunctl status` shows it."""
    group_id: str
    members: list[tuple[str, int, int]]   # (worker, layer start, layer end), pipeline order: [0] is the head
    serving: bool                         # the head is routable
    kv_blocks_total: int | None           # the unit's KV capacity: the head's block space (None: no stats)
    kv_blocks_undropped: int | None       # sum of the members' capacity as whole instances (None: unknown)
    transitioning: bool
    bubble_ratio: float | None = None     # see group_bubble_ratio (None: a member without stats, or no work yet)
    tp_members: tuple[str, ...] = ()      # a tensor-parallel instance's members in rank order (empty: none)


def group_bubble_ratio(order: list[str], stats, before=None) -> float | None:
    """The share of the unit's stage time spent idle while it had work (KunServe §5.3's pipeline bubble), from
    the members' busy / bubble counters: their growth since the `before` sample (the live ratio over that
    window), or their totals since each worker started. The unit had work whenever its head computed or had
    requests waiting (head busy + head bubble); during that time every member should have computed, so the
    bubble is 1 - sum(members' busy) / (members x that time). A whole instance: its own bubble ratio. None: a
    member without stats (or restarted within the window), or no work in the window."""
    if not order or any(w not in stats or (before is not None and w not in before) for w in order):
        return None

    def grew(w: str, name: str) -> float:
        return getattr(stats[w], name) - (getattr(before[w], name) if before is not None else 0.0)

    work = grew(order[0], "busy_seconds_total") + grew(order[0], "bubble_seconds_total")
    if work <= 0 or any(grew(w, "busy_seconds_total") < 0 for w in order):
        return None
    busy = sum(min(grew(w, "busy_seconds_total"), work) for w in order)
    return max(0.0, 1.0 - busy / (len(order) * work))


def status_groups(status, before=None) -> list[GroupView]:
    """The units of an AdminStatus: layout groups, members ordered as the workers report (group_members),
    else by layer range. A pipeline group's KV capacity is its head's kv_blocks_total: every request's KV
    spans all members under one block-id space. `before`: an earlier AdminStatus; bubble ratios are then
    over the time between the two."""
    stats = {ws.stats.worker_id: ws.stats for ws in status.cluster.workers}
    earlier = {ws.stats.worker_id: ws.stats for ws in before.cluster.workers} if before is not None else None
    layout = {w.worker_id: w for w in status.layout.workers}
    groups: dict[str, list[str]] = {}
    for wid in sorted(set(layout) | set(stats)):
        lay = layout.get(wid)
        gid = (lay.group_id if lay is not None else "") or (stats[wid].group_id if wid in stats else "") or wid
        groups.setdefault(gid, []).append(wid)
    out = []
    for gid in sorted(groups):
        wids = groups[gid]
        tp = tp_members(stats[wids[0]]) if len(wids) == 1 and wids[0] in stats else ()
        if tp and tp[0] != wids[0]:
            continue  # a tensor-parallel follower: shown with its rank 0
        order = next((list(stats[w].group_members) for w in wids if w in stats and stats[w].group_members), [])
        if sorted(order) != sorted(wids):
            order = sorted(wids, key=lambda w: (_range(w, layout, stats)[0], w))
        head = order[0]
        members = [(w, *_range(w, layout, stats)) for w in order]
        if head in layout:
            serving = layout[head].serving
        else:
            serving = head in stats and stats[head].serving
        und = [stats[w].kv_blocks_undropped if w in stats else 0 for w in order]
        out.append(GroupView(gid, members, serving,
                             stats[head].kv_blocks_total if head in stats else None,
                             sum(und) if all(x > 0 for x in und) else None,
                             any(stats[w].transitioning for w in order if w in stats),
                             group_bubble_ratio(order, stats, earlier), tp))
    return out


def tp_members(stats) -> tuple[str, ...]:
    """The members (rank order) of the tensor-parallel instance a worker's stats report; empty when it is in none."""
    return tuple(stats.tp_members) if stats.tp_degree > 1 else ()


def tp_cell(stats) -> str:
    """A worker's tensor-parallel degree, with its rank in an instance of more than one."""
    members = tp_members(stats)
    return f"{len(members)} (rank {members.index(stats.worker_id)})" if stats.worker_id in members else "1"


def _range(wid: str, layout, stats) -> tuple[int, int]:
    if wid in layout:
        return layout[wid].layer_start, layout[wid].layer_end
    if wid in stats:
        return stats[wid].layer_start, stats[wid].layer_end
    return 0, 0


def _members(members) -> str:
    """Pipeline order: "worker-0 [0, 2) -> worker-1 [2, 4)"."""
    return " -> ".join(f"{w} [{a}, {b})" for w, a, b in members)


def format_groups(status, before=None) -> list[str]:
    lines = []
    for g in status_groups(status, before):
        kind = f"pipeline group of {len(g.members)}" if len(g.members) > 1 else "instance"
        members = _members(g.members)
        if g.tp_members:
            _, a, b = g.members[0]
            kind = f"tensor-parallel instance, TP{len(g.tp_members)}"
            members = " + ".join(f"{w} (rank {r})" for r, w in enumerate(g.tp_members)) + f" [{a}, {b})"
        cap = "?" if g.kv_blocks_total is None else f"{g.kv_blocks_total}"
        und = f", undropped {g.kv_blocks_undropped}" if g.kv_blocks_undropped is not None and len(g.members) > 1 else ""
        state = "serving" if g.serving else "not serving"
        if g.transitioning:
            state += ", transitioning"
        bubble = f"; bubble {100 * g.bubble_ratio:.1f}%" if g.bubble_ratio is not None else ""
        lines.append(f"{g.group_id} ({kind}, {state}): {members}; KV capacity {cap} blocks{und}{bubble}")
    return lines


def _console():
    from rich.console import Console

    # Piped output (scripts, logs) gets a wide table instead of rich's 80-column default.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 220)


def render_status(status, before=None) -> None:
    _console().print(status_view(status, before))


def status_view(status: admin_pb2.AdminStatus, before: admin_pb2.AdminStatus | None = None) -> Group:
    """The status table, the groups and the cluster's KV line as one rich renderable (printed, or refreshed in
    place by `kunctl watch`)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    layout = {w.worker_id: w for w in status.layout.workers}
    cl = status.cluster
    t = Table(title=f"KunServe cluster - layout epoch {status.layout.epoch}, "
                    f"{status.layout.num_layers_model} model layers")
    for col in ("worker", "address", "layers", "group", "TP", "serving", "healthy", "KV used/total", "KV %", "running",
                "waiting", "queued demand", "prompt tok/s", "gen tok/s", "preempted", "bubble %"):
        t.add_column(col, justify="right" if col not in ("worker", "address", "group", "serving") else "left")
    seen = set()
    for ws in cl.workers:
        s = ws.stats
        seen.add(s.worker_id)
        lay = layout.get(s.worker_id)
        serving = lay.serving if lay is not None else s.serving
        t.add_row(s.worker_id + _membership_mark(lay), s.address, f"{s.layer_start}-{s.layer_end}",
                  (lay.group_id if lay else s.group_id) or "?", tp_cell(s),
                  ("yes" if serving else "no") + (" (transitioning)" if s.transitioning else ""),
                  "[green]yes[/]" if ws.healthy else f"[red]no[/] ({ws.last_report_age_s:.0f}s)",
                  f"{s.kv_blocks_used}/{s.kv_blocks_total}", f"{100 * ws.kv_usage:.1f}", str(s.num_running),
                  # queue time: how long the oldest request not started yet has waited (what its client sees)
                  f"{s.num_waiting} (oldest {s.oldest_waiting_age_s:.1f}s)" if s.oldest_waiting_age_s > 0
                  else str(s.num_waiting), str(s.queued_demand_blocks), f"{ws.prompt_tokens_per_s:.1f}",
                  f"{ws.generated_tokens_per_s:.1f}", str(s.num_preemptions),
                  # idle while requests were queued / (busy + that), since the worker started
                  f"{100 * s.bubble_ratio:.1f}" if s.busy_seconds_total > 0 else "-")
    for wid, lay in sorted(layout.items()):
        if wid not in seen:
            t.add_row(wid + _membership_mark(lay), lay.address, f"{lay.layer_start}-{lay.layer_end}", lay.group_id, "?",
                      "yes" if lay.serving else "no", "[red]no stats[/]", "-", "-", "-", "-", "-", "-", "-", "-", "-")
    parts: list[Any] = [t]
    lines = format_groups(status, before)
    if lines:
        parts.append(f"groups (layout epoch {status.layout.epoch}):")
        parts.extend("  " + escape(line) for line in lines)
    usage = (cl.kv_blocks_used / cl.kv_blocks_total * 100) if cl.kv_blocks_total else 0.0
    parts.append(f"cluster KV: {cl.kv_blocks_used}/{cl.kv_blocks_total} blocks ({usage:.1f}%), queued demand "
                 f"{cl.queued_demand_blocks} blocks, overloaded: {'[red]yes[/]' if cl.overloaded else 'no'}")
    standby = ", ".join(f"{w.worker_id} ({w.address})" for w in status.layout.standby)
    if standby:
        parts.append(f"standby workers: {escape(standby)}")
    a = status.layout.autoscale
    if a.scaler and a.scaler != "none":
        line = f"autoscale ({a.scaler}): " + (f"[yellow]needed[/] for {a.needed_for_s:.1f}s" if a.needed else "not needed")
        line += f", {a.pending} pending" if a.pending else ""
        line += f", last: {escape(a.last_action)}" if a.last_action else ""
        parts.append(line)
        if a.last_error:
            parts.append(f"[yellow]autoscale error[/]: {escape(a.last_error)}")
    if status.monitor_error:
        parts.append(f"[yellow]warning[/]: {escape(status.monitor_error)}")
    return Group(*parts)


def _membership_mark(lay) -> str:
    """A worker that joined at run time (not in the config), or one that is draining (leaving)."""
    if lay is None:
        return ""
    return " (draining)" if lay.draining else (" (joined)" if lay.joined else "")


def cmd_status(args: argparse.Namespace) -> None:
    def fetch():
        return _rpc(_target(args), lambda stub: stub.GetStatus(common_pb2.Empty(), timeout=args.timeout))

    if args.json:
        print(message_json(fetch()))
        return
    if args.window < 0:
        print("kunctl: --window must be >= 0 seconds", file=sys.stderr)
        raise SystemExit(2)
    before = None
    if args.window > 0:  # the live bubble: counters sampled twice
        before = fetch()
        time.sleep(args.window)
    render_status(fetch(), before)


def cmd_watch(args: argparse.Namespace) -> None:
    if not args.interval > 0:
        print("kunctl: --interval must be > 0 seconds", file=sys.stderr)
        raise SystemExit(2)
    try:
        asyncio.run(watch(_target(args), args.interval, args.timeout))
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends
        pass


async def watch(target: Target, interval: float, timeout: float, rounds: int | None = None,
                stub_cls: Callable[[Any], Any] = admin_pb2_grpc.AdminStub) -> None:
    """Show the status every `interval` seconds (`rounds` times; None: until interrupted), over one connection.
    On a terminal the table is redrawn in place; piped, each refresh is printed after the last (as vmstat does).
    Bubble ratios are over the last interval. An unreachable admin port is shown and retried, not fatal: the
    memory manager may be restarting."""
    from rich.live import Live
    from rich.text import Text

    console = _console()
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None

    def show(view) -> None:
        if live is not None:
            live.update(view, refresh=True)
        else:
            console.print(view)

    before = None
    if live is not None:
        live.start()
    try:
        async with client.admin_channel(target.address, target.creds) as ch:
            stub = stub_cls(ch)
            n = 0
            while rounds is None or n < rounds:
                if n:
                    await asyncio.sleep(interval)
                n += 1
                stamp = time.strftime("%H:%M:%S")
                try:
                    status = await stub.GetStatus(common_pb2.Empty(), timeout=timeout)
                except grpc.aio.AioRpcError as exc:
                    show(Text(f"{stamp} kunctl: {exc.code().name}: {exc.details()} (admin address {target.address}); "
                              f"retrying every {interval:g}s, Ctrl-C to stop"))
                    before = None
                    continue
                show(status_view(status, before))
                before = status
    finally:
        if live is not None:
            live.stop()


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


_INT64_TYPES = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64})


def message_dict(msg: Message) -> dict[str, Any]:
    """A message as a dict for --json: every field (defaults too) under its proto name, and 64-bit integers as
    numbers. Proto3's JSON mapping writes those as strings, for JavaScript's doubles; jq and Python read them
    exactly, and a script comparing `.layout.epoch > 3` should not have to know which fields are 64-bit."""
    out = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _int64_as_numbers(msg.DESCRIPTOR, out)
    return out


def _int64_as_numbers(desc: Descriptor, d: dict[str, Any]) -> None:
    for f in desc.fields:
        if f.name not in d:
            continue
        value = d[f.name]
        kind = f.message_type
        if kind is not None and kind.GetOptions().map_entry:
            value_field = kind.fields_by_name["value"]
            for key, item in value.items():
                value[key] = _number_or_nested(value_field, item)
        elif f.is_repeated:
            d[f.name] = [_number_or_nested(f, item) for item in value]
        else:
            d[f.name] = _number_or_nested(f, value)


def _number_or_nested(f: FieldDescriptor, value: Any) -> Any:
    if f.message_type is not None and isinstance(value, dict):
        _int64_as_numbers(f.message_type, value)
    elif f.type in _INT64_TYPES:
        return int(value)
    return value


def message_json(msg: Message) -> str:
    return json.dumps(message_dict(msg))


def _print(msg, as_json: bool, render) -> None:
    if as_json:
        print(message_json(msg))
    else:
        render(msg)


def cmd_memory(args: argparse.Namespace) -> None:
    m = _rpc(_target(args), lambda stub: stub.GetWorkerMemory(admin_pb2.WorkerRef(worker_id=args.worker),
                                                              timeout=args.timeout))
    _print(m, args.json, render_memory)


def cmd_drop_layers(args: argparse.Namespace) -> None:
    c = _rpc(_target(args), lambda stub: stub.DropWorkerLayers(
        admin_pb2.WorkerLayersRequest(worker_id=args.worker, layers=args.layers), timeout=max(args.timeout, 60)))
    _print(c, args.json, render_change)


def cmd_restore_layers(args: argparse.Namespace) -> None:
    c = _rpc(_target(args), lambda stub: stub.RestoreWorkerLayers(
        admin_pb2.WorkerLayersRequest(worker_id=args.worker, layers=args.layers, source=args.source or ""),
        timeout=max(args.timeout, 300)))
    _print(c, args.json, render_change)


# --- cluster drop / restore (MemoryManager.PlanDrop / Drop / Restore) ------------------------------------------

REQUIRE_FORMS = ("a number of KV blocks (e.g. 1200 or 1200blocks) or bytes with a unit suffix "
                 "(e.g. 512MiB, 1.5GiB, 64KiB; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
_BYTE_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_REQUIRE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Requirement:
    """A drop requirement: KV blocks or bytes (exactly one is > 0)."""
    blocks: int = 0
    bytes: int = 0

    def __str__(self) -> str:
        return f"{self.blocks} KV blocks" if self.blocks else _human_bytes(self.bytes)


def parse_requirement(text: str) -> Requirement:
    """"1200" / "1200blocks" -> 1200 KV blocks; "512MiB", "1.5GiB", "64KiB", "2GB", "4096B" -> bytes
    (fractions of a byte round up)."""
    m = _REQUIRE_RE.match(text or "")
    if m is None:
        raise argparse.ArgumentTypeError(f"expected {REQUIRE_FORMS}, got {text!r}")
    num, unit = m.group(1), m.group(2).lower()
    try:
        value = Decimal(num)
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise argparse.ArgumentTypeError(f"expected {REQUIRE_FORMS}, got {text!r}") from None
    if unit in ("", "block", "blocks"):
        if value != value.to_integral_value():
            raise argparse.ArgumentTypeError(f"KV blocks must be a whole number, got {text!r}; "
                                             f"expected {REQUIRE_FORMS}")
        req = Requirement(blocks=int(value))
    elif unit in _BYTE_UNITS:
        req = Requirement(bytes=int(math.ceil(value * _BYTE_UNITS[unit])))
    else:
        raise argparse.ArgumentTypeError(f"unknown unit {m.group(2)!r} in {text!r}; expected {REQUIRE_FORMS}")
    if req.blocks <= 0 and req.bytes <= 0:
        raise argparse.ArgumentTypeError(f"the requirement must be > 0, got {text!r}")
    return req


def parse_group(text: str) -> list[str]:
    """"worker-0,worker-1" -> ["worker-0", "worker-1"]: one pipeline group, head first."""
    ids = [w.strip() for w in (text or "").split(",")]
    if not ids or any(not w for w in ids):
        raise argparse.ArgumentTypeError(f"expected worker ids separated by commas (head first), e.g. "
                                         f"worker-0,worker-1; got {text!r}")
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"a worker is listed twice in group {text!r}")
    return ids


def drop_request(require: Requirement | None, groups: list[list[str]] | None, reason: str = "manual"):
    """The DropRequest for `kunctl plan` / `kunctl drop`; a worker in two groups is a usage error."""
    seen: dict[str, int] = {}
    for i, g in enumerate(groups or []):
        for w in g:
            if w in seen:
                raise ValueError(f"worker {w} is in two --group lists")
            seen[w] = i
    return memory_manager_pb2.DropRequest(
        required_blocks=require.blocks if require else 0, required_bytes=require.bytes if require else 0,
        groups=[memory_manager_pb2.GroupMembers(worker_ids=g) for g in groups or []], reason=reason)


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _planned_groups(groups) -> list[str]:
    out = []
    for g in groups:
        members = [(m.worker_id, m.layer_start, m.layer_end) for m in g.members]
        kind = f"group of {len(members)}" if len(members) > 1 else "instance"
        out.append(f"  {g.group_id} ({kind}{', changed' if g.changed else ''}): {_members(members)}")
    return out


def format_plan(plan) -> str:
    """A DropPlanReply as text (nothing changes: PlanDrop is a dry run)."""
    lines = [f"drop plan on layout epoch {plan.epoch} (dry run)"]
    req = _human_bytes(plan.required_bytes) if plan.required_bytes else "none (merge as far as the planner goes)"
    lines.append(f"requirement: {req}; frees {_human_bytes(plan.freed_bytes)} ({plan.freed_blocks} KV blocks)")
    if plan.met:
        lines.append("requirement met")
    else:
        lines.append(f"requirement NOT met; fallback: {plan.fallback or 'kv_centric'}")
    lines.append(f"autoscale needed: {'yes' if plan.autoscale_needed else 'no'}")
    if plan.groups:
        lines.append("groups:")
        lines.extend(_planned_groups(plan.groups))
    return "\n".join(lines)


def format_report(rep) -> str:
    """A TransitionReport (drop or restore) as text."""
    op = rep.op or "transition"
    if rep.completed:
        lines = [f"{op} completed: layout epoch {rep.epoch}"]
    else:
        how = "rolled back" if rep.rolled_back else "not completed"
        lines = [f"{op} FAILED ({how}): layout epoch {rep.epoch}" + (f": {rep.error}" if rep.error else "")]
    if rep.autoscale_needed:
        lines.append("autoscale needed: no drop plan meets the requirement (more instances needed)")
    if rep.groups:
        lines.append("groups after:")
        lines.extend(_planned_groups(rep.groups))
    lines.append(f"moved {rep.requests_moved} request{'s' if rep.requests_moved != 1 else ''}, "
                 f"{_human_bytes(rep.kv_bytes_moved)} of KV")
    sources = [f"{_human_bytes(n)} from {src}" for src, n in (("peers", rep.weight_bytes_from_peers),
               ("the host copy", rep.weight_bytes_from_host), ("the checkpoint", rep.weight_bytes_from_checkpoint)) if n]
    if sources:
        lines.append("weights restored: " + ", ".join(sources))
    lines.append(f"timings: plan {_ms(rep.plan_seconds)}, prepare {_ms(rep.prepare_seconds)}, "
                 f"exchange {_ms(rep.exchange_seconds)} (remap {_ms(rep.remap_seconds)}), "
                 f"total {_ms(rep.total_seconds)}; serving paused {_ms(rep.pause_seconds)}"
                 + ("; the moved KV lands after the commit while serving" if rep.kv_in_background else ""))
    return "\n".join(lines)


def _mm_rpc(args: argparse.Namespace, fn):
    return _rpc(_target(args), fn, memory_manager_pb2_grpc.MemoryManagerStub)


def _finish_transition(rep, args: argparse.Namespace, fmt=None) -> None:
    """Print a transition's report (`fmt`, default format_report; --json as is); exit 1 when it did not complete."""
    _print(rep, args.json, lambda r: print((fmt or format_report)(r)))
    if not rep.completed:
        print(f"kunctl: {rep.op or 'transition'} not completed: {rep.error or 'no error given'}", file=sys.stderr)
        raise SystemExit(1)


def cmd_plan(args: argparse.Namespace) -> None:
    req = drop_request(args.require, None)
    plan = _mm_rpc(args, lambda stub: stub.PlanDrop(req, timeout=max(args.timeout, 30)))
    _print(plan, args.json, lambda p: print(format_plan(p)))


def cmd_drop(args: argparse.Namespace) -> None:
    req = drop_request(args.require, args.group)
    rep = _mm_rpc(args, lambda stub: stub.Drop(req, timeout=max(args.timeout, 300)))
    _finish_transition(rep, args)


def cmd_restore(args: argparse.Namespace) -> None:
    rep = _mm_rpc(args, lambda stub: stub.Restore(memory_manager_pb2.RestoreRequest(group_id=args.group or ""),
                                                  timeout=max(args.timeout, 300)))
    _finish_transition(rep, args)


# --- elastic tensor parallelism, in place or by cold re-form (MemoryManager.TransformTP / SplitTP) ------------------------------
def _tp_instances(instances) -> str:
    return "; ".join(f"{'+'.join(i.members)}{f' (TP{len(i.members)})' if len(i.members) > 1 else ''}: "
                     f"{i.kv_blocks} KV blocks ({i.kv_tokens} tokens)" for i in instances) or "unknown"


def format_tp_report(rep) -> str:
    """A TPReport (kunctl tp / tp-split) as text."""
    what = f"TP{rep.degree} over {', '.join(rep.members)}" if rep.op == "tp" else \
        f"split of {', '.join(rep.members)} into whole instances"
    if rep.completed:
        lines = [f"{rep.op} completed: {what}; layout epoch {rep.epoch}"]
    else:
        how = "healed: every member is a whole instance again" if rep.healed else "not completed"
        lines = [f"{rep.op} FAILED ({how}): {what}; layout epoch {rep.epoch}" + (f": {rep.error}" if rep.error else "")]
    lines.append(f"before: {_tp_instances(rep.before)}")
    lines.append(f"after:  {_tp_instances(rep.after)}")
    extra = f", rendezvous port {rep.port}" if rep.port else ""
    if rep.mode == "in-place":
        lines.append(f"in place (running requests kept running with their KV; the pool keeps the whole model){extra}; "
                     f"total {_ms(rep.total_seconds)}")
    else:
        lines.append(f"cold re-form (weights reloaded, no KV kept): {rep.handed_over} running request"
                     f"{'s' if rep.handed_over != 1 else ''} handed over to re-prefill{extra}; total {_ms(rep.total_seconds)}")
    return "\n".join(lines)


def _tp_mode(args: argparse.Namespace) -> str:
    return "in-place" if args.in_place else "cold" if args.cold else ""


def cmd_tp(args: argparse.Namespace) -> None:
    req = memory_manager_pb2.TransformTPRequest(worker_ids=args.group, degree=args.degree or 0, mode=_tp_mode(args))
    _finish_transition(_mm_rpc(args, lambda stub: stub.TransformTP(req, timeout=max(args.timeout, 600))), args, format_tp_report)


def cmd_tp_split(args: argparse.Namespace) -> None:
    req = memory_manager_pb2.SplitTPRequest(worker_id=args.group, mode=_tp_mode(args))
    _finish_transition(_mm_rpc(args, lambda stub: stub.SplitTP(req, timeout=max(args.timeout, 600))), args, format_tp_report)


def _mode_flags(p: argparse.ArgumentParser) -> None:
    how = p.add_mutually_exclusive_group()
    how.add_argument("--in-place", action="store_true", help="change the running processes: requests keep their KV")
    how.add_argument("--cold", action="store_true", help="re-execute the members: requests re-prefill")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kunctl", description="KunServe admin CLI.")
    p.add_argument("--config", help="cluster config file (TOML); default $KUNSERVE_CONFIG or built-in defaults")
    p.add_argument("--address", help="admin host:port (the memory manager; default: from the config)")
    p.add_argument("--token-file", help="file holding the admin token (default: $KUNSERVE_ADMIN_TOKEN, the config's "
                                        "[security] admin_token_file, then the file `kunserve up` writes)")
    p.add_argument("--timeout", type=float, default=5.0)
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="workers, KV usage, load and layout as a table")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.add_argument("--window", type=float, default=1.0, metavar="S",
                    help="bubble ratios over the next S seconds (the status is sampled twice); 0 = since each worker "
                         "started (default 1.0)")
    st.set_defaults(func=cmd_status)
    wa = sub.add_parser("watch", help="the status table, refreshed live until Ctrl-C",
                        description="Show `kunctl status` every --interval seconds, redrawn in place on a terminal "
                                    "(printed one after another when piped); bubble ratios are over the last interval. "
                                    "Ctrl-C ends it.")
    wa.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes (default 2)")
    wa.set_defaults(func=cmd_watch)
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

    require_help = f"the memory to free: {REQUIRE_FORMS}"
    pl = sub.add_parser(
        "plan", help="dry-run the drop planner (KunServe Fig. 6) for a requirement: groups, freed memory",
        description="Ask the memory manager for a drop plan (nothing changes): the pipeline groups it would form "
                    "(members in pipeline order, with the layer ranges they would hold), the memory it frees, whether "
                    "the requirement is met, and whether more instances are needed (autoscale).",
        epilog="examples: kunctl plan --require 512MiB; kunctl plan --require 1200 --json")
    pl.add_argument("--require", type=parse_requirement, metavar="N",
                    help=require_help + "; omitted: merge as far as the planner goes")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)
    dr = sub.add_parser(
        "drop", help="force a cluster drop: merge instances or groups into pipeline groups (planner or explicit --group)",
        description="Drive a drop through the workers: plan for --require (or take the explicit --group lists), "
                    "move the affected requests' KV, remap the freed weight pages into KV cache. Prints the "
                    "transition report (layout epoch, groups after, requests and KV bytes moved, timings); exits "
                    "1 when the drop did not complete (it is rolled back).",
        epilog="examples: kunctl drop (the planner's next merge: two instances, or two pairs into a quad); kunctl drop "
               "--require 1.5GiB; kunctl drop --group worker-0,worker-1 --group worker-2,worker-3")
    dr.add_argument("--require", type=parse_requirement, metavar="N", help=require_help)
    dr.add_argument("--group", type=parse_group, action="append", metavar="W0,W1",
                    help="one pipeline group, worker ids head first (repeatable); replaces the planner. Naming every "
                         "member of existing groups merges them (pairs -> a quad), laid out as the planner would")
    dr.add_argument("--json", action="store_true", help="print the transition report as JSON")
    dr.set_defaults(func=cmd_drop)
    rs = sub.add_parser(
        "restore", help="split dropped pipeline groups back: all into whole instances, or --group G one step",
        description="Restore the dropped layers of every pipeline group so each member is a whole instance "
                    "again, or with --group undo that group's last merge (a quad splits into pairs, a pair into "
                    "whole instances). Prints the transition report; exits 1 when it did not complete.",
        epilog="examples: kunctl restore; kunctl restore --group worker-0+worker-1")
    rs.add_argument("--group", metavar="G", help="the group id to restore (see kunctl status); default: every group")
    rs.add_argument("--json", action="store_true", help="print the transition report as JSON")
    rs.set_defaults(func=cmd_restore)
    tp = sub.add_parser(
        "tp", help="re-form co-located whole instances into one tensor-parallel instance (TP2 / TP4)",
        description="README 'Elastic tensor parallelism (Gyges)'. In place (--in-place): the members meet, split "
                    "their KV heads and exchange them, and rank 0 (the first id) serves every member's running "
                    "requests, which keep their KV. Cold (--cold): every member hands its running requests over "
                    "(they re-prefill on the new instance), restarts with a shard of every layer and meets the others. "
                    "Without either, memory_manager.tp_mode decides. Prints the report (KV capacity before and after, "
                    "time); exits 1 when it did not complete (every member is healed to a whole instance).",
        epilog="examples: kunctl tp --group worker-0,worker-1; kunctl tp --group w0,w1,w2,w3 --degree 4")
    tp.add_argument("--group", type=parse_group, required=True, metavar="W0,W1",
                    help="the members, rank 0 first; every one a serving whole instance on the same host")
    tp.add_argument("--degree", type=int, choices=(2, 4), help="the tensor-parallel degree (default: the group size)")
    tp.add_argument("--json", action="store_true", help="print the report as JSON")
    _mode_flags(tp)
    tp.set_defaults(func=cmd_tp)
    ts = sub.add_parser(
        "tp-split", help="split a tensor-parallel instance back into whole instances",
        description="Split the tensor-parallel instance --group names into whole instances. In place (an "
                    "instance formed in place): rank 0 takes the followers with it, the running requests are shared "
                    "among the members and keep their KV (refused while they would not fit the whole instances). "
                    "Cold (or an instance formed cold): every member re-forms as a whole instance of its own (rank 0 "
                    "first; its running requests re-prefill on one of them). Prints the report; exits 1 when it did "
                    "not complete.",
        epilog="example: kunctl tp-split --group worker-0")
    ts.add_argument("--group", required=True, metavar="W", help="any member of the tensor-parallel instance")
    ts.add_argument("--json", action="store_true", help="print the report as JSON")
    _mode_flags(ts)
    ts.set_defaults(func=cmd_tp_split)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "group", None) and args.command == "drop":
        try:
            drop_request(None, args.group)
        except ValueError as exc:
            parser.error(f"argument --group: {exc}")
    try:
        args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's final flush
    except BrokenPipeError:
        reader_went_away()


def reader_went_away() -> None:
    """stdout's reader closed the pipe (`kunctl status | head -1`): exit quietly, with status 1 as rich does for the
    tables (Python's recipe: point stdout at /dev/null, so that the flush at exit cannot raise again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise SystemExit(1)


if __name__ == "__main__":
    main()
