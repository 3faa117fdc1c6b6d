"""Size a bursty trace to the machine it runs on, and tell afterwards whether it overloaded anything.

A fixed trace overloads a slow CPU and not a fast one: how much KV memory a burst needs depends on how long
each request stays in flight, which is the machine's prefill and decode speed. So `bench compare` measures
those speeds (a probe, or a cost-model profile), reads the cluster's undropped KV capacity, and picks each
burst's factor so that the trace's *peak KV demand* over that burst is a chosen multiple of that capacity
(KunServe's regime: beyond what the instances hold, within what a drop frees).

Peak KV demand (:func:`peak_kv_demand`) is the largest, over time, of the sum over the requests in flight of
their prompt plus the tokens generated so far, where a request is in flight from its arrival until it would
finish at the measured speeds with nothing queued: prefill at ``prefill_tokens_per_s``, then one token per
``tpot_s``. It is a plan, not a simulation: requests that queue stay in flight longer, so a real overload is
at least as deep as planned.

Afterwards :func:`observed_overload` reads the replay's KV samples (what the instances held plus the prompts
waiting at them, over the undropped capacity) and :func:`verdict` says whether the comparison overloaded at
all, so a benchmark that never filled memory is reported as such instead of as latency ratios. Pure: no
clocks, no I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kunserve.benchkit.trace import TraceRequest
from kunserve.shared.policy.costmodel import BatchShape, KunServeCostModel

DEFAULT_OVERLOAD = 1.5
# Outside the burst the load stays under half the undropped capacity: the monitor's restore threshold
# (monitor.restore_threshold) is the same half, so a cluster that dropped during the burst can restore after it.
BASE_LOAD_MAX = 0.5
BURST_FACTOR_MAX = 1000.0
RATE_SCALE_MIN = 1e-3
SEARCH_STEPS = 30
# A run whose KV usage (used / total blocks of the serving units) reached this much was memory-bound.
NEAR_FULL_USAGE = 0.9


class CalibrationError(ValueError):
    """The trace cannot be sized to the asked overload (the message says which knob to turn)."""


@dataclass(frozen=True)
class Speeds:
    """How fast one instance serves one request of the trace: what decides how long its KV is held."""

    prefill_tokens_per_s: float   # one prompt alone on an instance
    tpot_s: float                 # seconds per output token with the instance holding `concurrency` requests
    concurrency: int              # requests per instance the decode speed was measured (or predicted) at
    source: str                   # "probe" or "profile <key>"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prefill_tokens_per_s) and self.prefill_tokens_per_s > 0):
            raise ValueError(f"prefill_tokens_per_s must be finite and > 0, got {self.prefill_tokens_per_s}")
        if not (math.isfinite(self.tpot_s) and self.tpot_s > 0):
            raise ValueError(f"tpot_s must be finite and > 0, got {self.tpot_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def speeds_from_cost_model(model: KunServeCostModel, *, prompt_tokens: int, concurrency: int, context_tokens: int,
                           source: str) -> Speeds:
    """Speeds predicted by a fitted KunServe cost model of the whole model (Eq. 1-3): a prefill of
    ``prompt_tokens`` alone, and a decode step of ``concurrency`` requests of ``context_tokens`` each (every
    one of them gets a token per step, so the step time is each one's TPOT)."""
    prefill = model.chunk_cost(max(1, prompt_tokens), 0)
    k = max(1, concurrency)
    step = model.shape_cost(BatchShape.of_decodes(k, k * max(1, context_tokens)))
    return Speeds(prefill_tokens_per_s=max(1, prompt_tokens) / prefill, tpot_s=step, concurrency=k, source=source)


@dataclass(frozen=True)
class PeakDemand:
    tokens: float    # KV tokens the requests in flight hold at the peak
    at_s: float      # when (trace time); 0 for an empty trace


def peak_kv_demand(trace: Sequence[TraceRequest], speeds: Speeds, *, start_s: float = -math.inf,
                   end_s: float = math.inf) -> PeakDemand:
    """The trace's peak KV demand at these speeds, in tokens (see the module docstring), over the times t with
    ``start_s < t <= end_s`` (the whole trace by default; PeakDemand(0, start_s) when nothing is in flight there).

    Request i arrives at a_i holding its prompt p_i, finishes its prefill at e_i = a_i + p_i / prefill rate
    (first token), then gains one token per ``tpot_s`` until it has all o_i, at f_i = e_i + (o_i - 1) tpot_s,
    when it leaves with p_i + o_i. Between two departures every request in flight only grows and arrivals
    only add, so the peak is the total just before some departure, or at ``end_s``: a sweep over the sorted
    events evaluates it there (a request counts when a_i < t <= f_i, its decode share when e_i < t).
    """
    if not trace:
        return PeakDemand(0.0, 0.0)
    rate, tpot = speeds.prefill_tokens_per_s, speeds.tpot_s
    # (time, order, kind, prompt, prefill end): at one instant the departures (and the window's end) are
    # evaluated first (their left limit), then removed, then arrivals and prefill ends at that instant join.
    events: list[tuple[float, int, int, float, float]] = []
    for r in trace:
        end = r.arrival_s + r.prompt_tokens / rate
        finish = end + (r.output_tokens - 1) * tpot
        events.append((r.arrival_s, 1, 0, r.prompt_tokens, end))
        if r.output_tokens > 1:
            events.append((end, 2, 1, r.prompt_tokens, end))
        events.append((finish, 0, 2, r.prompt_tokens, end if r.output_tokens > 1 else math.nan))
    if math.isfinite(end_s):
        events.append((end_s, -1, 3, 0.0, math.nan))
    events.sort(key=lambda e: (e[0], e[1]))
    prompts = 0.0      # sum of p_i in flight
    decoding = 0       # requests past their prefill end
    ends = 0.0         # sum of their e_i
    best = PeakDemand(0.0, 0.0 if math.isinf(start_s) else start_s)
    for t, _, kind, p, end in events:
        if t > end_s:
            break
        if kind == 0:
            prompts += p
        elif kind == 1:
            decoding += 1
            ends += end
        else:
            if t > start_s:
                # generated_i(t) = 1 + (t - e_i) / tpot for each decoding request
                total = prompts + decoding * (1.0 + t / tpot) - ends / tpot
                if total > best.tokens:
                    best = PeakDemand(total, t)
            if kind == 3:
                continue
            prompts -= p
            if not math.isnan(end):
                decoding -= 1
                ends -= end
    return best


# -- calibration -----------------------------------------------------------------------------------------------
MakeTrace = Callable[[float, Sequence[float]], Sequence[TraceRequest]]  # (rate, a factor per burst) -> trace
Span = tuple[float, float]  # (start_s, end_s]: where one burst's peak demand is measured


@dataclass(frozen=True)
class Calibration:
    """The load the calibration chose and the demand it plans."""

    rate: float                        # base arrival rate (requests/s)
    burst_factors: tuple[float, ...]   # rate multiplier of each burst, in the order given; () without a burst
    burst_ratios: tuple[float, ...]    # planned peak demand / capacity within each burst's span
    capacity_tokens: int               # the cluster's undropped KV capacity
    target: float                      # asked peak demand / capacity (of every burst)
    planned_peak_tokens: float         # over the whole trace
    planned_peak_at_s: float
    base_ratio: float | None           # peak demand / capacity of the base load alone (no burst); None without a burst
    requests: int
    speeds: Speeds

    @property
    def planned_ratio(self) -> float:
        return self.planned_peak_tokens / self.capacity_tokens

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["burst_factors"], d["burst_ratios"] = list(self.burst_factors), list(self.burst_ratios)
        d["planned_ratio"] = self.planned_ratio
        return d


def _search(g: Callable[[float], float], lo: float, hi: float, target: float, *, at_most: bool = False) -> float:
    """A log-space bisection over [lo, hi] for a demand g(x) that grows with x (give or take the noise of a
    seeded trace, hence "closest" rather than "equal"): the x tried whose g(x) is closest to target or, with
    ``at_most``, the largest x tried whose g(x) <= target (lo when none). g(lo) <= target <= g(hi) is the
    caller's business."""
    tried: dict[float, float] = {lo: g(lo)}
    a, b = lo, hi
    for _ in range(SEARCH_STEPS):
        mid = math.sqrt(a * b)
        tried[mid] = g(mid)
        if tried[mid] < target:
            a = mid
        else:
            b = mid
        if b / a < 1.0005:
            break
    if at_most:
        return max(x for x, v in tried.items() if v <= target or x == lo)
    return min(tried, key=lambda x: (abs(math.log(max(tried[x], 1e-12) / target)), x))


def calibrate(make: MakeTrace, *, rate: float, burst_factors: Sequence[float] = (), spans: Sequence[Span] = (),
              speeds: Speeds, capacity_tokens: int, target: float = DEFAULT_OVERLOAD) -> Calibration:
    """Choose the load so each burst's peak KV demand is ``target`` x ``capacity_tokens``.

    ``make(rate, factors)`` builds the trace with one factor per burst (same seed, so the arrivals only get
    denser as the rate or a factor grows); burst k's peak is measured over ``spans[k]``, from its start to where
    the next burst's span begins (the last one's to the end of the trace), so that each burst is sized for what
    it adds on top of what the earlier ones left in flight. With bursts: first the base rate, lowered (never
    raised) until the trace without its bursts stays under ``min(BASE_LOAD_MAX, target / 2)`` of the capacity,
    then each burst's factor in [1, BURST_FACTOR_MAX], in time order, the earlier ones fixed (a burst's arrivals
    move every later arrival of the stream, never an earlier one). Without a burst the rate itself, within
    [RATE_SCALE_MIN, BURST_FACTOR_MAX] x the given one. CalibrationError when even the largest load stays below
    the target.
    """
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"target must be finite and > 0, got {target}")
    if capacity_tokens <= 0:
        raise ValueError(f"capacity_tokens must be > 0, got {capacity_tokens}")
    if len(spans) != len(burst_factors):
        raise ValueError(f"one span per burst: {len(burst_factors)} bursts, {len(spans)} spans")
    n = len(burst_factors)

    def ratio(r: float, factors: Sequence[float], span: Span = (-math.inf, math.inf)) -> float:
        return peak_kv_demand(make(r, factors), speeds, start_s=span[0], end_s=span[1]).tokens / capacity_tokens

    base_ratio: float | None = None
    chosen: list[float] = []
    if n:
        calm = [1.0] * n
        base_max = min(BASE_LOAD_MAX, target / 2)
        base_ratio = ratio(rate, calm)
        if base_ratio > base_max:
            lowest = rate * RATE_SCALE_MIN
            if ratio(lowest, calm) > base_max:
                raise CalibrationError(f"even at {lowest:.3g} requests/s the trace without its burst needs "
                                       f"{ratio(lowest, calm):.2f}x the KV capacity: shorten the lengths (--length-scale)")
            rate = _search(lambda r: ratio(r, calm), lowest, rate, base_max, at_most=True)
            base_ratio = ratio(rate, calm)

        def burst_ratio(k: int, factor: float) -> float:
            """Burst k's peak over its span, the earlier bursts at their chosen factors, the later ones off."""
            return ratio(rate, [*chosen, factor, *([1.0] * (n - k - 1))], spans[k])

        for k, span in enumerate(spans):
            top = burst_ratio(k, BURST_FACTOR_MAX)
            if top < target:
                which = f" (burst {k + 1} of {n}, from {span[0]:g} s)" if n > 1 else ""
                raise CalibrationError(f"even a {BURST_FACTOR_MAX:g}x burst{which} needs only {top:.2f}x the KV "
                                       f"capacity (target {target:g}x): lengthen the burst window (--burst) or the "
                                       "prompts (--length-scale), or shrink the pool (--pool-mib)")
            chosen.append(_search(functools.partial(burst_ratio, k), 1.0, BURST_FACTOR_MAX, target))
    else:
        lo, hi = rate * RATE_SCALE_MIN, rate * BURST_FACTOR_MAX
        if ratio(hi, ()) < target:
            raise CalibrationError(f"even {hi:.3g} requests/s needs only {ratio(hi, ()):.2f}x the KV capacity "
                                   f"(target {target:g}x): lengthen the trace (--duration) or the prompts (--length-scale)")
        rate = _search(lambda r: ratio(r, ()), lo, hi, target)
    trace = make(rate, chosen)
    peak = peak_kv_demand(trace, speeds)
    ratios = tuple(peak_kv_demand(trace, speeds, start_s=a, end_s=b).tokens / capacity_tokens for a, b in spans)
    return Calibration(rate=rate, burst_factors=tuple(chosen), burst_ratios=ratios, capacity_tokens=capacity_tokens,
                       target=target, planned_peak_tokens=peak.tokens, planned_peak_at_s=peak.at_s,
                       base_ratio=base_ratio, requests=len(trace), speeds=speeds)


# -- what a run saw ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observed:
    """Overload evidence of one replay, from its cluster samples."""

    peak_ratio: float | None    # max over samples of (KV used + prompts waiting at the workers) / undropped capacity
    max_kv_usage: float | None  # max over samples of used / total blocks of the serving units
    drops: int
    overloaded: bool | None     # None: no samples (an external server, no admin address)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def observed_overload(samples: Sequence[Mapping[str, Any]], drops: int) -> Observed:
    """A run overloaded when it dropped, when its KV usage came near full (NEAR_FULL_USAGE), or when what the
    instances held plus what waited for them reached the undropped capacity. The demand seen this way is a
    lower bound: requests still queued at the dispatcher are not in the workers' stats."""
    if not samples:
        return Observed(None, None, drops, None)
    ratios = [(s["kv_blocks_used"] + s["queued_demand_blocks"]) / s["kv_blocks_undropped"]
              for s in samples if s.get("kv_blocks_undropped")]
    usage = [s["kv_usage"] for s in samples if s.get("kv_blocks_total")]
    peak = max(ratios) if ratios else None
    top = max(usage) if usage else None
    over = drops > 0 or (top is not None and top >= NEAR_FULL_USAGE) or (peak is not None and peak >= 1.0)
    return Observed(peak, top, drops, over)


OVERLOADED = "overloaded"
NEVER_OVERLOADED = "never_overloaded"
UNKNOWN = "unknown"


def verdict(flags: Mapping[str, Sequence[bool | None]]) -> dict[str, Any]:
    """Whether a comparison overloaded at all, from each row's runs' ``Observed.overloaded``.

    ``never_overloaded`` when at least one run was observed and none overloaded: its latency ratios compare
    policies that never had to act, so they are withheld. ``unknown`` when no run was observed."""
    seen = {row: [f for f in fs if f is not None] for row, fs in flags.items()}
    observed = sum(len(fs) for fs in seen.values())
    over = sum(sum(fs) for fs in seen.values())
    rows = sorted(row for row, fs in seen.items() if any(fs))
    if observed == 0:
        state, banner = UNKNOWN, None
    elif over == 0:
        state = NEVER_OVERLOADED
        banner = (f"THIS TRACE NEVER OVERLOADED THE CLUSTER: no drop and KV usage under {NEAR_FULL_USAGE:.0%} in all "
                  f"{observed} observed runs. The policies never had to act, so the latency ratios are withheld; "
                  "raise --overload, or calibrate (drop --calibrate off).")
    else:
        state, banner = OVERLOADED, None
    return {"verdict": state, "overloaded_runs": over, "observed_runs": observed, "overloaded_rows": rows,
            "banner": banner}


__all__ = ["BASE_LOAD_MAX", "BURST_FACTOR_MAX", "Calibration", "CalibrationError", "DEFAULT_OVERLOAD", "NEAR_FULL_USAGE",
           "NEVER_OVERLOADED", "OVERLOADED", "Observed", "PeakDemand", "Span", "Speeds", "UNKNOWN", "calibrate",
           "observed_overload", "peak_kv_demand", "speeds_from_cost_model", "verdict"]
