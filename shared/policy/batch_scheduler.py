"""Continuous batching with chunked prefill under a per-iteration token budget: a pure policy (no I/O,
no torch), so the worker, the unit tests and the simulator run the same code.

One rule covers prefill and decode: every sequence has tokens whose KV is not computed yet (a whole
prompt, the rest of a chunked prompt, or the one token sampled last step). Each iteration:

1. running decodes first, one token each, oldest first (TBT matters most for them);
2. then prompt chunks FCFS: partially prefilled running sequences, then waiting ones; a chunk is
   min(remaining tokens, budget left, max_prefill_chunk, what free KV blocks hold).

When blocks run out for a running sequence, the most recently arrived running request is preempted
by recompute (vLLM's default): its blocks are freed and it goes back to the waiting queue in arrival
order (ahead of every later arrival) with its generated tokens appended to the tokens to re-prefill.
Re-prefilling prompt + generated gives the same greedy continuation. Nothing is ever dropped.

The budget is pluggable (`TokenBudget`): the fixed `max_num_batched_tokens` (the default), or the
SLO-aware `SLOTokenBudget` (shared/policy/token_budget.py, ConServe's k1..k5 fit), which also sizes each
prompt chunk through the optional `chunk_limit` hook: a chunk deep into a long prompt costs more
(attention over its prefix) than a fresh one of the same length.

Request classes (ConServe §4.2, Algorithm 1). An offline request (`EngineRequest.offline`) runs on what
online requests leave, so online ones see the same schedule as if no offline request existed:

* Phase 1, an online request running or waiting: steps 1-2 above over the online requests alone; when
  memory is short for one of them, running offline requests are preempted first (newest first), online
  ones only after that (as above). Then offline decodes and offline prompt chunks fill what the budget
  left: the fixed budget's remaining tokens, or under the SLO budget only tokens whose predicted iteration
  stays under the TBT SLO (`chunk_limit`, with no progress floor: offline work never pushes an iteration
  over the SLO). A new offline request is admitted only while no online request waits, nothing was
  preempted this iteration and `offline_free_watermark` of the blocks stay free after its chunk: room
  for the next online arrivals without preempting (which, by recompute, loses the offline work).
* Phase 2, offline requests only: steps 1-2 over them under the throughput-maximising budget the budget
  offers (`for_throughput`: the latency model picks the batch with the most tokens per second instead of
  the TBT cap); the fixed budget stays the fixed cap.

An offline request never takes memory from an online one. In phase 1 one that finds too few free blocks
waits with its KV (Algorithm 1 stops offline scheduling when memory is short): the next online request to
leave frees some, while preempting another offline request would throw that one's KV away. In phase 2 they
follow the newest-first rule above among themselves. With no offline request the schedule is exactly the
class-blind one above. Every preemption goes through `preempt`: with the engine's incremental KV checkpoints
(`checkpointer`, shared/engine/kv_checkpoint.py) an offline request whose KV is in host memory leaves by
checkpoint there (its blocks are freed at once, nothing is recomputed) and waits like a swapped-out one; the
engine prefetches its KV back once memory lets `schedule()` re-admit it (`next_to_prefetch`, `readmit_arriving`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kunserve.shared.engine.api import EngineRequest, EngineStats, InvalidRequest
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable, blocks_needed, life_blocks
from kunserve.shared.policy.costmodel import BatchShape
from kunserve.shared.policy.microbatch import WorkItem


class TokenBudget(Protocol):
    """How many tokens one iteration may run, given what is already committed to it.

    num_decodes: decoding sequences this step (each costs one token);
    decode_context_tokens: their total context length (attention cost grows with it);
    A latency-model budget answers the largest token count whose predicted iteration time stays
    under the TBT SLO; the fixed budget ignores both.

    Optional hook, used when present: `chunk_limit(shape, prefix, want, first=...) -> int`, the most of
    `want` tokens of a prompt chunk whose first `prefix` tokens are cached that may join a batch already
    holding `shape` (a `costmodel.BatchShape` of the chunks scheduled so far); `first`: whether it is the
    iteration's first prompt chunk (the one that gets a progress floor).

    Optional hook, used when present: `for_throughput(max_tokens) -> TokenBudget`, the budget of an
    iteration with no online request (ConServe's offline-optimised mode): no TBT SLO binds, so it sizes the
    batch for the most tokens per second, at most `max_tokens` tokens. Without it that iteration uses this
    budget too."""

    def max_tokens_for(self, num_decodes: int, *, decode_context_tokens: int = 0) -> int: ...


@dataclass(frozen=True)
class FixedTokenBudget:
    """vLLM's max_num_batched_tokens: the same cap every iteration."""

    max_num_batched_tokens: int = 512

    def max_tokens_for(self, num_decodes: int, *, decode_context_tokens: int = 0) -> int:
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_prefill_chunk: int = 0  # 0 = no cap beyond the budget
    # Admit a new request only while this fraction of blocks stays free after its chunk, so decodes
    # of running requests do not immediately preempt it (vLLM's watermark). Ignored when idle.
    admission_watermark: float = 0.01
    # What happens to a running request when blocks run out (the KV-centric baselines of KunServe §5):
    #   "recompute" (vLLM's default): free its KV, re-prefill prompt + generated tokens later;
    #   "swap" (InferCept-like): copy its KV to host memory, copy it back when it is re-admitted;
    #   "none" (queueing only): admit a request only when blocks for its whole life (prompt + max_tokens)
    #   are free beside what running requests will still grow into, so no online request is ever preempted.
    #   Offline requests stay the first victims of online ones (ConServe): an online request counts only the
    #   online requests' growth and takes offline requests' blocks, at admission or as it grows.
    preemption: str = "recompute"
    # A new offline request is admitted only while this fraction of the blocks stays free after its chunk (never
    # less than admission_watermark; ignored when idle). Online arrivals then find room for their prompts at once
    # instead of preempting offline requests, whose KV a recompute preemption throws away: a tenth of the cache
    # holds several typical prompts, while offline decodes still grow into it.
    offline_free_watermark: float = 0.1
    # How offline requests share the engine (COSERVING_MODES; the baselines of ConServe §6 beside it):
    #   "conserve": Algorithm 1 as described above;
    #   "preemptive" (vLLM-style priority): Algorithm 1's order and offline-first preemption, but a new offline
    #   request is admitted greedily (admission_watermark only, no offline_free_watermark), so online arrivals
    #   preempt it, losing its KV to recompute;
    #   "non-preemptive": class-blind: every request is scheduled as an online one (its class is dropped on entry),
    #   FCFS, so nothing is preempted or held back for its class.
    # The worker pairs both baselines with the fixed budget and no layer-wise preemption (services/worker/build.py).
    coserving: str = "conserve"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0, got {self.max_prefill_chunk}")
        if not 0 <= self.offline_free_watermark < 1:
            raise ValueError(f"offline_free_watermark must be in [0, 1), got {self.offline_free_watermark}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption!r}")
        if self.coserving not in COSERVING_MODES:
            raise ValueError(f"coserving must be one of {', '.join(COSERVING_MODES)}, got {self.coserving!r}")


PREEMPTION_MODES = ("recompute", "swap", "none")
COSERVING_MODES = ("conserve", "preemptive", "non-preemptive")

_arrival_counter = itertools.count()


class Swapper(Protocol):
    """Moves a preempted sequence's KV blocks to host memory and back (the engine implements it)."""

    def swap_out(self, seq: Sequence) -> None: ...

    def swap_in(self, seq: Sequence) -> None: ...


class Checkpointer(Protocol):
    """Preempts an offline sequence by checkpoint (the engine's incremental KV checkpoints, kv_checkpoint.py)."""

    def checkpoint_out(self, seq: Sequence) -> bool:
        """True when seq's KV is in host memory now (seq.swapped holds it) and its blocks may be freed; False: the
        preemption goes on as configured."""
        ...


@dataclass(eq=False)
class Sequence:
    """A request's state inside the engine. KV exists for tokens[:num_computed]."""

    request: EngineRequest
    tokens: list[int]  # prompt + generated
    block_table: BlockTable
    # FCFS key: (request.arrival_time, add order). Ties (e.g. arrival_time left at 0) keep add order.
    order: tuple[float, int] = (0.0, -1)
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)
    generator: Any = None  # the sampler's per-request torch.Generator (opaque here)
    num_preemptions: int = 0
    swapped_tokens: int = 0  # swap preemption: tokens whose KV waits in host memory
    swapped: Any = None      # the host copy (opaque here)

    def __post_init__(self) -> None:
        if self.order[1] < 0:
            self.order = (float(self.request.arrival_time), next(_arrival_counter))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to be computed."""
        return len(self.tokens) - self.num_computed


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    start: int = -1  # position of the chunk's first token (num_computed when scheduled)

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed

    @property
    def completes(self) -> bool:
        """After this chunk every token has KV, so the last one's logits give the next token."""
        return self.start + self.num_tokens == len(self.seq.tokens)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.completes and self.start > 0


@dataclass
class _Batch:
    """One iteration's batch while schedule() builds it."""

    budget: int  # tokens the budget allows this iteration
    chunk_limit: Callable[..., int] | None  # the budget's chunk_limit hook, if any
    prompt_tokens: int | None  # a planned microbatch: exactly this many prompt tokens
    preemptions_before: int
    online_preemptions_before: int
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prompts: list[ScheduledChunk] = field(default_factory=list)
    shape: BatchShape = field(default_factory=BatchShape)  # for the latency-model budget
    in_batch: set[int] = field(default_factory=set)
    used: int = 0
    prompt_used: int = 0

    @property
    def count(self) -> int:
        return len(self.decodes) + len(self.prompts)

    def add(self, seq: Sequence, n: int, *, decode: bool) -> None:
        (self.decodes if decode else self.prompts).append(ScheduledChunk(seq, n))
        self.in_batch.add(id(seq))
        self.shape.add(n, seq.num_computed)
        self.used += n
        if not decode:
            self.prompt_used += n


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, config: SchedulerConfig | None = None,
                 budget: TokenBudget | None = None) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.config = config or SchedulerConfig()
        self.budget: TokenBudget = budget or FixedTokenBudget(self.config.max_num_batched_tokens)
        self.waiting: list[Sequence] = []  # sorted by arrival order
        self.running: list[Sequence] = []  # hold KV blocks; sorted by arrival order
        self.num_preemptions = 0
        self.num_offline_preemptions = 0  # of num_preemptions, those of offline requests
        # Pipeline groups: sequences with a microbatch in flight (id -> count) are never preempted
        # (their KV is being written on later stages and their sampled token is still to come).
        self.pinned: dict[int, int] = {}
        self.swapper: Swapper | None = None  # set by the engine for preemption = "swap"
        self.num_swapped_out = 0
        self.checkpointer: Checkpointer | None = None  # set by the engine while it checkpoints offline KV
        self.num_checkpointed_out = 0
        self._admitting = True  # hold_admissions

    def reset(self, allocator: BlockAllocator) -> None:
        """Hold no sequence and schedule over `allocator` from now on (a layout change gave the engine a new
        block space); the counters go on."""
        self.allocator = allocator
        self.waiting.clear()
        self.running.clear()
        self.pinned.clear()

    def hold_admissions(self, hold: bool) -> None:
        """While held, no waiting request starts (running ones go on): an engine whose layers are being split one by
        one (tp_stagger.py) has no place yet for a new request's KV in the layers already split."""
        self._admitting = not hold

    def pin(self, seq: Sequence) -> None:
        self.pinned[id(seq)] = self.pinned.get(id(seq), 0) + 1

    def unpin(self, seq: Sequence) -> None:
        n = self.pinned.get(id(seq), 0) - 1
        if n > 0:
            self.pinned[id(seq)] = n
        else:
            self.pinned.pop(id(seq), None)

    # -- membership ---------------------------------------------------------------------------------
    def check_fits(self, request: EngineRequest) -> None:
        """Reject what could never run even alone in the whole cache (it would wait forever)."""
        total = self.allocator.num_blocks
        n_prompt = len(request.prompt_token_ids)
        if blocks_needed(n_prompt, self.block_size) > total:
            raise InvalidRequest("prompt", f"{n_prompt} tokens need more KV blocks than this worker has "
                                           f"({total} x {self.block_size} tokens)")
        # the last sampled token never gets KV: prompt + max_tokens - 1 tokens are cached at most
        need = n_prompt + request.sampling.max_tokens - 1
        if blocks_needed(need, self.block_size) > total:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens = {need + 1} tokens exceed this worker's KV "
                                               f"capacity of {total * self.block_size} tokens")

    def add(self, seq: Sequence) -> None:
        self._class_blind(seq)
        self._insert(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """A request whose KV is already in place (a transition handed it over with its block table)."""
        self._class_blind(seq)
        self._insert(self.running, seq)

    def _class_blind(self, seq: Sequence) -> None:
        """coserving = "non-preemptive": the request enters as an online one (a copy of its request: the caller's
        keeps its class), so the scheduler and the engine treat it exactly like one."""
        if self.config.coserving == "non-preemptive" and seq.request.offline:
            seq.request = dataclasses.replace(seq.request, offline=False)

    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        i = len(queue)
        while i > 0 and queue[i - 1].order > seq.order:
            i -= 1
        queue.insert(i, seq)

    def remove(self, seq: Sequence) -> None:
        """Finished or aborted: release its KV blocks now."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table.clear())
        seq.num_computed = 0

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its KV; it re-prefills prompt + generated tokens later. With
        preemption = "swap" its computed KV is first copied to host memory (swapped back on re-admission). An offline
        seq whose KV the checkpointer holds leaves by checkpoint whatever the mode: swapped back the same way."""
        self.running.remove(seq)
        if (seq.request.offline and self.checkpointer is not None and seq.num_computed > 0
                and self.checkpointer.checkpoint_out(seq)):
            seq.swapped_tokens = seq.num_computed
            self.num_checkpointed_out += 1
        elif self.config.preemption == "swap" and self.swapper is not None and seq.num_computed > 0:
            computed = seq.num_computed
            self.swapper.swap_out(seq)
            seq.swapped_tokens = computed
            self.num_swapped_out += 1
        self._free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.request.offline:
            self.num_offline_preemptions += 1
        self._insert(self.waiting, seq)

    def use_budget(self, budget: TokenBudget) -> None:
        """Budget the next iterations with `budget` (a pipeline group's head: its group's latency model)."""
        self.budget = budget

    # -- the policy -----------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for seq's next num_tokens tokens; False (nothing allocated) when too few are free."""
        need = seq.block_table.extra_blocks_for(seq.num_computed + num_tokens)
        if need > self.allocator.num_free:
            return False
        if need:
            seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _room(self, seq: Sequence) -> int:
        """Tokens seq could still add with its own blocks plus every free block."""
        return seq.block_table.capacity + self.allocator.num_free * self.block_size - seq.num_computed

    def _preempt_offline(self, protected: set[int]) -> bool:
        """Preempt the most recently arrived running offline sequence that is neither in this step's batch nor
        in flight: where an online request takes memory from first. False when there is none."""
        for victim in reversed(self.running):
            if victim.request.offline and id(victim) not in protected and id(victim) not in self.pinned:
                self.preempt(victim)
                return True
        return False

    def _preempt_newest(self, newer_than: Sequence, protected: set[int]) -> bool:
        """Preempt the most recently arrived running sequence that arrived after `newer_than` and is not
        in this step's batch. False when there is none."""
        for victim in reversed(self.running):
            if victim.order <= newer_than.order:
                return False
            if id(victim) not in protected and id(victim) not in self.pinned:
                self.preempt(victim)
                return True
        return False

    def _decode_victim(self, seq: Sequence, protected: set[int]) -> Sequence | None:
        """Whom to preempt when decoding seq finds no free block: the newest offline request when seq is online,
        else the newest running request, maybe seq itself; never one in flight nor one already in this step's
        batch."""
        candidates = [v for v in reversed(self.running)
                      if id(v) not in self.pinned and (v is seq or id(v) not in protected)]
        if not seq.request.offline:
            candidates.sort(key=lambda v: not v.request.offline)  # stable: newest offline first, then newest online
        return candidates[0] if candidates else None

    def _online_present(self) -> bool:
        return any(not s.request.offline for s in self.running) or any(not s.request.offline for s in self.waiting)

    def _mode_budget(self, online: bool) -> TokenBudget:
        """Phase 1 (an online request present): the configured budget. Phase 2 (offline only): the
        throughput-maximising one when the budget offers it, at most max_num_batched_tokens per iteration."""
        make = None if online else getattr(self.budget, "for_throughput", None)
        return self.budget if make is None else make(self.config.max_num_batched_tokens)

    def _keep_free(self, seq: Sequence) -> int:
        """Blocks admitting seq must leave free: offline, the offline watermark while anything runs; online, the
        admission watermark while an online request runs (running offline requests are preempted for it anyway).
        Nothing when idle: a request swapped out whole must be able to come back."""
        cfg = self.config
        if seq.request.offline:
            if not self.running:
                return 0
            offline_watermark = cfg.offline_free_watermark if cfg.coserving == "conserve" else 0.0
            return int(max(offline_watermark, cfg.admission_watermark) * self.allocator.num_blocks)
        if any(not s.request.offline for s in self.running):
            return int(cfg.admission_watermark * self.allocator.num_blocks)
        return 0

    def decode_share(self, num_microbatches: int) -> int:
        """The most decodes one of `num_microbatches` microbatches in flight should carry: the decoding
        sequences (those with a token in flight included) spread evenly over them. A pipeline group's head
        caps each microbatch at this, so every stage has a microbatch to run during pure decode instead of
        one microbatch holding every decode while the other stages idle."""
        return max(1, -(-self.num_decoding() // max(1, num_microbatches)))

    def num_decoding(self) -> int:
        """Running sequences past their prompt: ready to decode, or with their token in flight."""
        return sum(1 for s in self.running if s.num_computed > 0 and s.remaining <= 1)

    def prompt_work(self) -> list[WorkItem]:
        """The prompt tokens schedule() would chunk, in the order it takes them: partly prefilled running
        sequences, then the waiting ones (a swapped-out one from its saved KV on), online ones before offline
        ones while an online request is present. What a pipeline group's head plans its lookahead microbatches
        over."""
        work = [(s, WorkItem(s.request_id, s.remaining, s.num_computed)) for s in self.running if s.remaining > 1]
        for s in self.waiting:
            done = s.swapped_tokens if s.swapped is not None else s.num_computed
            if len(s.tokens) > done:
                work.append((s, WorkItem(s.request_id, len(s.tokens) - done, done)))
        if self._online_present():
            work.sort(key=lambda sw: sw[0].request.offline)
        return [item for _, item in work]

    def schedule(self, max_decodes: int | None = None, prompt_tokens: int | None = None) -> list[ScheduledChunk]:
        """Pick this iteration's work and reserve its KV blocks. Decodes come first in the result, at most
        `max_decodes` of them (the oldest, online ones first; None: every one). `prompt_tokens`: the prompt
        chunks take exactly this many tokens (a planned microbatch: the budget's chunk sizing does not apply)
        unless memory or max_num_seqs stops them first; None: what the budget leaves after the decodes."""
        online = self._online_present()
        policy = self._mode_budget(online)
        decodes = [s for s in self.running if s.remaining == 1 and not (online and s.request.offline)]
        if max_decodes is not None:
            decodes = decodes[:max_decodes]
        batch = _Batch(policy.max_tokens_for(len(decodes), decode_context_tokens=sum(len(s.tokens) for s in decodes)),
                       getattr(policy, "chunk_limit", None), prompt_tokens, self.num_preemptions,
                       self.num_preemptions - self.num_offline_preemptions)
        # the online requests (phase 1), or every request when none is online (phase 2, the throughput budget)
        self._schedule_decodes(batch, decodes, fill=False)
        partial = [s for s in self.running
                   if id(s) not in batch.in_batch and s.remaining > 1 and not (online and s.request.offline)]
        self._schedule_prompts(batch, partial + [s for s in self.waiting if not (online and s.request.offline)],
                               fill=False)
        if online:  # Phase 1: offline work fills what the online requests left
            off = [s for s in self.running if s.request.offline and s.remaining == 1]
            if max_decodes is not None:
                off = off[:max(0, max_decodes - len(decodes))]
            self._schedule_decodes(batch, off, fill=True)
            partial = [s for s in self.running if s.request.offline and id(s) not in batch.in_batch and s.remaining > 1]
            self._schedule_prompts(batch, partial + [s for s in self.waiting if s.request.offline], fill=True)
        return batch.decodes + batch.prompts

    def _schedule_decodes(self, batch: _Batch, decodes: list[Sequence], *, fill: bool) -> None:
        """One token each, oldest first; when blocks run out preempt (see _decode_victim), maybe seq itself.
        `fill`: offline decodes filling what online requests left: under the SLO budget only while the predicted
        iteration stays under the SLO, and when memory is short they stop (Algorithm 1): a paused offline request
        keeps its KV for when an online request leaves, instead of throwing another one's away."""
        cfg = self.config
        for seq in decodes:
            if seq.num_computed == 0:
                continue  # preempted below to make room for an older one
            if batch.used >= batch.budget or batch.count >= cfg.max_num_seqs:
                break
            if fill:
                if batch.chunk_limit is not None and batch.chunk_limit(batch.shape, seq.num_computed, 1, first=False) < 1:
                    break
                if not self._reserve(seq, 1):
                    break
                batch.add(seq, 1, decode=True)
                continue
            while not self._reserve(seq, 1):
                victim = self._decode_victim(seq, batch.in_batch)
                if victim is None:
                    break  # everything newer is in flight: this decode waits for a result
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, 1, decode=True)

    def _schedule_prompts(self, batch: _Batch, seqs: list[Sequence], *, fill: bool) -> None:
        """Prompt chunks in the given order (partially prefilled running sequences, then waiting ones); FCFS: one
        that cannot go on stops the later ones. `fill`: offline chunks filling what online requests left: no
        progress floor, and only free blocks (they preempt nothing)."""
        cfg = self.config
        for seq in seqs:
            left = batch.budget - batch.used if batch.prompt_tokens is None else batch.prompt_tokens - batch.prompt_used
            if left <= 0 or batch.count >= cfg.max_num_seqs:
                break
            admitting = seq.num_computed == 0 and not seq.block_table
            if admitting and not self._may_admit(seq, batch):
                break
            if admitting and seq.swapped is not None:
                if not seq.request.offline:
                    need = blocks_needed(seq.swapped_tokens, self.block_size) + self._keep_free(seq)
                    while self.allocator.num_free < need and self._preempt_offline(batch.in_batch):
                        pass
                if not self._swap_in(seq):
                    break
                admitting = False
                self.waiting.remove(seq)
                self._insert(self.running, seq)
                if seq.remaining <= 0:
                    continue
            n = min(seq.remaining, left)
            if cfg.max_prefill_chunk:
                n = min(n, cfg.max_prefill_chunk)
            if batch.chunk_limit is not None and batch.prompt_tokens is None and n > 0:
                n = min(n, batch.chunk_limit(batch.shape, seq.num_computed, n, first=not fill and not batch.prompts))
            if not admitting and not fill:
                # a running sequence may take blocks from ones that are not in this batch: an online one from
                # offline ones first, then from newer ones
                while self._room(seq) < n and ((not seq.request.offline and self._preempt_offline(batch.in_batch))
                                               or self._preempt_newest(seq, batch.in_batch)):
                    pass
            elif admitting and not seq.request.offline:
                keep_free = self._keep_free(seq)
                while (self.allocator.num_free - seq.block_table.extra_blocks_for(n) < keep_free
                       and self._preempt_offline(batch.in_batch)):
                    pass
            n = min(n, self._room(seq))
            if admitting:
                keep_free = self._keep_free(seq)
                spare = self.allocator.num_free - seq.block_table.extra_blocks_for(n)
                if spare < keep_free:
                    n = min(n, max(0, (self.allocator.num_free - keep_free) * self.block_size))
            if n <= 0:
                break  # FCFS: later requests do not overtake one waiting for memory
            self._reserve(seq, n)
            if admitting:
                self.waiting.remove(seq)
                self._insert(self.running, seq)
            batch.add(seq, n, decode=False)

    def _may_admit(self, seq: Sequence, batch: _Batch) -> bool:
        """Whether a waiting seq may start now. Not after a preemption in this step (memory is short, admitting
        would only thrash): for an online seq a preemption of an online one, for an offline seq any, and an
        offline seq also not while an online request waits. Queue-only admission ("none"): when its whole life
        fits; for an online seq beside the online requests' growth only, with the running offline requests'
        blocks taken for it (newest first) when that is what it takes: offline work never holds an online request
        back, and online requests never preempt each other."""
        if not self._admitting:
            return False
        if seq.request.offline:
            if self.num_preemptions != batch.preemptions_before or any(not s.request.offline for s in self.waiting):
                return False
            return self.config.preemption != "none" or self._fits_whole_life(seq)
        if self.num_preemptions - self.num_offline_preemptions != batch.online_preemptions_before:
            return False
        if self.config.preemption != "none":
            return True
        takeable = sum(len(s.block_table) for s in self.running
                       if s.request.offline and id(s) not in batch.in_batch and id(s) not in self.pinned)
        if not self._fits_whole_life(seq, spare=takeable):
            return False
        while not self._fits_whole_life(seq) and self._preempt_offline(batch.in_batch):
            pass
        return self._fits_whole_life(seq)

    def _life_blocks(self, seq: Sequence) -> int:
        return life_blocks(seq.request, self.block_size)

    def _fits_whole_life(self, seq: Sequence, spare: int = 0) -> bool:
        """Queue-only admission: blocks for its whole life fit in the free blocks (plus `spare`) beside the future
        growth of the running requests it must not take from: every one for an offline seq, the online ones for an
        online seq (offline requests give their blocks back to online ones when they run short)."""
        growth = sum(max(0, self._life_blocks(s) - len(s.block_table)) for s in self.running
                     if seq.request.offline or not s.request.offline)
        return self._life_blocks(seq) + growth <= self.allocator.num_free + spare

    def _swap_in(self, seq: Sequence) -> bool:
        """Re-admit a swapped-out sequence: blocks for its saved KV, copied back from host memory."""
        need = blocks_needed(seq.swapped_tokens, self.block_size)
        if need + self._keep_free(seq) > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        assert self.swapper is not None
        self.swapper.swap_in(seq)
        seq.num_computed = seq.swapped_tokens
        seq.swapped_tokens = 0
        return True

    # -- prefetching checkpointed offline requests (ConServe §4.4: the engine's kv_checkpoint.py) --------------------
    def next_to_prefetch(self) -> Sequence | None:
        """The waiting offline request whose KV is away (swapped or checkpointed) that schedule() would re-admit
        first, when it may now: no online request waits, it heads the offline queue (FCFS) and its blocks fit beside
        the offline watermark. The engine copies a checkpointed one's KV back in the background meanwhile."""
        if any(not s.request.offline for s in self.waiting):
            return None
        seq = next((s for s in self.waiting if s.request.offline), None)
        if seq is None or seq.swapped is None:
            return None
        need = blocks_needed(seq.swapped_tokens, self.block_size)
        return seq if need + self._keep_free(seq) <= self.allocator.num_free else None

    def readmit_arriving(self, seq: Sequence) -> list[int]:
        """Re-admit a waiting seq while its KV is still copied back into its new blocks (returned): it runs and holds
        them, so it is preempted like any running request when memory runs short, but has nothing to compute until
        the engine sets its num_computed to swapped_tokens once its KV has arrived (num_computed = every token
        meanwhile, as for a request whose tokens are in flight)."""
        self.waiting.remove(seq)
        seq.block_table.extend(self.allocator.allocate(blocks_needed(seq.swapped_tokens, self.block_size)))
        seq.num_computed = len(seq.tokens)
        self._insert(self.running, seq)
        return list(seq.block_table.ids)

    def oldest_waiting_arrival(self) -> float | None:
        """Arrival of the longest-waiting request that has produced no token yet (its client still waits for
        the first one): the head-of-line queue time the overload signal counts. Preempted requests that
        already streamed tokens are not counted: their arrival says nothing about how long they wait now, nor
        are requests without an arrival time (0: set by tests and tools that do not stamp one)."""
        return min((s.request.arrival_time for s in self.waiting if not s.generated and s.request.arrival_time > 0),
                   default=None)

    def queued_demand_blocks(self) -> int:
        """KV blocks the waiting requests need to (re-)prefill: the router's and monitor's demand signal."""
        return sum(blocks_needed(len(s.tokens), self.block_size) for s in self.waiting)

    # -- the offline share, for the monitor's overload signal: offline work is harvested, never a reason to drop --
    def oldest_online_waiting_arrival(self) -> float | None:
        """`oldest_waiting_arrival` over online requests only: offline ones have no TTFT SLO to miss."""
        return min((s.request.arrival_time for s in self.waiting
                    if not s.request.offline and not s.generated and s.request.arrival_time > 0), default=None)

    def online_queued_demand_blocks(self) -> int:
        """`queued_demand_blocks` over online requests only: waiting offline requests take only what online
        ones leave, so they are no demand a parameter drop should serve."""
        return sum(blocks_needed(len(s.tokens), self.block_size) for s in self.waiting if not s.request.offline)

    def offline_kv_blocks(self) -> int:
        """KV blocks offline requests hold: an online request takes them before anything else (preemption)."""
        return sum(len(s.block_table) for s in (*self.running, *self.waiting) if s.request.offline)

    def stats(self, *, prompt_tokens_total: int, generated_tokens_total: int, **counts: int) -> EngineStats:
        """The engine's stats snapshot, from this scheduler's queries and its allocator. One builder, so the engine
        and the simulator report the same fields the same way; ``counts`` are the engine's own extra counters."""
        queued = self.queued_demand_blocks()
        offline_running, offline_waiting = self.num_offline()
        return EngineStats(
            kv_blocks_total=self.allocator.num_blocks, kv_blocks_used=self.allocator.num_used,
            block_size=self.block_size, num_running=len(self.running), num_waiting=len(self.waiting),
            queued_demand_blocks=queued, num_preemptions=self.num_preemptions,
            prompt_tokens_total=prompt_tokens_total, generated_tokens_total=generated_tokens_total,
            oldest_waiting_arrival=self.oldest_waiting_arrival(),
            num_offline_running=offline_running, num_offline_waiting=offline_waiting,
            offline_kv_blocks_used=self.offline_kv_blocks(),
            offline_queued_demand_blocks=queued - self.online_queued_demand_blocks(),
            oldest_online_waiting_arrival=self.oldest_online_waiting_arrival(),
            **counts,
        )

    def num_offline(self) -> tuple[int, int]:
        """(running, waiting) offline requests."""
        return sum(s.request.offline for s in self.running), sum(s.request.offline for s in self.waiting)
