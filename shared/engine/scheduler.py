"""Continuous batching with chunked prefill under a per-iteration token budget: a pure policy.

One rule covers prefill and decode: every sequence has tokens whose KV is not yet computed (a whole
prompt, the rest of a chunked prompt, or the one token sampled last step); each iteration gives
running decodes their token first, then prompt chunks in arrival order, as far as the budget, the
sequence limit and free KV blocks allow. When decodes run out of blocks the most recently arrived
running request is preempted by recompute (vLLM's default): its blocks are freed and it re-prefills
prompt + generated tokens later, which yields the same greedy continuation. Nothing is dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kunserve.shared.engine.api import EngineRequest, InvalidRequest
from kunserve.shared.engine.kv_cache import BlockAllocator, blocks_needed


class TokenBudget(Protocol):
    """How many tokens one iteration may run (a later SLO-aware latency model plugs in here)."""

    def max_tokens_for(self, num_decodes: int) -> int: ...


@dataclass(frozen=True)
class FixedTokenBudget:
    max_num_batched_tokens: int = 256

    def max_tokens_for(self, num_decodes: int) -> int:
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    max_prefill_chunk: int = 0  # 0 = no cap beyond the budget


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    tokens: list[int]  # prompt + generated; KV exists for tokens[:num_computed]
    order: int = field(default_factory=lambda: next(_arrival_counter))
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk every token has KV, so the last one's logits give the next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, config: SchedulerConfig = SchedulerConfig(),
                 budget: TokenBudget | None = None) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.config = config
        self.budget = budget or FixedTokenBudget(config.max_num_batched_tokens)
        self.waiting: list[Sequence] = []  # sorted by arrival order
        self.running: list[Sequence] = []  # hold KV blocks; sorted by arrival order
        self.num_preemptions = 0

    # -- membership ---------------------------------------------------------------------------------
    def check_fits(self, request: EngineRequest) -> None:
        total = self.allocator.num_blocks
        if blocks_needed(len(request.prompt_token_ids), self.block_size) > total:
            raise InvalidRequest("prompt", f"{len(request.prompt_token_ids)} tokens need more KV blocks than this "
                                           f"worker has ({total} x {self.block_size} tokens)")
        need = len(request.prompt_token_ids) + request.sampling.max_tokens
        if blocks_needed(need, self.block_size) > total:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens = {need} tokens exceed this worker's KV "
                                               f"capacity of {total * self.block_size} tokens")

    def add(self, seq: Sequence) -> None:
        self._insert(self.waiting, seq)

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
            self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

    # -- the policy -----------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = blocks_needed(seq.num_computed + num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def schedule(self) -> list[ScheduledChunk]:
        cfg = self.config
        out: list[ScheduledChunk] = []
        decodes = [s for s in self.running if s.remaining == 1]
        budget = self.budget.max_tokens_for(len(decodes))
        used_tokens = 0
        # 1. decodes, oldest first; preempt the newest running request when blocks run out.
        for seq in list(decodes):
            if seq not in self.running:
                continue  # preempted to make room for an older one
            if used_tokens >= budget or len(out) >= cfg.max_num_seqs:
                break
            while not self._grow(seq, 1):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                out.append(ScheduledChunk(seq, 1))
                used_tokens += 1
        # 2. prompt chunks: partially prefilled running sequences, then waiting ones, in arrival order.
        scheduled = {id(c.seq) for c in out}
        candidates = [s for s in self.running if id(s) not in scheduled and s.remaining > 1]
        candidates += list(self.waiting)
        candidates.sort(key=lambda s: s.order)
        for seq in candidates:
            if used_tokens >= budget or len(out) >= cfg.max_num_seqs:
                break
            n = min(seq.remaining, budget - used_tokens)
            if cfg.max_prefill_chunk:
                n = min(n, cfg.max_prefill_chunk)
            # shrink the chunk to what free blocks can hold (tokens already fitting in its last block are free)
            room = (len(seq.block_table) + self.allocator.num_free) * self.block_size - seq.num_computed
            n = min(n, room)
            if n <= 0:
                break  # FCFS: later requests do not overtake one waiting for memory
            self._grow(seq, n)
            if seq in self.waiting:
                self.waiting.remove(seq)
                self._insert(self.running, seq)
            out.append(ScheduledChunk(seq, n))
            used_tokens += n
        return out

    def queued_demand_blocks(self) -> int:
        return sum(blocks_needed(len(s.tokens), self.block_size) for s in self.waiting)
