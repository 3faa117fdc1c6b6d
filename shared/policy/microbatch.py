"""Microbatch formulation for pipeline groups: KunServe's lookahead formulation (§4.3, Fig. 10-11)
and the token-count chunking it replaces (Sarathi-Serve style). Pure functions, no torch.

Input: work items `(request_id, tokens to run, prefix)` in queue order (prefix = tokens of that
request already in the KV cache). Output: microbatches, each a list of `MicroChunk`s; every queued
token appears in exactly one chunk, a request's chunks appear in order (its earlier tokens in an
earlier microbatch, never two chunks of one request in one microbatch), and each microbatch is a
contiguous piece of the queue in token order. Executing microbatches in order is therefore valid on
a pipeline: every stage runs them in order, so a chunk's prefix KV exists in every stage's layers
before the chunk reaches them.

**Lookahead** (`lookahead_microbatches`): the whole queue is one batch, split recursively into
cost-balanced halves (Fig. 11) under the KunServe cost model (Eq. 1-3). A split point may fall
inside a request: the request is chunked there (the later chunk's prefix grows by the earlier
chunk's tokens, so it costs more per token: the model accounts for that). The recursion stops at
K = `num_microbatches` parts, by default total tokens // MIN: Fig. 11's "don't chunk batches of
<= MIN tokens", applied to the average part (a per-part token test would stop some branches early
and leave them with several parts' worth of cost, since balanced parts hold different token
counts). Fig. 11 halves the cost; to reach any K the split puts k0 = K // 2 parts' worth of cost on
the left (the paper's 0.5 when K is a power of two) so that every final part gets the same share.

**Token count** (`token_microbatches`): fill each microbatch with `budget` tokens in queue order,
chunking the request at the boundary: equal token counts, unequal costs.

`MicrobatchFormer` is what a live pipeline group's head uses (`Engine._step_pipelined`): lookahead when
its queue is long (more prompt tokens than one microbatch's budget: how the queue is cut then decides how
evenly the stages are loaded) and a fitted cost model is there, token-count chunking otherwise.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class ChunkCostModel(Protocol):
    """What the splitter needs: KunServeCostModel satisfies it."""

    def chunk_cost(self, c: int, p: int) -> float: ...

    def batch_discount(self, num_chunks: int) -> float: ...


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    tokens: int  # tokens to run (> 0)
    prefix: int = 0  # tokens of this request already cached

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.prefix < 0:
            raise ValueError(f"work item {self.request_id!r}: tokens must be > 0 and prefix >= 0, "
                             f"got {self.tokens}, {self.prefix}")


@dataclass(frozen=True)
class MicroChunk:
    request_id: str
    start: int  # position of its first token = its prefix length
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


Microbatch = list[MicroChunk]


def microbatch_cost(mb: Sequence[MicroChunk], model: ChunkCostModel) -> float:
    """Eq. 3: sum of the chunk costs minus the shared parameter loading."""
    if not mb:
        return 0.0
    return sum(model.chunk_cost(c.num_tokens, c.start) for c in mb) - model.batch_discount(len(mb))


def _tokens(mb: Sequence[MicroChunk]) -> int:
    return sum(c.num_tokens for c in mb)


class _Splitter:
    """Cost of any prefix / suffix of one batch (cut at a flat token offset) in O(log n)."""

    def __init__(self, mb: Sequence[MicroChunk], model: ChunkCostModel) -> None:
        self.mb = list(mb)
        self.model = model
        self.starts = [0]  # flat token offset where each chunk begins
        self.pre = [0.0]  # sum of whole-chunk costs before chunk i
        for c in self.mb:
            self.starts.append(self.starts[-1] + c.num_tokens)
            self.pre.append(self.pre[-1] + model.chunk_cost(c.num_tokens, c.start))
        self.total_tokens = self.starts[-1]

    def parts(self, s: int) -> tuple[float, float]:
        """(cost of the first s tokens, cost of the rest)."""
        m = self.model
        i = bisect.bisect_right(self.starts, s) - 1  # chunk containing token s (or the end)
        if i >= len(self.mb):
            left_cost, n_left = self.pre[-1], len(self.mb)
            return left_cost - m.batch_discount(n_left), 0.0
        c = self.mb[i]
        k = s - self.starts[i]  # tokens of chunk i on the left
        left = self.pre[i] + (m.chunk_cost(k, c.start) if k else 0.0)
        n_left = i + (1 if k else 0)
        right = (self.pre[-1] - self.pre[i + 1]) + m.chunk_cost(c.num_tokens - k, c.start + k)
        n_right = len(self.mb) - i
        return left - m.batch_discount(n_left), right - m.batch_discount(n_right)

    def cut(self, s: int) -> tuple[Microbatch, Microbatch]:
        i = bisect.bisect_right(self.starts, s) - 1
        if i >= len(self.mb):
            return list(self.mb), []
        c = self.mb[i]
        k = s - self.starts[i]
        left = self.mb[:i] + ([MicroChunk(c.request_id, c.start, k)] if k else [])
        right = [MicroChunk(c.request_id, c.start + k, c.num_tokens - k)] + self.mb[i + 1:]
        return left, right


def split_batch(mb: Sequence[MicroChunk], model: ChunkCostModel, k_left: int, k_right: int,
                min_left: int = 1, min_right: int = 1) -> tuple[Microbatch, Microbatch]:
    """Cut mb at the token offset s where cost(left)/k_left best matches cost(right)/k_right
    (k_left = k_right: Fig. 11's 0.5 * cost split). s keeps >= min_left / min_right tokens per side.
    cost(left) never decreases and cost(right) never increases with s (non-negative coefficients), so
    the balance point is found by bisection."""
    sp = _Splitter(mb, model)
    T = sp.total_tokens
    lo_s, hi_s = max(1, min_left), min(T - 1, T - min_right)
    if lo_s > hi_s:
        lo_s = hi_s = max(1, min(T - 1, T // 2))

    def f(s: int) -> float:
        left, right = sp.parts(s)
        return left * k_right - right * k_left

    lo, hi = lo_s, hi_s
    if f(hi) < 0:
        best = hi
    elif f(lo) >= 0:
        best = lo
    else:  # f(lo) < 0 <= f(hi): smallest s with f(s) >= 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if f(mid) >= 0:
                hi = mid
            else:
                lo = mid
        best = lo if abs(f(lo)) <= abs(f(hi)) else hi
    return sp.cut(best)


def _as_batch(items: Iterable[WorkItem]) -> Microbatch:
    out = []
    seen: set[str] = set()
    for it in items:
        if it.request_id in seen:
            raise ValueError(f"request {it.request_id!r} appears twice in the queue")
        seen.add(it.request_id)
        out.append(MicroChunk(it.request_id, it.prefix, it.tokens))
    return out


def lookahead_microbatches(items: Sequence[WorkItem], model: ChunkCostModel, *, min_tokens: int,
                           num_microbatches: int | None = None) -> list[Microbatch]:
    """KunServe Fig. 11 over the whole queue. min_tokens = MIN (no part is split below it)."""
    if min_tokens <= 0:
        raise ValueError(f"min_tokens must be > 0, got {min_tokens}")
    batch = _as_batch(items)
    total = _tokens(batch)
    if total == 0:
        return []
    k = num_microbatches if num_microbatches is not None else total // min_tokens
    k = max(1, min(k, total))

    def balance(mb: Microbatch, parts: int) -> list[Microbatch]:
        tokens = _tokens(mb)
        if parts <= 1 or tokens < 2:
            return [mb]
        parts = min(parts, tokens)
        k0 = parts // 2
        k1 = parts - k0
        left, right = split_batch(mb, model, k0, k1, min_left=k0, min_right=k1)
        return balance(left, k0) + balance(right, k1)

    return [mb for mb in balance(batch, k) if mb]


def token_microbatches(items: Sequence[WorkItem], budget: int) -> list[Microbatch]:
    """Token-count chunking: every microbatch holds `budget` tokens (the last one what is left)."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    out: list[Microbatch] = []
    cur: Microbatch = []
    room = budget
    for c in _as_batch(items):
        start, left = c.start, c.num_tokens
        while left > 0:
            n = min(left, room)
            cur.append(MicroChunk(c.request_id, start, n))
            start += n
            left -= n
            room -= n
            if room == 0:
                out.append(cur)
                cur, room = [], budget
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True)
class MicrobatchFormer:
    """How a pipeline group's head cuts its queue of prompt work into microbatches of about `budget` tokens.

    model: the fitted cost model of one stage (KunServe Eq. 1-3, from the worker's cost-model profile); None
    when no profile matches the worker: token chunking only. lookahead: False = token chunking always (the
    "kunserve-no-lookahead" ablation).

    A queue is long when it holds more than `budget` tokens: then lookahead cuts it into
    ceil(tokens / budget) cost-balanced microbatches (on average `budget` tokens, so a lookahead microbatch
    is no larger than a chunked one on average, but each costs the same on every stage, where equal token
    counts cost more the deeper they sit in a long prompt). A shorter queue fits one microbatch: nothing to
    balance."""

    model: ChunkCostModel | None
    lookahead: bool = True

    def uses_lookahead(self, items: Sequence[WorkItem], budget: int) -> bool:
        return self.lookahead and self.model is not None and sum(it.tokens for it in items) > budget

    def form(self, items: Sequence[WorkItem], budget: int) -> list[Microbatch]:
        if self.uses_lookahead(items, budget):
            assert self.model is not None
            total = sum(it.tokens for it in items)
            return lookahead_microbatches(items, self.model, min_tokens=budget, num_microbatches=-(-total // budget))
        return token_microbatches(items, budget)


@dataclass
class DecodeSplit:
    """Whether a pipeline group's head spreads its decodes over the microbatches in flight ("split": every stage
    has a microbatch to run during pure decode) or ships them in one ("whole": the stages take turns).

    Which one decodes faster depends on the hardware, so "auto" measures it. With a device per stage, splitting
    overlaps the stages and a request's token takes about one whole instance's step. When the stages share
    cores (two workers on a 2-core CPU) they cannot overlap; splitting then only adds each microbatch's fixed
    cost (a small decode batch costs nearly as much as one twice its size): measured on a 2-core CPU, 16 decodes
    per group decoded ~1.4x slower split, 48 decodes ~1.2x faster.

    "auto" alternates the two for one window each (`window_s` of decoding with at least two requests), keeps
    the one whose decode rate per decoding request (1 / TPOT) was higher for `hold_windows` windows, then
    measures again: the load and the batch size change. "on" / "off" always split / never split."""

    mode: str = "auto"
    window_s: float = 0.25
    hold_windows: int = 12
    split: bool = True
    _phase: int = 0  # 0: measuring split, 1: measuring whole, 2..: holding the winner
    _start: float | None = None
    _last: float = 0.0
    _tokens: int = 0
    _request_seconds: float = 0.0  # integral of the number of decoding requests over the window
    _rate: dict[bool, float] | None = None

    MODES = ("auto", "on", "off")

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"decode split mode must be one of {', '.join(self.MODES)}, got {self.mode!r}")
        if self.mode != "auto":
            self.split = self.mode == "on"

    def observe(self, now: float, decode_tokens: int, decoding: int) -> None:
        """After the head sampled: `decode_tokens` tokens of requests already decoding, `decoding` requests
        decoding now. Windows with fewer than two decoding requests (nothing to split) and pauses longer
        than a window (idle, a transition) restart the measurement of the current arm."""
        if self.mode != "auto":
            return
        if decoding < 2 or self._start is None or now - self._last > self.window_s:
            self._start, self._last, self._tokens, self._request_seconds = now, now, 0, 0.0
            return
        self._request_seconds += decoding * (now - self._last)
        self._tokens += decode_tokens
        self._last = now
        if now - self._start < self.window_s:
            return
        rate = self._tokens / self._request_seconds if self._request_seconds > 0 else 0.0
        self._start, self._tokens, self._request_seconds = now, 0, 0.0
        if self._phase == 0:
            self._rate = {True: rate}
            self._phase, self.split = 1, False
        elif self._phase == 1:
            assert self._rate is not None
            self._rate[False] = rate
            self._phase, self.split = 2, self._rate[True] >= rate
        elif self._phase - 1 >= self.hold_windows:
            self._phase, self.split = 0, True
        else:
            self._phase += 1
