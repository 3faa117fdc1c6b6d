"""gRPC face of a worker: request streams in and out of the engine thread, stats, info.

The engine runs in its own thread (EngineLoop); this servicer only moves events between that thread
and the asyncio event loop, so RPCs and the stats stream stay responsive while a batch computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from kunserve.shared.convert import finish_to_pb, sampling_from_pb, stats_to_pb
from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest, TokenEvent
from kunserve.shared.log import get_logger
from kunserve.shared.streams import Shutdown, StreamRegistry
from kunserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str
    model_name: str
    num_layers_model: int
    layer_start: int
    layer_end: int
    vocab_size: int
    max_model_len: int
    device: str
    dtype: str


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, identity: WorkerIdentity, engine_loop) -> None:  # engine_loop: EngineLoop
        self.identity = identity
        self.engine = engine_loop
        self.streams: StreamRegistry[TokenEvent] = StreamRegistry()
        self.log = get_logger()

    # -- requests ---------------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        if rid in self.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running on this worker")
        engine_request = EngineRequest(
            request_id=rid,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=sampling_from_pb(request.sampling),
            arrival_time=time.monotonic(),
        )
        queue = self.streams.open(rid)
        finished = False
        try:
            try:
                self.engine.submit(engine_request, lambda ev: self.streams.put_threadsafe(rid, ev))
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            while True:
                item = await queue.get()
                if isinstance(item, Shutdown):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, item.message)
                ev: TokenEvent = item
                if ev.finish_reason is FinishReason.ABORTED and ev.token_id < 0:
                    finished = True
                    yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=-1, index=ev.index,
                                                      finish_reason=finish_to_pb(ev.finish_reason))
                    return
                yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=ev.token_id, index=ev.index,
                                                  finish_reason=finish_to_pb(ev.finish_reason))
                if ev.finished:
                    finished = True
                    return
        finally:
            # Client went away (cancelled RPC), shutdown, or error: free the request's KV blocks now.
            if not finished:
                self.engine.abort(rid)
            self.streams.close(rid)

    async def Cancel(self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        if not self.engine.abort(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {request.request_id!r}")
        return common_pb2.CancelResponse(cancelled=True)

    # -- observation ------------------------------------------------------------------------------
    def current_stats(self) -> common_pb2.WorkerStats:
        ident = self.identity
        return stats_to_pb(
            self.engine.stats(), worker_id=ident.worker_id, address=ident.address, timestamp_unix_s=time.time(),
            layer_start=ident.layer_start, layer_end=ident.layer_end, num_layers_model=ident.num_layers_model,
        )

    async def GetStats(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        return self.current_stats()

    async def GetInfo(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        ident = self.identity
        stats = self.engine.stats()
        return worker_pb2.WorkerInfo(
            worker_id=ident.worker_id, address=ident.address, model_name=ident.model_name,
            num_layers_model=ident.num_layers_model, layer_start=ident.layer_start, layer_end=ident.layer_end,
            vocab_size=ident.vocab_size, max_model_len=ident.max_model_len, block_size=stats.block_size,
            kv_blocks_total=stats.kv_blocks_total, device=ident.device, dtype=ident.dtype,
        )

    async def shutdown(self) -> None:
        """End every in-flight stream with UNAVAILABLE, then stop the engine thread."""
        self.streams.shutdown_all(f"worker {self.identity.worker_id} is shutting down")
        self.engine.stop(timeout=5.0)
