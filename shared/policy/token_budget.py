"""SLO-aware token budget (ConServe §4.2): each iteration admits the most tokens whose predicted
latency keeps the iteration under the TBT SLO.

The scheduler asks in two steps, both answered from the fitted latency model:

1. `max_tokens_for(num_decodes, decode_context_tokens=...)`: every running decode is admitted (their
   TBT is what the SLO protects); the answer is the decodes plus the largest *fresh* prompt chunk
   that still fits. This alone is a valid `TokenBudget` for any scheduler.
2. `chunk_limit(shape, prefix, want)`: for each prompt chunk in FCFS order, the most of its `want`
   tokens that fit given what the batch already holds (`shape`) and the chunk's cached prefix. A
   chunk deep into a long prompt attends to its whole prefix, so it gets fewer tokens than a fresh
   one under the same SLO: chunks are sized by the model, not by a fixed chunk size.

Guarantees: the prediction for the scheduled batch is <= headroom * TBT, except that the first prompt
chunk of an iteration always gets at least `min_chunk_tokens` (so prefill never starves when decodes
alone use the SLO up) and decodes are never refused. `max_tokens` bounds every iteration (the
memory of one step's activations). KV capacity is the scheduler's business: it caps every chunk by
the free blocks after asking the budget.

Without a profile the worker uses `FixedTokenBudget(max_num_batched_tokens)`: vLLM's fixed cap, the
documented conservative default (256 tokens in configs/cluster.toml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kunserve.shared.policy.costmodel import BatchShape


class LatencyModel(Protocol):
    def shape_cost(self, s: BatchShape) -> float: ...


@dataclass
class SLOTokenBudget:
    model: LatencyModel
    tbt_s: float
    headroom: float = 1.0  # target = headroom * tbt_s (room for model error and scheduling overhead)
    max_tokens: int = 8192  # hard cap per iteration, whatever the model says
    min_chunk_tokens: int = 16  # progress floor for the iteration's first prompt chunk

    def __post_init__(self) -> None:
        if not self.tbt_s > 0:
            raise ValueError(f"tbt_s must be > 0, got {self.tbt_s}")
        if not 0 < self.headroom <= 1.0:
            raise ValueError(f"headroom must be in (0, 1], got {self.headroom}")
        if self.max_tokens <= 0 or self.min_chunk_tokens < 0:
            raise ValueError("max_tokens must be > 0 and min_chunk_tokens >= 0")

    @property
    def target_s(self) -> float:
        return self.headroom * self.tbt_s

    def predict(self, shape: BatchShape) -> float:
        return self.model.shape_cost(shape)

    def _largest(self, shape: BatchShape, prefix: int, hi: int) -> int:
        """Largest n in [0, hi] with predict(shape + (n, prefix)) <= target (monotonic in n)."""
        if hi <= 0:
            return 0
        target = self.target_s
        if self.predict(shape.with_chunk(hi, prefix)) <= target:
            return hi
        lo = 0  # invariant: lo fits (0 adds nothing), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.predict(shape.with_chunk(mid, prefix)) <= target:
                lo = mid
            else:
                hi = mid
        return lo

    def max_tokens_for(self, num_decodes: int, *, decode_context_tokens: int = 0) -> int:
        shape = BatchShape.of_decodes(num_decodes, decode_context_tokens)
        room = max(0, self.max_tokens - num_decodes)
        fresh = max(self._largest(shape, 0, room), min(self.min_chunk_tokens, room))
        return num_decodes + fresh

    def chunk_limit(self, shape: BatchShape, prefix: int, want: int, *, first: bool | None = None) -> int:
        """Tokens (<= want) of a prompt chunk with `prefix` cached tokens that may join `shape`. The iteration's
        first prompt chunk gets at least the progress floor (min_chunk_tokens), later ones only what fits.
        `first` says which it is; when the caller does not say, a shape of one-token chunks only is taken for
        decodes (a one-token *prompt* chunk looks the same, which is why the scheduler says)."""
        want = min(want, max(0, self.max_tokens - shape.tokens))
        n = self._largest(shape, prefix, want)
        if first if first is not None else shape.num_chunks == shape.tokens:
            n = max(n, min(self.min_chunk_tokens, want))
        return n
