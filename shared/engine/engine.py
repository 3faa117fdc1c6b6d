"""The single-instance engine: scheduler + model runner + sampler over a paged KV cache.

`step()` is one iteration: the scheduler picks decodes and prompt chunks and reserves their KV
blocks, the runner computes one flat token batch (decodes first, then chunks), the sampler picks a
token for every sequence whose KV is complete. Not thread-safe by itself; `EngineLoop` runs it on a
dedicated thread and feeds it commands between iterations.

The runner handles any layer range: a whole instance runs every layer; in a pipeline group the head
runs the first range and ships each microbatch through a `PipelineLink` (UCX between workers:
services/worker/group.py; one process: local_link.py), and every later stage runs `forward_stage`.
The head spreads the decodes over the microbatches in flight when that decodes faster on this hardware
(every stage has one to run during pure decode; DecodeSplit measures it) and, with a long queue and a
`former` that looks ahead, cuts the prompts into the cost-balanced microbatches of KunServe's lookahead
formulation (shared/policy/microbatch.py).

Busy / idle accounting (`busy_idle()`): an iteration is busy from scheduling to the sampled tokens;
idle time while requests were queued is this instance's "bubble" (accounting.py). A group head
waiting for its later stages' results is not busy; a later stage is busy while it runs a microbatch.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from kunserve.shared.engine.accounting import BusyIdle, BusyIdleClock
from kunserve.shared.engine.api import EngineRequest, EngineStats, FinishReason, InvalidRequest, SeqSnapshot, TokenEvent
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable, blocks_needed, life_blocks
from kunserve.shared.engine.kv_checkpoint import Checkpoint, CheckpointStats, KVCheckpointStore
from kunserve.shared.engine.kv_landing import KVLanding
from kunserve.shared.engine.kv_storage import KVStorage, TorchKVStorage
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.engine.safepoint import Safepoint
from kunserve.shared.engine.sampler import ChosenLogprobs, sample_rows, token_logprobs
from kunserve.shared.engine.stage_wire import StageBatch
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights
from kunserve.shared.policy.batch_scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence, TokenBudget
from kunserve.shared.policy.costmodel import BatchShape
from kunserve.shared.policy.head_schedule import LookaheadPlan, online_queued_tokens, role_budget
from kunserve.shared.policy.layerwise_preemption import IterationInFlight, should_preempt
from kunserve.shared.policy.measured_latency import MeasuredLatencyModel
from kunserve.shared.policy.microbatch import DecodeSplit, Microbatch, MicrobatchFormer

__all__ = ["Engine", "SchedulerConfig", "PipelineLink", "GroupBroken", "InstanceBroken", "TPHealed", "HealFailed", "NotServing"]


class GroupBroken(RuntimeError):
    """A pipeline stage of this head's group is gone (or timed out); the worker heals to a whole instance.

    `events`: the tokens the raising call sampled before it noticed the break (results of earlier microbatches
    taken in the same call). Their requests' `generated` holds them already, so the heal's recompute goes on
    after them: whoever catches this delivers them, or each such request skips a token."""

    def __init__(self, message: str, events: Iterable[TokenEvent] = ()) -> None:
        super().__init__(message)
        self.events: list[TokenEvent] = list(events)


# A layer-staggered split's forward (tp_stagger.py): (the step's plan, its token ids, logits rows) -> logits.
StaggeredForward = Callable[[StageBatch, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class InstanceBroken(RuntimeError):
    """A process this instance computes with is gone (a tensor-parallel member): no batch can compute any more. It
    passes the per-batch failure handling, so the engine loop stops and every request resumes elsewhere."""


class TPHealed(InstanceBroken):
    """An in-place tensor-parallel change failed part-way and this member healed (tp_transform.py, tp_stagger.py): it
    is a whole engine again, and no longer computes with the others."""


class HealFailed(RuntimeError):
    """An in-place tensor-parallel change failed and this member could not heal either: its state is not known (a
    worker exits and is started again)."""


class NotServing(InvalidRequest):
    """A request reached a worker that holds part of the model and heads no group (a drop raced with it)."""

    def __init__(self, message: str) -> None:
        super().__init__("worker", message)


class PipelineLink(Protocol):
    """How a group head reaches its later stages: over UCX between workers (services/worker/group.py),
    or to Engines in the same process (local_link.py). Each later stage runs `Engine.forward_stage`."""

    max_inflight: int

    def send(self, batch: StageBatch, hidden: torch.Tensor) -> None:
        """Hand the head's output for batch to stage 1 (must not block on the network)."""

    def result(self, mb_id: int, block: bool) -> torch.Tensor | None:
        """Logits of batch mb_id from the last stage; None when not there yet and not block. Raises
        GroupBroken when a stage is lost or the wait times out."""


@dataclasses.dataclass
class _Shipped:
    """A microbatch a group head shipped and awaits the logits of."""

    mb_id: int
    chunks: list[ScheduledChunk]
    sampled: list[ScheduledChunk]
    sent_at: float  # perf_counter() when the head began it (its own stage is part of the round trip)
    shape: BatchShape  # for the group's measured step (measured_latency.py)


class Engine:
    """One model instance: add requests, call step() until has_work() is False.

    num_kv_blocks sizes the default torch-allocated cache; with `kv_storage` (the memory pool's
    layout) the storage's own num_blocks wins and `sync_kv_capacity()` follows later changes. An engine over
    part of the layers serves nothing until it heads a group (`become_head`) or computes as a later stage
    (`become_stage`)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, *, num_kv_blocks: int = 0, block_size: int = 16,
                 device: str | torch.device = "cpu", layer_range: tuple[int, int] | None = None,
                 scheduler_config: SchedulerConfig | None = None, budget: TokenBudget | None = None,
                 kv_storage: KVStorage | None = None, pack_weights: bool | None = None) -> None:
        if kv_storage is None and num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {num_kv_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        self.pack_weights = pack_weights
        self.runner = ModelRunner(cfg, weights, layer_range, self.device, pack_weights=pack_weights)
        self.kv = kv_storage or TorchKVStorage(range(self.runner.start, self.runner.end), num_kv_blocks,
                                               cfg.num_kv_heads, block_size, cfg.head_dim, cfg.torch_dtype, self.device)
        cache = self.kv.layer_cache(self.runner.start)
        want = (2, cfg.num_kv_heads, block_size, cfg.head_dim)
        if tuple(cache.shape[1:]) != want:
            raise ValueError(f"KV storage blocks are {tuple(cache.shape[1:])}, this model needs {want} "
                             "([K/V, kv_heads, block_size, head_dim])")
        del cache  # never hold KV tensors across steps: the pool may remap them
        self.allocator = BlockAllocator(self.kv.num_blocks)
        self.scheduler = Scheduler(self.allocator, block_size, scheduler_config, budget)
        self.scheduler.swapper = self  # used when scheduler_config.preemption == "swap"
        self.seqs: dict[str, Sequence] = {}
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.clock = BusyIdleClock()
        self._mb_counter = 0
        self.consecutive_failed_steps = 0  # batches whose forward raised, in a row (EngineLoop gives up at a bound)
        # Pipeline-group head mode (KunServe §3): later stages reached through `link`; the block-id space
        # is shared by every member, so it is capped at the smallest member's capacity (kv_limit).
        self.link: PipelineLink | None = None
        self.kv_limit: int | None = None
        self._inflight: collections.deque[_Shipped] = collections.deque()
        # ConServe's SLO budget runs under the measured latency (measured_latency.py) of this engine's role: its
        # iterations as a whole instance, its microbatches' round trips as a group head. The configured budget is
        # what each role starts from.
        self._configured_budget = self.scheduler.budget
        self._latency: MeasuredLatencyModel | None = None
        self._budget_for(None)
        # How the head cuts a long queue into microbatches (KunServe §4.3), the plan still to ship and how many went
        # out as planned; its former None: the scheduler's token chunking. The worker sets the former from
        # engine.lookahead and its cost-model profile (services/worker/build.py).
        self.lookahead = LookaheadPlan()
        self.decode_split = DecodeSplit()  # whether the head spreads its decodes over the microbatches in flight
        # A transition's KV still landing (kv_landing.py): requests held out of the scheduler until theirs has
        # landed everywhere, and the blocks of held requests aborted meanwhile (freed once their KV landed).
        self._landing: KVLanding | None = None
        self._held: dict[str, Sequence] = {}
        self._held_aborted: dict[str, list[int]] = {}
        self._stage_block_high = 0  # a later stage: one past the highest block id the head had it write
        # Layer-wise preemption (ConServe §4.3, safepoint.py): off until enable_layerwise_preemption. The
        # iteration in flight is published for the arrival check, which may raise the flag from another thread.
        self.safepoint_every = 0
        self.preemption_ttft_s = 0.0
        self.preempt_offline = threading.Event()
        self.in_flight: IterationInFlight | None = None
        # The arrival check and the publication (and end) of a pass take this lock, so an arrival is either seen by
        # the pass it must wait for or sees that pass, and a flag raised for one pass never carries into the next.
        # Arrivals announced while nothing is in flight whose add the engine has not taken yet (request id -> (when,
        # prompt tokens)) are checked once the next pass is published: they arrived after its schedule and wait for
        # all of it. Adds taken before their announcement (request id -> when taken) make that announcement a no-op.
        # Prompt tokens of the online arrivals during the pass in flight queue behind it, ahead of the next arrival.
        self._arrivals = threading.Lock()
        self._unseen_arrivals: dict[str, tuple[float, int]] = {}
        self._taken_unannounced: dict[str, float] = {}
        self._arrived_tokens = 0
        self._step_began = 0.0  # time.monotonic() when the latest step began (after the loop took its queue)
        self.layerwise_preemptions = 0
        # Incremental KV checkpoints of offline requests (ConServe §4.4, kv_checkpoint.py): off until
        # enable_kv_checkpoint. Requests whose checkpointed KV is being prefetched back run (they hold their blocks
        # and may be preempted) with nothing to compute until the copy is done (_prefetching).
        self._ckpt: KVCheckpointStore | None = None
        self._ckpt_bytes = 0  # enable_kv_checkpoint's capacity
        # What a whole instance ran with before it became a tensor-parallel member (change_shard): safepoints every
        # n layers and the checkpoint capacity; None while whole.
        self._whole_features: tuple[int, int] | None = None
        self._prefetching: dict[str, Sequence] = {}
        # Called on the engine thread with every iteration's (a head's: microbatch's) scheduled chunks before they
        # compute: the worker's Prometheus metrics (tokens per iteration, queue time) read what was scheduled.
        self.on_schedule: Callable[[list[ScheduledChunk]], None] | None = None
        # Rank 0 of a tensor-parallel instance (tensor_parallel.py): gets every forward's plan and inputs before it
        # computes, so the other ranks run the same forward on their shards.
        self.step_plan: Callable[[StageBatch, torch.Tensor], None] | None = None
        # A layer-staggered split in progress (tp_stagger.py): every forward goes through it; None otherwise. The
        # requests added meanwhile stay on this engine once whole: their whole life must fit its whole blocks.
        self._staggered: StaggeredForward | None = None
        self._stagger_blocks: int | None = None

    # -- requests -------------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        """Raise InvalidRequest (naming the field) for anything this engine could never serve."""
        request.validate(self.cfg.vocab_size, self.cfg.max_position_embeddings)
        self.scheduler.check_fits(request)

    @property
    def serving(self) -> bool:
        """Whether requests may be added: the whole model here, or the head of a pipeline group."""
        return self.runner.is_first and (self.runner.is_last or self.link is not None)

    def add_request(self, request: EngineRequest) -> None:
        if self.safepoint_every and not request.offline:
            with self._arrivals:  # taken (or refused): whatever becomes of it, not a late arrival of a later pass
                if self._unseen_arrivals.pop(request.request_id, None) is None:
                    self._taken_unannounced[request.request_id] = time.monotonic()
        if not self.serving:
            raise NotServing(f"this worker holds layers [{self.runner.start}, {self.runner.end}) only and heads "
                             "no pipeline group; retry on a serving worker")
        self.validate(request)
        if self._stagger_blocks is not None and life_blocks(request, self.block_size) > self._stagger_blocks:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens need more than the {self._stagger_blocks} KV "
                                 "blocks this worker keeps once its tensor-parallel instance has split")
        if request.request_id in self.seqs:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
        gen = None
        if not request.sampling.greedy:
            seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
            gen = torch.Generator().manual_seed(seed)
        seq = Sequence(request, list(request.prompt_token_ids), BlockTable(self.block_size), generator=gen)
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)
        self.clock.work_waiting()

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if request_id in self._held:  # its KV is still being written into its blocks
            self._held_aborted[request_id] = seq.block_table.ids  # before it leaves _held: kv_landing never blinks
            del self._held[request_id]
            return True
        if self._prefetching.pop(request_id, None) is not None and self._ckpt is not None:
            self._ckpt.cancel_prefetch(seq.swapped, preempted=False)  # no copy may write into its freed blocks
        self.scheduler.remove(seq)
        if self._ckpt is not None:
            self._ckpt.forget(request_id)
        return True

    def has_work(self) -> bool:
        """Something to compute: requests the scheduler may run (not only ones waiting for their KV to land)
        or microbatches in flight."""
        return len(self.seqs) > len(self._held) or bool(self._inflight)

    # -- one iteration ----------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One iteration; returns the tokens it produced (finished requests have left already)."""
        if not self.has_work():
            return []
        self.clock.begin_busy()
        try:
            return self._step()
        finally:
            self.clock.end_busy(still_waiting=bool(self.seqs))

    def _step(self) -> list[TokenEvent]:
        self._forget_seen_arrivals()
        if self.link is not None:
            return self._step_pipelined(self.link)
        if self._prefetching:
            self._adopt_prefetched(block=False)
        preemptions = self.scheduler.num_preemptions
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks and self._prefetching:  # nothing else runs: wait for the KV coming back
            self._adopt_prefetched(block=True)
            t0 = time.perf_counter()
            chunks = self.scheduler.schedule()
        if not chunks:
            return []
        if self.on_schedule is not None:
            self.on_schedule(chunks)
        scheduled, cuts = chunks, self.layerwise_preemptions
        try:
            logits, sampled, chunks = self._forward(chunks)
        except InstanceBroken:
            raise
        except Exception as exc:  # a fault computing this batch: its requests fail, the engine goes on
            return self._fail_batch(chunks, exc)
        self.consecutive_failed_steps = 0
        for chunk in chunks:
            seq = chunk.seq
            if chunk.start == 0 and seq.num_preemptions == 0:
                self.prompt_tokens_total += len(seq.request.prompt_token_ids)
            seq.num_computed = chunk.start + chunk.num_tokens
        events = self._sample(logits, [c.seq for c in sampled]) if sampled else []
        if self._latency is not None and self.layerwise_preemptions == cuts:  # a cut iteration ends early
            self._latency.observe(BatchShape.of((c.num_tokens, c.start) for c in scheduled), time.perf_counter() - t0)
        if self._ckpt is not None:
            self._checkpoint_iteration(chunks, preemptions)
        return events

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[TokenEvent]:
        """One token per row of logits (with its logprobs when the request asked); a row that cannot be sampled
        fails its request alone. Every sampled token goes through here: a whole instance's and a group head's
        (the group's last stage sends its logits back to the head)."""
        params = [s.request.sampling for s in seqs]
        tokens = sample_rows(logits, params, [s.generator for s in seqs], self._cannot_end_yet(seqs))
        logprobs = token_logprobs(logits, params, tokens)
        return [self._append(seq, tok, lp) if tok is not None else self.fail(seq.request_id, "its logits could not "
                f"be sampled at token {len(seq.generated)} (non-finite logits from the model)")
                for seq, tok, lp in zip(seqs, tokens, logprobs)]

    def _cannot_end_yet(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """Rows short of their request's min_tokens: the ids that would end it (EOS unless ignore_eos, stop ids),
        which the sampler must not pick for them. Logprobs stay those of the raw logits."""
        out = {}
        for i, s in enumerate(seqs):
            p = s.request.sampling
            if len(s.generated) < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.cfg.eos_token_ids))
                if ids:
                    out[i] = sorted(ids)
        return out

    def fail(self, request_id: str, why: str) -> TokenEvent:
        """End one request with an ERROR event (its KV blocks are freed): what the engine does instead of
        dying when a computation fails for it, so the other requests keep running."""
        seq = self.seqs[request_id]
        self.abort(request_id)
        return TokenEvent(request_id, -1, len(seq.generated), FinishReason.ERROR, why)

    def _fail_batch(self, chunks: list[ScheduledChunk], exc: Exception) -> list[TokenEvent]:
        """The forward pass of a batch raised: no request in it can trust its KV, so each fails (the
        engine cannot tell which one caused it); requests outside the batch are untouched."""
        self.consecutive_failed_steps += 1
        why = f"the engine failed computing a batch with this request: {type(exc).__name__}: {exc}"
        ids = dict.fromkeys(c.seq.request_id for c in chunks)
        return [self.fail(rid, why) for rid in ids if rid in self.seqs]

    def _build(self, chunks: list[ScheduledChunk]) -> tuple[StageBatch, list[int], list[ScheduledChunk]]:
        """The flat token batch of this step (decodes first, then chunks): what every stage needs, the token
        ids (first stage only) and the chunks whose last token gets logits."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_b: list[int] = []
        slot_o: list[int] = []
        decodes, prefills, logit_rows, sampled = [], [], [], []
        row = 0
        for c in chunks:
            s, start, n = c.seq, c.start, c.num_tokens
            table = s.block_table.ids[: -(-(start + n) // bs)]  # the blocks this chunk's context uses
            if n == 1:
                ids.append(s.tokens[start])
                positions.append(start)
                slot_b.append(table[start // bs])
                slot_o.append(start % bs)
                decodes.append((row, start + 1, table))
            else:
                ids.extend(s.tokens[start:start + n])
                positions.extend(range(start, start + n))
                b, o = s.block_table.slots(start, n)
                slot_b.extend(b)
                slot_o.extend(o)
                prefills.append((row, n, start + n, table))
            if c.completes:
                logit_rows.append(row + n - 1)
                sampled.append(c)
            row += n
        rows = None if len(logit_rows) == row else logit_rows
        self._mb_counter += 1
        return StageBatch(self._mb_counter, positions, slot_b, slot_o, decodes, prefills, rows), ids, sampled

    def _run_local(self, batch: StageBatch, inputs: torch.Tensor, safepoint: Safepoint | None = None) -> torch.Tensor:
        """This engine's layers over the batch, from token ids (first layer) or the previous stage's hidden
        states: logits of batch.rows (last layer) or hidden states for the next stage. Every member of a
        group and a whole instance compute through here."""
        if self.step_plan is not None:
            self.step_plan(batch, inputs)
        dev = self.device
        return self._compute(batch, inputs, batch.rows_tensor(dev) if self.runner.is_last else None, safepoint)

    def _compute(self, batch: StageBatch, inputs: torch.Tensor, rows: torch.Tensor | None,
                 safepoint: Safepoint | None = None) -> torch.Tensor:
        """The forward over this engine's layers (through a staggered split while one runs): logits of `rows`."""
        dev = self.device
        if self._staggered is not None:
            return self._staggered(batch, inputs.to(dev), rows)
        args = (inputs.to(dev), batch.positions_tensor(dev), self.kv, batch.metadata(self.block_size, dev), rows)
        return self.runner.forward(*args) if safepoint is None else self.runner.forward(*args, safepoint=safepoint)

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk], list[ScheduledChunk]]:
        """Run the flat token batch of this step: logits [len(sampled), vocab] for the completing chunks, those
        chunks, and the chunks computed (all of them, or the online ones when a safepoint dropped the offline
        rows: those are scheduled again from where they were)."""
        batch, ids, sampled = self._build(chunks)
        cut = self._safepoint(chunks) if self.safepoint_every else None
        if cut is None:
            return self._run_local(batch, torch.tensor(ids, dtype=torch.long)).cpu(), sampled, chunks
        safepoint, online, online_sampled = cut
        self._publish_pass(IterationInFlight(time.monotonic(), self._predict(chunks), len(ids) - len(safepoint.keep),
                                             len(safepoint.keep), online_queued_tokens(self.scheduler, chunks)))
        try:
            logits = self._run_local(batch, torch.tensor(ids, dtype=torch.long), safepoint).cpu()
        finally:
            with self._arrivals:
                self.in_flight = None
        if safepoint.fired_before is None:
            return logits, sampled, chunks
        self.layerwise_preemptions += 1
        return logits, online_sampled, online

    # -- layer-wise preemption (ConServe §4.3) -----------------------------------------------------------
    def enable_layerwise_preemption(self, every: int, ttft_s: float) -> None:
        """Safepoints every `every` layers of a whole instance's forward pass; an online arrival that would miss
        `ttft_s` waiting for the iteration in flight drops its offline rows (0 = off)."""
        if every < 0 or ttft_s <= 0:
            raise ValueError(f"every must be >= 0 and ttft_s > 0, got {every}, {ttft_s}")
        self.safepoint_every = every
        self.preemption_ttft_s = ttft_s

    def online_arrived(self, prompt_tokens: int, request_id: str | None = None) -> bool:
        """Algorithm 2, for an online request of `prompt_tokens` that was just submitted (its add queued for the
        engine thread): raise the preemption flag when waiting for the iteration in flight, then for the prefill of
        the online prompts queued ahead of it and its own, would miss the TTFT SLO. With nothing in flight the
        request is normally taken by the next schedule; one whose add that schedule missed (`request_id` not among
        the engine's requests when the next pass starts) is checked against that pass as it starts. Safe from any
        thread. Returns whether it raised the flag now."""
        if not self.safepoint_every:
            return False
        with self._arrivals:
            if request_id is not None and self._taken_unannounced.pop(request_id, None) is not None:
                return False  # its add was taken before this announcement: it is scheduled (or already left)
            it = self.in_flight
            if it is None:
                if request_id is not None:
                    self._unseen_arrivals[request_id] = (time.monotonic(), prompt_tokens)
                return False
            return self._check_arrival(it, prompt_tokens)

    def _check_arrival(self, it: IterationInFlight, prompt_tokens: int, waited_s: float = 0.0) -> bool:
        """One arrival during pass `it` (under self._arrivals); `waited_s`: how long it has waited already (one
        announced before the pass began)."""
        self._arrived_tokens += max(1, prompt_tokens)
        prefill = self._predict_shape(BatchShape.of([(it.online_queued_tokens + self._arrived_tokens, 0)]))
        if not should_preempt(time.monotonic(), it, waited_s + prefill, self.preemption_ttft_s):
            return False
        self.preempt_offline.set()
        return True

    def _publish_pass(self, it: IterationInFlight) -> None:
        """The pass `it` begins: the preemption flag is lowered (under the lock: an arrival checked against the
        previous pass cannot raise it after this), arrivals from now on are checked against it, and so are those
        announced after the schedule that built it (their add not taken yet), counting the time they waited."""
        with self._arrivals:
            self.preempt_offline.clear()
            self.in_flight = it
            self._arrived_tokens = 0
            now = time.monotonic()
            late = [(when, n) for rid, (when, n) in self._unseen_arrivals.items() if rid not in self.seqs]
            self._unseen_arrivals.clear()
            for when, n in late:
                self._check_arrival(it, n, waited_s=max(0.0, now - when))

    def _forget_seen_arrivals(self) -> None:
        """A step begins: forget the arrivals announced between iterations whose add was taken before this schedule
        (the schedule sees them), and those announced before the previous step began (their add was taken since,
        whatever became of it), so nothing stays here longer than an iteration."""
        began, self._step_began = self._step_began, time.monotonic()
        if self._unseen_arrivals or self._taken_unannounced:
            with self._arrivals:
                for rid in [r for r, (t, _) in self._unseen_arrivals.items() if r in self.seqs or t < began]:
                    del self._unseen_arrivals[rid]
                # an announcement follows its submit at once: one not made by now never comes (a request added
                # directly, not through the loop)
                for rid in [r for r, t in self._taken_unannounced.items() if t < began]:
                    del self._taken_unannounced[rid]

    def _safepoint(self, chunks: list[ScheduledChunk]
                   ) -> tuple[Safepoint, list[ScheduledChunk], list[ScheduledChunk]] | None:
        """The safepoint of a batch that mixes in offline rows: what goes on without them (their rows, positions,
        metadata and logit rows, built now so the cut costs one index), the online chunks and those sampled.
        None for a batch without offline rows (nothing to cut) or a pipeline group's (not cut: the later stages
        run the microbatch as shipped)."""
        if self.link is not None or not any(c.seq.request.offline for c in chunks):
            return None
        online = [c for c in chunks if not c.seq.request.offline]
        keep: list[int] = []
        row = 0
        for c in chunks:
            if not c.seq.request.offline:
                keep.extend(range(row, row + c.num_tokens))
            row += c.num_tokens
        batch, _, sampled = self._build(online)
        dev = self.device
        rows = batch.rows_tensor(dev) if self.runner.is_last else None
        return (Safepoint(self.safepoint_every, self.preempt_offline, torch.tensor(keep, dtype=torch.long, device=dev),
                          batch.positions_tensor(dev), batch.metadata(self.block_size, dev), rows), online, sampled)

    def _predict(self, chunks: list[ScheduledChunk]) -> float:
        return self._predict_shape(BatchShape.of((c.num_tokens, c.start) for c in chunks))

    def _predict_shape(self, shape: BatchShape) -> float:
        """The budget's latency model's prediction (0: the budget has none, e.g. the fixed one)."""
        model = getattr(self.scheduler.budget, "model", None)
        return model.shape_cost(shape) if model is not None else 0.0

    def forward_stage(self, batch: StageBatch, hidden: torch.Tensor) -> torch.Tensor:
        """A later stage of a pipeline group runs its part of the head's microbatch: its layers over its own
        KV cache (at the block ids the head chose) from the previous stage's hidden states. Returns hidden
        states for the next stage, or on the last stage the float32 logits of batch.rows on the CPU (what
        goes back to the head). The time counts as busy (busy_idle)."""
        self.clock.begin_busy()
        if batch.slot_blocks:
            self._stage_block_high = max(self._stage_block_high, max(batch.slot_blocks) + 1)
        try:
            out = self._run_local(batch, hidden)
            return out.float().cpu().contiguous() if self.runner.is_last else out
        finally:
            self.clock.end_busy(still_waiting=False)

    def _step_pipelined(self, link: PipelineLink) -> list[TokenEvent]:
        """Head of a pipeline group: ship one microbatch when fewer than max_inflight are out (the head runs
        its own layers, then the later stages run theirs while the head forms the next one), then take
        whatever results came back; block for one only when nothing could be shipped (that wait is bubble,
        not busy: the later stages compute, the head does not)."""
        shipped = False
        if len(self._inflight) < link.max_inflight:
            t0 = time.perf_counter()  # the round trip includes this head's own stage
            chunks = self._next_microbatch(link.max_inflight)
            if chunks:
                if self.on_schedule is not None:
                    self.on_schedule(chunks)
                batch, ids, sampled = self._build(chunks)
                try:
                    hidden = self._run_local(batch, torch.tensor(ids, dtype=torch.long))
                except Exception as exc:
                    return self._fail_batch(chunks, exc)
                self.consecutive_failed_steps = 0
                link.send(batch, hidden)
                for chunk in chunks:
                    seq = chunk.seq
                    if chunk.start == 0 and seq.num_preemptions == 0:
                        self.prompt_tokens_total += len(seq.request.prompt_token_ids)
                    seq.num_computed = chunk.start + chunk.num_tokens
                    self.scheduler.pin(seq)
                self._inflight.append(_Shipped(batch.mb_id, chunks, sampled, t0,
                                               BatchShape.of((c.num_tokens, c.start) for c in chunks)))
                shipped = True
        if shipped:
            return self._collect(link, block=False)
        self.clock.end_busy(still_waiting=bool(self.seqs))
        try:
            return self._collect(link, block=True)
        finally:
            self.clock.begin_busy()

    def _next_microbatch(self, inflight: int) -> list[ScheduledChunk]:
        """Schedule the head's next microbatch: its share of the decodes while decode_split says so, the next
        lookahead microbatch while a plan lasts (`LookaheadPlan.next_microbatch`)."""
        return self.lookahead.next_microbatch(self.scheduler, inflight, self.decode_split.split)

    @property
    def former(self) -> MicrobatchFormer | None:
        return self.lookahead.former

    @former.setter
    def former(self, former: MicrobatchFormer | None) -> None:
        self.lookahead.former = former

    @property
    def planned_microbatches(self) -> int:
        """Microbatches shipped as their lookahead plan said."""
        return self.lookahead.planned

    @property
    def _plan(self) -> collections.deque[Microbatch]:
        return self.lookahead.pending

    def _collect(self, link: PipelineLink, block: bool) -> list[TokenEvent]:
        """Results of the microbatches in flight, oldest first; waits for the first one when block."""
        events: list[TokenEvent] = []
        while self._inflight:
            try:
                logits = link.result(self._inflight[0].mb_id, block=block and not events)
            except GroupBroken as exc:
                exc.events[:0] = events
                raise
            if logits is None:
                break
            shipped = self._inflight.popleft()
            if self._latency is not None:
                self._latency.observe(shipped.shape, time.perf_counter() - shipped.sent_at)
            chunks, sampled = shipped.chunks, shipped.sampled
            for chunk in chunks:
                self.scheduler.unpin(chunk.seq)
            live = [i for i, c in enumerate(sampled) if self.seqs.get(c.seq.request_id) is c.seq]  # not aborted
            if live:
                decode_tokens = sum(1 for i in live if sampled[i].seq.generated)
                events.extend(self._sample(logits[torch.tensor(live, dtype=torch.long)], [sampled[i].seq for i in live]))
                self.decode_split.observe(time.perf_counter(), decode_tokens, self.scheduler.num_decoding())
        return events

    # -- KV blocks in and out (swap preemption and layout transitions) -----------------------------------
    @torch.inference_mode()  # the KV views may be inference tensors (made during a forward)
    def export_blocks(self, block_ids: Iterable[int], layer_start: int, layer_end: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of the KV of `block_ids` in layers [layer_start, layer_end), layer-major: one tensor
        [num_layers * len(block_ids), 2, kv_heads, block_size, head_dim], rows (layer, block) in that order,
        written into `out` when given (a buffer whose pages are already faulted in: a fresh allocation's page
        faults cost more than the copy). On a GPU this is a device-to-host copy; the bookkeeping is untouched
        (the caller frees the blocks)."""
        self._check_layers(layer_start, layer_end)
        blocks = list(block_ids)
        n = len(blocks)
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        first = self.kv.layer_cache(layer_start)
        want = ((layer_end - layer_start) * n, *first.shape[1:])
        if out is None:
            out = torch.empty(want, dtype=first.dtype, device="cpu")
        elif tuple(out.shape) != want or out.dtype != first.dtype:
            raise ValueError(f"KV blocks: export buffer is {tuple(out.shape)} {out.dtype}, expected {want} {first.dtype}")
        del first
        for i, layer in enumerate(range(layer_start, layer_end)):
            out[i * n:(i + 1) * n].copy_(self.kv.layer_cache(layer).index_select(0, ids))
        return out

    def kv_blocks_in_use(self) -> int:
        """KV blocks holding data here: what the allocator handed out, or on a later stage (whose head allocates)
        an upper bound, one past the highest block id written (the allocator hands out low ids first)."""
        return max(self.allocator.num_used, min(self._stage_block_high, self.allocator.num_blocks))

    def kv_slab(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of one (layer, block) row of export_blocks: [2, kv_heads, block_size, head_dim]."""
        first = self.kv.layer_cache(self.runner.start)
        return tuple(first.shape[1:]), first.dtype

    @torch.inference_mode()
    def import_blocks(self, block_ids: Iterable[int], layer_start: int, layer_end: int, data: torch.Tensor) -> None:
        """Write `data` (as export_blocks lays it out) into blocks `block_ids` of layers [layer_start,
        layer_end): the ids may differ from the ones it was exported from. Checks the shape before writing."""
        self._check_layers(layer_start, layer_end)
        blocks = list(block_ids)
        n = len(blocks)
        block = tuple(self.kv.layer_cache(layer_start).shape[1:])
        want = ((layer_end - layer_start) * n, *block)
        if tuple(data.shape) != want:
            raise ValueError(f"KV blocks: got {tuple(data.shape)} for {n} blocks of {block} in layers "
                             f"[{layer_start}, {layer_end}), expected {want}")
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for i, layer in enumerate(range(layer_start, layer_end)):
            cache = self.kv.layer_cache(layer)
            cache.index_copy_(0, ids, data[i * n:(i + 1) * n].to(cache.device, cache.dtype))

    def _check_layers(self, layer_start: int, layer_end: int) -> None:
        if not self.runner.start <= layer_start < layer_end <= self.runner.end:
            raise ValueError(f"KV blocks: layers [{layer_start}, {layer_end}) are not within the held "
                             f"[{self.runner.start}, {self.runner.end})")

    # -- swap preemption (InferCept-like baseline) -------------------------------------------------------
    def swap_out(self, seq: Sequence) -> None:
        """Copy the KV of seq's computed tokens to host memory, before its blocks are freed. On a GPU this
        is a device-to-host copy on the critical path, as in a swapping server."""
        n = blocks_needed(seq.num_computed, self.block_size)
        seq.swapped = self.export_blocks(seq.block_table.ids[:n], self.runner.start, self.runner.end)

    def swap_in(self, seq: Sequence) -> None:
        """Copy seq's host KV back into its (new) blocks: a swapped copy, or its checkpoint (kv_checkpoint.py)."""
        if isinstance(seq.swapped, Checkpoint):
            assert self._ckpt is not None
            self._ckpt.restore(seq.swapped, seq.block_table.ids[:blocks_needed(seq.swapped_tokens, self.block_size)])
            seq.swapped = None
            return
        n = seq.swapped.shape[0] // (self.runner.end - self.runner.start)
        self.import_blocks(seq.block_table.ids[:n], self.runner.start, self.runner.end, seq.swapped)
        seq.swapped = None

    # -- incremental KV checkpointing of offline requests (ConServe §4.4, kv_checkpoint.py) -------------------------
    def enable_kv_checkpoint(self, capacity_bytes: int) -> None:
        """Checkpoint offline requests' completed KV blocks into at most capacity_bytes of host memory after every
        iteration of a whole instance, so their preemption frees their blocks at once and recomputes nothing
        (0 = off: they are preempted as the scheduler config says). Call it while the engine holds no request."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if self.seqs:
            raise RuntimeError(f"enable_kv_checkpoint with {len(self.seqs)} requests in the engine (their checkpoints "
                               "would be lost)")
        if self._ckpt is not None:
            self._ckpt.reset()  # copies of requests that left may still be running
        self._ckpt = None
        self._ckpt_bytes = capacity_bytes
        if capacity_bytes:  # every layer: only a whole instance checkpoints (a group's KV is spread over its stages)
            shape, dtype = self.kv_slab()
            self._ckpt = KVCheckpointStore(self.kv, range(self.cfg.num_layers), shape, dtype, capacity_bytes, self.device)
        self.scheduler.checkpointer = self if self._ckpt is not None else None

    @property
    def kv_checkpoint(self) -> KVCheckpointStore | None:
        return self._ckpt

    def checkpoint_stats(self) -> CheckpointStats | None:
        """The checkpoints' counters (safe from any thread); None while checkpointing is off."""
        ckpt = self._ckpt
        return ckpt.stats() if ckpt is not None else None

    def checkpoint_out(self, seq: Sequence) -> bool:
        """The scheduler's Checkpointer: preempt offline seq by checkpoint when its checkpoint covers its KV (seq.swapped
        holds it until swap_in or a prefetch copies it back); False: recompute or swap instead. A pipeline group's
        head checkpoints nothing (its KV is spread over the group's stages)."""
        ckpt = self._ckpt
        if ckpt is None or self.link is not None or not (self.runner.is_first and self.runner.is_last):
            return False
        if self._prefetching.pop(seq.request_id, None) is not None:  # preempted again while its KV came back
            seq.num_computed = seq.swapped_tokens
            ck = seq.swapped
            if ckpt.cancel_prefetch(ck, preempted=True):
                return True
            seq.swapped = None
            if ck.failed:  # its blocks hold garbage: nothing may swap them out or compute on them; it re-prefills
                seq.num_computed = seq.swapped_tokens = 0
                ckpt.forget(seq.request_id)
                return False
        got = ckpt.checkpoint_out(seq, self.block_size)
        if got is None:
            return False
        seq.swapped = got
        return True

    def _checkpoint_iteration(self, chunks: list[ScheduledChunk], preemptions_before: int) -> None:
        """After an iteration of a whole instance: queue the copies of the blocks its offline requests completed,
        and prefetch the KV of checkpointed requests the scheduler would re-admit now (not after a preemption in
        this iteration: memory is short)."""
        assert self._ckpt is not None
        live = [c.seq for c in chunks if c.seq.request.offline and self.seqs.get(c.seq.request_id) is c.seq]
        self._ckpt.after_iteration(live, self.block_size)
        if self.scheduler.num_preemptions != preemptions_before:
            return
        while (seq := self.scheduler.next_to_prefetch()) is not None and isinstance(seq.swapped, Checkpoint):
            blocks = self.scheduler.readmit_arriving(seq)
            self._ckpt.prefetch(seq.swapped, blocks)
            self._prefetching[seq.request_id] = seq

    def _adopt_prefetched(self, *, block: bool) -> None:
        """The requests whose prefetch is done compute again from where they were (block: wait for every prefetch).
        A prefetch that failed makes its request recompute instead."""
        assert self._ckpt is not None
        for rid, seq in list(self._prefetching.items()):
            ck = seq.swapped
            if not self._ckpt.ready(ck, wait=block):
                continue
            del self._prefetching[rid]
            seq.swapped = None
            if ck.failed:
                self._ckpt.forget(rid)
                self.scheduler.remove(seq)  # frees its blocks
                seq.swapped_tokens = 0
                self.scheduler.add(seq)
                continue
            seq.num_computed, seq.swapped_tokens = seq.swapped_tokens, 0

    def _settle_checkpoints(self) -> None:
        """No checkpoint copy in flight and every prefetched request computing again: before the KV memory is remapped
        or compacted and before the requests are snapshotted, preempted all at once or forgotten."""
        if self._ckpt is not None:
            self._ckpt.drain()
            self._adopt_prefetched(block=True)

    # -- layout transitions -----------------------------------------------------------------------------
    def snapshot(self) -> list[SeqSnapshot]:
        """Every request's state in FCFS order (call with nothing in flight: see drain_inflight)."""
        self._settle_checkpoints()
        out = []
        for seq in sorted(self.seqs.values(), key=lambda s: s.order):
            gen = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else b""
            out.append(SeqSnapshot(seq.request, list(seq.generated), seq.num_computed, list(seq.block_table.ids),
                                   gen, seq.num_preemptions))
        return out

    def drain_inflight(self) -> list[TokenEvent]:
        """Wait for every microbatch in flight (a transition starts from a quiet pipeline)."""
        events: list[TokenEvent] = []
        try:
            while self._inflight and self.link is not None:
                events.extend(self._collect(self.link, block=True))
        except GroupBroken as exc:
            exc.events[:0] = events
            raise
        return events

    def clear(self) -> None:
        """Forget every request and free every block, without events (their state was snapshotted): a fresh
        block space of this engine's capacity, and a scheduler holding nothing (its counters go on)."""
        if self._ckpt is not None:
            self._settle_checkpoints()
            self._ckpt.reset()
        self.seqs.clear()
        self._inflight.clear()
        self.lookahead.clear()
        self._landing = None
        self._held.clear()
        self._held_aborted.clear()
        self._stage_block_high = 0
        self.allocator = BlockAllocator(self._capacity())
        self.scheduler.reset(self.allocator)

    def install(self, snaps: Iterable[SeqSnapshot], landing: KVLanding | None = None) -> None:
        """Take over requests (with their block tables in this engine's block space) after clear(). With
        `landing`, the requests it waits for keep their blocks but stay out of the scheduler until their KV
        has landed (``kv_landed``)."""
        self._landing = landing
        used: list[int] = []
        for snap in snaps:
            gen = None
            if snap.generator_state:
                gen = torch.Generator()
                gen.set_state(torch.frombuffer(bytearray(snap.generator_state), dtype=torch.uint8))
            elif not snap.request.sampling.greedy:
                seed = snap.request.sampling.seed if snap.request.sampling.seed is not None else random.getrandbits(63)
                gen = torch.Generator().manual_seed(seed)
            seq = Sequence(snap.request, list(snap.request.prompt_token_ids) + list(snap.generated),
                           BlockTable(self.block_size, snap.blocks), generator=gen)
            seq.generated = list(snap.generated)
            seq.num_computed = snap.num_computed if snap.blocks else 0
            seq.num_preemptions = snap.num_preemptions
            used.extend(snap.blocks)
            self.seqs[seq.request_id] = seq
            if landing is not None and landing.waiting(seq.request_id) and seq.block_table:
                self._held[seq.request_id] = seq
            elif seq.block_table:
                self.scheduler.add_running(seq)
            else:
                self.scheduler.add(seq)
        self.allocator.take(used)
        if self.seqs:
            self.clock.work_waiting()

    def preempt_all(self) -> None:
        """Recompute preemption of every request (their KV is gone or untrusted: a group broke), those whose KV
        was still landing included: no more of it will be written."""
        if self._ckpt is not None:
            self._settle_checkpoints()
            for seq in self.scheduler.running:  # their device KV is not trusted: neither are checkpoints taken from it
                self._ckpt.forget(seq.request_id)
        self._inflight.clear()
        self.lookahead.clear()
        self.scheduler.pinned.clear()
        self._requeue_held()
        for seq in list(self.scheduler.running):
            self.scheduler.preempt(seq)

    def abandon_landing(self, epoch: int) -> list[str]:
        """The KV of transition `epoch` will not all land here (a sender was lost after the commit) and no group
        break will re-prefill the requests waiting for it (this worker is a whole instance): they re-prefill now
        (recompute preemption: the same greedy tokens) while the others keep running. Returns them."""
        if self._landing is None or self._landing.epoch != epoch:
            return []
        held = list(self._held)
        self._requeue_held()
        if held:
            self.clock.work_waiting()
        return held

    def _requeue_held(self) -> None:
        """Forget the landing (nothing more of it is written); the held requests become recompute preemptions
        (never swapped: their blocks hold no complete KV) and the blocks of aborted ones are freed."""
        self._landing = None
        for seq in self._held.values():
            self.allocator.free(seq.block_table.clear())
            seq.num_computed = 0
            seq.num_preemptions += 1
            self.scheduler.add(seq)
        self._held.clear()
        for blocks in self._held_aborted.values():
            self.allocator.free(blocks)
        self._held_aborted.clear()

    # -- roles in a layout: whole instance, group head, later stage -----------------------------------------
    def become_head(self, link: PipelineLink, kv_blocks: int, seqs: Iterable[SeqSnapshot],
                    landing: KVLanding | None = None) -> None:
        """Head a pipeline group: later stages are reached through `link`, the block-id space (shared by every
        member) is capped at `kv_blocks`, and these requests (tables in that space) are the group's. Call with
        this engine's layers already the group's first range, and nothing in flight. `landing`: the KV of the
        transition that made the group still lands (``install``)."""
        if not self.runner.is_first or self.runner.is_last:
            raise ValueError(f"a group head holds the first layers only, this engine holds "
                             f"[{self.runner.start}, {self.runner.end})")
        self._take_role(link, kv_blocks, seqs, landing)

    def become_stage(self, landing: KVLanding | None = None) -> None:
        """A later stage of a pipeline group: no link, no requests of its own; its KV blocks are written at the
        ids the head's microbatches name (and, with `landing`, the transition's KV is written as it lands)."""
        if self.runner.is_first:
            raise ValueError(f"a later stage does not hold the first layer, this engine holds "
                             f"[{self.runner.start}, {self.runner.end})")
        self._take_role(None, None, (), landing)

    def become_whole(self, seqs: Iterable[SeqSnapshot] = (), *, recompute: bool = False,
                     landing: KVLanding | None = None) -> None:
        """A whole instance of its own holding exactly these requests (the others are forgotten): no link,
        the block space is all of this engine's KV. With recompute their KV is not trusted: each re-prefills
        its prompt and generated tokens (a recompute preemption; greedy tokens stay the same)."""
        if recompute:
            seqs = [SeqSnapshot(s.request, list(s.generated), 0, [], s.generator_state, s.num_preemptions + 1)
                    for s in seqs]
        self._take_role(None, None, seqs, landing)

    def leave_group(self) -> None:
        """Stop heading (or serving as a stage of) a group that broke: every request this engine owns becomes a
        recompute preemption (its KV on the other members is gone), no link, no cap on the block space
        (sync_kv_capacity follows once the layers changed)."""
        self.preempt_all()
        self.link = None
        self.kv_limit = None
        self._budget_for(None)

    def follow(self, batch: StageBatch, inputs: torch.Tensor) -> None:
        """A tensor-parallel follower's part of rank 0's forward (tensor_parallel.py): the same layers over its shard,
        the output discarded (no logits rows)."""
        self._compute(batch, inputs, torch.empty(0, dtype=torch.long, device=self.device))

    def stagger(self, forward: StaggeredForward | None, whole_blocks: int | None = None) -> None:
        """While a layer-staggered split runs (tp_stagger.py), every step's forward goes through `forward` (token ids,
        logits rows: None for all, empty on a follower) and no waiting request is admitted: the layers already split
        have no place for a new request's KV. A request added meanwhile stays here once whole: it is refused
        (InvalidRequest) unless its whole life fits `whole_blocks`. None ends it (so does change_shard)."""
        self._staggered = forward
        self._stagger_blocks = whole_blocks if forward is not None else None
        self.scheduler.hold_admissions(forward is not None)

    def block_tables(self) -> dict[str, list[int]]:
        """The block table of every request holding blocks (engine thread)."""
        return {rid: list(seq.block_table.ids) for rid, seq in self.seqs.items() if seq.block_table.ids}

    def shard_runner(self, cfg: ModelConfig, weights: Weights) -> ModelRunner:
        """A runner of this engine's layers as the tensor-parallel shard `cfg` (the whole model's config at TP1) over
        `weights`, built apart from the engine so that a failure to build it changes nothing (see change_shard)."""
        return ModelRunner(cfg, weights, (self.runner.start, self.runner.end), self.device, pack_weights=self.pack_weights)

    def change_shard(self, runner: ModelRunner, seqs: Iterable[SeqSnapshot] = (), *, tensor_parallel: bool) -> None:
        """Compute as another tensor-parallel shard of the model from now on (an in-place TP change:
        tp_transform.py) with `runner` (shard_runner); the KV storage must already hold the shard's KV heads per block
        (split_kv_heads / merge_kv_heads), and these requests, with tables in that block space, are the engine's (the
        others are forgotten; their KV stays where it is). The engine computes alone until a TP role attaches to it
        again (TPLeader.attach, TPFollower). Layer-wise preemption safepoints and incremental KV checkpoints would act
        on one member's shard alone, so a member of a TP instance (`tensor_parallel`) runs without them, as a static
        member does (services/worker/build.py), and gets back what it had once it is whole again. Call with nothing in
        flight and no pipeline role."""
        if self.link is not None or self.kv_limit is not None:
            raise ValueError("a pipeline group's head cannot change its tensor-parallel shard")
        if self.kv.kv_heads_per_block != runner.cfg.num_kv_heads:
            raise ValueError(f"KV storage blocks hold {self.kv.kv_heads_per_block} KV heads, the shard needs "
                             f"{runner.cfg.num_kv_heads}: split or merge the storage's heads first")
        self._settle_checkpoints()
        self.stagger(None)
        if tensor_parallel and self._whole_features is None:
            self._whole_features = (self.safepoint_every, self._ckpt_bytes)
            self.safepoint_every = 0
        self.runner.release()
        self.cfg = runner.cfg
        self.runner = runner
        self.step_plan = None
        self._take_role(None, None, ())
        if tensor_parallel:
            self.enable_kv_checkpoint(0)
        elif self._whole_features is not None:
            every, ckpt_bytes = self._whole_features
            self._whole_features = None
            self.safepoint_every = every
            self.enable_kv_checkpoint(ckpt_bytes)
        self.install(seqs)

    def _budget_for(self, link: PipelineLink | None) -> None:
        """The budget of a role: the configured one, under a fresh measured latency when it has a latency model
        (ConServe's SLO budget): a whole instance's iterations, or as a group head its microbatches' round trips,
        assumed until measured to take `link.max_inflight` times the profile's prediction: a round trip waits behind
        every other microbatch in flight, as if nothing overlapped (a live group keeps one in flight per stage)."""
        budget, self._latency = role_budget(self._configured_budget, float(max(1, link.max_inflight)) if link else 1.0)
        self.scheduler.use_budget(budget)

    def _take_role(self, link: PipelineLink | None, kv_limit: int | None, seqs: Iterable[SeqSnapshot],
                   landing: KVLanding | None = None) -> None:
        self.link = link
        self.kv_limit = kv_limit
        self._budget_for(link)
        self.clear()
        self.install(seqs, landing)

    # -- a transition's KV landing after the engine resumed (kv_landing.py) --------------------------------
    def land_blocks(self, epoch: int, block_ids: Iterable[int], layer_start: int, layer_end: int,
                    data: torch.Tensor) -> bool:
        """Write landed KV (as ``import_blocks``) if this engine is still in the layout of transition `epoch`;
        False (nothing written) when it is not: the group broke or another transition followed."""
        if self._landing is None or self._landing.epoch != epoch:
            return False
        self.import_blocks(block_ids, layer_start, layer_end, data)
        return True

    def kv_landed(self, epoch: int, worker: str, request_ids: Iterable[str]) -> list[str]:
        """`worker` has written its share of these requests' KV of transition `epoch`; the requests that now
        have all of it run again (returned). Reports of another epoch are ignored."""
        if self._landing is None or self._landing.epoch != epoch:
            return []
        ready = self._landing.landed(worker, request_ids)
        for rid in ready:
            seq = self._held.pop(rid, None)
            if seq is not None:
                self.scheduler.add_running(seq)
            blocks = self._held_aborted.pop(rid, None)
            if blocks is not None:
                self.allocator.free(blocks)
        if ready:
            self.clock.work_waiting()
        return ready

    @property
    def kv_landing(self) -> bool:
        """Requests still wait for KV of a transition to land (safe to read from any thread: two dicts' truth)."""
        return bool(self._held) or bool(self._held_aborted)

    @property
    def landing_epoch(self) -> int | None:
        """The transition whose KV may still be written here (None: none; safe to read from any thread)."""
        landing = self._landing
        return landing.epoch if landing is not None else None

    def _append(self, seq: Sequence, token: int, logprobs: ChosenLogprobs | None) -> TokenEvent:
        seq.tokens.append(token)
        seq.generated.append(token)
        self.generated_tokens_total += 1
        p = seq.request.sampling
        reason = FinishReason.NONE
        if not p.ignore_eos and token in self.cfg.eos_token_ids:
            reason = FinishReason.EOS
        elif token in p.stop_token_ids:
            reason = FinishReason.STOP
        elif len(seq.generated) >= p.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not FinishReason.NONE:
            self.seqs.pop(seq.request_id, None)
            self.scheduler.remove(seq)
            if self._ckpt is not None:
                self._ckpt.forget(seq.request_id)
        chosen, top = logprobs if logprobs is not None else (None, ())
        return TokenEvent(seq.request_id, token, len(seq.generated) - 1, reason, logprob=chosen, top_logprobs=top)

    # -- KV capacity changes (memory pool drop / restore) ----------------------------------------------
    def sync_kv_capacity(self) -> int:
        """Follow kv_storage.num_blocks after the pool remapped pages: grow the allocator at the tail, or
        shrink it when the tail blocks are free (else BlockAllocatorError: compact first). Returns the
        new block count. Call between steps."""
        self._settle_checkpoints()
        if self.kv.kv_heads_per_block != self.cfg.num_kv_heads:
            raise ValueError(f"KV storage blocks hold {self.kv.kv_heads_per_block} KV heads, this model needs "
                             f"{self.cfg.num_kv_heads}: a head-split storage's block ids name sub-blocks")
        new = self._capacity()
        old = self.allocator.num_blocks
        if new > old:
            self.allocator.grow(new - old)
        elif new < old:
            self.allocator.shrink_to(new)
        return new

    def release_weights(self) -> None:
        """Drop every reference to the weights before the pool unmaps their pages; nothing computes until
        use_weights()."""
        self._settle_checkpoints()
        self.runner.release()

    def use_weights(self, weights: Weights, layer_range: tuple[int, int]) -> None:
        """Compute layers [start, end) over `weights` from now on (views of the pool's pages after a remap),
        with the same attention backend."""
        self.runner = ModelRunner(self.cfg, weights, layer_range, self.device, attention=self.runner.attention,
                                  pack_weights=self.pack_weights, reduce=self.runner.reduce)

    def _capacity(self) -> int:
        """Blocks this engine may use: its storage's, capped at the group's block space when it heads one."""
        return self.kv.num_blocks if self.kv_limit is None else min(self.kv.num_blocks, self.kv_limit)

    def apply_compaction(self, mapping: dict[int, int]) -> None:
        """After the KV bytes of blocks were moved (old id -> new id), rewrite the bookkeeping: the
        allocator's free set and every sequence's block table."""
        self._settle_checkpoints()
        self.allocator.remap(mapping)
        for seq in self.seqs.values():
            seq.block_table.remap(mapping)

    # -- observation ------------------------------------------------------------------------------------
    def busy_idle(self) -> BusyIdle:
        """Busy, idle and bubble seconds since the engine was built (safe from any thread)."""
        return self.clock.snapshot()

    def stats(self) -> EngineStats:
        return self.scheduler.stats(prompt_tokens_total=self.prompt_tokens_total,
                                    generated_tokens_total=self.generated_tokens_total, **self._checkpoint_counts())

    def _checkpoint_counts(self) -> dict[str, int]:
        ck = self.checkpoint_stats()
        if ck is None:
            return {}
        return {"checkpointed_blocks_total": ck.blocks_checkpointed, "checkpoint_preemptions": ck.preemptions,
                "checkpoint_host_blocks": ck.host_blocks_used}

    # -- convenience for tests and benchmarks -------------------------------------------------------------
    def generate(self, requests: Iterable[EngineRequest], max_steps: int = 1_000_000) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in requests:
            self.add_request(r)
            out[r.request_id] = []
        for _ in range(max_steps):
            if not self.has_work():
                return out
            for ev in self.step():
                out[ev.request_id].append(ev.token_id)
        raise RuntimeError(f"requests unfinished after {max_steps} steps")
