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

With no online request present (ConServe's offline-optimised mode) the scheduler asks `for_throughput`
instead: a `ThroughputTokenBudget` over the same model that sizes every chunk for the most tokens per
predicted second rather than under the TBT SLO.

Without a profile the worker uses `FixedTokenBudget(max_num_batched_tokens)`: vLLM's fixed cap, the
documented conservative default (256 tokens in configs/cluster.toml).
"""

from __future__ import annotations

import math
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

    def for_throughput(self, max_tokens: int) -> ThroughputTokenBudget:
        """The budget of an iteration with no online request: no TBT SLO binds, the model picks the batch with
        the most tokens per second, at most max_tokens (and this budget's max_tokens) per iteration."""
        return ThroughputTokenBudget(self.model, min(max_tokens, self.max_tokens), self.min_chunk_tokens)


@dataclass(frozen=True)
class ThroughputTokenBudget:
    """Offline-optimised mode (ConServe §4.2): each prompt chunk takes the token count that maximises the
    batch's tokens per predicted second, the largest one on ties, up to `max_tokens` per iteration.

    Why neither "as many as fit" nor a fixed chunk: under ConServe's model an iteration pays a constant k5
    that more tokens amortise, but the attention term grows with the square of a chunk, so past some size a
    chunk costs more per token than it saves; a second chunk of another request (attention never crosses
    sequences) then raises throughput more than growing the first one. Added chunk by chunk, the batch's rate
    never drops. With a linear model (k2 = 0) every chunk takes all it may: the cap. The first prompt chunk
    keeps the progress floor, decodes are never refused (as in SLOTokenBudget)."""

    model: LatencyModel
    max_tokens: int
    min_chunk_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.min_chunk_tokens < 0:
            raise ValueError("max_tokens must be > 0 and min_chunk_tokens >= 0")

    def rate(self, shape: BatchShape) -> float:
        """Predicted tokens per second of a batch (0 for an empty one)."""
        if shape.tokens <= 0:
            return 0.0
        cost = self.model.shape_cost(shape)
        return shape.tokens / cost if cost > 0 else math.inf

    def _best(self, shape: BatchShape, prefix: int, hi: int) -> int:
        """The largest n in [0, hi] maximising rate(shape + (n, prefix)). For n >= 1 the rate is (T + n) / cost(n)
        with the cost convex in n, hence unimodal: binary search for the first step that lowers it. The first token
        also pays for reading the chunk's cached prefix, so n = 0 (no chunk) is compared on its own."""
        if hi <= 0:
            return 0

        def rate(n: int) -> float:
            return self.rate(shape.with_chunk(n, prefix))

        lo, top = 1, hi  # the peak is in [lo, top]: every step below lo rises (up to rounding)
        while lo < top:
            mid = (lo + top) // 2
            if rate(mid + 1) >= rate(mid) * (1 - 1e-12):
                lo = mid + 1
            else:
                top = mid
        return lo if rate(lo) >= rate(0) else 0

    def max_tokens_for(self, num_decodes: int, *, decode_context_tokens: int = 0) -> int:
        return max(num_decodes, self.max_tokens)

    def chunk_limit(self, shape: BatchShape, prefix: int, want: int, *, first: bool | None = None) -> int:
        """Tokens (<= want) of a prompt chunk with `prefix` cached tokens that may join `shape`: the count that
        maximises the batch's predicted tokens per second; the iteration's first prompt chunk at least the
        progress floor. `first` as in SLOTokenBudget.chunk_limit."""
        want = min(want, max(0, self.max_tokens - shape.tokens))
        n = self._best(shape, prefix, want)
        if first if first is not None else shape.num_chunks == shape.tokens:
            n = max(n, min(self.min_chunk_tokens, want))
        return n
