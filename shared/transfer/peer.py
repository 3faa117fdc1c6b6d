"""A stand-alone transfer peer for tests and benchmarks: ``python -m kunserve.shared.transfer.peer``.

Listens (UCX), prints ``TRANSFER_PEER_READY {"port": N, "name": ...}`` on stdout, then serves:

- any data message whose ``name`` is ``"echo"`` is sent back to its sender with the same kind and
  metadata, named ``"echo-reply"``;
- CONTROL ``"report"`` is answered with CONTROL ``"report"`` whose payload is JSON:
  ``{"recv": [[t, kind, message_id, chunk_index, nbytes, last], ...], "stats": {...}}`` (receive trace,
  ``t`` from time.perf_counter(), comparable across processes on one host), and the trace is cleared;
- CONTROL ``"exit"`` (or stdin reaching EOF, e.g. the parent died) closes the service and exits.

The cluster secret for the link handshake comes from $KUNSERVE_CLUSTER_SECRET (required).

``--kv-pool-mib N`` receives KV_EXCHANGE messages into one preallocated, pre-touched buffer (as a worker
receives into its KV cache) instead of a fresh tensor per message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from typing import Any

import torch

from kunserve.shared.credentials import CLUSTER_SECRET
from kunserve.shared.log import configure_logging

from .framing import ACTIVATION, CHECKPOINT, CONTROL, KV_EXCHANGE, WEIGHTS, torch_dtype
from .service import Received, TransferConfig, TransferService

READY = "TRANSFER_PEER_READY "


async def serve(args: argparse.Namespace) -> None:
    config = TransferConfig(target_chunk_s=args.target_chunk_s, min_chunk_bytes=args.min_chunk_bytes,
                            max_chunk_bytes=args.max_chunk_bytes, trace_len=args.trace)
    svc = TransferService(args.name, config=config, secret=os.environ[CLUSTER_SECRET.env].encode())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def watch_stdin() -> None:
        try:
            sys.stdin.buffer.read()
        finally:
            loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()

    def on_data(msg: Received) -> None:
        if msg.header.name == "echo":
            h = msg.header
            svc.submit(msg.peer, h.kind, msg.data, request_ids=list(h.request_ids), layer_start=h.layer_start,
                       layer_end=h.layer_end, epoch=h.epoch, name="echo-reply")

    def on_control(msg: Received) -> None:
        if msg.header.name == "report":
            recv = [[e.t, e.kind, e.message_id, e.chunk_index, e.nbytes, e.last] for e in svc.trace
                    if e.op == "recv" and e.peer == msg.peer]
            svc.trace.clear()
            body = json.dumps({"recv": recv, "stats": svc.stats()}).encode()
            svc.submit(msg.peer, CONTROL, body, name="report")
        elif msg.header.name == "exit":
            stop.set()

    if args.kv_pool_mib:
        pool = torch.zeros(args.kv_pool_mib << 20, dtype=torch.uint8)  # zeros: pages touched up front

        def into_pool(peer: str, header: Any) -> Any:
            if header.total_bytes > pool.numel() or header.name == "echo":
                return None
            dtype = torch_dtype(header.dtype)
            return pool[:header.total_bytes].view(dtype).view(list(header.shape))

        svc.set_allocator(KV_EXCHANGE, into_pool)
    for kind in (ACTIVATION, KV_EXCHANGE, WEIGHTS, CHECKPOINT):
        svc.on_message(kind, on_data)
    svc.on_message(CONTROL, on_control)
    port = await svc.start(args.port)
    print(READY + json.dumps({"port": port, "name": args.name}), flush=True)
    try:
        await stop.wait()
    finally:
        await svc.close(drain=True, timeout=5.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="peer")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--target-chunk-s", type=float, default=0.005)
    ap.add_argument("--min-chunk-bytes", type=int, default=64 * 1024)
    ap.add_argument("--max-chunk-bytes", type=int, default=64 << 20)
    ap.add_argument("--trace", type=int, default=100_000)
    ap.add_argument("--kv-pool-mib", type=int, default=0, help="receive KV_EXCHANGE into a preallocated buffer")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    if not os.environ.get(CLUSTER_SECRET.env):
        ap.error(f"${CLUSTER_SECRET.env} must hold the cluster secret (the link handshake needs it)")
    configure_logging("transfer-peer", level=args.log_level)  # logs to stderr; stdout carries the port line
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
