"""Dispatcher: the client API. Routes each request to the most-free routable instance, relays its token
stream (adding text and timing), propagates cancellation, and owns the request record so that the
request survives what happens to the worker serving it:

* a worker that is alive but not routable (dropped layers, forming a pipeline group) refuses with
  FAILED_PRECONDITION or reports ``serving = false``: the request waits, re-polling, up to
  ``dispatcher.route_timeout_s`` for a routable worker;
* a layout transition moves the request to another worker (the stream's last event carries
  ``moved_to``): the dispatcher attaches there and keeps relaying;
* a worker fails mid-stream: the request is resumed on a healthy instance by re-prefilling the prompt
  plus the tokens already emitted (KunServe §4.4); the client stream continues without an error;
* a worker stalls (its stats polls stop answering, or its engine stops progressing, for
  ``dispatcher.stall_timeout_s``): it leaves routing, its calls are cancelled (which frees their KV when it
  wakes up) and its requests resume elsewhere the same way.

The workers it routes to are the config's plus the ones that joined at run time: it follows the memory
manager's layout (``GetLayout``), adding joined workers, routing no new request to a draining one, and
dropping a worker that left once the layout is settled (README "Discovery and autoscaling").

It also guards the cluster (see kunserve.shared.policy.admission): prompts are measured before they are tokenized
or forwarded, requests beyond the in-flight and queued-prompt-token bounds get RESOURCE_EXHAUSTED with a
retry hint, an accepted request that gets no first token within ``dispatcher.queue_timeout_s`` gets the same
status instead of hanging, and a request can be cancelled only by the client that sent it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import grpc

from kunserve.services.dispatcher.limits import DispatcherLimits
from kunserve.services.dispatcher.metrics import DispatcherMetrics
from kunserve.shared.config import ClusterConfig
from kunserve.shared.log import get_logger
from kunserve.shared.model.generation_config import GenerationDefaults
from kunserve.shared.model.tokenizer import TextStream
from kunserve.shared.policy import dispatch_rules, long_requests
from kunserve.shared.policy.admission import Admission, Refusal
from kunserve.shared.policy.liveness import Liveness
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad
from kunserve.shared.rpc import REFORMING, WORKER_END, channel
from kunserve.shared.wire.cluster_state import report_from_pb
from kunserve.shared.wire.requests import REQUEST_CLASSES, sampling_from_pb
from kunserve.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    memory_manager_pb2,
    memory_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

MAX_REQUEST_ID_LEN = 256
MAX_RESUMES = 3  # worker failures after the first token before the client gets UNAVAILABLE
# Workers that may fail under one request before it is given up (not carried to the next): a request that
# was running on two workers that both crashed may be what crashes them (a poison request).
MAX_WORKER_CRASHES = 2
MAX_MOVES = 32  # layout moves of one request (each is an attach): a bound against ping-pong
ROUTE_RETRY_S = 0.05  # pause between polls while waiting for a routable worker
PLACE_RETRY_S = 1.0  # dispatcher.elastic_tp: a request the memory manager told to wait asks again after this
POLL_TIMEOUT_S = 1.0
LAYOUT_TIMEOUT_S = 2.0
REFORM_RESTART_MARGIN_S = 15.0  # past memory_manager.transition_timeout_s: a re-formed worker's restart (model load)
# A worker that left the layout gets no new request at once; calls still open to it may finish for this long before
# its channel closes (a drained worker has none; a dead one's fail on their own).
LEFT_WORKER_GRACE_S = 300.0
CANCEL_RPC_TIMEOUT_S = 5.0
SHUTTING_DOWN = "the dispatcher is shutting down"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry convention: when to try again, in a trailer
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256

# A worker stream that broke with one of these (or ended without a finish event) lost its worker.
_WORKER_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def _reforming(exc: grpc.aio.AioRpcError | None) -> bool:
    """The worker refused the request because it re-forms its tensor-parallel instance (it comes back shortly)."""
    return exc is not None and any(k == REFORMING for k, _ in (exc.trailing_metadata() or ()))


def _ended_by_worker(exc: grpc.aio.AioRpcError | None) -> bool:
    """The worker ended the stream on purpose (shutdown, request lost to a layout change), rather than dying."""
    return exc is not None and any(k == WORKER_END for k, _ in (exc.trailing_metadata() or ()))


class RequestError(Exception):
    """Why a request is refused or ended: a gRPC status and a message that starts with the field or bound at
    fault. The gRPC API aborts with it; the HTTP front answers the matching OpenAI error."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms

    @classmethod
    def refused(cls, refusal: Refusal) -> RequestError:
        """Admission said no: RESOURCE_EXHAUSTED with when to try again."""
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, refusal.retry_after_ms)


@dataclass
class RequestRecord:
    request_id: str
    prompt_token_ids: list[int]
    arrival: float
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    max_tokens: int = 0
    worker_id: str = ""
    token_ids: list[int] = field(default_factory=list)  # emitted to the client so far
    call: grpc.aio.UnaryStreamCall | None = None
    shutting_down: bool = False
    cancelled: bool = False  # Cancel was called: the stream ends with ABORTED, nothing is retried
    finished: bool = False  # the final event was relayed
    index_offset: int = 0  # tokens emitted before the current worker-side incarnation (resume)
    request_class: common_pb2.RequestClass = common_pb2.REQUEST_CLASS_ONLINE
    resumes: int = 0
    crashes: int = 0  # workers that failed (not stalled) while this request ran there
    last_event: float = 0.0
    route_deadline: float | None = None  # set while waiting for a routable worker; cleared by a token
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # cuts waits short (cancel, shutdown)
    owner: str = ""  # who may cancel it: the sender's credential (hashed) or connection
    expired: bool = False  # no first token within the queue timeout: the stream ends with RESOURCE_EXHAUSTED
    stalled_call: grpc.aio.UnaryStreamCall | None = None  # the call cancelled because its worker stalled
    stall_reason: str = ""
    text: TextStream | None = None  # the streaming decoder of the generated ids (None: no tokenizer)
    stops: tuple[str, ...] = ()  # stop strings
    held: str = ""  # decoded text not sent yet: it may be the start of a stop string
    user_stop_ids: frozenset[int] = frozenset()  # the client's stop_token_ids (EOS ids are added to what workers get)


def _offline(record: RequestRecord) -> bool:
    return record.request_class == common_pb2.REQUEST_CLASS_OFFLINE


def _stop_split(held: str, stops: tuple[str, ...]) -> tuple[str, str, bool]:
    """(text to send now, text to keep holding, a stop string was found). On a stop: the text before the
    earliest one. Otherwise everything but the longest tail that could still grow into a stop string."""
    found = [i for i in (held.find(s) for s in stops) if i >= 0]
    if found:
        return held[:min(found)], "", True
    for j in range(len(held)):
        tail = held[j:]
        if any(s.startswith(tail) for s in stops):
            return held[:j], tail, False
    return held, "", False


@dataclass
class _Segment:
    """One worker stream of a request: its outcome decides what happens next."""

    worker_id: str
    attach: bool
    received: int = 0  # events received from the worker
    finished: bool = False
    moved_to: str = ""
    error: grpc.aio.AioRpcError | None = None
    local_cancel: bool = False  # our own call.cancel() (Cancel, shutdown, queue timeout) ended it
    stalled: str = ""  # we cancelled it because its worker stalled (why): a worker failure, resumed elsewhere


class WorkerPool:
    """Channels to every worker plus the router fed by periodic GetStats polls, and the liveness watch.

    Each worker is polled on its own (a frozen one does not slow the polls of the others). A poll that
    times out makes the worker not routable for new requests until a later poll answers; one that stays
    unanswered -- or a worker whose engine has requests but stops progressing -- for ``stall_timeout_s``
    is *stalled*: unhealthy (until a poll sent after that answers) and reported to ``on_stall`` listeners,
    which move its requests elsewhere.

    The pool starts with the config's workers (the seeds) and follows the memory manager's layout
    (``apply_layout``): a worker that joined is added and polled, a draining one gets no new request, and a joined
    worker that left is dropped from routing (its calls still in flight may finish; see `remove`). A joined worker is
    taken as gone only when the layout is settled (``members_settled``): a memory manager that just restarted lists
    the joined workers again as they re-register, and one missing meanwhile is still serving. Seeds stay."""

    def __init__(self, cfg: ClusterConfig, stall_timeout_s: float | None = None) -> None:
        self.seeds = frozenset(w.id for w in cfg.workers)
        self.memory_manager = cfg.memory_manager.address
        self.addresses: dict[str, str] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self.draining: frozenset[str] = frozenset()  # leaving: no new request is routed there
        self.members_version = 0  # of the last layout applied
        self._pollers: dict[str, asyncio.Task] = {}
        self._poll_interval_s: float | None = None  # set once poll_forever runs
        self._mm_channel: grpc.aio.Channel | None = None
        self._layout_error = ""  # the last GetLayout failure (logged once per episode)
        self._retiring: dict[grpc.aio.Channel, asyncio.Task] = {}  # channels of workers that left, closing
        for w in cfg.workers:
            self.add(w.id, w.address)
        self._kv_tokens_seen = 0  # the routable units' KV capacity when last there was one (see capacity)
        self.elastic_tp = cfg.dispatcher.elastic_tp  # a request too long for every routable unit asks the memory manager
        self.tp_members: dict[str, tuple[str, ...]] = {}  # worker -> its tensor-parallel instance's members, rank order
        self.router = FreenessRouter()
        self.reform_wait_s = cfg.memory_manager.transition_timeout_s + REFORM_RESTART_MARGIN_S
        self.liveness = Liveness(cfg.dispatcher.stall_timeout_s if stall_timeout_s is None else stall_timeout_s)
        self.on_stall: list[Callable[[str, str], None]] = []  # (worker id, why): move its requests
        self.log = get_logger()
        self._healthy: dict[str, bool] = {}
        self._failed_at: dict[str, float] = {}  # when a request last saw the worker fail
        self._slow: set[str] = set()  # workers whose last poll timed out (logged once per episode)
        self._polls: dict[str, asyncio.Future] = {}

    # -- membership ----------------------------------------------------------------------------------------------
    def add(self, wid: str, address: str) -> None:
        """Route to a worker at `address` from now on (a joined worker; one that moved gets a new channel)."""
        if self.addresses.get(wid) == address:
            return
        old = self.channels.get(wid)
        if old is not None:
            asyncio.ensure_future(old.close())
        self.addresses[wid] = address
        self.channels[wid] = channel(address)
        self.stubs[wid] = worker_pb2_grpc.WorkerStub(self.channels[wid])
        if self._poll_interval_s is not None:
            self._start_polling(wid)

    def remove(self, wid: str) -> None:
        """A joined worker left: no more routing or polling. Calls still open on its channel may finish for up to
        LEFT_WORKER_GRACE_S before the channel closes (then they end with an error and their requests resume
        elsewhere, as for a worker that died)."""
        poller = self._pollers.pop(wid, None)
        if poller is not None:
            poller.cancel()
        self.stubs.pop(wid, None)
        self.addresses.pop(wid, None)
        self.router.forget(wid)
        self.tp_members.pop(wid, None)
        self._healthy.pop(wid, None)
        ch = self.channels.pop(wid, None)
        if ch is not None:
            task = asyncio.ensure_future(ch.close(grace=LEFT_WORKER_GRACE_S))
            self._retiring[ch] = task
            task.add_done_callback(lambda _t, ch=ch: self._retiring.pop(ch, None))

    def apply_layout(self, layout: memory_manager_pb2.ClusterLayout) -> None:
        """Follow the memory manager's layout: add the workers that joined, drop the joined workers it no longer
        lists (once the layout is settled), and keep the draining ones out of routing."""
        listed = {w.worker_id: w.address for w in layout.workers if w.address}
        for wid, address in sorted(listed.items()):
            if wid not in self.addresses or (wid not in self.seeds and self.addresses[wid] != address):
                self.log.info("worker_discovered", worker=wid, address=address, members_version=layout.members_version)
                self.add(wid, address)
        if layout.members_settled:
            for wid in [w for w in self.addresses if w not in listed and w not in self.seeds]:
                self.log.info("worker_gone", worker=wid, members_version=layout.members_version)
                self.remove(wid)
        draining = frozenset(w.worker_id for w in layout.workers if w.draining)
        if draining != self.draining:
            self.log.info("workers_draining", workers=sorted(draining))
        self.draining = draining
        self.members_version = layout.members_version

    async def place_long(self, request_id: str, tokens: int, timeout: float) -> memory_manager_pb2.PlaceLongRequestReply:
        """The memory manager's placement of a request of `tokens` whole-life tokens (it may scale instances up)."""
        if self._mm_channel is None:
            self._mm_channel = channel(self.memory_manager)
        return await memory_manager_pb2_grpc.MemoryManagerStub(self._mm_channel).PlaceLongRequest(
            memory_manager_pb2.PlaceLongRequestRequest(request_id=request_id, tokens=tokens), timeout=timeout)

    async def discover(self, timeout: float = LAYOUT_TIMEOUT_S) -> bool:
        """One GetLayout from the memory manager, applied; False when it did not answer (the pool stays as is)."""
        if self._mm_channel is None:
            self._mm_channel = channel(self.memory_manager)
        try:
            layout = await memory_manager_pb2_grpc.MemoryManagerStub(self._mm_channel).GetLayout(
                common_pb2.Empty(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
            if error != self._layout_error:
                self.log.warning("layout_unavailable", memory_manager=self.memory_manager, error=error)
            self._layout_error = error
            return False
        if self._layout_error:
            self.log.info("layout_available_again", memory_manager=self.memory_manager)
            self._layout_error = ""
        self.apply_layout(layout)
        return True

    async def discover_forever(self, interval_s: float) -> None:
        while True:
            await self.discover()
            await asyncio.sleep(interval_s)

    # -- polling ---------------------------------------------------------------------------------------------------
    async def poll_one(self, wid: str, timeout: float = POLL_TIMEOUT_S) -> None:
        sent = time.monotonic()
        stub = self.stubs.get(wid)
        if stub is None:
            return  # it left
        try:
            s = report_from_pb(await stub.GetStats(common_pb2.Empty(), timeout=timeout))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.mark(wid, False)
                return
            # Busy or frozen: no new requests until it answers again; the liveness watch decides when its
            # requests must move (a worker answering late is not yet a stalled one).
            self.router.refused(wid, time.monotonic())
            if wid not in self._slow:
                self._slow.add(wid)
                self.log.warning("worker_poll_timed_out", worker=wid, timeout_s=timeout)
            return
        if wid not in self.stubs:
            return  # it left while we asked
        if sent < self._failed_at.get(wid, -1.0):
            return  # taken before a request saw this worker fail: stale, keep it unhealthy
        if wid in self._slow:
            self._slow.discard(wid)
            self.log.info("worker_poll_answers_again", worker=wid)
        serving = s.routable
        self.liveness.answered(wid, time.monotonic(), work=(s.num_running + s.num_waiting) if serving else 0,
                               # busy seconds move during a long prefill too (a chunk computes for a while
                               # before any token counter does); a hung iteration is the worker's own
                               # watchdog's to catch (it answers NOT_SERVING)
                               progress=(s.prompt_tokens_total, s.generated_tokens_total, s.busy_seconds_total),
                               transitioning=s.transitioning)
        alive = not self.liveness.stuck(wid)  # an engine that stalled stays out until it progresses again
        online = s.num_running + s.num_waiting - s.num_offline_running - s.num_offline_waiting
        self.router.update(RoutingLoad(wid, s.kv_blocks_total, s.kv_blocks_used, s.queued_demand_blocks,
                                       s.block_size or 16, alive, sent, serving=serving, online_requests=online))
        self.tp_members[wid] = s.tp_members or (wid,)
        if s.reforming:
            self.reforming(wid, sent)
        self.mark(wid, alive)

    def reforming(self, wid: str, now: float) -> None:
        """The worker said at `now` that it re-forms its tensor-parallel instance: requests that find nothing routable
        wait for it while it re-executes, up to the re-form's timeout and the restart's margin."""
        self.router.reforming(wid, now, now + self.reform_wait_s)

    async def refresh_one(self, wid: str, timeout: float = POLL_TIMEOUT_S) -> None:
        """One poll of the worker, shared: callers arriving while its poll is in flight await that one
        instead of starting their own. A caller that is cancelled does not cancel the shared poll."""
        poll = self._polls.get(wid)
        if poll is None or poll.done():
            poll = self._polls[wid] = asyncio.ensure_future(self.poll_one(wid, timeout))
        await asyncio.shield(poll)

    async def refresh(self, timeout: float = POLL_TIMEOUT_S) -> None:
        """One (shared) poll of every worker."""
        await asyncio.gather(*(self.refresh_one(w, timeout) for w in self.stubs))

    async def wait_for_workers(self, timeout_s: float) -> int:
        """Poll until every configured worker answers (or the deadline); returns how many are healthy.

        The dispatcher reports SERVING only after this, so "healthy" means it can route to the cluster."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.refresh()
            healthy = sum(self._healthy.get(w, False) for w in self.stubs)
            if healthy == len(self.stubs) or loop.time() >= deadline:
                return healthy
            await asyncio.sleep(0.1)

    def failed(self, wid: str) -> None:
        """A request saw the worker fail (its stream broke): unhealthy until a poll sent after now answers."""
        self._failed_at[wid] = time.monotonic()
        self.mark(wid, False)

    def mark(self, wid: str, healthy: bool) -> None:
        if self._healthy.get(wid) != healthy:
            self.log.info("worker_health_changed", worker=wid, healthy=healthy)
        self._healthy[wid] = healthy
        self.router.set_healthy(wid, healthy)

    def check_liveness(self, now: float) -> list[str]:
        """Declare stalled workers failed and tell the listeners; returns their ids."""
        stalled = []
        for wid in self.stubs:
            why = self.liveness.stalled(wid, now)
            if why is None:
                continue
            stalled.append(wid)
            self.log.warning("worker_stalled", worker=wid, reason=why,
                             stall_timeout_s=self.liveness.stall_timeout_s)
            self.failed(wid)
            for listener in self.on_stall:
                listener(wid, why)
        return stalled

    def capacity(self) -> tuple[int, int]:
        """(live workers, the routable units' KV capacity in tokens): what the admission bounds scale with.

        Every live worker counts, routable or not: members of a pipeline group serve through its head, and a
        worker in the middle of a drop serves again in a moment; a dead or stalled one does not count. A
        group's KV is its head's (the members share one block-id space), so a drop does not shrink the token
        bound; while no unit is routable (every worker mid-transition) the last capacity seen stands."""
        live, tokens = dispatch_rules.capacity(self.router)
        if tokens:
            self._kv_tokens_seen = tokens
        return live, tokens or self._kv_tokens_seen

    async def _poll_worker_forever(self, wid: str, interval_s: float) -> None:
        while True:
            await self.refresh_one(wid)
            await asyncio.sleep(interval_s)

    async def _watch_forever(self, interval_s: float) -> None:
        while True:
            self.check_liveness(time.monotonic())
            await asyncio.sleep(interval_s)

    def _start_polling(self, wid: str) -> None:
        assert self._poll_interval_s is not None
        if wid not in self._pollers:
            self._pollers[wid] = asyncio.create_task(self._poll_worker_forever(wid, self._poll_interval_s))

    async def poll_forever(self, interval_s: float) -> None:
        """Poll every worker (those that join later too) on its own, and watch their liveness."""
        self._poll_interval_s = interval_s
        for wid in list(self.stubs):
            self._start_polling(wid)
        try:
            await self._watch_forever(interval_s)
        finally:
            self._poll_interval_s = None
            for poller in self._pollers.values():
                poller.cancel()
            self._pollers.clear()

    async def close(self) -> None:
        for poll in self._polls.values():
            if not poll.done():
                poll.cancel()
        for ch in self.channels.values():
            await ch.close()
        if self._retiring:  # the dispatcher's shutdown cancelled the calls they waited for: they close now
            tasks = list(self._retiring.values())
            _, pending = await asyncio.wait(tasks, timeout=CANCEL_RPC_TIMEOUT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._mm_channel is not None:
            await self._mm_channel.close()


class DispatcherServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, pool: WorkerPool, tokenizer, route_timeout_s: float = 30.0,
                 max_resumes: int = MAX_RESUMES, limits: DispatcherLimits | None = None,
                 generation: GenerationDefaults | None = None, metrics: DispatcherMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics if metrics is not None else DispatcherMetrics()
        self.tokenizer = tokenizer  # None when the model ships no tokenizer: token-id prompts only
        self.generation = generation or GenerationDefaults()  # generation_config.json: EOS ids, sampling defaults
        self.route_timeout_s = route_timeout_s
        self.max_resumes = max_resumes
        self.limits = limits or DispatcherLimits()
        self.admission = Admission()
        self.records: dict[str, RequestRecord] = {}
        self.stopping = False  # shutdown() began: no new requests
        self.log = get_logger()
        self._refusing = False  # admission is refusing requests (logged when it starts and stops)
        # dispatcher.elastic_tp: unit -> long requests (see long_requests.is_long) it holds now, counted per worker
        # stream; and the merged units short requests avoid (logged when it changes)
        self._long_held = long_requests.LongHeld()
        self._throttled: frozenset[str] = frozenset()
        pool.on_stall.append(self._worker_stalled)

    # -- helpers ----------------------------------------------------------------------------------
    def _prompt_too_long(self, n: int, what: str) -> str:
        lim = self.limits
        return dispatch_rules.prompt_too_long(n, what, context_len=lim.context_len,
                                              max_prompt_tokens=lim.max_prompt_tokens,
                                              auto_prompt_tokens=lim.auto_prompt_tokens)

    async def _prompt_ids(self, request: generation_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids, measured before anything is tokenized or copied: a text longer than
        dispatcher.max_prompt_bytes and an id list longer than the token limit are refused at once."""
        kind = request.WhichOneof("prompt")
        lim = self.limits
        if kind == "token_ids":
            n = len(request.token_ids.ids)
            if n > lim.max_prompt_tokens:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, self._prompt_too_long(n, "token ids"))
            return list(request.token_ids.ids)
        if kind == "text":
            if self.tokenizer is None:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                    "prompt.text: the served model has no tokenizer; send prompt.token_ids")
            # characters <= UTF-8 bytes: a text with more characters than the bound is too long unencoded
            size = len(request.text)
            if size <= lim.max_prompt_bytes:
                size = len(request.text.encode("utf-8"))
            if size > lim.max_prompt_bytes:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt.text: {size} bytes or more exceed dispatcher.max_prompt_bytes = "
                                    f"{lim.max_prompt_bytes} (a text that long cannot fit {lim.max_prompt_tokens} "
                                    "tokens); shorten the prompt")
            ids = list(self.tokenizer.encode(request.text))
            if len(ids) > lim.max_prompt_tokens:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, self._prompt_too_long(len(ids), "tokens"))
            return ids
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set either text or token_ids")
        return []

    @staticmethod
    def _owner(context) -> str:
        """Who may cancel a request: the holder of the credential it was sent with (the `authorization`
        metadata, hashed: never kept in clear), else the connection it came on."""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                raw = value if isinstance(value, bytes) else value.encode("utf-8")
                return "credential:" + hashlib.sha256(raw).hexdigest()
        return "peer:" + (context.peer() or "")

    def _bounds(self) -> tuple[int, int]:
        """(max in flight, max queued prompt tokens) now: they scale with the live workers (see capacity)."""
        live, kv_tokens = self.pool.capacity()
        lim = self.limits
        return dispatch_rules.admission_bounds(max_inflight_per_worker=lim.max_inflight_per_worker,
                                               max_queued_prompt_tokens=lim.max_queued_prompt_tokens,
                                               max_prompt_tokens=lim.max_prompt_tokens, live_workers=live,
                                               kv_tokens=kv_tokens)

    def _admit(self, rid: str, prompt_tokens: int, now: float) -> Refusal | None:
        max_inflight, max_tokens = self._bounds()
        refusal = self.admission.admit(rid, prompt_tokens, now, max_inflight=max_inflight,
                                       max_queued_tokens=max_tokens)
        if refusal is not None and not self._refusing:
            self._refusing = True
            self.log.warning("admission_refusing", bound=refusal.bound, inflight=self.admission.inflight,
                             max_inflight=max_inflight, queued_prompt_tokens=self.admission.queued_tokens,
                             max_queued_prompt_tokens=max_tokens, retry_after_ms=refusal.retry_after_ms)
        elif refusal is None and self._refusing:
            self._refusing = False
            self.log.info("admission_accepting_again", refused_total=self.admission.refused_total,
                          inflight=self.admission.inflight)
        return refusal

    def _queue_expired(self, record: RequestRecord) -> None:
        """The queue timeout: an accepted request still without a first token ends with RESOURCE_EXHAUSTED
        (and leaves its worker) instead of hanging."""
        if record.token_ids or record.finished or record.cancelled or record.shutting_down:
            return
        record.expired = True
        record.wake.set()
        if record.call is not None:
            record.call.cancel()

    def _worker_stalled(self, wid: str, why: str) -> None:
        """The pool declared `wid` stalled: cancel our calls there; each request resumes elsewhere."""
        moved = 0
        for record in self.records.values():
            call = record.call
            if record.worker_id == wid and call is not None and not call.done():
                record.stalled_call, record.stall_reason = call, f"worker {wid} stalled: {why}"
                call.cancel()
                moved += 1
        if moved:
            self.log.warning("requests_leaving_stalled_worker", worker=wid, requests=moved, reason=why)

    def _effective_sampling(self, sent: common_pb2.SamplingParams, prompt_len: int) -> common_pb2.SamplingParams:
        """The request's sampling with the model's generation_config.json defaults in the fields it left unset,
        and the model's EOS ids among the stop ids the worker gets (unless ignore_eos)."""
        g = self.generation
        out = common_pb2.SamplingParams()
        out.CopyFrom(sent)
        if not out.HasField("max_tokens") and g.max_new_tokens is not None:
            out.max_tokens = max(1, min(g.max_new_tokens, self.limits.context_len - prompt_len))
        if not out.HasField("temperature") and g.temperature is not None:
            out.temperature = g.temperature
        if not out.HasField("top_p") and g.top_p is not None:
            out.top_p = g.top_p
        if not out.HasField("top_k") and g.top_k is not None:
            out.top_k = g.top_k
        if not out.ignore_eos:
            extra = [e for e in g.eos_token_ids if e not in out.stop_token_ids]
            out.stop_token_ids.extend(extra)
        return out

    async def _check_stops(self, sampling: common_pb2.SamplingParams) -> None:
        stops = list(sampling.stop)
        if not stops:
            return
        if self.tokenizer is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                "sampling.stop: the served model has no tokenizer, so no text to match stop strings in")
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"sampling.stop: {len(stops)} stop strings; at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(stops):
            if not s or len(s) > MAX_STOP_STRING_LEN:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"sampling.stop[{i}]: must have 1 to {MAX_STOP_STRING_LEN} characters, got {len(s)}")

    def _text(self, record: RequestRecord, token_id: int, final: bool) -> tuple[str, bool]:
        """(the text this event carries, a stop string ended the request). Text that may be the start of a stop
        string is held back until it is not (or the request ends: the last event carries it)."""
        piece = record.text.step(token_id) if record.text is not None and token_id >= 0 else ""
        if not record.stops:
            return piece, False
        send, record.held, stopped = _stop_split(record.held + piece, record.stops)
        if final and not stopped:
            send, record.held = send + record.held, ""
        return send, stopped

    def _final_event(self, record: RequestRecord,
                     finish_reason: common_pb2.FinishReason) -> generation_pb2.GenerateEvent:
        """A tokenless last event the dispatcher makes itself (cancelled while not on a worker)."""
        now = time.monotonic()
        record.finished = True
        text, record.held = record.held, ""
        return generation_pb2.GenerateEvent(
            request_id=record.request_id, token_id=-1, text=text, index=len(record.token_ids),
            finish_reason=finish_reason,
            elapsed_s=now - record.arrival, token_latency_s=now - record.last_event, worker_id=record.worker_id,
            num_prompt_tokens=len(record.prompt_token_ids))

    @staticmethod
    async def _pause(record: RequestRecord, seconds: float) -> None:
        try:
            await asyncio.wait_for(record.wake.wait(), seconds)
        except TimeoutError:
            pass

    # -- the request lifecycle, shared by the gRPC API and the HTTP front --------------------------------
    async def open(self, request: generation_pb2.GenerateRequest, owner: str) -> RequestRecord:
        """Validate, admit and register a request (raises RequestError). From here it counts against the
        admission bounds until `events` has run to its end or was closed, so every open must be followed by
        `events`."""
        try:
            return await self._open(request, owner)
        except RequestError as exc:
            self.metrics.refused(exc.code.name)
            raise

    async def _open(self, request: generation_pb2.GenerateRequest, owner: str) -> RequestRecord:
        arrival = time.monotonic()
        if self.stopping:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        rid = request.request_id or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_LEN:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: longer than {MAX_REQUEST_ID_LEN} characters")
        if rid in self.records:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running")
        if request.request_class not in REQUEST_CLASSES:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"request_class: {request.request_class} is not a request "
                               "class (0 = online, 1 = offline)")
        prompt = await self._prompt_ids(request)
        if not prompt:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        effective = self._effective_sampling(request.sampling, len(prompt))
        await self._check_stops(effective)
        sampling = sampling_from_pb(effective)
        if sampling.max_tokens <= 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.max_tokens: must be > 0, got {sampling.max_tokens}")
        total = len(prompt) + sampling.max_tokens
        if total > self.limits.context_len:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) = "
                               f"{total} exceeds the model context of {self.limits.context_len}")
        refusal = self._admit(rid, len(prompt), arrival)
        if refusal is not None:
            raise RequestError.refused(refusal)
        record = RequestRecord(rid, prompt, arrival, sampling=effective, max_tokens=sampling.max_tokens,
                               last_event=arrival, owner=owner, request_class=request.request_class,
                               text=self.tokenizer.decode_stream() if self.tokenizer is not None else None,
                               stops=tuple(effective.stop), user_stop_ids=frozenset(request.sampling.stop_token_ids))
        self.records[rid] = record
        return record

    async def events(self, record: RequestRecord) -> AsyncGenerator[generation_pb2.GenerateEvent, None]:
        """The opened request's events to its end (raises RequestError). Closing the iterator early (the client
        went away) cancels the worker's call, which frees the request's KV at once."""
        expiry = asyncio.get_running_loop().call_later(self.limits.queue_timeout_s, self._queue_expired, record)
        try:
            async for ev in self._serve(record):
                self.metrics.observe(ev)
                yield ev
        except RequestError as exc:
            self.metrics.failed(exc.code.name)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if not record.finished:
                self.metrics.abandoned()
            raise
        finally:
            expiry.cancel()
            if record.call is not None:
                record.call.cancel()
            self.records.pop(record.request_id, None)
            self.admission.release(record.request_id, time.monotonic())

    # -- RPCs ---------------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            record = await self.open(request, self._owner(context))
            async for ev in self.events(record):
                yield ev
        except RequestError as exc:
            trailer = ((RETRY_PUSHBACK_KEY, str(exc.retry_after_ms)),) if exc.retry_after_ms is not None else ()
            await context.abort(exc.code, exc.message, trailing_metadata=trailer)

    async def _serve(self, record: RequestRecord):
        """Drive one request over as many worker streams as it takes (retries, moves, resumes).

        Resume after a worker failure (KunServe §4.4): a new worker request with the same request_id,
        prompt = original prompt + the tokens already emitted, max_tokens = original - emitted; the
        events it produces are re-indexed by the emitted count, so the client sees one stream. With
        greedy sampling (temperature 0) the client gets exactly the tokens it would have got without
        the failure (up to the usual near-tie caveat of recomputed logits). Stop token ids and EOS work
        the same (they only look at generated tokens, and a stop token already emitted would have
        finished the request). A seeded non-greedy request continues, but not bit-identically: the
        resumed worker seeds a fresh generator for the remaining tokens, so the continuation differs
        from what the failed worker would have sampled.
        """
        rid = record.request_id
        dead: set[str] = set()  # workers that failed this request: never tried again for it
        failures: list[str] = []  # what went wrong, in order: logs and the final error
        attach_to = ""
        moves = 0
        while True:
            if record.cancelled:
                yield self._final_event(record, common_pb2.FINISH_REASON_ABORTED)
                return
            if record.shutting_down or self.stopping:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{SHUTTING_DOWN}; retry the request")
            if record.expired:
                wait = self.admission.retry_after_s(time.monotonic())
                self.log.warning("request_queue_timeout", request_id=rid, timeout_s=self.limits.queue_timeout_s,
                                 worker=record.worker_id or None)
                raise RequestError.refused(Refusal(
                    "dispatcher.queue_timeout_s",
                    f"request {rid!r} got no first token within dispatcher.queue_timeout_s = "
                    f"{self.limits.queue_timeout_s:g} s: the cluster is overloaded; retry in {wait * 1000:.0f} ms",
                    wait))
            if attach_to:
                wid, attach_to = attach_to, ""
                wreq = worker_pb2.WorkerGenerateRequest(request_id=rid, attach=True)
                attach = True
            else:
                remaining = record.max_tokens - len(record.token_ids)
                if remaining <= 0:  # every token was emitted but the finish event was lost with the worker
                    yield self._final_event(record, common_pb2.FINISH_REASON_LENGTH)
                    return
                routed = await self._route(record, dead, failures)
                if routed is None:
                    continue  # cancelled or shutting down while waiting: the loop top answers
                wid = routed
                wreq = self._worker_request(record, remaining)
                attach = False
            record.worker_id = wid
            seg = _Segment(wid, attach)
            if not attach:
                self.pool.router.routed(wid, rid, len(wreq.prompt_token_ids) + 1, time.monotonic(),
                                        offline=_offline(record))
            long = self.pool.elastic_tp and long_requests.is_long(
                self.pool.router, self.pool.tp_members, len(record.prompt_token_ids) + record.max_tokens)
            if long:
                self._long_held.add(wid)
            try:
                async for ev in self._relay(record, seg, wreq):
                    yield ev
            finally:
                self.pool.router.done(wid, rid)
                if long:
                    self._long_held.release(wid)
            if seg.finished:
                return
            if record.cancelled or record.shutting_down or record.expired or seg.local_cancel:
                continue
            if seg.moved_to:
                moves += 1
                if seg.moved_to not in self.pool.stubs:
                    await self.pool.discover()  # moved to a worker that joined since the last layout poll
                if seg.moved_to in self.pool.stubs and moves <= MAX_MOVES:
                    self.log.info("request_moved", request_id=rid, from_worker=wid, to_worker=seg.moved_to,
                                  emitted=len(record.token_ids))
                    attach_to = seg.moved_to
                    self.metrics.reattaches.inc()
                    continue
                failures.append(f"{wid}: moved to {seg.moved_to!r}, which cannot be attached")
                self.log.warning("request_move_unusable", request_id=rid, from_worker=wid, to_worker=seg.moved_to,
                                 moves=moves)
                await self._resume_or_give_up(record, wid, failures)
                continue
            await self._after_failure(record, seg, dead, failures)

    def _worker_request(self, record: RequestRecord, remaining: int) -> worker_pb2.WorkerGenerateRequest:
        emitted = len(record.token_ids)
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(record.sampling)
        if emitted:
            sampling.max_tokens = remaining
            sampling.min_tokens = max(0, sampling.min_tokens - emitted)
        record.index_offset = emitted
        return worker_pb2.WorkerGenerateRequest(request_id=record.request_id,
                                                prompt_token_ids=record.prompt_token_ids + record.token_ids,
                                                sampling=sampling, request_class=record.request_class)

    async def _after_failure(self, record: RequestRecord, seg: _Segment, dead: set[str], failures: list[str]) -> None:
        """A worker stream ended without finishing: decide between retry, resume and an error."""
        rid, wid, exc = record.request_id, seg.worker_id, seg.error
        code = exc.code() if exc is not None else None
        if seg.stalled:
            details = seg.stalled
        else:
            details = (exc.details() or exc.code().name) if exc is not None else "the stream ended without a finish event"
        if seg.attach and seg.received == 0:
            # The attach did not take (the new head does not know the request, died, or refuses):
            # fall back to a resume by re-prefill. Make sure a half-alive copy there is dropped first
            # (a stalled worker's copy goes with our cancelled call when it wakes up).
            failures.append(f"{wid}: attach failed: {code.name if code else 'ended'}: {details}")
            if code == grpc.StatusCode.UNAVAILABLE or seg.stalled:
                self.pool.failed(wid)
                dead.add(wid)
            elif code != grpc.StatusCode.NOT_FOUND:
                await self._cancel_on_worker(wid, rid)
            self.log.warning("attach_failed", request_id=rid, worker=wid, code=code.name if code else None,
                             error=details)
            await self._resume_or_give_up(record, wid, failures)
            return
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            # Alive but not routable (dropped layers, forming a group, re-forming): wait for a poll that says it
            # serves again; it is not excluded for this request.
            if _reforming(exc):
                self.pool.reforming(wid, time.monotonic())
            else:
                self.pool.router.refused(wid, time.monotonic())
            self.log.info("worker_not_serving_retrying", request_id=rid, worker=wid, emitted=len(record.token_ids),
                          error=details)
            if seg.received:
                failures.append(f"{wid}: {code.name}: {details}")
                await self._resume_or_give_up(record, wid, failures)
            return
        if code is None or code in _WORKER_FAILURE_CODES:
            self.pool.failed(wid)
            dead.add(wid)
            failures.append(f"{wid}: {code.name if code else ('STALLED' if seg.stalled else 'ENDED')}: {details}")
            record.crashes += not seg.stalled and not _ended_by_worker(exc)
            if record.token_ids:
                await self._resume_or_give_up(record, wid, failures)
            else:
                # Nothing was streamed yet: a plain retry elsewhere.
                self.log.warning("worker_unavailable_retrying", request_id=rid, worker=wid, error=details)
            if record.crashes >= MAX_WORKER_CRASHES and self.pool.router.choose(exclude=dead) is not None:
                self.log.error("request_quarantined", request_id=rid, crashes=record.crashes, failures=failures)
                raise RequestError(grpc.StatusCode.INTERNAL,
                                    f"request {rid!r} was running on {record.crashes} workers that failed; it is not "
                                    "sent to another, since it may be what makes them fail: " + "; ".join(failures))
            return
        # Validation and other errors from the worker keep their status and message.
        raise RequestError(code, details)

    async def _resume_or_give_up(self, record: RequestRecord, wid: str, failures: list[str]) -> None:
        if not record.token_ids:
            return  # nothing emitted: the next attempt is a plain (re)try, not a resume
        record.resumes += 1
        if record.resumes > self.max_resumes:
            self.log.error("request_resume_gave_up", request_id=record.request_id, emitted=len(record.token_ids),
                           resumes=record.resumes - 1, failures=failures)
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                f"request {record.request_id!r} lost its worker {record.resumes} times after "
                                f"{len(record.token_ids)} tokens; gave up after {self.max_resumes} resumes: "
                                + "; ".join(failures))
        self.metrics.resumes.inc()
        self.log.warning("request_resuming", request_id=record.request_id, from_worker=wid,
                         emitted=len(record.token_ids), attempt=record.resumes, error=failures[-1] if failures else "")

    async def _route(self, record: RequestRecord, dead: set[str], failures: list[str]) -> str | None:
        """The most-free routable worker not in `dead` (an offline request: the one where online work leaves
        the most room, `FreenessRouter.choose_offline`); waits (re-polling) while none is routable but
        some candidate is alive, up to route_timeout_s without a token. None: cancelled / shutting down.
        With dispatcher.elastic_tp a short request avoids the merged units that hold no long request while another
        unit has room for it (`long_requests.choose_unthrottled`)."""
        router = self.pool.router
        if record.route_deadline is None:
            record.route_deadline = time.monotonic() + self.route_timeout_s
        polled = logged = False
        asked_at, waiting_for = -PLACE_RETRY_S, ""
        while True:
            if record.cancelled or record.shutting_down or record.expired or self.stopping:
                return None
            avoid = dead | self.pool.draining
            throttled: frozenset[str] = frozenset()
            if self.pool.elastic_tp:
                whole_life = len(record.prompt_token_ids) + record.max_tokens
                fits, small = long_requests.split_by_fit(router, whole_life, exclude=avoid)
                avoid = avoid | set(small)  # they would refuse it (INVALID_ARGUMENT)
                if small and not fits:
                    if time.monotonic() - asked_at >= PLACE_RETRY_S:
                        asked_at = time.monotonic()
                        placed, waiting_for = await self._place_long(record, whole_life)
                        if placed is not None:
                            return placed
                    if time.monotonic() >= record.route_deadline:
                        raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                           f"request {record.request_id!r}: prompt + max_tokens = {whole_life} tokens "
                                           "exceed every routable instance's KV, and no instance held it within "
                                           f"dispatcher.route_timeout_s = {self.route_timeout_s:g} s: {waiting_for}")
                    await self._pause(record, ROUTE_RETRY_S)
                    await self.pool.refresh()
                    continue
                if not long_requests.is_long(router, self.pool.tp_members, whole_life):
                    throttled = self._throttled_units()
            wid = long_requests.choose_unthrottled(router, offline=_offline(record),
                                                   tokens=len(record.prompt_token_ids) + len(record.token_ids) + 1,
                                                   throttled=throttled, exclude=avoid)
            if wid is not None:
                if logged:
                    self.log.info("routable_worker_found", request_id=record.request_id, worker=wid)
                return wid
            if polled:
                if not dispatch_rules.may_wait_for_route(router, time.monotonic(), record.route_deadline, exclude=avoid):
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, self._no_route_message(record, dead, failures))
                if not logged:
                    logged = True
                    self.log.info("waiting_for_routable_worker", request_id=record.request_id,
                                  timeout_s=round(record.route_deadline - time.monotonic(), 3))
                await self._pause(record, ROUTE_RETRY_S)
            await self.pool.refresh()  # maybe a worker is just coming (back) up or finished a transition
            polled = True

    def _throttled_units(self) -> frozenset[str]:
        """dispatcher.elastic_tp: the merged units holding no long request, which short requests avoid while another
        unit has room (Gyges Algorithm 2's reduced rate: they drain, go idle and are split back)."""
        throttled = self._long_held.throttled(self.pool.router, self.pool.tp_members)
        if throttled != self._throttled:
            self.log.info("tp_throttled", units=sorted(throttled),
                          long_held=dict(sorted(self._long_held.counts.items())))
            self._throttled = throttled
        return throttled

    async def _place_long(self, record: RequestRecord, whole_life: int) -> tuple[str | None, str]:
        """dispatcher.elastic_tp: ask the memory manager where a request too long for every routable unit goes (it
        may scale co-located instances up first, within the request's route deadline). (worker, "") to route to;
        (None, why) to wait; RequestError INVALID_ARGUMENT naming the cluster's maximum when no layout could hold it."""
        assert record.route_deadline is not None
        timeout = max(1.0, record.route_deadline - time.monotonic())
        try:
            reply = await self.pool.place_long(record.request_id, whole_life, timeout)
        except grpc.aio.AioRpcError as exc:
            return None, f"the memory manager's placement: {exc.code().name}: {exc.details()}"
        Reply = memory_manager_pb2.PlaceLongRequestReply
        if reply.action == Reply.REFUSE:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt + max_tokens = {whole_life} tokens: {reply.reason} (the cluster's maximum: "
                               f"{reply.max_tokens} KV tokens, i.e. prompt + max_tokens <= {reply.max_tokens + 1})")
        if reply.action == Reply.ROUTE and reply.worker_id in self.pool.stubs:
            wid = reply.worker_id
            # A scale-up re-executed the worker: route once a poll says it serves (its channel reconnects first), or
            # the request would count it as failed.
            while True:
                await self.pool.refresh_one(wid)
                if self.pool.router.routable(wid):
                    break
                if record.cancelled or record.shutting_down or record.expired or self.stopping:
                    return None, "the request ended while its placement waited"  # the caller's loop sees why
                if time.monotonic() >= record.route_deadline:
                    return None, f"the memory manager placed it on {wid}, which did not answer as serving"
                await self._pause(record, ROUTE_RETRY_S)
            self.log.info("long_request_placed", request_id=record.request_id, worker=wid, tokens=whole_life,
                          scaled_up=list(reply.scale_up.members) if reply.scale_up.op else None)
            return wid, ""
        why = reply.reason or f"the memory manager placed it on {reply.worker_id!r}, which this dispatcher does not know"
        self.log.info("long_request_waiting", request_id=record.request_id, tokens=whole_life, reason=why)
        return None, why

    def _no_route_message(self, record: RequestRecord, dead: set[str], failures: list[str]) -> str:
        states = []
        for wid in sorted(self.pool.stubs):
            load = self.pool.router.workers.get(wid)
            if wid in dead:
                state = "failed"
            elif wid in self.pool.draining:
                state = "draining"
            elif load is None or not load.healthy:
                state = "unreachable"
            else:
                state = "not serving"
            states.append(f"{wid}: {state}")
        msg = f"no routable worker for request {record.request_id!r} ({', '.join(states) or 'no workers'})"
        if record.token_ids:
            msg += f" to resume it after {len(record.token_ids)} tokens"
        if failures:
            msg += "; " + "; ".join(failures)
        return msg

    async def _relay(self, record: RequestRecord, seg: _Segment, wreq: worker_pb2.WorkerGenerateRequest):
        stub = self.pool.stubs.get(seg.worker_id)
        if stub is None:  # it left the cluster between routing and here: as if its stream broke at once
            seg.error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                             details=f"worker {seg.worker_id} left the cluster")
            return
        call = stub.Generate(wreq)
        record.call = call
        try:
            async for ev in call:
                seg.received += 1
                if ev.moved_to:
                    seg.moved_to = ev.moved_to  # nothing to show the client: continue where it moved
                    return
                now = time.monotonic()
                finish = ev.finish_reason
                if (finish == common_pb2.FINISH_REASON_STOP and ev.token_id in self.generation.eos_token_ids
                        and ev.token_id not in record.user_stop_ids):
                    finish = common_pb2.FINISH_REASON_EOS  # the worker only knew it as one of our stop ids
                text, stopped = self._text(record, ev.token_id, final=bool(finish))
                if stopped:
                    finish = common_pb2.FINISH_REASON_STOP  # a stop string: the worker's call is cancelled below
                if ev.token_id >= 0:
                    record.token_ids.append(ev.token_id)
                    record.route_deadline = None  # progress: a later wait gets the whole timeout again
                    if len(record.token_ids) == 1:
                        self.admission.started(record.request_id, now)  # its prompt no longer queues
                if finish:
                    seg.finished = record.finished = True
                out = generation_pb2.GenerateEvent(
                    request_id=record.request_id, token_id=ev.token_id, text=text,
                    index=ev.index + record.index_offset, finish_reason=finish,
                    elapsed_s=now - record.arrival, token_latency_s=now - record.last_event,
                    worker_id=seg.worker_id, num_prompt_tokens=len(record.prompt_token_ids),
                    top_logprobs=ev.top_logprobs,
                )
                if ev.HasField("logprob"):
                    out.logprob = ev.logprob
                yield out
                record.last_event = now
                if seg.finished:
                    return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the client went away (or the server is stopping the handler)
            if record.stalled_call is call:
                seg.stalled = record.stall_reason  # the worker stalled: resume elsewhere
            else:
                seg.local_cancel = True  # our own call.cancel(): Cancel, shutdown or the queue timeout
        except grpc.aio.AioRpcError as exc:
            seg.error = exc
        finally:
            if record.call is call:
                record.call = None
            if not call.done():
                call.cancel()

    async def _cancel_on_worker(self, wid: str, rid: str) -> None:
        stub = self.pool.stubs.get(wid)
        if stub is None:
            return  # it left the cluster: nothing of the request is left there
        try:
            await stub.Cancel(common_pb2.CancelRequest(request_id=rid), timeout=CANCEL_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            pass

    async def Cancel(self, request, context):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        record = self.records.get(rid)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {rid!r}")
        if record.owner != self._owner(context):
            self.log.warning("cancel_refused_not_owner", request_id=rid, caller=context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"request_id: {rid!r} was sent by another client; a request can be cancelled only "
                                "on the connection (or with the credential) that sent it")
        if record.finished:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {rid!r} already finished")
        # From here on nothing is retried, moved or resumed: the stream ends with ABORTED.
        record.cancelled = True
        record.wake.set()
        call, wid = record.call, record.worker_id
        stub = self.pool.stubs.get(wid)
        if call is not None and not call.done():
            try:
                if stub is None:  # its worker left the cluster: nothing to cancel there
                    raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details=f"worker {wid} left the cluster")
                # The worker frees the request and ends its stream with an ABORTED event (its index).
                await stub.Cancel(common_pb2.CancelRequest(request_id=rid), timeout=CANCEL_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                # Not (or no longer) there, or unreachable: end our call; the dispatcher answers ABORTED.
                self.log.info("cancel_on_worker_failed", request_id=rid, worker=wid, code=exc.code().name)
                if record.call is call:
                    call.cancel()
        self.log.info("request_cancelled", request_id=rid, worker=wid or None, emitted=len(record.token_ids))
        return common_pb2.CancelResponse(cancelled=True)

    async def shutdown(self) -> None:
        """Refuse new requests; end the in-flight ones with UNAVAILABLE "the dispatcher is shutting down"."""
        self.stopping = True
        for record in list(self.records.values()):
            record.shutting_down = True
            record.wake.set()
            if record.call is not None:
                record.call.cancel()
