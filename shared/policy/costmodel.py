"""Execution-time models of one batch on one stage, and their least-squares fit (no torch, no I/O).

A batch is a list of chunks `(c, p)`: c new tokens of one sequence whose first p tokens already have
KV (a decode is `(1, context - 1)`, a fresh prefill `(prompt, 0)`, a later prefill chunk `(c, prefix)`).

Two published models:

* **KunServe** (§4.3, Eq. 1-3), the microbatch cost the lookahead formulation balances::

      cost(c, p) = alpha * (p*c + (c^2 + c)/2) + beta * c + gamma        (Eq. 1: prefix-attn, self-attn, FFN, other)
      cost(b)    = sum of cost(c, p) over b's chunks - (|b| - 1) * lambda   (Eq. 3: parameters loaded once per batch)

  (Eq. 3 in the paper's text prints gamma in the formula and names lambda in the prose; lambda is the
  separately fitted parameter here.) Fitted on the features [attn, tokens, |b|, 1] with coefficients
  [alpha, beta, gamma - lambda, lambda].

* **ConServe** (§4.2), the iteration latency the SLO-aware token budget bounds::

      latency(P, C) = k1*P + k2*P*(P + C) + k3*P + k4*(P + C) + k5

  P = tokens computed this iteration, C = context tokens already in the KV cache. For a batch of
  several sequences P and C are the sums, and the attention term is summed per sequence,
  `sum_i c_i*(c_i + p_i)`, because attention never crosses sequences (for one sequence it is exactly
  the paper's P*(P + C); for B decodes it is sum(context), which `k4*(P+C)` alone would otherwise
  have to absorb). k3 (tensor-parallel communication) multiplies the same feature as k1, so on one
  device it is not identifiable: it is fixed at 0 and k1 absorbs it.

Both fits are non-negative least squares on *relative* residuals (each row divided by its measured
time), so they minimize the relative error both papers report, and every coefficient is >= 0, which
makes every prediction monotonic (non-decreasing) in the chunk tokens and the prefix length.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Chunk = tuple[int, int]  # (tokens to compute c, prefix tokens already cached p)


@dataclass
class BatchShape:
    """Running aggregates of a batch under construction, enough for both models in O(1) per chunk."""

    num_chunks: int = 0
    tokens: int = 0  # P = sum c
    context: int = 0  # C = sum p
    attn_pairs: int = 0  # sum c*(c + p)      (ConServe attention term)
    attn_kun: float = 0.0  # sum p*c + (c^2+c)/2 (KunServe prefix-attn + self-attn)

    def add(self, c: int, p: int) -> None:
        self.num_chunks += 1
        self.tokens += c
        self.context += p
        self.attn_pairs += c * (c + p)
        self.attn_kun += p * c + (c * c + c) / 2

    def with_chunk(self, c: int, p: int) -> BatchShape:
        out = BatchShape(self.num_chunks, self.tokens, self.context, self.attn_pairs, self.attn_kun)
        if c > 0:
            out.add(c, p)
        return out

    @classmethod
    def of(cls, chunks: Iterable[Chunk]) -> BatchShape:
        s = cls()
        for c, p in chunks:
            if c > 0:
                s.add(c, p)
        return s

    @classmethod
    def of_decodes(cls, num_decodes: int, decode_context_tokens: int) -> BatchShape:
        """num_decodes one-token chunks whose contexts (including the token itself) sum to
        decode_context_tokens: the shape a scheduler knows before adding prompt chunks."""
        s = cls()
        if num_decodes <= 0:
            return s
        ctx = max(decode_context_tokens, num_decodes)
        s.num_chunks = num_decodes
        s.tokens = num_decodes
        s.context = ctx - num_decodes
        s.attn_pairs = ctx  # sum 1*(1 + p_i)
        s.attn_kun = float(ctx)  # sum p_i + 1
        return s


# -- the two models ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KunServeCostModel:
    """KunServe Eq. 1-3 (seconds). `chunk_cost` and `batch_discount` are what the lookahead splitter
    needs to evaluate split points in O(1)."""

    alpha: float
    beta: float
    gamma: float
    lam: float = 0.0

    NAMES = ("alpha", "beta", "gamma", "lambda")

    def chunk_cost(self, c: int, p: int) -> float:
        if c <= 0:
            return 0.0
        return self.alpha * (p * c + (c * c + c) / 2) + self.beta * c + self.gamma

    def batch_discount(self, num_chunks: int) -> float:
        return self.lam * max(0, num_chunks - 1)

    def batch_cost(self, chunks: Iterable[Chunk]) -> float:
        return self.shape_cost(BatchShape.of(chunks))

    def shape_cost(self, s: BatchShape) -> float:
        if s.num_chunks == 0:
            return 0.0
        return (self.alpha * s.attn_kun + self.beta * s.tokens + self.gamma * s.num_chunks
                - self.batch_discount(s.num_chunks))

    @staticmethod
    def features(s: BatchShape) -> list[float]:
        return [s.attn_kun, float(s.tokens), float(s.num_chunks), 1.0]

    @classmethod
    def from_coefficients(cls, coef: Sequence[float]) -> KunServeCostModel:
        a, b, u, lam = coef  # u = gamma - lambda
        return cls(alpha=a, beta=b, gamma=u + lam, lam=lam)

    def to_dict(self) -> dict[str, float]:
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma, "lambda": self.lam}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KunServeCostModel:
        return cls(float(d["alpha"]), float(d["beta"]), float(d["gamma"]), float(d.get("lambda", 0.0)))


@dataclass(frozen=True)
class ConServeLatencyModel:
    """ConServe's latency(P, C) (seconds), generalized to batches as described in the module doc."""

    k1: float
    k2: float
    k3: float = 0.0
    k4: float = 0.0
    k5: float = 0.0

    def latency(self, P: int, C: int) -> float:
        """The paper's formula for one chunk of P tokens over C cached tokens."""
        if P <= 0:
            return 0.0
        return self.k1 * P + self.k2 * P * (P + C) + self.k3 * P + self.k4 * (P + C) + self.k5

    def batch_latency(self, chunks: Iterable[Chunk]) -> float:
        return self.shape_cost(BatchShape.of(chunks))

    def shape_cost(self, s: BatchShape) -> float:
        if s.num_chunks == 0:
            return 0.0
        return ((self.k1 + self.k3) * s.tokens + self.k2 * s.attn_pairs + self.k4 * (s.tokens + s.context)
                + self.k5)

    @staticmethod
    def features(s: BatchShape) -> list[float]:
        return [float(s.tokens), float(s.attn_pairs), float(s.tokens + s.context), 1.0]

    @classmethod
    def from_coefficients(cls, coef: Sequence[float]) -> ConServeLatencyModel:
        k1, k2, k4, k5 = coef
        return cls(k1=k1, k2=k2, k3=0.0, k4=k4, k5=k5)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConServeLatencyModel:
        return cls(*(float(d.get(k, 0.0)) for k in ("k1", "k2", "k3", "k4", "k5")))


# -- what an iteration costs beyond its forward pass -----------------------------------------------------------
@dataclass(frozen=True)
class LoopOverhead:
    """Seconds an engine iteration spends outside the forward pass both models price: the scheduler's batch,
    sampling, token bookkeeping and the stats snapshot, as `iteration_s` per iteration plus `per_sequence_s` per
    chunk in the batch. Fitted from timed `Engine.step` calls against the ConServe prediction for the same batches
    (`fit_loop_overhead`); `points` is how many iterations the fit saw (0: not measured)."""

    iteration_s: float = 0.0
    per_sequence_s: float = 0.0
    points: int = 0
    mean_abs_err_s: float = 0.0  # of the fit over the measured iterations

    def cost(self, num_chunks: int) -> float:
        return self.iteration_s + self.per_sequence_s * num_chunks if num_chunks > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopOverhead:
        out = cls(float(d.get("iteration_s", 0.0)), float(d.get("per_sequence_s", 0.0)), int(d.get("points", 0)),
                  float(d.get("mean_abs_err_s", 0.0)))
        if not all(math.isfinite(v) and v >= 0 for v in (out.iteration_s, out.per_sequence_s)):
            raise ValueError(f"loop overhead must be finite and >= 0, got {d}")
        return out


def fit_loop_overhead(steps: Sequence[tuple[BatchShape, float]], model: ConServeLatencyModel) -> LoopOverhead:
    """Least squares, non-negative, of measured - model.shape_cost(shape) over [1, chunks] (absolute residuals: an
    overhead is a few hundred microseconds on steps from 3 to 50 ms, and relative weighting would let the short
    steps alone decide it). Empty input: no overhead."""
    rows, target = [], []
    for shape, seconds in steps:
        if shape.num_chunks > 0:
            rows.append([1.0, float(shape.num_chunks)])
            target.append(seconds - model.shape_cost(shape))
    if not rows:
        return LoopOverhead()
    it, per = nnls(rows, target)
    err = sum(abs(it + per * r[1] - y) for r, y in zip(rows, target, strict=True)) / len(rows)
    return LoopOverhead(it, per, len(rows), err)


# -- samples and fitting -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One measured batch: its phase label (prefill / chunked_prefill / decode / mixed), chunks, seconds."""

    phase: str
    chunks: tuple[Chunk, ...]
    seconds: float

    @property
    def shape(self) -> BatchShape:
        return BatchShape.of(self.chunks)

    def to_json(self) -> list[Any]:
        return [self.phase, [list(c) for c in self.chunks], self.seconds]

    @classmethod
    def from_json(cls, v: list[Any]) -> Sample:
        phase, chunks, seconds = v
        return cls(str(phase), tuple((int(c), int(p)) for c, p in chunks), float(seconds))


def nnls(rows: Sequence[Sequence[float]], target: Sequence[float]) -> list[float]:
    """Non-negative least squares, exact for the few columns used here: the optimum is the
    unconstrained least-squares solution on its support, so try every support (2^k solves, k <= 5)
    and keep the best feasible one. Columns are scaled to unit norm first (features span 1 .. 1e7)."""
    import numpy as np

    A = np.asarray(rows, dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    if A.ndim != 2 or A.shape[0] != y.shape[0] or A.shape[0] == 0:
        raise ValueError("nnls: need a non-empty 2-D feature matrix with one target per row")
    k = A.shape[1]
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    An = A / norms
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            x, *_ = np.linalg.lstsq(An[:, cols], y, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((An[:, cols] @ x - y) ** 2))
            if res < best_res - 1e-15 * max(1.0, best_res):
                best_res = res
                best = np.zeros(k)
                best[cols] = x
    return [float(x) for x in best / norms]


def _fit_relative(feature_fn: Callable[[BatchShape], list[float]], samples: Sequence[Sample]) -> list[float]:
    rows, target = [], []
    for s in samples:
        if s.seconds <= 0:
            raise ValueError(f"sample with non-positive time {s.seconds}")
        f = feature_fn(s.shape)
        rows.append([v / s.seconds for v in f])
        target.append(1.0)
    return nnls(rows, target)


def fit_kunserve(samples: Sequence[Sample]) -> KunServeCostModel:
    return KunServeCostModel.from_coefficients(_fit_relative(KunServeCostModel.features, samples))


def fit_conserve(samples: Sequence[Sample]) -> ConServeLatencyModel:
    return ConServeLatencyModel.from_coefficients(_fit_relative(ConServeLatencyModel.features, samples))


@dataclass
class ErrorStats:
    mean_rel_err: float
    max_rel_err: float
    points: int
    per_phase: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def relative_errors(model: KunServeCostModel | ConServeLatencyModel, samples: Sequence[Sample]) -> ErrorStats:
    """|predicted - measured| / measured over samples, overall and per phase."""
    errs: dict[str, list[float]] = {}
    allv: list[float] = []
    for s in samples:
        e = abs(model.shape_cost(s.shape) - s.seconds) / s.seconds
        errs.setdefault(s.phase, []).append(e)
        allv.append(e)
    if not allv:
        return ErrorStats(math.nan, math.nan, 0)
    per = {ph: {"mean_rel_err": sum(v) / len(v), "max_rel_err": max(v), "points": len(v)} for ph, v in errs.items()}
    return ErrorStats(sum(allv) / len(allv), max(allv), len(allv), per)


def split_holdout(samples: Sequence[Sample], every: int = 4, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """Deterministic train / held-out split: within each phase, every `every`-th point (after a
    seeded shuffle) is held out, so every phase is represented on both sides."""
    import random

    rng = random.Random(seed)
    by_phase: dict[str, list[Sample]] = {}
    for s in samples:
        by_phase.setdefault(s.phase, []).append(s)
    train: list[Sample] = []
    held: list[Sample] = []
    for phase in sorted(by_phase):
        group = list(by_phase[phase])
        rng.shuffle(group)
        for i, s in enumerate(group):
            (held if i % every == every - 1 else train).append(s)
    return train, held
