"""`kunserve batch`: offline batches on the dispatcher's Batches service (OpenAI Batch-format JSONL files).

    ID=$(kunserve batch submit requests.jsonl)         # prints the batch id; --wait follows it with a progress bar
    kunserve batch status $ID
    kunserve batch list
    kunserve batch results $ID -o results.jsonl        # one result line per request, in input order
    kunserve batch cancel $ID

Each line of the file is {"custom_id", "method": "POST", "url": "/v1/completions" or "/v1/chat/completions",
"body"}; the body is what that endpoint of the HTTP front takes. The requests run as offline requests and
survive a dispatcher restart. Errors are one line on stderr and a non-zero exit (2 for a batch that did not
complete, with --wait).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import IO, Any, NoReturn, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict

from kunserve import client
from kunserve.shared.config import ConfigError, load_config
from kunserve.v1 import batch_pb2, batch_pb2_grpc

CHUNK_BYTES = 32 * 1024  # well under the dispatcher's gRPC message limit, whatever its prompt limit
TERMINAL = ("completed", "expired", "cancelled", "failed")
BAR_WIDTH = 30
T = TypeVar("T")


def _fail(msg: str, code: int = 1) -> NoReturn:
    print(f"kunserve batch: {msg}", file=sys.stderr)
    raise SystemExit(code)


def _call(args: argparse.Namespace, fn: Callable[[batch_pb2_grpc.BatchesStub], Awaitable[T]]) -> T:
    """Run `fn` with a Batches stub on the dispatcher (--address, else the config's); a gRPC error is one line."""
    try:
        cfg = load_config(args.config)
        creds = client.credentials_from(cfg)
    except ConfigError as exc:
        raise SystemExit(f"kunserve batch: config error: {exc}") from None
    address = args.address or cfg.dispatcher.address

    async def run() -> T:
        async with client.dispatcher_channel(address, creds) as ch:
            return await fn(batch_pb2_grpc.BatchesStub(ch))

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as exc:
        _fail(f"{exc.code().name}: {exc.details()}")
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def _summary(b: batch_pb2.Batch) -> str:
    c = b.request_counts
    return f"{b.id} {b.status}: {c.completed} completed, {c.failed} failed, {c.total} total"


def _print_batch(b: batch_pb2.Batch, as_json: bool) -> None:
    if as_json:
        print(json.dumps(MessageToDict(b, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
        return
    print(_summary(b))
    for name in ("endpoint", "completion_window", "input_file_id", "output_file_id", "error_file_id"):
        if value := getattr(b, name):
            print(f"  {name}: {value}")
    for name in ("created_at", "expires_at", "cancelling_at", "completed_at", "expired_at", "cancelled_at"):
        if value := getattr(b, name):
            print(f"  {name}: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(value))}")
    for k, v in sorted(b.metadata.items()):
        print(f"  metadata.{k}: {v}")


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line per change otherwise."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last = ""
        self.start = time.monotonic()

    def show(self, b: batch_pb2.Batch) -> None:
        c = b.request_counts
        done = c.completed + c.failed
        filled = BAR_WIDTH * done // c.total if c.total else 0
        text = (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{c.total} ({c.failed} failed) {b.status} "
                f"{time.monotonic() - self.start:.0f}s")
        if self.tty:
            self.out.write("\r" + text)
        elif text.rsplit(" ", 1)[0] != self.last.rsplit(" ", 1)[0]:
            self.out.write(text + "\n")
        self.out.flush()
        self.last = text

    def close(self) -> None:
        if self.tty and self.last:
            self.out.write("\n")
            self.out.flush()


def _metadata(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--metadata: expected KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


async def _chunks(path: str, header: batch_pb2.CreateBatchChunk) -> AsyncIterator[batch_pb2.CreateBatchChunk]:
    """The file in pieces; the first carries the header (an empty file sends the header alone)."""
    first: batch_pb2.CreateBatchChunk | None = header
    with open(path, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            if first is not None:
                first.data, chunk, first = data, first, None
                yield chunk
            else:
                yield batch_pb2.CreateBatchChunk(data=data)
    if first is not None:
        yield first


async def _follow(stub: batch_pb2_grpc.BatchesStub, batch: batch_pb2.Batch, poll_s: float) -> batch_pb2.Batch:
    bar = Progress(sys.stderr)
    try:
        while True:
            bar.show(batch)
            if batch.status in TERMINAL:
                return batch
            await asyncio.sleep(poll_s)
            batch = await stub.GetBatch(batch_pb2.BatchRef(batch_id=batch.id))
    finally:
        bar.close()


def cmd_submit(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.file):
        _fail(f"{args.file}: no such file")
    header = batch_pb2.CreateBatchChunk(endpoint=args.endpoint or "", completion_window=args.completion_window,
                                        metadata=_metadata(args.metadata), filename=os.path.basename(args.file))

    async def submit(stub: batch_pb2_grpc.BatchesStub) -> batch_pb2.Batch:
        batch = await stub.CreateBatch(_chunks(args.file, header))
        print(batch.id, flush=True)
        return await _follow(stub, batch, args.poll) if args.wait else batch

    batch = _call(args, submit)
    if args.wait:
        print(_summary(batch), file=sys.stderr)
        if batch.status != "completed":
            raise SystemExit(2)


def cmd_status(args: argparse.Namespace) -> None:
    _print_batch(_call(args, lambda stub: stub.GetBatch(batch_pb2.BatchRef(batch_id=args.id))), args.json)


def cmd_list(args: argparse.Namespace) -> None:
    page = _call(args, lambda stub: stub.ListBatches(batch_pb2.ListBatchesRequest(limit=args.limit, after=args.after or "")))
    for b in page.batches:
        if args.json:
            _print_batch(b, True)
        else:
            print(f"{_summary(b)}  created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(b.created_at))}")
    if page.has_more and not args.json:
        print(f"(more: --after {page.batches[-1].id})", file=sys.stderr)


def cmd_cancel(args: argparse.Namespace) -> None:
    print(_summary(_call(args, lambda stub: stub.CancelBatch(batch_pb2.BatchRef(batch_id=args.id)))))


def cmd_results(args: argparse.Namespace) -> None:
    async def results(stub: batch_pb2_grpc.BatchesStub) -> tuple[int, int, batch_pb2.Batch]:
        batch = await stub.GetBatch(batch_pb2.BatchRef(batch_id=args.id))  # NOT_FOUND before a file is created
        n = failed = 0
        with contextlib.ExitStack() as stack:
            out: IO[str] = stack.enter_context(open(args.output, "w", encoding="utf-8")) if args.output != "-" else sys.stdout
            async for r in stub.GetBatchResults(batch_pb2.BatchResultsRequest(batch_id=args.id)):
                out.write(r.line + "\n")
                n += 1
                failed += not r.ok
        return n, failed, batch

    try:
        n, failed, batch = _call(args, results)
    except OSError as exc:
        _fail(f"-o {args.output}: {exc.strerror}")
    pending = batch.request_counts.total - n
    note = f", {pending} still pending" if pending > 0 and batch.status not in TERMINAL else ""
    print(f"{n} result lines ({failed} errors){note}" + (f" written to {args.output}" if args.output != "-" else ""),
          file=sys.stderr)


def register(sub: Any) -> None:
    p = sub.add_parser("batch", help="offline batches (OpenAI Batch-format JSONL): submit, follow, fetch results")
    verbs = p.add_subparsers(dest="batch_command", required=True)

    def verb(name: str, help_: str, func: Callable[[argparse.Namespace], None]) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=help_)
        v.add_argument("--address", help="dispatcher host:port (default: from the config)")
        v.set_defaults(func=func)
        return v

    s = verb("submit", "submit a JSONL file; prints the batch id", cmd_submit)
    s.add_argument("file", help="OpenAI Batch-format JSONL: one {custom_id, method, url, body} per line")
    s.add_argument("--endpoint", choices=["/v1/completions", "/v1/chat/completions"],
                   help="the batch's endpoint (default: the first line's url)")
    s.add_argument("--completion-window", default="24h", help="the batch expires after this (24h; <N>s, <N>m, <N>h)")
    s.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="a metadata pair (repeatable)")
    s.add_argument("--wait", action="store_true", help="follow it to its end with a progress bar on stderr; exit 2 "
                   "unless it completed")
    s.add_argument("--poll", type=float, default=0.5, help="seconds between status polls with --wait")

    st = verb("status", "a batch's status and request counts", cmd_status)
    st.add_argument("id")
    st.add_argument("--json", action="store_true", help="one JSON object")

    ls = verb("list", "batches, newest first", cmd_list)
    ls.add_argument("--limit", type=int, default=20, help="at most this many (1 to 100)")
    ls.add_argument("--after", help="continue after this batch id")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")

    r = verb("results", "the result lines recorded so far, in input order", cmd_results)
    r.add_argument("id")
    r.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")

    c = verb("cancel", "cancel a batch: its running requests stop, the rest never run", cmd_cancel)
    c.add_argument("id")
