"""Dispatcher: the client API. Routes each request to the most-free healthy instance, relays its token
stream (adding text and timing), propagates cancellation, and owns the request record so that a
worker failure is reported to the client instead of silently losing the request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import grpc

from kunserve.shared.config import ClusterConfig
from kunserve.shared.convert import sampling_from_pb
from kunserve.shared.log import get_logger
from kunserve.shared.router import FreenessRouter, InstanceLoad
from kunserve.shared.rpc import insecure_channel
from kunserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

MAX_REQUEST_ID_LEN = 256


@dataclass
class RequestRecord:
    request_id: str
    prompt_token_ids: list[int]
    arrival: float
    worker_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    call: grpc.aio.UnaryStreamCall | None = None
    shutting_down: bool = False


class WorkerPool:
    """Channels to every worker plus the router fed by periodic GetStats polls."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.addresses = {w.id: w.address for w in cfg.workers}
        self.channels = {wid: insecure_channel(addr) for wid, addr in self.addresses.items()}
        self.stubs = {wid: worker_pb2_grpc.WorkerStub(ch) for wid, ch in self.channels.items()}
        self.router = FreenessRouter()
        self.log = get_logger()
        self._healthy: dict[str, bool] = {}

    async def poll_once(self, timeout: float = 1.0) -> None:
        async def one(wid: str) -> None:
            sent = time.monotonic()
            try:
                s = await self.stubs[wid].GetStats(common_pb2.Empty(), timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                # A busy worker answering late is not a dead one: keep its last state then.
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.mark(wid, False)
                return
            whole = s.layer_start == 0 and s.layer_end == s.num_layers_model
            self.router.update(InstanceLoad(wid, s.kv_blocks_total, s.kv_blocks_used, s.queued_demand_blocks,
                                            s.block_size or 16, True, sent, serving=whole))
            self.mark(wid, True)

        await asyncio.gather(*(one(w) for w in self.stubs))

    async def wait_for_workers(self, timeout_s: float) -> int:
        """Poll until every configured worker answers (or the deadline); returns how many are healthy.

        The dispatcher reports SERVING only after this, so "healthy" means it can route to the cluster."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.poll_once(timeout=1.0)
            healthy = sum(self._healthy.get(w, False) for w in self.stubs)
            if healthy == len(self.stubs) or loop.time() >= deadline:
                return healthy
            await asyncio.sleep(0.1)

    def mark(self, wid: str, healthy: bool) -> None:
        if self._healthy.get(wid) != healthy:
            self.log.info("worker_health_changed", worker=wid, healthy=healthy)
        self._healthy[wid] = healthy
        self.router.set_healthy(wid, healthy)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


class DispatcherServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, pool: WorkerPool, tokenizer) -> None:
        self.pool = pool
        self.tokenizer = tokenizer  # None when the model ships no tokenizer: token-id prompts only
        self.records: dict[str, RequestRecord] = {}
        self.log = get_logger()

    # -- helpers ----------------------------------------------------------------------------------
    async def _prompt_ids(self, request: generation_pb2.GenerateRequest, context) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            if self.tokenizer is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "prompt.text: the served model has no tokenizer; send prompt.token_ids")
            return list(self.tokenizer.encode(request.text))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set either text or token_ids")
        return []

    def _text(self, previous: list[int], token_id: int) -> str:
        if self.tokenizer is None or token_id < 0:
            return ""
        return self.tokenizer.decode_token(previous, token_id)

    # -- RPCs ---------------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: longer than {MAX_REQUEST_ID_LEN} characters")
        if rid in self.records:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running")
        prompt = await self._prompt_ids(request, context)
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        sampling = sampling_from_pb(request.sampling)
        if sampling.max_tokens <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.max_tokens: must be > 0, got {sampling.max_tokens}")
        record = RequestRecord(rid, prompt, arrival)
        self.records[rid] = record
        tried: set[str] = set()
        try:
            while True:
                wid = self.pool.router.choose(exclude=tried)
                if wid is None:
                    await self.pool.poll_once(timeout=2.0)  # maybe a worker is just coming (back) up
                    wid = self.pool.router.choose(exclude=tried)
                if wid is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "no healthy worker available" + (f" (tried {', '.join(sorted(tried))})" if tried else ""))
                tried.add(wid)
                record.worker_id = wid
                self.pool.router.routed(wid, rid, len(prompt) + 1, arrival)
                try:
                    async for ev in self._relay(record, request, sampling, context):
                        yield ev
                    return
                except grpc.aio.AioRpcError as exc:
                    retriable = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
                    if retriable and not record.token_ids and not record.shutting_down:
                        # The worker died, or dropped layers, before producing anything: nothing was
                        # streamed, so retry elsewhere.
                        if exc.code() == grpc.StatusCode.UNAVAILABLE:
                            self.pool.mark(wid, False)
                        self.log.warning("worker_unavailable_retrying", request_id=rid, worker=wid)
                        continue
                    await self._fail(record, exc, context)
                finally:
                    self.pool.router.done(wid, rid)
        finally:
            if record.call is not None:
                record.call.cancel()  # client went away or we failed: free the worker's KV now
            self.records.pop(rid, None)

    async def _relay(self, record: RequestRecord, request, sampling, context):
        wreq = worker_pb2.WorkerGenerateRequest(request_id=record.request_id, prompt_token_ids=record.prompt_token_ids,
                                                sampling=request.sampling)
        call = self.pool.stubs[record.worker_id].Generate(wreq)
        record.call = call
        last = record.arrival
        try:
            async for ev in call:
                now = time.monotonic()
                text = self._text(record.token_ids, ev.token_id)
                if ev.token_id >= 0:
                    record.token_ids.append(ev.token_id)
                yield generation_pb2.GenerateEvent(
                    request_id=record.request_id, token_id=ev.token_id, text=text, index=ev.index,
                    finish_reason=ev.finish_reason, elapsed_s=now - record.arrival, token_latency_s=now - last,
                    worker_id=record.worker_id, num_prompt_tokens=len(record.prompt_token_ids),
                )
                last = now
        except asyncio.CancelledError:
            if record.shutting_down:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                           details="the dispatcher is shutting down") from None
            raise
        finally:
            record.call = None
            if not call.done():
                call.cancel()

    async def _fail(self, record: RequestRecord, exc: grpc.aio.AioRpcError, context) -> None:
        code = exc.code()
        if record.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the dispatcher is shutting down; retry the request")
        if code == grpc.StatusCode.UNAVAILABLE or code == grpc.StatusCode.CANCELLED and record.token_ids:
            self.pool.mark(record.worker_id, False)
            self.log.warning("worker_failed_mid_stream", request_id=record.request_id, worker=record.worker_id,
                             tokens=len(record.token_ids), error=exc.details())
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"worker {record.worker_id} failed after {len(record.token_ids)} tokens: {exc.details()}")
        # Validation and other errors from the worker keep their status and message.
        await context.abort(code, exc.details() or code.name)

    async def Cancel(self, request, context):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        record = self.records.get(rid)
        if record is None or not record.worker_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {rid!r}")
        try:
            await self.pool.stubs[record.worker_id].Cancel(common_pb2.CancelRequest(request_id=rid), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                await context.abort(exc.code(), f"cancel on worker {record.worker_id}: {exc.details()}")
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {rid!r} already finished")
        return common_pb2.CancelResponse(cancelled=True)

    async def shutdown(self) -> None:
        for record in list(self.records.values()):
            record.shutting_down = True
            if record.call is not None:
                record.call.cancel()
