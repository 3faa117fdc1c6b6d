"""One simulated worker: the engine's iteration loop over the live request scheduler, without a model.

A worker holds a contiguous layer range and plays one of the engine's three roles (shared/engine/engine.py):

* **whole** instance: each iteration asks the scheduler (``batch_scheduler.Scheduler``, the worker's own class,
  with its token budget) for a batch, takes the time model's step time for it, then marks the chunks computed and
  samples a token for every sequence whose KV is complete. Swap preemption charges the KV copy to the iteration
  that swaps (``Swapper``); ConServe's layer-wise preemption cuts an iteration at its next safepoint when an online
  arrival would miss the TTFT SLO (``layerwise_preemption.should_preempt``).
* pipeline-group **head**: ships microbatches through its stages, up to one per stage in flight, as
  ``Engine._step_pipelined`` does: the decodes spread over the microbatches while ``DecodeSplit`` says so, the
  prompt chunks cut by the lookahead ``MicrobatchFormer`` when the queue is long (the engine's own
  ``head_schedule.LookaheadPlan`` picks each microbatch); each microbatch runs the head's
  layers, crosses to each later stage (activations over the network), runs there when the stage is free, and its
  logits come back; sequences in flight are pinned.
* later **stage**: busy while it runs a microbatch of its head.

With elastic tensor parallelism (``elastic.py``) a worker is also the **rank 0** of a merged TP2 / TP4 instance
(a whole instance with the merged instance's KV capacity and step time), a **follower** of one (it serves nothing:
rank 0 speaks for the instance), or **re-forming** (a cold re-form: it serves nothing until it comes back).

Requests carry lengths, not tokens: a prompt is that many placeholder ids and every sampled token the same id,
which is all the scheduler's block accounting and FCFS order read. What the engine does between these steps that
is not a policy (building tensors, sampling) costs nothing here; what it does that is a policy is the policy's
own code.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kunserve.shared.engine.api import EngineRequest, EngineStats, InvalidRequest, SamplingParams
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable, blocks_needed
from kunserve.shared.policy.batch_scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence, TokenBudget
from kunserve.shared.policy.cluster import Member, Unit, WorkerReport
from kunserve.shared.policy.costmodel import BatchShape
from kunserve.shared.policy.head_schedule import LookaheadPlan, online_queued_tokens, role_budget
from kunserve.shared.policy.layerwise_preemption import IterationInFlight, should_preempt
from kunserve.shared.policy.measured_latency import MeasuredLatencyModel
from kunserve.shared.policy.microbatch import DecodeSplit, MicrobatchFormer

if TYPE_CHECKING:
    from kunserve.sim.cluster import SimRequest, Simulation
    from kunserve.sim.timing import TimeModel

PLACEHOLDER_TOKEN = 1  # every prompt and generated token: lengths are what the simulation is about
ENGINE_CLOCK_BASE_S = 1000.0  # engine arrival stamps are sim time + this (the engine treats a stamp of 0 as unset)


class NotServingHere(Exception):
    """The worker takes no request now (a later stage, or paused by a transition): FAILED_PRECONDITION."""


@dataclass
class _Iteration:
    """A whole instance's iteration in flight."""

    start: float
    end: float
    chunks: list[ScheduledChunk]
    shape: BatchShape
    offline_rows: int
    online_rows: int
    predicted: float
    online_queued: int = 0  # prompt tokens of online requests left to prefill after this batch
    arrived_tokens: int = 0  # prompts of the online requests that arrived during it
    computed: list[ScheduledChunk] | None = None  # the chunks that compute (None: all; a cut keeps the online ones)


@dataclass(eq=False)
class _Microbatch:
    """A microbatch a group head shipped."""

    chunks: list[ScheduledChunk]
    sampled: list[ScheduledChunk]
    sent_at: float
    shape: BatchShape
    arrives: float
    arrived: bool = False


@dataclass
class WorkerSetup:
    """What every worker of one simulated cluster shares: the engine's configuration."""

    scheduler: SchedulerConfig
    budget: TokenBudget
    former: MicrobatchFormer
    block_size: int
    vocab_size: int
    max_model_len: int
    safepoint_every: int = 0
    ttft_slo_s: float = math.inf


@dataclass
class Counters:
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    iterations: int = 0
    microbatches: int = 0
    planned_microbatches: int = 0
    layerwise_preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    busy_s: float = 0.0


class SimWorker:
    def __init__(self, sim: Simulation, worker_id: str, setup: WorkerSetup) -> None:
        self.sim = sim
        self.worker_id = worker_id
        self.setup = setup
        self.memory = sim.memory
        self.num_layers = sim.shape.num_layers
        self.member = Member(worker_id, 0, self.num_layers, f"sim:{worker_id}")
        self.unit = Unit(worker_id, (self.member,))
        self.epoch = 0
        self.allocator = BlockAllocator(self.memory.undropped_blocks)
        self.time = sim.time  # the step times of this worker's instance (a merged one's are its degree's)
        self.tp_members: tuple[str, ...] = (worker_id,)  # its tensor-parallel instance in rank order
        self.reforming = False  # a cold re-form holds it: it serves nothing until it comes back
        self.scheduler = Scheduler(self.allocator, setup.block_size, setup.scheduler, setup.budget)
        self.scheduler.swapper = self
        self.latency: MeasuredLatencyModel | None = None
        self._budget_for(0)
        self.seqs: dict[str, Sequence] = {}
        self.requests: dict[str, SimRequest] = {}
        self.held: dict[str, Sequence] = {}  # their KV still lands after a transition
        self.paused = False  # a transition holds the engine
        self.paused_at = 0.0
        self._quiet_waiters: list[Callable[[], None]] = []
        self.counters = Counters()
        self._io_s = 0.0  # swap copies charged to the iteration being scheduled
        # whole instance
        self.iteration: _Iteration | None = None
        # group head
        self.inflight: collections.deque[_Microbatch] = collections.deque()
        self.head_free_at = 0.0
        self.lookahead = LookaheadPlan(setup.former)
        self.decode_split = DecodeSplit()
        # later stage
        self.free_at = 0.0

    # -- role ------------------------------------------------------------------------------------------------------
    @property
    def layer_range(self) -> tuple[int, int]:
        return self.member.range

    @property
    def held_layers(self) -> int:
        return self.member.layer_end - self.member.layer_start

    @property
    def is_head(self) -> bool:
        return self.unit.is_group and self.unit.head == self.worker_id

    @property
    def is_stage(self) -> bool:
        return self.unit.is_group and self.unit.head != self.worker_id

    @property
    def is_tp_follower(self) -> bool:
        return len(self.tp_members) > 1 and self.tp_members[0] != self.worker_id

    @property
    def tp_degree(self) -> int:
        return len(self.tp_members)

    @property
    def serving(self) -> bool:
        """Routable: a whole instance, a group's head or a TP instance's rank 0 (Engine.serving), not re-forming."""
        return not self.is_stage and not self.is_tp_follower and not self.reforming

    def _budget_for(self, group_size: int) -> None:
        """Engine._budget_for: the configured budget, under a fresh measured latency when it is ConServe's SLO
        budget (a group head's assumed scale: its number of stages, until measured)."""
        budget, self.latency = role_budget(self.setup.budget, float(max(1, group_size or 1)))
        self.scheduler.use_budget(budget)

    def take_role(self, unit: Unit, kv_blocks: int, epoch: int) -> None:
        """Become what `unit` makes this worker (whole, head or stage) holding no request; the caller installs the
        head's requests next (Engine._take_role)."""
        member = unit.member(self.worker_id)
        assert member is not None
        self.member = member
        self.unit = unit
        self.epoch = epoch
        self.seqs.clear()
        self.requests.clear()
        self.held.clear()
        self.inflight.clear()
        self.lookahead.clear()
        self.iteration = None
        capacity = self.memory.blocks(*member.range)
        self.allocator = BlockAllocator(min(capacity, kv_blocks) if unit.is_group else capacity)
        self.scheduler.reset(self.allocator)
        self._budget_for(unit.size if self.is_head else 0)
        now = self.sim.now
        self.head_free_at = self.free_at = now

    def install(self, seq: Sequence, request: SimRequest, blocks: list[int], landing: bool) -> None:
        """Take over a request with its block table in this worker's block space (Engine.install)."""
        seq.block_table = BlockTable(self.setup.block_size, blocks)
        if not blocks:
            seq.num_computed = 0
        self.allocator.take(blocks)
        self.seqs[seq.request_id] = seq
        self.requests[seq.request_id] = request
        request.worker_id = self.worker_id
        if landing and blocks:
            self.held[seq.request_id] = seq
        elif blocks:
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq)

    def landed(self, request_id: str) -> None:
        """A held request's KV has landed everywhere: it runs again (Engine.kv_landed)."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.scheduler.add_running(seq)
            self.kick()
        self._check_quiet()

    # -- requests ------------------------------------------------------------------------------------------------
    def add(self, request: SimRequest) -> None:
        """Engine.add_request: NotServingHere when it takes none now; InvalidRequest for what it could never run."""
        if not self.serving or self.paused:
            raise NotServingHere(f"worker {self.worker_id} is not serving")
        # a resumed request (handed over by a re-form) re-prefills its prompt and the tokens it has, as the
        # dispatcher resends them
        request.resumed_at = request.emitted
        req = EngineRequest(
            request.request_id,
            [PLACEHOLDER_TOKEN] * (request.prompt_tokens + request.emitted),
            SamplingParams(max_tokens=request.output_tokens - request.emitted, ignore_eos=True),
            arrival_time=self.sim.now + ENGINE_CLOCK_BASE_S,
            offline=request.offline,
        )
        req.validate(self.setup.vocab_size, self.setup.max_model_len)
        self.scheduler.check_fits(req)
        seq = Sequence(req, list(req.prompt_token_ids), BlockTable(self.setup.block_size))
        self.seqs[req.request_id] = seq
        self.requests[req.request_id] = request
        request.worker_id = self.worker_id
        self.scheduler.add(seq)
        if not request.offline:
            self._online_arrived(request.prompt_tokens + request.emitted)
        self.kick()

    def abort(self, request_id: str) -> bool:
        """Engine.abort: the request leaves and frees its blocks (a sequence in flight on a group is unpinned when
        its microbatch returns, as the engine does)."""
        seq = self.seqs.pop(request_id, None)
        self.requests.pop(request_id, None)
        if seq is None:
            return False
        if self.held.pop(request_id, None) is not None:
            self.allocator.free(seq.block_table.clear())
            return True
        self.scheduler.remove(seq)
        return True

    # -- Swapper (swap preemption: the copy is on the iteration's critical path) ------------------------------------
    def swap_out(self, seq: Sequence) -> None:
        n = blocks_needed(seq.num_computed, self.setup.block_size)
        self._io_s += n * self._block_bytes() / self.sim.time.links.host
        self.counters.swapped_out_blocks += n
        seq.swapped = n

    def swap_in(self, seq: Sequence) -> None:
        n = int(seq.swapped or 0)
        self._io_s += n * self._block_bytes() / self.sim.time.links.host
        self.counters.swapped_in_blocks += n
        seq.swapped = None

    def _block_bytes(self) -> int:
        return self.memory.shape.kv_spec.block_bytes * self.held_layers

    # -- the loop ---------------------------------------------------------------------------------------------------
    def kick(self) -> None:
        """Start work if there is some and nothing holds the engine."""
        if self.paused or self.is_stage or self.is_tp_follower:
            return
        if self.is_head:
            self._head_step()
        elif self.iteration is None:
            self._start_iteration()

    def _step_s(self, shape: BatchShape, layers: int) -> float:
        return self.time.step_s(shape, layers, self.num_layers)

    def _predict(self, shape: BatchShape) -> float:
        model = getattr(self.scheduler.budget, "model", None)
        return model.shape_cost(shape) if model is not None else 0.0

    def _start_iteration(self) -> None:
        self._io_s = 0.0
        chunks = self.scheduler.schedule()
        if not chunks:
            self._check_quiet()
            return
        now = self.sim.now
        shape = BatchShape.of((c.num_tokens, c.start) for c in chunks)
        duration = self._step_s(shape, self.held_layers) + self._io_s
        offline = sum(c.num_tokens for c in chunks if c.seq.request.offline)
        cut = bool(self.setup.safepoint_every and offline)
        it = _Iteration(
            now,
            now + duration,
            chunks,
            shape,
            offline,
            shape.tokens - offline,
            self._predict(shape) if cut else 0.0,
            online_queued_tokens(self.scheduler, chunks) if cut else 0,
        )
        self.iteration = it
        self.counters.iterations += 1
        self.sim.at(it.end, self._iteration_done, it)

    def _online_arrived(self, prompt_tokens: int) -> None:
        """Engine.online_arrived: cut the iteration in flight at its next safepoint when waiting for it, then for the
        prefill of the online prompts queued ahead and this one's, would miss the TTFT SLO (ConServe Algorithm 2);
        the iteration then finishes with its online rows only."""
        it = self.iteration
        every = self.setup.safepoint_every
        if not every or it is None or it.computed is not None or not it.offline_rows:
            return
        now = self.sim.now
        it.arrived_tokens += max(1, prompt_tokens)
        in_flight = IterationInFlight(it.start, it.predicted, it.offline_rows, it.online_rows, it.online_queued)
        prefill = self._predict(BatchShape.of([(it.online_queued + it.arrived_tokens, 0)]))
        if not should_preempt(now, in_flight, prefill, self.setup.ttft_slo_s):
            return
        layers = self.held_layers
        per_layer = (it.end - it.start) / layers
        cut_layer = min(layers, math.ceil((now - it.start) / per_layer / every) * every)
        if cut_layer >= layers:
            return
        online = [c for c in it.chunks if not c.seq.request.offline]
        rest = BatchShape.of((c.num_tokens, c.start) for c in online)
        it.computed = online
        it.end = it.start + cut_layer * per_layer + (self._step_s(rest, layers - cut_layer) if online else 0.0)
        self.counters.layerwise_preemptions += 1
        self.sim.at(it.end, self._iteration_done, it)

    def _iteration_done(self, it: _Iteration) -> None:
        if self.iteration is not it or self.sim.now != it.end:
            return  # superseded by a cut (its own event is the one that counts)
        self.iteration = None
        self.counters.busy_s += it.end - it.start
        computed = it.chunks if it.computed is None else it.computed
        self._computed(computed)
        for chunk in computed:
            if chunk.completes and self.seqs.get(chunk.seq.request_id) is chunk.seq:
                self._append(chunk.seq)
        if self.latency is not None and it.computed is None:
            self.latency.observe(it.shape, it.end - it.start)
        if self.paused:
            self._check_quiet()
        else:
            self._start_iteration()

    def _computed(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            seq = chunk.seq
            if chunk.start == 0 and seq.num_preemptions == 0:
                self.counters.prompt_tokens_total += len(seq.request.prompt_token_ids)
            seq.num_computed = chunk.start + chunk.num_tokens

    def _append(self, seq: Sequence) -> None:
        seq.tokens.append(PLACEHOLDER_TOKEN)
        seq.generated.append(PLACEHOLDER_TOKEN)
        self.counters.generated_tokens_total += 1
        request = self.requests[seq.request_id]
        finished = len(seq.generated) >= seq.request.sampling.max_tokens
        if finished:
            self.seqs.pop(seq.request_id, None)
            self.requests.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        self.sim.token(request, request.resumed_at + len(seq.generated) - 1, finished)

    # -- a pipeline group's head -------------------------------------------------------------------------------------
    def _head_step(self) -> None:
        """Engine._step_pipelined at a moment the head's own stage is free: take the results that came back, then
        ship one microbatch when fewer than one per stage are in flight."""
        now = self.sim.now
        if now < self.head_free_at:
            return
        self._collect()
        if self.paused:
            self._check_quiet()
            return
        stages = self.unit.size
        if len(self.inflight) >= stages:
            return
        chunks = self._next_microbatch(stages)
        if not chunks:
            self._check_quiet()
            return
        self._ship(chunks)

    def _next_microbatch(self, inflight: int) -> list[ScheduledChunk]:
        """Engine._next_microbatch: the head's next microbatch by the engine's own `LookaheadPlan`."""
        chunks = self.lookahead.next_microbatch(self.scheduler, inflight, self.decode_split.split)
        self.counters.planned_microbatches = self.lookahead.planned
        return chunks

    def _ship(self, chunks: list[ScheduledChunk]) -> None:
        now = self.sim.now
        sim = self.sim
        shape = BatchShape.of((c.num_tokens, c.start) for c in chunks)
        sampled = [c for c in chunks if c.completes]
        head_end = now + self._step_s(shape, self.held_layers)
        t = head_end
        for m in self.unit.members[1:]:
            stage = sim.workers[m.worker_id]
            t += sim.time.links.network_s(shape.tokens * sim.shape.hidden_bytes_per_token)
            start = max(t, stage.free_at)
            stage.free_at = start + self._step_s(shape, m.layer_end - m.layer_start)
            stage.counters.busy_s += stage.free_at - start
            t = stage.free_at
        t += sim.time.links.network_s(len(sampled) * sim.shape.logits_bytes_per_row)
        self._computed(chunks)
        for c in chunks:
            self.scheduler.pin(c.seq)
        mb = _Microbatch(chunks, sampled, now, shape, t)
        self.inflight.append(mb)
        self.counters.microbatches += 1
        self.counters.busy_s += head_end - now
        self.head_free_at = head_end
        sim.at(head_end, self._head_step)
        sim.at(t, self._result, mb)

    def _result(self, mb: _Microbatch) -> None:
        if mb not in self.inflight:
            return  # the group was dissolved meanwhile
        mb.arrived = True
        self._head_step()
        self._check_quiet()

    def _collect(self) -> None:
        """Engine._collect: every result that came back, oldest first."""
        now = self.sim.now
        while self.inflight and self.inflight[0].arrived:
            mb = self.inflight.popleft()
            if self.latency is not None:
                self.latency.observe(mb.shape, now - mb.sent_at)
            for chunk in mb.chunks:
                self.scheduler.unpin(chunk.seq)
            live = [c for c in mb.sampled if self.seqs.get(c.seq.request_id) is c.seq]
            if live:
                decode_tokens = sum(1 for c in live if c.seq.generated)
                for c in live:
                    self._append(c.seq)
                self.decode_split.observe(now, decode_tokens, self.scheduler.num_decoding())

    # -- transitions -------------------------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """Nothing in flight and no KV landing: a transition may snapshot it (Prepare's drain and settle)."""
        now = self.sim.now
        return self.iteration is None and not self.inflight and self.head_free_at <= now and self.free_at <= now and not self.held

    def pause(self, on_quiet: Callable[[], None]) -> None:
        self.paused = True
        self.paused_at = self.sim.now
        self._quiet_waiters.append(on_quiet)
        if self.is_stage and self.free_at > self.sim.now:
            self.sim.at(self.free_at, self._check_quiet)
        self._check_quiet()

    def resume(self) -> None:
        self.paused = False
        self.kick()

    # -- elastic tensor parallelism (cold re-form) -------------------------------------------------------------------
    def hand_over(self) -> list[SimRequest]:
        """A quiet, paused worker gives every request it holds back to the dispatcher (the re-form's drain): their
        KV is freed, and they resume elsewhere by re-prefilling prompt + emitted tokens."""
        assert self.quiet, f"{self.worker_id}: hand-over with work in flight"
        out = []
        for rid in sorted(self.seqs, key=lambda r: self.seqs[r].order):
            out.append(self.requests[rid])
            self.abort(rid)
        return out

    def take_tp_role(self, members: tuple[str, ...], kv_blocks: int, time: TimeModel) -> None:
        """Come back from a re-form as a member of the instance `members` (one: a whole instance again): rank 0
        with the instance's KV blocks and step times, a follower with nothing (Engine started anew)."""
        self.tp_members = members
        self.time = time
        self.unit = Unit(self.worker_id, (self.member,))
        self.seqs.clear()
        self.requests.clear()
        self.held.clear()
        self.iteration = None
        self.allocator = BlockAllocator(kv_blocks)  # a follower's pool is rank 0's: it reports the same blocks
        self.scheduler.reset(self.allocator)
        self._budget_for(0)
        self.reforming = False
        self.resume()

    def _check_quiet(self) -> None:
        if self.paused and self._quiet_waiters and self.quiet:
            waiters, self._quiet_waiters = self._quiet_waiters, []
            for w in waiters:
                w()

    # -- observation -------------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Engine.stats: the scheduler's own snapshot."""
        return self.scheduler.stats(
            prompt_tokens_total=self.counters.prompt_tokens_total, generated_tokens_total=self.counters.generated_tokens_total
        )

    def report(self) -> WorkerReport:
        """What the worker's stats stream says now (WorkerServicer.current_stats as the monitor reads it)."""
        now = self.sim.now
        at = now + ENGINE_CLOCK_BASE_S
        s = self.stats()
        if self.is_stage:  # a later stage's blocks are the head's block-id space again
            head = self.sim.workers[self.unit.head].allocator
            s = dataclasses.replace(
                s,
                kv_blocks_total=self.memory.blocks(*self.member.range),
                kv_blocks_used=min(head.num_used, self.memory.blocks(*self.member.range)),
            )

        def age(arrival: float | None) -> float:
            return 0.0 if arrival is None else max(0.0, at - arrival)

        return WorkerReport(
            self.member,
            num_layers_model=self.num_layers,
            unit_id=self.unit.unit_id,
            unit_members=self.unit.worker_ids,
            serving=self.serving,
            transitioning=self.paused and not self.reforming,
            epoch=self.epoch,
            address=f"sim:{self.worker_id}",
            timestamp_unix_s=now,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_undropped=self.memory.undropped_blocks,
            queued_demand_blocks=s.queued_demand_blocks,
            block_size=s.block_size,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=s.prompt_tokens_total,
            generated_tokens_total=s.generated_tokens_total,
            oldest_waiting_age_s=age(s.oldest_waiting_arrival),
            busy_seconds_total=self.counters.busy_s,
            num_offline_running=s.num_offline_running,
            num_offline_waiting=s.num_offline_waiting,
            offline_kv_blocks_used=s.offline_kv_blocks_used,
            offline_queued_demand_blocks=s.offline_queued_demand_blocks,
            oldest_online_waiting_age_s=age(s.oldest_online_waiting_arrival),
            tp_degree=self.tp_degree,
            tp_members=self.tp_members if self.tp_degree > 1 else (),
            reforming=self.reforming,
        )


__all__ = ["InvalidRequest", "NotServingHere", "SimWorker", "WorkerSetup"]
