"""gRPC face of a worker: request streams in and out of the engine thread, stats, info.

The engine runs in its own thread (EngineLoop); this servicer only moves events between that thread
and the asyncio event loop, so RPCs and the stats stream stay responsive while a batch computes.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from kunserve.shared.config import TensorParallelSection
from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest, TokenEvent
from kunserve.shared.engine.engine import HealFailed, InstanceBroken
from kunserve.shared.engine.loop import EngineStopped
from kunserve.shared.engine.pooled import LayerChange, PooledInstance
from kunserve.shared.engine.tensor_parallel import TPFollower
from kunserve.shared.engine.tp_transform import TransformReport
from kunserve.shared.epochs import epoch_error
from kunserve.shared.log import get_logger
from kunserve.shared.memory.errors import MemoryPoolError
from kunserve.shared.model.tp_capacity import in_place_kv_tokens_by_degree, kv_tokens_by_degree
from kunserve.shared.model.weights import ModelSource
from kunserve.shared.rpc import REFORMING, WORKER_END
from kunserve.shared.streams import Shutdown, StreamRegistry
from kunserve.shared.transfer.service import TransferError
from kunserve.shared.wire.cluster_state import busy_idle_fields, engine_stats_to_pb
from kunserve.shared.wire.requests import finish_to_pb, logprobs_to_pb, sampling_from_pb
from kunserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .cluster_membership import ClusterMembership, MembershipRefused
from .handover import Moved, StreamHandover
from .relayout import TransitionRefused, TransitionRunner
from .tp_in_place import InPlaceTP
from .tp_member import TPArgs, TPMembership, check_model_degree, pick_free_port

DRAIN_POLL_S = 0.05
HANDOVER_WAIT_S = 5.0  # after a drain's timeout: how long the ended streams take to close
REEXEC_AFTER_S = 0.05  # after a ReformTP answer: the graceful stop that ends in the re-exec
REFORM_SEEN_WAIT_S = 1.0  # at most: a polled worker stays up until a stats poll saw it re-forming


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str
    model_name: str
    num_layers_model: int
    vocab_size: int
    max_model_len: int
    device: str
    dtype: str


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, identity: WorkerIdentity, engine_loop, instance: PooledInstance,
                 transfer=None, transition_timeout_s: float = 60.0, tp: TPMembership | None = None,
                 whole_model: ModelSource | None = None, tp_mode: str = "cold") -> None:
        self.identity = identity
        self.tp = tp  # its tensor-parallel instance (None: a whole instance of its own)
        self.whole_model = whole_model  # the unsharded model (None: not known; a re-form's degree is checked at build)
        self.reform: TPArgs | None = None  # set by ReformTP: the membership to re-execute with once stopped
        self.tp_mode = tp_mode  # memory_manager.tp_mode: how this cluster's TP changes happen unless asked otherwise
        self.engine = engine_loop  # EngineLoop
        self.instance = instance
        self._remap_lock = asyncio.Lock()  # one drop / restore at a time
        self.streams: StreamRegistry[TokenEvent] = StreamRegistry()
        self.log = get_logger()
        self.undropped_blocks = instance.capacity_for(0, identity.num_layers_model)
        # Cluster layout transitions (drop into / restore from pipeline groups); needs the transfer service.
        self.transitions: TransitionRunner | None = None
        self._transition_timeout_s = transition_timeout_s
        # Streams of requests that move between workers (a transition's, an in-place TP change's): one per process.
        self.handover = StreamHandover(self.streams, engine_loop, transition_timeout_s)
        self.in_place = InPlaceTP(engine_loop, instance, self.handover, lambda rid: rid in self.streams,
                                  lambda: self.transitions.peers if self.transitions is not None else None)
        self.reform_in_place = False  # `reform` is an in-place change under way (no re-exec follows)
        self._loop: asyncio.AbstractEventLoop | None = None  # the service's, for a follower thread's SPLIT
        self._context = contextvars.copy_context()
        if transfer is not None:
            self.attach_transfer(transfer)
        # Runtime membership (standby, draining); None: always in service (a worker run without a memory manager)
        self.cluster: ClusterMembership | None = None
        self._draining: asyncio.Future | None = None  # the drain under way (it outlives a cancelled Drain call)
        self._reforming: asyncio.Future | None = None  # the re-form's drain (it outlives a cancelled ReformTP call)
        self._polled_at = -math.inf  # when a GetStats was last answered (time.monotonic())
        self._kv_by_degree: dict[int, int] | None = None  # see _kv_tokens_by_degree (the pool's size never changes)

    def attach_transfer(self, transfer) -> None:
        """Take part in layout transitions over `transfer` (at start, or once its port came free)."""
        self.transitions = TransitionRunner(self.identity.worker_id, self.engine, self.instance, transfer, self.streams,
                                            self._transition_timeout_s, self.handover)

    # -- layout state ---------------------------------------------------------------------------------
    @property
    def transitioning(self) -> bool:
        return self.transitions is not None and self.transitions.transitioning

    @property
    def in_service(self) -> bool:
        """Not a standby worker, not draining, not removed from the cluster."""
        return self.cluster is None or self.cluster.in_service

    @property
    def serving(self) -> bool:
        """Routable: a whole instance, the head of a pipeline group or rank 0 of a tensor-parallel instance."""
        return (self.engine.running and self.engine.engine.serving and not self.transitioning and self.in_service
                and (self.tp is None or self.tp.is_leader) and self.reform is None)

    # -- requests ---------------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        if request.attach:
            queue = self.handover.attach(rid)
            if queue is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no request {rid!r} moved to worker "
                                    f"{self.identity.worker_id} (or it was attached already)")
            assert queue is not None
            async for ev in self._pump(rid, queue, context):
                yield ev
            return
        if self.transitioning:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is changing its layout (drop / restore); "
                                "retry shortly or on another worker")
        if self.cluster is not None and not self.cluster.in_service:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.cluster.why_not_serving())
        if self.reform is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._reforming_message(),
                                trailing_metadata=((REFORMING, "1"),))
        if self.tp is not None and not self.tp.is_leader:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is {self.tp.describe()}; send requests to "
                                f"{self.tp.members[0]}")
        if rid in self.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running on this worker")
        engine_request = EngineRequest(
            request_id=rid,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=sampling_from_pb(request.sampling),
            arrival_time=time.monotonic(),
            offline=request.request_class == common_pb2.REQUEST_CLASS_OFFLINE,
        )
        if not self.engine.engine.serving:
            start, end = self.instance.layer_range
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} holds layers [{start}, {end}) of "
                                f"{self.identity.num_layers_model} and is a later stage of its pipeline group; "
                                "send requests to the group's head")
        queue = self.streams.open(rid)
        try:
            self.engine.submit(engine_request, lambda ev: self.streams.put_threadsafe(rid, ev))
        except InvalidRequest as exc:
            self.streams.close(rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineStopped as exc:
            self.streams.close(rid)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.identity.worker_id}: {exc}")
        async for ev in self._pump(rid, queue, context):
            yield ev

    async def _pump(self, rid: str, queue: asyncio.Queue, context):
        """Relay one request's engine events to its stream until it finishes, moves or is lost."""
        wid = self.identity.worker_id
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Shutdown) and self.reform is not None and not self.reform_in_place:
                    # handed over for a re-form: the dispatcher resumes it once a re-formed instance serves (this
                    # worker is not written off for it, as a worker that went away would be)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self._reforming_message()}; resume",
                                        trailing_metadata=((REFORMING, "1"),))
                if isinstance(item, Shutdown):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, item.message,
                                        trailing_metadata=((WORKER_END, "shutdown"),))
                if isinstance(item, Moved):
                    finished = True  # the engine here no longer has it
                    yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=-1, moved_to=item.worker_id)
                    return
                ev: TokenEvent = item
                if ev.finish_reason is FinishReason.ERROR:
                    # This request alone failed (the engine goes on): INTERNAL, which the dispatcher passes to
                    # its client instead of carrying the request to another worker.
                    finished = True
                    self.streams.close(rid, queue)  # the engine no longer has it (see the LOST case below)
                    await context.abort(grpc.StatusCode.INTERNAL, f"request {rid!r} failed on worker {wid}: "
                                        f"{ev.error}")
                if ev.finish_reason is FinishReason.LOST or (
                        ev.finish_reason is FinishReason.ABORTED and ev.token_id < 0 and self.engine.error is not None):
                    finished = True
                    why = f"engine failed: {self.engine.error!r}" if self.engine.error is not None else \
                        "it cannot serve this request any more (layout changed)"
                    # forgotten before the status goes out: abort() sends it and only then raises, so the
                    # dispatcher may resume the request here before this generator's `finally` runs
                    self.streams.close(rid, queue)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {wid}: {why}; resume it elsewhere",
                                        trailing_metadata=((WORKER_END, "lost"),))
                if ev.finish_reason is FinishReason.ABORTED and ev.token_id < 0:
                    finished = True
                    yield worker_pb2.WorkerTokenEvent(request_id=rid, token_id=-1, index=ev.index,
                                                      finish_reason=finish_to_pb(ev.finish_reason))
                    return
                out = worker_pb2.WorkerTokenEvent(request_id=rid, token_id=ev.token_id, index=ev.index,
                                                  finish_reason=finish_to_pb(ev.finish_reason))
                logprobs_to_pb(ev, out)
                yield out
                if ev.finished:
                    finished = True
                    return
        finally:
            # Client went away (cancelled RPC), shutdown, or error: free the request's KV blocks now.
            if not finished:
                self.engine.abort(rid)
            self.streams.close(rid, queue)

    async def Cancel(self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        if not self.engine.abort(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {request.request_id!r}")
        return common_pb2.CancelResponse(cancelled=True)

    # -- observation ------------------------------------------------------------------------------
    def _layout_fields(self) -> dict:
        t = self.transitions
        return dict(serving=self.serving, group_id=t.unit_id if t else self.identity.worker_id,
                    group_members=t.members if t else [self.identity.worker_id], epoch=t.epoch if t else 0,
                    transitioning=self.transitioning, tp_degree=self.tp.degree if self.tp else 1,
                    tp_members=list(self.tp.members) if self.tp else [self.identity.worker_id])

    def current_stats(self) -> common_pb2.WorkerStats:
        ident = self.identity
        start, end = self.instance.layer_range
        engine = getattr(self.engine, "engine", None)  # the EngineLoop's Engine: busy / idle / bubble seconds
        busy_idle = busy_idle_fields(engine.busy_idle()) if engine is not None and hasattr(engine, "busy_idle") else {}
        return engine_stats_to_pb(
            self.engine.stats(), worker_id=ident.worker_id, address=ident.address, timestamp_unix_s=time.time(),
            layer_start=start, layer_end=end, num_layers_model=ident.num_layers_model,
            kv_blocks_undropped=self.undropped_blocks, reforming=self.reform is not None, **self._layout_fields(),
            **busy_idle,
        )

    async def GetStats(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        if self.engine.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"worker {self.identity.worker_id}: engine failed: {self.engine.error!r}")
        stats = self.current_stats()
        self._polled_at = time.monotonic()
        return stats

    async def GetInfo(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        ident = self.identity
        stats = self.engine.stats()
        start, end = self.instance.layer_range
        return worker_pb2.WorkerInfo(
            worker_id=ident.worker_id, address=ident.address, model_name=ident.model_name,
            num_layers_model=ident.num_layers_model, layer_start=start, layer_end=end,
            vocab_size=ident.vocab_size, max_model_len=ident.max_model_len, block_size=stats.block_size,
            kv_blocks_total=stats.kv_blocks_total, device=ident.device, dtype=ident.dtype,
            transfer_address=self.transitions.svc.address if self.transitions else "",
            transfer_peers=self.transitions.svc.peers if self.transitions else [],
            transition_epoch=self.transitions.transition_epoch if self.transitions else 0, **self._layout_fields(),
            kv_tokens_by_degree=self._kv_tokens_by_degree(start, end),
        )

    def _kv_tokens_by_degree(self, start: int, end: int) -> dict[int, int]:
        """The KV tokens an instance of each degree the model shards at would hold with this worker's pool as every
        member's, whatever degree it runs at now (transformation-aware routing sizes scale-ups with it); empty while
        it holds part of the model (dropped layers)."""
        if (start, end) != (0, self.identity.num_layers_model):
            return {}
        if self._kv_by_degree is None:
            pool = self.instance.pool
            cfg = self.whole_model.config if self.whole_model is not None else self.instance.cfg
            n, page, block, dev = pool.num_pages, pool.page_size, self.instance.layout.block_size, pool.device.type
            if self.tp_mode == "in-place":  # members keep their whole-model pools (less the MLP shards they release)
                self._kv_by_degree = in_place_kv_tokens_by_degree(cfg, num_pages=n, page_size=page, block_size=block,
                                                                  device_type=dev, padded_mlp=self.instance.padded_mlp)
            else:
                self._kv_by_degree = kv_tokens_by_degree(cfg, num_pages=n, page_size=page, block_size=block,
                                                         device_type=dev)
        return self._kv_by_degree

    # -- memory pool --------------------------------------------------------------------------------------
    async def _on_engine(self, context, fn):
        """Run fn(engine) on the engine thread between iterations; map pool errors to gRPC statuses."""
        try:
            return await asyncio.wrap_future(self.engine.call(lambda _engine: fn()))
        except MemoryPoolError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _change_pb(self, change: LayerChange) -> worker_pb2.LayerChange:
        r = change.result
        return worker_pb2.LayerChange(
            op=r.op, layers=list(r.layers), layer_start=r.layer_start, layer_end=r.layer_end,
            kv_blocks_before=r.old_num_blocks, kv_blocks_after=r.new_num_blocks, pages_unmapped=r.pages_unmapped,
            pages_mapped=r.pages_mapped, compaction_moves=change.compaction_moves, remap_seconds=r.seconds,
            fill_seconds=r.fill_seconds, weight_source=change.weight_source, generation=r.generation)

    @staticmethod
    async def _layers(request, context) -> list[int]:
        layers = list(request.layers)
        if not layers:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "layers: must not be empty")
        return layers

    async def _not_tensor_parallel(self, context) -> None:
        if self.tp is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is {self.tp.describe()}: the parameter drop, "
                                "restore and migration are not supported on tensor-parallel instances")

    async def _not_reforming(self, context) -> None:
        if self.reform is not None:
            await context.abort(grpc.StatusCode.ABORTED, self._reforming_message())

    async def _not_in_group(self, context) -> None:
        await self._not_reforming(context)
        await self._not_tensor_parallel(context)
        t = self.transitions
        if t is not None and (t.role is not None or t.transitioning):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is in pipeline group {t.unit_id}: change its layers "
                                "through the memory manager (kunctl restore / drop), not one worker at a time")

    async def DropLayers(self, request: worker_pb2.DropLayersRequest, context: grpc.aio.ServicerContext):
        layers = await self._layers(request, context)
        await self._not_in_group(context)
        async with self._remap_lock:
            change = await self._on_engine(context, lambda: self.instance.drop(layers))
        self.log.info("layers_dropped", layers=layers, held=list(self.instance.layer_range),
                      kv_blocks=[change.result.old_num_blocks, change.result.new_num_blocks],
                      ms=round(change.result.seconds * 1e3, 3))
        return self._change_pb(change)

    async def RestoreLayers(self, request: worker_pb2.RestoreLayersRequest, context: grpc.aio.ServicerContext):
        layers = await self._layers(request, context)
        await self._not_in_group(context)
        source = request.source or ("host" if self.instance.host_copy is not None else "checkpoint")
        async with self._remap_lock:
            change = await self._on_engine(context, lambda: self.instance.restore(layers, source))
        self.log.info("layers_restored", layers=layers, held=list(self.instance.layer_range), source=source,
                      kv_blocks=[change.result.old_num_blocks, change.result.new_num_blocks],
                      compaction_moves=change.compaction_moves, ms=round(change.result.seconds * 1e3, 3))
        return self._change_pb(change)

    async def GetMemoryMap(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext):
        m = await self._on_engine(context, self.instance.memory_map)
        kv = m["kv"]
        return worker_pb2.MemoryMap(
            worker_id=self.identity.worker_id, backend=m["backend"], device=m["device"], page_size=m["page_size"],
            num_pages=m["num_pages"], free_pages=m["free_pages"], layer_start=m["layer_start"],
            layer_end=m["layer_end"], num_layers_model=m["num_layers_model"], weight_pages=m["weight_pages"],
            weight_bytes=m["weight_bytes"], block_size=kv["block_size"], block_bytes=kv["block_bytes"],
            kv_pages_per_layer=kv["pages_per_layer"], kv_blocks=kv["num_blocks"], kv_blocks_used=kv["used_blocks"],
            kv_capacity_tokens=kv["capacity_tokens"], kv_capacity_bytes=kv["capacity_bytes"],
            layers=[worker_pb2.LayerMemory(layer=x["layer"], weight_pages=x["weight_pages"],
                                           weight_bytes=x["weight_bytes"], kv_pages=x["kv_pages"],
                                           kv_blocks=x["kv_blocks"]) for x in m["layers"]],
            groups=[worker_pb2.WeightGroupMemory(name=g["name"], pages=g["pages"], bytes=g["bytes"])
                    for g in m["groups"]],
            page_runs=[worker_pb2.PageRun(first_page=a, count=b, owner=o) for a, b, o in m["page_runs"]],
            host_copy_bytes=m["host_copy_bytes"], generation=m["generation"])

    # -- layout transitions (driven by the memory manager) -------------------------------------------------
    async def _require_transfer(self, context) -> None:
        if self.transitions is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} runs without a transfer service")

    async def _transition(self, context, step, epoch: int | None = None):
        await self._require_transfer(context)
        assert self.transitions is not None
        if epoch is not None:
            why = epoch_error(epoch, self.transitions.epoch)
            if why is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker {self.identity.worker_id}: {why}")
        try:
            return await step(self.transitions)
        except TransitionRefused as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), f"worker {self.identity.worker_id}: {exc}")
        except (MemoryPoolError, ValueError, TimeoutError, RuntimeError, TransferError) as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"worker {self.identity.worker_id}: transition failed "
                                f"({type(exc).__name__}: {exc}); healed to a whole instance")

    async def PrepareTransition(self, request: worker_pb2.TransitionSpec, context: grpc.aio.ServicerContext):
        await self._not_reforming(context)
        await self._not_tensor_parallel(context)
        return await self._transition(context, lambda t: t.prepare(request), request.epoch)

    async def ExecuteTransition(self, request: worker_pb2.TransitionSpec, context: grpc.aio.ServicerContext):
        await self._not_tensor_parallel(context)
        return await self._transition(context, lambda t: t.execute(request), request.epoch)

    async def CommitTransition(self, request: worker_pb2.TransitionRef, context: grpc.aio.ServicerContext):
        return await self._transition(context, lambda t: t.commit(request.epoch), request.epoch)

    async def AbortTransition(self, request: worker_pb2.TransitionRef, context: grpc.aio.ServicerContext):
        return await self._transition(context, lambda t: t.abort(request.epoch), request.epoch)

    async def RenewTransition(self, request: worker_pb2.TransitionRef, context: grpc.aio.ServicerContext):
        async def renew(t: TransitionRunner) -> worker_pb2.TransitionLease:
            return t.renew(request.epoch)

        return await self._transition(context, renew, request.epoch)

    async def ConnectPeers(self, request: worker_pb2.PeerAddresses, context: grpc.aio.ServicerContext):
        await self._require_transfer(context)
        assert self.transitions is not None
        peers = {p.worker_id: p.transfer_address for p in request.peers}
        if "" in peers:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peers: every peer needs a worker_id")
        # A peer that never answers costs the whole connect timeout: keep a fifth of the caller's deadline to
        # answer in, or the reply (which names that peer as failed) arrives after the caller gave up.
        remaining = context.time_remaining()
        timeout_s = self.transitions.timeout_s if remaining is None else min(self.transitions.timeout_s,
                                                                            0.8 * remaining)
        failed = await self.transitions.peers.connect(peers, timeout_s)
        return worker_pb2.PeerLinks(linked=self.transitions.svc.peers, failed=failed)

    # -- standby workers and draining (the autoscaler) -----------------------------------------------------------
    async def Activate(self, request: worker_pb2.ActivateRequest, context: grpc.aio.ServicerContext):
        if self.cluster is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is not a member of a cluster (no memory manager)")
        assert self.cluster is not None
        try:
            await self.cluster.activate()
        except MembershipRefused as exc:
            await context.abort(exc.code, str(exc))
        return worker_pb2.ActivateReply(worker_id=self.identity.worker_id, address=self.identity.address)

    async def Drain(self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext):
        if self.cluster is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is not a member of a cluster (no memory manager)")
        assert self.cluster is not None
        if request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s: must be >= 0")
        await self._not_reforming(context)
        t = self.transitions
        if t is not None and (t.role is not None or t.transitioning):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.identity.worker_id} is in pipeline group {t.unit_id}: only a whole "
                                "instance drains (restore the group first)")
        try:
            self.cluster.start_draining()
        except MembershipRefused as exc:
            await context.abort(exc.code, str(exc))
        # Once begun, a drain finishes whatever becomes of this call (the memory manager died, its deadline
        # passed): a worker left draining would never serve again, and could not be activated either.
        drain = asyncio.ensure_future(self._drain_and_leave(self.cluster, request.timeout_s, request.to_standby))
        self._draining = drain
        finished, handed_over, seconds = await asyncio.shield(drain)
        return worker_pb2.DrainReply(finished=finished, handed_over=handed_over, seconds=seconds)

    async def _drain_and_leave(self, cluster: ClusterMembership, timeout_s: float,
                               to_standby: bool) -> tuple[int, int, float]:
        t0 = time.monotonic()
        try:
            finished, handed_over = await self._drain(timeout_s)
        finally:
            await cluster.drained(to_standby)
        seconds = time.monotonic() - t0
        self.log.info("drained", finished=finished, handed_over=handed_over, seconds=round(seconds, 3),
                      to_standby=to_standby)
        return finished, handed_over, seconds

    async def _drain(self, timeout_s: float) -> tuple[int, int]:
        """Wait (up to timeout_s) for the running requests to finish; end the rest with UNAVAILABLE and the
        worker-end trailer, which the dispatcher answers by resuming each on another worker (re-prefill, same greedy
        tokens). Returns (finished here, handed over)."""
        started = set(self.streams.keys())
        deadline = time.monotonic() + timeout_s
        while len(self.streams) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = set(self.streams.keys())
        if left:
            self.streams.shutdown_all(f"worker {self.identity.worker_id} is leaving the cluster; resume elsewhere")
            closing = time.monotonic() + HANDOVER_WAIT_S
            while len(self.streams) and time.monotonic() < closing:
                await asyncio.sleep(DRAIN_POLL_S)
        return len(started - left), len(left)

    # -- elastic tensor parallelism: cold re-form (the memory manager's TransformTP / SplitTP) ---------------------
    def _reforming_message(self) -> str:
        new = self.reform
        what = "a whole instance" if new is None or len(new.members) == 1 else \
            f"rank {new.rank} of TP{len(new.members)} ({', '.join(new.members)})"
        return f"worker {self.identity.worker_id} is re-forming as {what}; retry shortly"

    def _current_tp(self) -> tuple[str, ...]:
        return self.tp.members if self.tp is not None else (self.identity.worker_id,)

    async def ReformTP(self, request: worker_pb2.ReformTPRequest, context: grpc.aio.ServicerContext):
        wid = self.identity.worker_id
        members = tuple(request.members)
        if self.reform is not None:
            await context.abort(grpc.StatusCode.ABORTED, self._reforming_message())
        if self.transitioning:
            await context.abort(grpc.StatusCode.ABORTED, f"worker {wid} is in a drop / restore transition; retry "
                                "when it has finished")
        host = request.host or self.identity.address.rsplit(":", 1)[0]
        port = request.port
        if len(members) > 1 and request.rank == 0 and port == 0:
            port = pick_free_port()
        new = TPArgs(members, request.rank, port, host if len(members) > 1 else "", request.rendezvous_timeout_s)
        try:
            new.check(wid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        why = check_model_degree(self.whole_model, len(members)) if self.whole_model is not None else None
        if why is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if request.drain_timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s: must be >= 0")
        if members == self._current_tp():
            return worker_pb2.ReformTPReply(worker_id=wid, reforming=False, port=self.tp.port if self.tp else 0,
                                            host=self.tp.host if self.tp else "")
        if request.in_place:
            return await self._reform_in_place(new, context, dict(request.transfer_addresses))
        await self._free_for_reform(context, len(members) > 1)
        self.reform = new
        self.log.info("tensor_parallel_reform", members=list(members), rank=new.rank, port=port, host=host)
        # Once begun, a re-form ends in the re-exec whatever becomes of this call (the memory manager died, its
        # deadline passed): a worker left with `reform` set refuses every request and would never serve again.
        self._reforming = asyncio.ensure_future(self._drain_then_reexec(request.drain_timeout_s))
        finished, handed_over = await asyncio.shield(self._reforming)
        return worker_pb2.ReformTPReply(worker_id=wid, reforming=True, port=port, host=host, finished=finished,
                                        handed_over=handed_over)

    # -- in-place tensor-parallel changes (tp_in_place.py) -----------------------------------------------------
    async def _reform_in_place(self, new: TPArgs, context, addresses: dict[str, str]) -> worker_pb2.ReformTPReply:
        """Start an in-place scale-up (this worker joins `new`) or split (`new` is this worker alone; asked of rank 0,
        which takes the followers with it) and answer at once: the memory manager then waits for the new layout."""
        wid = self.identity.worker_id
        joining = len(new.members) > 1
        await self._free_for_reform(context, joining)
        tp = self.tp
        if not joining and tp is not None:
            if not tp.in_place:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {wid} is {tp.describe()}, formed cold: "
                                    "its pool holds its shard only, so it splits cold (kunctl tp-split --cold)")
            if not tp.is_leader:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {wid} is {tp.describe()}: an in-place "
                                    f"split is asked of rank 0 ({tp.members[0]}), which takes the followers with it")
        if self.transitioning:
            await context.abort(grpc.StatusCode.ABORTED, f"worker {wid} is in a drop / restore transition")
        self.reform, self.reform_in_place = new, True
        self.log.info("tensor_parallel_reform", members=list(new.members), rank=new.rank, port=new.port, host=new.host,
                      in_place=True)
        self._reforming = asyncio.ensure_future(self._merge_in_place(new, addresses) if joining
                                                else self._split_in_place())
        return worker_pb2.ReformTPReply(worker_id=wid, reforming=True, port=new.port, host=new.host)

    async def _merge_in_place(self, new: TPArgs, addresses: dict[str, str]) -> None:
        defaults = TensorParallelSection()
        host = new.host or self.identity.address.rsplit(":", 1)[0]
        membership = TPMembership(-1, new.rank, new.members, host, new.port, defaults.timeout_s,
                                  new.rendezvous_timeout_s or defaults.rendezvous_timeout_s, whole=self.instance.source,
                                  in_place=True)
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()  # the service's log context, for the split a follower thread starts
        try:
            report = await self.in_place.merge(membership, self._follower_ended, addresses)
        except HealFailed as exc:  # failed and could not heal: this worker's state is not known
            self.tp = membership
            self._exit_broken(membership, f"in-place scale-up: {exc}")
            return
        except Exception as exc:  # refused, healed or never met: whole, as before (tp_in_place.py)
            self.log.error("tensor_parallel_in_place_failed", op="scale-up", members=list(new.members),
                           error=f"{type(exc).__name__}: {exc}", now="whole instance")
            self._end_reform()
            return
        self.tp = membership
        membership.start(self.engine)
        self._end_reform()
        self.log.info("tensor_parallel_in_place_done", op="scale-up", role=membership.describe(),
                      requests=report.requests, moved=report.moved_requests, sent_subblocks=report.sent_subblocks,
                      staging_bytes=report.staging_bytes, kv_blocks=report.blocks_after, ms=round(report.seconds * 1e3, 1))

    async def _split_in_place(self) -> None:
        tp = self.tp
        assert tp is not None and tp.leader is not None
        leader = tp.leader
        await self._split_outcome(tp, self.in_place.split(tp), leader.split_refused)

    def _follower_ended(self, follower: TPFollower) -> None:
        """A follower's loop ended (its thread): on SPLIT this worker finishes rank 0's in-place split with it; healed
        mid-split, it is a whole instance again."""
        if self._loop is None:
            return
        if follower.split:
            self._loop.call_soon_threadsafe(self._start_follower_split, context=self._context)
        elif follower.healed is not None:
            self._loop.call_soon_threadsafe(self._follower_healed, follower.healed, context=self._context)

    def _follower_healed(self, why: str) -> None:
        tp = self.tp
        if tp is None:
            return
        tp.cancel_tasks()
        if tp.group is not None:
            tp.group.close()
        self.log.error("tensor_parallel_in_place_failed", op="split", error=why, now="whole instance")
        self._left_instance()

    def _start_follower_split(self) -> None:
        self.reform, self.reform_in_place = TPArgs((self.identity.worker_id,)), True
        self._reforming = asyncio.ensure_future(self._follower_split_in_place())

    async def _follower_split_in_place(self) -> None:
        tp = self.tp
        assert tp is not None and tp.group is not None
        group = tp.group  # refused, it follows rank 0 again over the same group
        await self._split_outcome(tp, self.in_place.follower_split(tp),
                                  lambda: tp.follow(group, self.engine.engine, self.engine.num_threads, self._follower_ended,
                                                    self.in_place.follower_stagger(tp, group)))

    async def _split_outcome(self, tp: TPMembership, part: Awaitable[TransformReport], refused: Callable[[], None]) -> None:
        """This member's part of an in-place split, and what follows (tp_in_place.py): refused (ValueError) -> the
        instance goes on (`refused` resumes this member's role); healed or failed after the commit (InstanceBroken)
        -> a whole instance; anything else -> its state is not known: exit and start again as configured."""
        try:
            report = await part
        except ValueError as exc:
            self.log.warning("tensor_parallel_in_place_refused", op="split", error=str(exc))
            refused()
            tp.start(self.engine)
            self._end_reform()
            return
        except InstanceBroken as exc:
            self.log.error("tensor_parallel_in_place_failed", op="split", error=str(exc), now="whole instance")
            self._left_instance()
            return
        except Exception as exc:  # SplitBroken or worse
            self._exit_broken(tp, f"in-place split: {type(exc).__name__}: {exc}")
            return
        self._left_instance()
        self.log.info("tensor_parallel_in_place_done", op="split", requests=report.requests,
                      moved=report.moved_requests, ms=round(report.seconds * 1e3, 1))

    def _left_instance(self) -> None:
        self.tp = None
        self._end_reform()

    def _exit_broken(self, tp: TPMembership, why: str) -> None:
        """A change failed where this worker's state is not known: stop the service and exit with EXIT_BROKEN (a
        supervisor starts it again as configured); its streams end, so the dispatcher resumes their requests."""
        self.log.error("tensor_parallel_in_place_broken", error=why, exit_status="EXIT_BROKEN")
        tp.exited_broken = True
        self._end_reform()
        os.kill(os.getpid(), signal.SIGTERM)

    def _end_reform(self) -> None:
        self.reform, self.reform_in_place = None, False

    async def _drain_then_reexec(self, timeout_s: float) -> tuple[int, int]:
        """Hand the running requests over, then stop the service (SIGTERM: main() re-executes with `reform`) even
        when the drain fails."""
        since = time.monotonic()
        try:
            drained = await self._drain(timeout_s)
            await self._seen_reforming(since)
            return drained
        finally:
            asyncio.get_running_loop().call_later(REEXEC_AFTER_S, os.kill, os.getpid(), signal.SIGTERM)

    async def _seen_reforming(self, since: float) -> None:
        """When something polls this worker's stats (the dispatcher), wait (up to REFORM_SEEN_WAIT_S) for a poll answered
        after `since`, which said `reforming`: the dispatcher then waits for the re-formed worker instead of failing
        the requests that arrive while it re-executes (a drain with nothing running is over before the next poll)."""
        if self._polled_at < since - REFORM_SEEN_WAIT_S:
            return  # not polled lately
        deadline = time.monotonic() + REFORM_SEEN_WAIT_S
        while self._polled_at <= since and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def _free_for_reform(self, context, joining: bool) -> None:
        """FAILED_PRECONDITION unless this worker may change its tensor-parallel membership now: not in a pipeline
        group, holding every layer, in service (not standby or draining), and to join an instance a whole one."""
        wid = self.identity.worker_id
        t = self.transitions
        if t is not None and t.role is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {wid} is in pipeline group {t.unit_id}: "
                                "restore it before a tensor-parallel re-form")
        start, end = self.instance.layer_range
        if (start, end) != (0, self.identity.num_layers_model):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {wid} holds layers [{start}, {end}) of "
                                f"{self.identity.num_layers_model}: restore its dropped layers first")
        if self.cluster is not None and not self.cluster.in_service:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.cluster.why_not_serving())
        if joining and self.tp is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {wid} is {self.tp.describe()}: split "
                                "it (kunctl tp-split) before it joins another instance")

    async def shutdown(self) -> None:
        """End every in-flight stream with UNAVAILABLE, stop the engine thread (off the event loop: joining it
        may take a step's time), and let transfer links still being opened finish before the service closes."""
        self.streams.shutdown_all(f"worker {self.identity.worker_id} is shutting down")
        await asyncio.to_thread(self.engine.stop, 5.0)
        if self.transitions is not None:
            await self.transitions.peers.settle(5.0)
