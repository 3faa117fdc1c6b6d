"""Statistics of a benchmark run: latency percentiles, SLO attainment, throughput, TTFT over time.

KunServe §5 reports tail latencies (P50 … P99.9) of TTFT and TPOT, and SLO attainment where an SLO
scale N means "the latency may be at most N × the P50 latency of the best policy" (§5.2), so policies
are compared against one shared reference instead of their own medians. These helpers turn the
per-request measurements of the benchmark client into those numbers. Pure: no clocks, no I/O.

Conventions: latencies are seconds; latency percentiles cover the requests that completed (a failed
request has no meaningful latency), while SLO attainment counts failed requests as violations so a
policy cannot improve its attainment by dropping requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

PERCENTILES: tuple[tuple[str, float], ...] = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9))

# summarize() counts requests whose TTFT exceeds this multiple of the reference P50: they waited in a
# queue (or behind a preemption) rather than being slow to prefill.
QUEUEING_TTFT_FACTOR = 5.0
TOP_ERRORS = 5
DEFAULT_SLO_SCALES: tuple[float, ...] = tuple(float(s) for s in range(1, 11))


@dataclass
class RequestResult:
    """What the benchmark client measured for one request of the trace."""

    index: int                 # position in the trace
    arrival_s: float           # scheduled arrival (trace time)
    sent_s: float              # when the client actually sent it, seconds since the bench start
    prompt_tokens: int
    output_tokens: int         # requested
    ttft_s: float | None = None          # from send to the first token (client clock)
    token_times_s: list[float] = field(default_factory=list)  # each token's time since send
    e2e_s: float | None = None           # send to stream end (None when it failed)
    ok: bool = False
    error: str = ""
    worker_id: str = ""
    finish_reason: str = ""

    @property
    def tokens(self) -> int:
        """Tokens actually received (may be fewer than requested: EOS, failure)."""
        return len(self.token_times_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (len(self.token_times_s) - 1)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the fields plus the derived ``tokens`` and ``tpot_s`` (for readers of the file)."""
        d = asdict(self)
        d["token_times_s"] = list(self.token_times_s)
        d["tokens"] = self.tokens
        d["tpot_s"] = self.tpot_s
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestResult:
        """Inverse of :meth:`to_dict`. Keys that are not fields (the derived ones, or fields of a newer
        version) are ignored, so older code can still read newer result files."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if "token_times_s" in kwargs:
            kwargs["token_times_s"] = [float(x) for x in kwargs["token_times_s"]]
        return cls(**kwargs)


def _present(values: Iterable[float | None]) -> np.ndarray:
    # None (no measurement) and NaN are not latencies; callers count them as failures where it matters.
    return np.asarray([float(v) for v in values if v is not None and not math.isnan(v)], dtype=np.float64)


def percentiles(values: Iterable[float | None]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99``, ``p999``, ``max`` and ``n`` of ``values``.

    Linear interpolation between order statistics (numpy's ``"linear"`` method), so values 1..100 give
    p50 = 50.5 and p99 = 99.01. None / NaN entries are dropped (``n`` counts what remained); with no
    values every statistic is None and ``n`` is 0.
    """
    x = _present(values)
    out: dict[str, float | None] = {"mean": None}
    out.update({name: None for name, _ in PERCENTILES})
    out["max"] = None
    out["n"] = int(x.size)
    if x.size == 0:
        return out
    out["mean"] = float(x.mean())
    qs = np.percentile(x, [q for _, q in PERCENTILES], method="linear")
    for (name, _), v in zip(PERCENTILES, qs):
        out[name] = float(v)
    out["max"] = float(x.max())
    return out


def _scale_key(scale: float) -> str:
    s = float(scale)
    return str(int(s)) if s.is_integer() else repr(s)


def slo_attainment(
    values: Sequence[float | None],
    reference_p50: float,
    scales: Sequence[float] = DEFAULT_SLO_SCALES,
    total: int | None = None,
) -> dict[str, float]:
    """Fraction of requests within each SLO: value ``<= N × reference_p50`` for every scale N (§5.2).

    Keys are the scales as text (``"1"``, ``"2"``, ``"1.5"``). Missing values (None) count as
    violations, and so do requests absent from ``values`` when ``total`` (the denominator; default
    ``len(values)``) is larger, so failed requests lower the attainment. With a zero denominator every
    attainment is 0.0: nothing was served.
    """
    if not (math.isfinite(reference_p50) and reference_p50 > 0):
        raise ValueError(f"reference_p50 must be finite and > 0, got {reference_p50}")
    x = _present(values)
    denominator = len(values) if total is None else total
    if denominator < x.size:
        raise ValueError(f"total ({denominator}) is smaller than the number of values ({x.size})")
    out: dict[str, float] = {}
    for scale in scales:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"SLO scales must be finite and > 0, got {scale}")
        within = int(np.count_nonzero(x <= scale * reference_p50))
        out[_scale_key(scale)] = within / denominator if denominator else 0.0
    return out


def best_p50(per_policy: Mapping[str, Sequence[float | None]]) -> float | None:
    """The lowest P50 among the policies that have data: the shared SLO reference of §5.2."""
    p50s = [p for p in (percentiles(v)["p50"] for v in per_policy.values()) if p is not None]
    return min(p50s) if p50s else None


def _usable_reference(ref: float | None) -> float | None:
    return ref if ref is not None and math.isfinite(ref) and ref > 0 else None


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    reference_ttft_p50: float | None = None,
    reference_tpot_p50: float | None = None,
) -> dict[str, Any]:
    """The report of one run.

    Keys: ``requests``, ``completed``, ``failed``, ``errors`` (the ``TOP_ERRORS`` most common messages
    → count), ``duration_s``, ``throughput`` (``requests_per_s`` and ``output_tokens_per_s``: completed
    requests and their received tokens over ``duration_s``), ``ttft`` / ``tpot`` / ``e2e`` (
    :func:`percentiles` in seconds, over completed requests), ``slo`` (``{"ttft": …, "tpot": …}``
    attainment dicts), ``slo_reference`` (the P50s used: the given references, or this run's own P50
    when None) and ``ttft_over_5x_p50`` (completed requests whose TTFT exceeds 5 × the TTFT reference:
    the ones that queued).

    SLO denominators: TTFT over all requests (failures are violations); TPOT over all requests except
    completed ones with fewer than 2 tokens, which have no TPOT to judge. An SLO dict is empty when no
    usable (positive) reference exists, and ``ttft_over_5x_p50`` is None then.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be finite and > 0, got {duration_s}")
    done = [r for r in results if r.ok]
    failed = len(results) - len(done)
    errors = Counter((r.error or "(no message)") for r in results if not r.ok)

    ttfts = [r.ttft_s for r in done]
    tpots = [r.tpot_s for r in done]
    ttft = percentiles(ttfts)
    tpot = percentiles(tpots)
    e2e = percentiles(r.e2e_s for r in done)

    ttft_ref = _usable_reference(reference_ttft_p50 if reference_ttft_p50 is not None else ttft["p50"])
    tpot_ref = _usable_reference(reference_tpot_p50 if reference_tpot_p50 is not None else tpot["p50"])
    ttft_slo = slo_attainment(ttfts, ttft_ref, total=len(results)) if ttft_ref is not None else {}
    tpot_total = len(results) - sum(1 for r in done if r.tpot_s is None)
    tpot_slo = (slo_attainment([v for v in tpots if v is not None], tpot_ref, total=tpot_total)
                if tpot_ref is not None else {})
    queued = (sum(1 for v in ttfts if v is not None and v > QUEUEING_TTFT_FACTOR * ttft_ref)
              if ttft_ref is not None else None)

    return {
        "requests": len(results),
        "completed": len(done),
        "failed": failed,
        "errors": dict(errors.most_common(TOP_ERRORS)),
        "duration_s": duration_s,
        "throughput": {
            "requests_per_s": len(done) / duration_s,
            "output_tokens_per_s": sum(r.tokens for r in done) / duration_s,
        },
        "ttft": ttft,
        "tpot": tpot,
        "e2e": e2e,
        "slo": {"ttft": ttft_slo, "tpot": tpot_slo},
        "slo_reference": {"ttft_p50_s": ttft_ref, "tpot_p50_s": tpot_ref},
        "ttft_over_5x_p50": queued,
    }


def timeline(results: Sequence[RequestResult], bin_s: float = 1.0) -> list[dict[str, Any]]:
    """Per ``bin_s`` bin of send time: how many requests were sent and their TTFT P50 / P99.

    For the TTFT-over-time plot that shows a burst's queueing and how fast a policy recovers. Bins are
    contiguous from 0 (or the earliest send, if earlier) to the last send, empty ones included so the
    plot's x axis is time. Keys: ``t_s`` (bin start), ``requests``, ``completed``, ``failed``,
    ``ttft_p50_s`` and ``ttft_p99_s`` (over completed requests; None when the bin has none).
    """
    if not (math.isfinite(bin_s) and bin_s > 0):
        raise ValueError(f"bin_s must be finite and > 0, got {bin_s}")
    if not results:
        return []
    idx = [math.floor(r.sent_s / bin_s) for r in results]
    first = min(0, min(idx))
    bins: list[list[RequestResult]] = [[] for _ in range(max(idx) - first + 1)]
    for i, r in zip(idx, results):
        bins[i - first].append(r)
    out: list[dict[str, Any]] = []
    for k, members in enumerate(bins):
        done = [r for r in members if r.ok]
        stats = percentiles(r.ttft_s for r in done)
        out.append({
            "t_s": (k + first) * bin_s,
            "requests": len(members),
            "completed": len(done),
            "failed": len(members) - len(done),
            "ttft_p50_s": stats["p50"],
            "ttft_p99_s": stats["p99"],
        })
    return out
