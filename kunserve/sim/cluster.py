"""The simulated cluster: N workers, the dispatcher's routing and admission, the monitor and the memory manager, in
one discrete-event loop over simulated time.

Events (a heap, ties broken by insertion order, so a run is a pure function of its inputs):

* a trace request **arrives** at the dispatcher: its prompt is checked against the dispatcher's limits, admission
  (``admission.Admission``) takes it in or refuses it, the router (``router.FreenessRouter``) picks the most-free
  routable worker and counts it there until a report includes it, and the worker's engine validates it as a real
  worker does (``EngineRequest.validate``, ``Scheduler.check_fits``): a request a real run would refuse fails here
  with the same message. A worker that does not serve (a transition holds it) refuses it and the dispatcher routes
  again ``ROUTE_RETRY_S`` later, as it does on FAILED_PRECONDITION;
* a worker's **iteration** (or microbatch, or its return) ends: see ``worker.py``;
* every ``ROUTER_POLL_INTERVAL_S`` the dispatcher **polls** every worker (``RoutingLoad``), and every
  ``monitor.stats_interval_s`` every worker **reports** to the monitor's ``ClusterLoad``;
* every 0.25 s the bench's sampler takes a **cluster sample** (KV in use and capacity, units, drops);
* a request's **queue timeout** (dispatcher.queue_timeout_s without a first token) or its KV **landing** after a
  transition.

Between events the control plane (``control.py``) runs on the same clock: the monitor's tick every
``monitor.policy_interval_s`` and whatever transition the memory manager is driving.

The result is what `kunserve bench` measures: one ``RequestResult`` per request (TTFT and every token's time,
seen by a client at the dispatcher with no network in between) and the sampler's ``ClusterSample``s, so the bench's
own statistics, JSON and plots take a simulated run as they take a real one.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kunserve.benchkit.replay import SAMPLE_INTERVAL_S, ClusterSample, ReplayOutcome
from kunserve.benchkit.stats import RequestResult
from kunserve.benchkit.trace import TraceRequest
from kunserve.services.dispatcher.__main__ import ROUTER_POLL_INTERVAL_S
from kunserve.services.dispatcher.limits import DispatcherLimits, limits_from_config
from kunserve.services.dispatcher.servicer import ROUTE_RETRY_S
from kunserve.services.worker.build import layerwise_every, make_microbatch_former, make_token_budget
from kunserve.shared.config import ClusterConfig
from kunserve.shared.engine.api import InvalidRequest
from kunserve.shared.policy import dispatch_rules
from kunserve.shared.policy.admission import Admission
from kunserve.shared.policy.batch_scheduler import SchedulerConfig
from kunserve.shared.policy.cluster import WorkerReport
from kunserve.shared.policy.overload_policies import overload_handling
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad
from kunserve.shared.wire.transitions import units_from_pb
from kunserve.sim.control import ControlPlane
from kunserve.sim.elastic import GPUS_PER_HOST, TP_REFORM_S, ElasticTP
from kunserve.sim.shapes import Memory, ModelShape
from kunserve.sim.timing import TimeModel
from kunserve.sim.worker import NotServingHere, SimWorker, WorkerSetup
from kunserve.v1 import worker_pb2


class SimulationError(RuntimeError):
    """An invariant of the simulated cluster broke (a token emitted twice, KV over capacity): a bug, not bad input."""


@dataclass
class SimRequest:
    """One request as the simulated client and dispatcher see it."""

    index: int
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    offline: bool = False
    worker_id: str = ""  # the worker that holds it now
    routed_to: str = ""  # the worker the router counts it on
    first_token_s: float | None = None
    last_token_s: float | None = None
    emitted: int = 0
    token_times: list[float] | None = None  # each token's time since arrival (when recorded)
    done: bool = False
    ok: bool = False
    error: str = ""
    route_deadline: float = math.inf
    served_by: list[str] = field(default_factory=list)  # the workers its tokens came from, in order (a move adds one)
    resumed_at: int = 0  # tokens it had when its current worker took it (a re-form's hand-over resumes it)
    handed_over: int = 0  # times a re-form handed it back to the dispatcher

    def result(self) -> RequestResult:
        """The bench's RequestResult of this request (the client sent it at its arrival)."""
        first = None if self.first_token_s is None else self.first_token_s - self.arrival_s
        times = list(self.token_times) if self.token_times is not None else []
        return RequestResult(
            index=self.index,
            arrival_s=self.arrival_s,
            sent_s=self.arrival_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            ttft_s=first,
            token_times_s=times,
            e2e_s=(self.last_token_s - self.arrival_s) if self.ok and self.last_token_s is not None else None,
            ok=self.ok,
            error=self.error,
            worker_id=self.worker_id,
            finish_reason="length" if self.ok else "",
        )


@dataclass(frozen=True)
class OfflineLoad:
    """ConServe's offline backlog: `inflight` offline requests kept in flight (a finished one is replaced at once)
    until every online request has ended; lengths cycle through `lengths`."""

    lengths: tuple[tuple[int, int], ...]
    inflight: int


@dataclass
class ClusterSetup:
    """Everything one simulated run is made of: the config (its policy.overload and engine, monitor, memory manager,
    dispatcher and SLO sections, as a real cluster reads them), the model, each worker's memory and the time model."""

    cfg: ClusterConfig
    shape: ModelShape
    memory: Memory
    time: TimeModel
    instances: int
    label: str = ""
    # dispatcher.elastic_tp: a cold re-form's restart constant, the co-location domain, and each merged degree's
    # time model (a degree not given steps at `time`'s speed)
    tp_reform_s: float = TP_REFORM_S
    gpus_per_host: int = GPUS_PER_HOST
    time_by_degree: dict[int, TimeModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if not (math.isfinite(self.tp_reform_s) and self.tp_reform_s >= 0):
            raise ValueError(f"tp_reform_s must be >= 0, got {self.tp_reform_s}")
        if self.gpus_per_host < 1:
            raise ValueError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")
        if self.cfg.dispatcher.elastic_tp and self.shape.tp != 1:
            raise ValueError(f"elastic tensor parallelism merges whole single-GPU instances: tp must be 1, got {self.shape.tp}")

    def time_for(self, degree: int) -> TimeModel:
        """The time model of an instance of `degree` GPUs."""
        return self.time_by_degree.get(degree, self.time)


@dataclass
class SimOutcome:
    """What a simulated run produced."""

    replay: ReplayOutcome
    offline: list[RequestResult] = field(default_factory=list)
    transitions: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    window_s: float = 0.0  # start to the last online request's end


class Simulation:
    def __init__(
        self,
        setup: ClusterSetup,
        trace: Sequence[TraceRequest],
        *,
        offline: OfflineLoad | None = None,
        record_token_times: bool = True,
        request_timeout_s: float = 600.0,
        check_invariants: bool = False,
    ) -> None:
        self.setup = setup
        self.cfg = setup.cfg
        self.shape = setup.shape
        self.memory = setup.memory
        self.time = setup.time
        self.record_token_times = record_token_times
        self.request_timeout_s = request_timeout_s
        self.check_invariants = check_invariants
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.control_dirty = False
        cfg = self.cfg
        e = cfg.engine
        handling = overload_handling(cfg.policy.overload)
        budget, self.budget_reason = make_token_budget(cfg, setup.time.profile, setup.time.source)
        former, self.former_reason = make_microbatch_former(cfg, setup.time.profile, setup.time.source)
        scheduler = SchedulerConfig(
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs,
            offline_free_watermark=e.offline_free_watermark,
            coserving=e.coserving,
            preemption=handling.preemption,
        )
        wsetup = WorkerSetup(
            scheduler,
            budget,
            former,
            e.block_size,
            self.shape.config.vocab_size,
            self.shape.config.max_position_embeddings,
            layerwise_every(cfg),
            cfg.slo.ttft_ms / 1e3,
        )
        self.workers: dict[str, SimWorker] = {}
        for i in range(setup.instances):
            wid = f"worker-{i}"
            self.workers[wid] = SimWorker(self, wid, wsetup)
        self.router = FreenessRouter()
        self.elastic = ElasticTP(self) if cfg.dispatcher.elastic_tp else None
        self.admission = Admission()
        self.limits = self._limits()
        self.control = ControlPlane(self, monitor_action=handling.monitor_action, static_pairs=handling.static_pairs)
        self.requests = [
            SimRequest(i, f"sim-{i}", r.arrival_s, r.prompt_tokens, r.output_tokens)
            for i, r in enumerate(sorted(trace, key=lambda r: r.arrival_s))
        ]
        self.offline_load = offline
        self.offline: list[SimRequest] = []
        self._offline_next = 0
        self._arrived = 0
        self.outstanding = 0
        self._online_left = len(self.requests)
        self.samples: list[ClusterSample] = []
        self.window_s = 0.0
        self._next_monitor = 0.0

    def _limits(self) -> DispatcherLimits:
        """limits_from_config reads the context from the model directory; the shape has it already."""
        cfg = self.cfg
        limits = limits_from_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="")))
        context = self.shape.config.max_position_embeddings
        d = cfg.dispatcher
        prompt = min(d.max_prompt_tokens, context) if d.max_prompt_tokens else context
        return dataclasses.replace(
            limits,
            context_len=context,
            max_prompt_tokens=prompt,
            auto_prompt_tokens=not d.max_prompt_tokens or d.max_prompt_tokens >= context,
        )

    # -- the event loop --------------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), fn, args))

    def run(self) -> SimOutcome:
        self.control.start()
        if self.elastic is not None:
            self.elastic.start()
        self._poll()  # the dispatcher serves once every worker answered its first poll
        self.at(0.0, self._sample)
        if self.requests:
            self.at(self.requests[0].arrival_s, self._arrive)
        if self.offline_load is not None:
            for _ in range(self.offline_load.inflight):
                self._submit_offline()
        last_arrival = self.requests[-1].arrival_s if self.requests else 0.0
        deadline = last_arrival + self.request_timeout_s
        heap = self._heap
        try:
            while self._online_left > 0:
                t_event = heap[0][0] if heap else math.inf
                t_control = self.control.next_time()
                t = min(t_event, t_control)
                if t > deadline or t == math.inf:
                    break
                if t_control <= t_event:
                    self.now = max(self.now, t_control)
                    self.control.run()
                    continue
                t, _, fn, args = heapq.heappop(heap)
                self.now = t
                fn(*args)
                if self.control_dirty:
                    self.control_dirty = False
                    self.control.run()
                if self.check_invariants:
                    self.verify()
            self._expire_all()
        finally:
            self.control.close()
        results = [r.result() for r in self.requests]
        ends = [r.last_token_s for r in self.requests if r.last_token_s is not None]
        duration = max([self.now if not ends else max(ends), 1e-9])
        self.window_s = duration
        replay = ReplayOutcome(results=results, duration_s=duration, samples=self.samples)
        return SimOutcome(
            replay, [r.result() for r in self.offline], [t.to_dict() for t in self.control.records], self.counters(), duration
        )

    def _expire_all(self) -> None:
        for r in [*self.requests, *self.offline]:
            if not r.done:
                if self.offline_load is not None and r.offline and self._online_left == 0:
                    self._fail(r, "interrupted")  # the co-serving run ends with the online trace
                else:
                    self._fail(r, f"DEADLINE_EXCEEDED: no answer within the {self.request_timeout_s:g} s request timeout")

    def counters(self) -> dict[str, Any]:
        workers = self.workers.values()
        c = {
            name: sum(getattr(w.counters, name) for w in workers)
            for name in (
                "iterations",
                "microbatches",
                "planned_microbatches",
                "layerwise_preemptions",
                "swapped_out_blocks",
                "swapped_in_blocks",
            )
        }
        c["preemptions"] = sum(w.scheduler.num_preemptions for w in workers)
        c["offline_preemptions"] = sum(w.scheduler.num_offline_preemptions for w in workers)
        if self.control.controller is not None:
            c["policy"] = dataclasses.asdict(self.control.controller.counters)
        c["admission_refused"] = self.admission.refused_total
        c["budget"] = self.budget_reason
        c["microbatches_by"] = self.former_reason
        if self.elastic is not None:
            c["tp"] = dict(self.elastic.counters)
        return c

    # -- requests ---------------------------------------------------------------------------------------------------
    def _arrive(self) -> None:
        req = self.requests[self._arrived]
        self._arrived += 1
        if self._arrived < len(self.requests):
            self.at(self.requests[self._arrived].arrival_s, self._arrive)
        if self.time.request_latency_s > 0:  # the client's send to the dispatcher (and the first token's way back)
            self.at(self.now + self.time.request_latency_s, self._accept, req)
        else:
            self._accept(req)

    def _accept(self, req: SimRequest) -> None:
        now = self.now
        self.outstanding += 1
        if self.record_token_times:
            req.token_times = []
        lim = self.limits
        if req.prompt_tokens > lim.max_prompt_tokens:
            message = dispatch_rules.prompt_too_long(
                req.prompt_tokens,
                "token ids",
                context_len=lim.context_len,
                max_prompt_tokens=lim.max_prompt_tokens,
                auto_prompt_tokens=lim.auto_prompt_tokens,
            )
            self._fail(req, f"INVALID_ARGUMENT: {message}")
            return
        inflight, tokens = self._bounds()
        refusal = self.admission.admit(req.request_id, req.prompt_tokens, now, max_inflight=inflight, max_queued_tokens=tokens)
        if refusal is not None:
            self._fail(req, f"RESOURCE_EXHAUSTED: {refusal.message}", admitted=False)
            return
        req.route_deadline = now + self.cfg.dispatcher.route_timeout_s
        self.at(now + self.limits.queue_timeout_s, self._queue_expired, req)
        self._route(req)

    def _bounds(self) -> tuple[int, int]:
        """DispatcherServicer._bounds over the router's view (every worker answers here)."""
        live, kv = dispatch_rules.capacity(self.router)
        lim = self.limits
        return dispatch_rules.admission_bounds(
            max_inflight_per_worker=lim.max_inflight_per_worker,
            max_queued_prompt_tokens=lim.max_queued_prompt_tokens,
            max_prompt_tokens=lim.max_prompt_tokens,
            live_workers=live,
            kv_tokens=kv,
        )

    def _route(self, req: SimRequest) -> None:
        if req.done:
            return
        now = self.now
        router = self.router
        if self.elastic is not None:
            wid = self.elastic.choose(req)
            if req.done or self.elastic.parked(req):
                return
        else:
            wid = dispatch_rules.choose_worker(router, offline=req.offline, tokens=req.prompt_tokens + req.emitted + 1)
        if wid is None:
            if not dispatch_rules.may_wait_for_route(router, now, req.route_deadline):
                self._fail(req, "UNAVAILABLE: no worker can take the request")
            else:
                self.at(now + ROUTE_RETRY_S, self._route, req)
            return
        self.send(req, wid)

    route = _route

    def send(self, req: SimRequest, wid: str) -> None:
        """The dispatcher sends `req` to `wid` (its prompt and the tokens it has so far)."""
        if req.done:
            return
        now = self.now
        router = self.router
        router.routed(wid, req.request_id, req.prompt_tokens + req.emitted + 1, now, offline=req.offline)
        req.routed_to = wid
        try:
            self.workers[wid].add(req)
        except NotServingHere:
            router.done(wid, req.request_id)
            router.refused(wid, now)
            self.at(now + ROUTE_RETRY_S, self._route, req)
        except InvalidRequest as exc:
            self._fail(req, f"INVALID_ARGUMENT: {exc}")
        else:
            if self.elastic is not None:
                self.elastic.routed(req, wid)

    def handed_over(self, req: SimRequest) -> None:
        """A re-form handed the request back (its stream ended with FAILED_PRECONDITION): the dispatcher resumes it
        on a routable unit, which re-prefills its prompt and the tokens it has."""
        if req.routed_to:
            self.router.done(req.routed_to, req.request_id)
            req.routed_to = ""
        if self.elastic is not None:
            self.elastic.released(req)
        req.handed_over += 1
        if req.emitted:  # the dispatcher's route deadline restarts with every token: a resume waits the whole timeout
            req.route_deadline = self.now + self.cfg.dispatcher.route_timeout_s
        self.at(self.now, self._route, req)

    def _queue_expired(self, req: SimRequest) -> None:
        if req.done or req.emitted:
            return
        if req.worker_id:
            self.workers[req.worker_id].abort(req.request_id)
        self._fail(
            req,
            f"RESOURCE_EXHAUSTED: request {req.request_id!r} got no first token within "
            f"dispatcher.queue_timeout_s = {self.limits.queue_timeout_s:g} s",
        )

    def _fail(self, req: SimRequest, error: str, *, admitted: bool = True) -> None:
        if req.done:
            return
        req.done, req.ok, req.error = True, False, error
        self._ended(req, admitted)

    fail = _fail

    def _ended(self, req: SimRequest, admitted: bool = True) -> None:
        self.outstanding -= 1
        if admitted:
            self.admission.release(req.request_id, self.now)
        if req.routed_to:
            self.router.done(req.routed_to, req.request_id)
        if self.elastic is not None:
            self.elastic.released(req)
        if req.offline:
            if self._online_left > 0:
                self._submit_offline()
        else:
            self._online_left -= 1

    def token(self, req: SimRequest, index: int, finished: bool) -> None:
        """A worker sampled token `index` of `req` (the dispatcher relays it to the client at once)."""
        if req.done or index != req.emitted:
            raise SimulationError(
                f"request {req.request_id}: token {index} after {req.emitted} emitted"
                f"{' and the request ended' if req.done else ''} (a token generated twice)"
            )
        now = self.now
        req.emitted += 1
        if not req.served_by or req.served_by[-1] != req.worker_id:
            req.served_by.append(req.worker_id)
        if index == 0:
            req.first_token_s = now
            self.admission.started(req.request_id, now)
        req.last_token_s = now
        if req.token_times is not None:
            req.token_times.append(now - req.arrival_s)
        if finished:
            if req.emitted != req.output_tokens:
                raise SimulationError(f"request {req.request_id}: finished after {req.emitted} of {req.output_tokens} tokens")
            req.done = req.ok = True
            self._ended(req)

    def _submit_offline(self) -> None:
        load = self.offline_load
        assert load is not None
        prompt, output = load.lengths[self._offline_next % len(load.lengths)]
        req = SimRequest(self._offline_next, f"sim-offline-{self._offline_next}", self.now, prompt, output, True)
        self._offline_next += 1
        self.offline.append(req)
        self._accept(req)

    # -- transitions ------------------------------------------------------------------------------------------------
    def apply_transition(self, spec: worker_pb2.TransitionSpec, landing: dict[str, float]) -> None:
        """Every member of the transition takes its place in the new units at once; each head takes its requests
        with their new block tables, those whose KV still moves held until it has landed (`landing`: request ->
        seconds from now)."""
        new_units = units_from_pb(spec.new_units)
        held: dict[str, tuple[Any, SimRequest]] = {}
        for u in units_from_pb(spec.old_units):
            head = self.workers[u.head]
            for rid, seq in head.seqs.items():
                held[rid] = (seq, head.requests[rid])
        heads = {u.unit_id: u.head for u in new_units}
        for u in new_units:
            for m in u.members:
                self.workers[m.worker_id].take_role(u, u.kv_blocks, spec.epoch)
        for s in spec.seqs:
            pair = held.get(s.request_id)
            if pair is None or pair[1].done:
                continue
            seq, req = pair
            head = self.workers[heads[s.new_unit]]
            wait = landing.get(s.request_id, 0.0)
            head.install(seq, req, list(s.new_blocks), wait > 0)
            if wait > 0:
                self.at(self.now + wait, head.landed, s.request_id)
            if req.routed_to and req.routed_to != head.worker_id:
                self.router.done(req.routed_to, req.request_id)
                req.routed_to = ""
        for u in new_units:
            for m in u.members:
                self.workers[m.worker_id].resume()

    # -- observation ------------------------------------------------------------------------------------------------
    def _poll(self) -> None:
        """The dispatcher's poll of every worker and, when due, every worker's report to the monitor."""
        now = self.now
        monitor = now + 1e-9 >= self._next_monitor
        for wid in self.workers:
            r = self.refresh_one(wid)
            if monitor:
                self.control.load.observe(r, now)
        if monitor:
            self._next_monitor = now + self.cfg.monitor.stats_interval_s
        if not self._finished():
            step = min(ROUTER_POLL_INTERVAL_S, self.cfg.monitor.stats_interval_s)
            self.at(now + step, self._poll)

    def refresh_one(self, wid: str) -> WorkerReport:
        """The dispatcher's poll of one worker (DispatcherPool.refresh_one)."""
        r = self.workers[wid].report()
        online = r.num_running + r.num_waiting - r.num_offline_running - r.num_offline_waiting
        self.router.update(
            RoutingLoad(
                wid,
                r.kv_blocks_total,
                r.kv_blocks_used,
                r.queued_demand_blocks,
                r.block_size or 16,
                True,
                self.now,
                serving=r.routable,
                online_requests=online,
            )
        )
        if self.elastic is not None:
            self.elastic.observe(wid, r.tp_members)
        return r

    def _sample(self) -> None:
        """The bench sampler's view (replay.sample_from_status): KV over the serving units' heads, the units."""
        # a tensor-parallel follower is part of its rank 0's instance, whose KV rank 0 reports
        serving_side = [w for w in self.workers.values() if not w.is_tp_follower]
        units = {w.unit.unit_id: w.unit for w in serving_side}
        used = total = queued = 0
        for u in units.values():
            head = self.workers[u.head]
            used += head.allocator.num_used
            total += head.allocator.num_blocks
            queued += head.scheduler.queued_demand_blocks()
        self.samples.append(
            ClusterSample(
                t_s=self.now,
                kv_blocks_used=used,
                kv_blocks_total=total,
                queued_demand_blocks=queued,
                units=len(units),
                pipelined_units=sum(1 for u in units.values() if u.is_group),
                workers=len(serving_side),
                epoch=max(w.epoch for w in self.workers.values()),
                kv_blocks_undropped=self.memory.undropped_blocks * len(self.workers),
            )
        )
        if not self._finished():
            self.at(self.now + SAMPLE_INTERVAL_S, self._sample)

    def _finished(self) -> bool:
        return self._online_left == 0

    def verify(self) -> None:
        """Conservation: every head's blocks are exactly its requests' tables, within its capacity."""
        for w in self.workers.values():
            if w.is_stage:
                continue
            held = sum(len(s.block_table) for s in w.seqs.values())
            if w.allocator.num_used != held or w.allocator.num_used > w.allocator.num_blocks:
                raise SimulationError(
                    f"{w.worker_id}: {w.allocator.num_used} blocks in use, its requests hold {held}, capacity {w.allocator.num_blocks}"
                )


__all__ = ["ClusterSetup", "OfflineLoad", "SimOutcome", "SimRequest", "Simulation", "SimulationError"]
