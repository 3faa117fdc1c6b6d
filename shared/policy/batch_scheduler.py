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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

from kunserve.shared.engine.api import EngineRequest, InvalidRequest
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable, blocks_needed
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
    iteration's first prompt chunk (the one that gets a progress floor)."""

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
    #   are free beside what running requests will still grow into, so nothing is ever preempted.
    preemption: str = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0, got {self.max_prefill_chunk}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption!r}")


PREEMPTION_MODES = ("recompute", "swap", "none")

_arrival_counter = itertools.count()


class Swapper(Protocol):
    """Moves a preempted sequence's KV blocks to host memory and back (the engine implements it)."""

    def swap_out(self, seq: Sequence) -> None: ...

    def swap_in(self, seq: Sequence) -> None: ...


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
        # Pipeline groups: sequences with a microbatch in flight (id -> count) are never preempted
        # (their KV is being written on later stages and their sampled token is still to come).
        self.pinned: dict[int, int] = {}
        self.swapper: Swapper | None = None  # set by the engine for preemption = "swap"
        self.num_swapped_out = 0

    def reset(self, allocator: BlockAllocator) -> None:
        """Hold no sequence and schedule over `allocator` from now on (a layout change gave the engine a new
        block space); the counters go on."""
        self.allocator = allocator
        self.waiting.clear()
        self.running.clear()
        self.pinned.clear()

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
        self._insert(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """A request whose KV is already in place (a transition handed it over with its block table)."""
        self._insert(self.running, seq)

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
        preemption = "swap" its computed KV is first copied to host memory (swapped back on re-admission)."""
        self.running.remove(seq)
        if self.config.preemption == "swap" and self.swapper is not None and seq.num_computed > 0:
            computed = seq.num_computed
            self.swapper.swap_out(seq)
            seq.swapped_tokens = computed
            self.num_swapped_out += 1
        self._free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

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
        sequences, then the waiting ones (a swapped-out one from its saved KV on). What a pipeline group's head
        plans its lookahead microbatches over."""
        out = [WorkItem(s.request_id, s.remaining, s.num_computed) for s in self.running if s.remaining > 1]
        for s in self.waiting:
            done = s.swapped_tokens if s.swapped is not None else s.num_computed
            if len(s.tokens) > done:
                out.append(WorkItem(s.request_id, len(s.tokens) - done, done))
        return out

    def schedule(self, max_decodes: int | None = None, prompt_tokens: int | None = None) -> list[ScheduledChunk]:
        """Pick this iteration's work and reserve its KV blocks. Decodes come first in the result, at most
        `max_decodes` of them (the oldest; None: every one). `prompt_tokens`: the prompt chunks take exactly
        this many tokens (a planned microbatch: the budget's chunk sizing does not apply) unless memory or
        max_num_seqs stops them first; None: what the budget leaves after the decodes."""
        cfg = self.config
        out: list[ScheduledChunk] = []
        decodes = [s for s in self.running if s.remaining == 1]
        if max_decodes is not None:
            decodes = decodes[:max_decodes]
        budget = self.budget.max_tokens_for(len(decodes),
                                            decode_context_tokens=sum(len(s.tokens) for s in decodes))
        chunk_limit = getattr(self.budget, "chunk_limit", None)
        shape = BatchShape()  # what this step holds so far, for the latency-model budget
        used = 0
        in_batch: set[int] = set()
        preemptions_before = self.num_preemptions
        # 1. decodes, oldest first; when blocks run out preempt the newest running request (maybe itself).
        for seq in decodes:
            if seq.num_computed == 0:
                continue  # preempted below to make room for an older one
            if used >= budget or len(out) >= cfg.max_num_seqs:
                break
            while not self._reserve(seq, 1):
                # newest first; never one in flight (pinned) nor one already in this step's batch
                victim = next((v for v in reversed(self.running)
                               if id(v) not in self.pinned and (v is seq or id(v) not in in_batch)), None)
                if victim is None:
                    break  # everything newer is in flight: this decode waits for a result
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                out.append(ScheduledChunk(seq, 1))
                in_batch.add(id(seq))
                shape.add(1, seq.num_computed)
                used += 1
        # 2. prompt chunks in arrival order: partially prefilled running sequences first, then waiting ones
        #    (not after a preemption in this step: memory is short, re-admitting would only thrash).
        num_decodes_in_batch = len(out)
        if prompt_tokens is not None:
            budget = used + prompt_tokens
            chunk_limit = None
        partial = [s for s in self.running if id(s) not in in_batch and s.remaining > 1]
        for seq in partial + list(self.waiting):
            if used >= budget or len(out) >= cfg.max_num_seqs:
                break
            admitting = seq.num_computed == 0 and not seq.block_table
            if admitting and self.num_preemptions != preemptions_before:
                break
            if admitting and cfg.preemption == "none" and not self._fits_whole_life(seq):
                break  # FCFS: it waits until its whole KV fits; nothing is ever preempted
            if admitting and seq.swapped is not None:
                if not self._swap_in(seq):
                    break
                admitting = False
                self.waiting.remove(seq)
                self._insert(self.running, seq)
                if seq.remaining <= 0:
                    continue
            n = min(seq.remaining, budget - used)
            if cfg.max_prefill_chunk:
                n = min(n, cfg.max_prefill_chunk)
            if chunk_limit is not None and n > 0:
                n = min(n, chunk_limit(shape, seq.num_computed, n, first=len(out) == num_decodes_in_batch))
            if not admitting:
                # a running sequence may take blocks from newer running ones that are not in this batch
                while self._room(seq) < n and self._preempt_newest(seq, in_batch):
                    pass
            n = min(n, self._room(seq))
            if admitting and self.running:
                keep_free = int(cfg.admission_watermark * self.allocator.num_blocks)
                spare = self.allocator.num_free - seq.block_table.extra_blocks_for(n)
                if spare < keep_free:
                    n = min(n, max(0, (self.allocator.num_free - keep_free) * self.block_size))
            if n <= 0:
                break  # FCFS: later requests do not overtake one waiting for memory
            self._reserve(seq, n)
            if admitting:
                self.waiting.remove(seq)
                self._insert(self.running, seq)
            out.append(ScheduledChunk(seq, n))
            in_batch.add(id(seq))
            shape.add(n, seq.num_computed)
            used += n
        return out

    def _life_blocks(self, seq: Sequence) -> int:
        r = seq.request
        return blocks_needed(len(r.prompt_token_ids) + r.sampling.max_tokens - 1, self.block_size)

    def _fits_whole_life(self, seq: Sequence) -> bool:
        """Queue-only admission: blocks for its whole life fit beside the running requests' future growth."""
        growth = sum(max(0, self._life_blocks(s) - len(s.block_table)) for s in self.running)
        return self._life_blocks(seq) + growth <= self.allocator.num_free

    def _swap_in(self, seq: Sequence) -> bool:
        """Re-admit a swapped-out sequence: blocks for its saved KV, copied back from host memory."""
        need = blocks_needed(seq.swapped_tokens, self.block_size)
        keep_free = int(self.config.admission_watermark * self.allocator.num_blocks) if self.running else 0
        if need + keep_free > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        assert self.swapper is not None
        self.swapper.swap_in(seq)
        seq.num_computed = seq.swapped_tokens
        seq.swapped_tokens = 0
        return True

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
