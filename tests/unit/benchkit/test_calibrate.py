"""Calibration of the bursty trace: the peak-KV-demand estimator, the load search, what a run observed and the
comparison's verdict."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunserve.benchkit.calibrate import (
    BASE_LOAD_MAX,
    CalibrationError,
    Speeds,
    calibrate,
    observed_overload,
    peak_kv_demand,
    speeds_from_cost_model,
    verdict,
)
from kunserve.benchkit.trace import Burst, TraceRequest, generate_trace
from kunserve.shared.policy.costmodel import KunServeCostModel

SPEEDS = Speeds(prefill_tokens_per_s=100.0, tpot_s=0.1, concurrency=1, source="test")


def test_peak_by_hand():
    # r0: prefill 0 -> 1 s, then tokens 2..11 at 0.1 s each: leaves at 2 s holding 100 + 11
    # r1: arrives at 1 s, prefill to 1.5 s, one token: leaves at 1.5 s holding 50
    trace = [TraceRequest(0.0, 100, 11), TraceRequest(1.0, 50, 1)]
    peak = peak_kv_demand(trace, SPEEDS)
    # just before 1.5 s: r0 holds 100 + 1 + 0.5 / 0.1 = 106 and r1 its 50 prompt tokens
    assert peak.tokens == pytest.approx(156.0) and peak.at_s == pytest.approx(1.5)
    assert peak_kv_demand([TraceRequest(0.0, 100, 11)], SPEEDS).tokens == pytest.approx(111.0)
    assert peak_kv_demand([], SPEEDS).tokens == 0.0
    # requests that never overlap: the largest alone
    apart = [TraceRequest(0.0, 100, 11), TraceRequest(10.0, 300, 2)]
    assert peak_kv_demand(apart, SPEEDS).tokens == pytest.approx(302.0)


def _demand_at(trace, speeds, t):
    """The definition, at one instant: prompt + tokens generated so far of every request in flight."""
    total = 0.0
    for r in trace:
        end = r.arrival_s + r.prompt_tokens / speeds.prefill_tokens_per_s
        finish = end + (r.output_tokens - 1) * speeds.tpot_s
        if r.arrival_s <= t < finish:
            total += r.prompt_tokens + (min(r.output_tokens, 1 + (t - end) / speeds.tpot_s) if t >= end else 0)
    return total


requests = st.lists(st.tuples(st.floats(0, 5), st.integers(1, 400), st.integers(1, 60)), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(requests, st.floats(50, 5000), st.floats(0.001, 0.2))
def test_peak_is_the_supremum_of_the_demand(reqs, rate, tpot):
    trace = sorted((TraceRequest(a, p, o) for a, p, o in reqs), key=lambda r: r.arrival_s)
    speeds = Speeds(rate, tpot, 1, "test")
    peak = peak_kv_demand(trace, speeds)
    spans = [(r.arrival_s, r.arrival_s + r.prompt_tokens / rate + (r.output_tokens - 1) * tpot) for r in trace]
    grid = [a + (f - a) * k / 7 for a, f in spans for k in range(7)]
    assert all(_demand_at(trace, speeds, t) <= peak.tokens * (1 + 1e-9) + 1e-6 for t in grid)
    # and it is reached: just before `at_s` the demand is (nearly) the peak
    eps = 1e-7 * max(1.0, peak.at_s)
    assert _demand_at(trace, speeds, peak.at_s - eps) == pytest.approx(peak.tokens, rel=1e-4, abs=1e-3)


@settings(max_examples=50, deadline=None)
@given(requests, st.floats(0.1, 10))
def test_a_machine_c_times_slower_sees_the_trace_c_times_slower_the_same(reqs, c):
    # the same demand curve on a stretched time axis: arrivals x c with both speeds / c
    trace = [TraceRequest(a, p, o) for a, p, o in sorted(reqs)]
    stretched = [TraceRequest(r.arrival_s * c, r.prompt_tokens, r.output_tokens) for r in trace]
    peak = peak_kv_demand(trace, Speeds(1000.0, 0.01, 1, "t"))
    slow = peak_kv_demand(stretched, Speeds(1000.0 / c, 0.01 * c, 1, "t"))
    assert slow.tokens == pytest.approx(peak.tokens, rel=1e-6) and slow.at_s == pytest.approx(peak.at_s * c, rel=1e-6)


def test_a_slower_machine_needs_a_gentler_burst():
    make = _maker()
    fast = peak_kv_demand(make(1.0, [6.0]), Speeds(5000.0, 0.01, 8, "t")).tokens
    assert peak_kv_demand(make(1.0, [6.0]), Speeds(2500.0, 0.02, 8, "t")).tokens > 1.3 * fast


def test_peak_within_a_span_by_hand():
    # r0 in flight over [0, 2] (peak 111 just before 2 s), r1 over [10, 10.01] holding 302
    apart = [TraceRequest(0.0, 100, 11), TraceRequest(10.0, 300, 2)]
    assert peak_kv_demand(apart, SPEEDS, start_s=0.0, end_s=5.0).tokens == pytest.approx(111.0)
    assert peak_kv_demand(apart, SPEEDS, start_s=5.0).tokens == pytest.approx(302.0)
    # a span that ends mid-request: the demand at its end (100 + 1 + 0.5 / 0.1 = 106 at 1.5 s)
    mid = peak_kv_demand(apart, SPEEDS, start_s=0.0, end_s=1.5)
    assert mid.tokens == pytest.approx(106.0) and mid.at_s == 1.5
    assert peak_kv_demand(apart, SPEEDS, start_s=3.0, end_s=9.0).tokens == 0.0  # nothing in flight


@settings(max_examples=100, deadline=None)
@given(requests, st.floats(0, 5), st.floats(0.01, 5))
def test_peak_within_a_span_is_the_supremum_there(reqs, start, length):
    trace = sorted((TraceRequest(a, p, o) for a, p, o in reqs), key=lambda r: r.arrival_s)
    speeds = Speeds(400.0, 0.05, 1, "test")
    end = start + length
    peak = peak_kv_demand(trace, speeds, start_s=start, end_s=end)
    grid = [start + length * k / 50 for k in range(1, 50)]  # inside: at `end` the peak is the left limit
    assert all(_demand_at(trace, speeds, t) <= peak.tokens * (1 + 1e-9) + 1e-6 for t in grid)
    assert peak.tokens <= peak_kv_demand(trace, speeds).tokens * (1 + 1e-9) + 1e-6
    assert peak.tokens == 0.0 or start < peak.at_s <= end


def test_speeds_from_the_cost_model():
    model = KunServeCostModel(alpha=0.0, beta=0.001, gamma=0.01, lam=0.0)
    s = speeds_from_cost_model(model, prompt_tokens=100, concurrency=4, context_tokens=300, source="profile x")
    assert s.prefill_tokens_per_s == pytest.approx(100 / 0.11)  # 100 tokens x beta + gamma
    assert s.tpot_s == pytest.approx(4 * 0.001 + 4 * 0.01)  # one step of 4 decodes
    assert s.concurrency == 4 and s.source == "profile x"
    with pytest.raises(ValueError):
        Speeds(0.0, 0.01, 1, "x")
    with pytest.raises(ValueError):
        Speeds(10.0, math.nan, 1, "x")


def _maker(duration=30.0, bursts=((5.0, 10.0),), seed=0):
    def make(rate, factors):
        return generate_trace(rate=rate, cv=1.0, duration_s=duration, seed=seed, scale=0.5, max_prompt=1024,
                              max_output=384, burst=[Burst(a, d, f) for (a, d), f in zip(bursts, factors)])
    return make


ONE = {"burst_factors": [6.0], "spans": [(5.0, math.inf)]}


@pytest.mark.parametrize("target", [1.2, 1.5, 3.0])
def test_calibration_hits_the_target(target):
    speeds = Speeds(5000.0, 0.012, 8, "probe")
    cal = calibrate(_maker(), rate=1.0, **ONE, speeds=speeds, capacity_tokens=4096, target=target)
    assert cal.planned_ratio == pytest.approx(target, rel=0.1) and cal.burst_ratios == (cal.planned_ratio,)
    assert cal.base_ratio is not None and cal.base_ratio <= BASE_LOAD_MAX and cal.burst_factors[0] > 1
    trace = _maker()(cal.rate, cal.burst_factors)
    assert len(trace) == cal.requests and peak_kv_demand(trace, speeds).tokens == pytest.approx(cal.planned_peak_tokens)
    assert 5.0 <= cal.planned_peak_at_s <= 15.0 + 30  # the peak comes with the burst (or its tail)
    d = cal.to_dict()
    assert d["planned_ratio"] == cal.planned_ratio and d["speeds"]["source"] == "probe"
    assert d["burst_factors"] == list(cal.burst_factors)


def test_each_burst_is_sized_for_what_it_adds():
    # two windows apart: each one's peak over its span (its start to the next one's) reaches the target; the
    # second, starting where the first left nothing in flight, needs about the same factor
    speeds = Speeds(5000.0, 0.012, 8, "probe")
    windows = ((5.0, 10.0), (40.0, 10.0))
    spans = [(5.0, 40.0), (40.0, math.inf)]
    make = _maker(duration=60.0, bursts=windows, seed=2)
    cal = calibrate(make, rate=1.0, burst_factors=[6.0, 6.0], spans=spans, speeds=speeds, capacity_tokens=4096,
                    target=1.5)
    assert len(cal.burst_factors) == 2 and all(f > 1 for f in cal.burst_factors)
    trace = make(cal.rate, cal.burst_factors)
    for (a, b), ratio in zip(spans, cal.burst_ratios):
        assert ratio == pytest.approx(1.5, rel=0.1)
        assert peak_kv_demand(trace, speeds, start_s=a, end_s=b).tokens / 4096 == pytest.approx(ratio)
    assert cal.burst_factors[1] == pytest.approx(cal.burst_factors[0], rel=0.2)
    # back to back on a slower machine, the second burst starts on top of the first one's tail: a smaller factor
    close = _maker(duration=60.0, bursts=((5.0, 10.0), (15.0, 10.0)), seed=2)
    tight = calibrate(close, rate=1.0, burst_factors=[6.0, 6.0], spans=[(5.0, 15.0), (15.0, math.inf)],
                      speeds=Speeds(2000.0, 0.05, 8, "probe"), capacity_tokens=4096, target=1.5)
    assert tight.burst_factors[1] < tight.burst_factors[0] / 2
    assert tight.burst_ratios == pytest.approx((1.5, 1.5), rel=0.1)
    with pytest.raises(ValueError, match="one span per burst"):
        calibrate(_maker(), rate=1.0, burst_factors=[6.0], spans=[], speeds=speeds, capacity_tokens=4096)


def test_a_base_load_that_overloads_alone_is_lowered():
    slow = Speeds(300.0, 0.2, 8, "probe")  # every request stays in flight for ~30 s
    cal = calibrate(_maker(), rate=1.0, **ONE, speeds=slow, capacity_tokens=4096, target=1.5)
    assert cal.rate < 1.0 and cal.base_ratio <= BASE_LOAD_MAX
    assert cal.planned_ratio == pytest.approx(1.5, rel=0.15)


def test_without_a_burst_the_rate_is_calibrated():
    speeds = Speeds(5000.0, 0.012, 8, "probe")
    cal = calibrate(_maker(bursts=()), rate=1.0, speeds=speeds, capacity_tokens=4096, target=1.5)
    assert cal.burst_factors == () and cal.burst_ratios == () and cal.base_ratio is None and cal.rate > 1.0
    assert cal.planned_ratio == pytest.approx(1.5, rel=0.15)


def test_unreachable_targets_are_errors():
    speeds = Speeds(5000.0, 0.012, 8, "probe")
    with pytest.raises(CalibrationError, match="1000x burst needs"):
        calibrate(_maker(bursts=((1.0, 0.5),)), rate=1.0, burst_factors=[6.0], spans=[(1.0, math.inf)], speeds=speeds,
                  capacity_tokens=10**8, target=1.5)
    with pytest.raises(CalibrationError, match=r"1000x burst \(burst 2 of 2, from 20 s\)"):
        calibrate(_maker(bursts=((1.0, 10.0), (20.0, 0.05))), rate=1.0, burst_factors=[6.0, 6.0],
                  spans=[(1.0, 20.0), (20.0, math.inf)], speeds=speeds, capacity_tokens=20_000, target=1.5)
    with pytest.raises(CalibrationError, match="requests/s"):
        calibrate(_maker(bursts=(), duration=2.0), rate=1.0, speeds=speeds, capacity_tokens=10**9, target=1.5)
    with pytest.raises(ValueError):
        calibrate(_maker(), rate=1.0, **ONE, speeds=speeds, capacity_tokens=0, target=1.5)


def _sample(used, total=100, queued=0, undropped=100):
    return {"kv_blocks_used": used, "kv_blocks_total": total, "queued_demand_blocks": queued,
            "kv_blocks_undropped": undropped, "kv_usage": used / total}


def test_observed_overload():
    calm = observed_overload([_sample(10), _sample(60, queued=20)], drops=0)
    assert (calm.peak_ratio, calm.max_kv_usage, calm.overloaded) == (0.8, 0.6, False)
    assert observed_overload([_sample(92)], drops=0).overloaded  # KV near full
    assert observed_overload([_sample(70, queued=40)], drops=0).overloaded  # held + waiting beyond the capacity
    dropped = observed_overload([_sample(200, total=250)], drops=1)  # a drop: more blocks than undropped
    assert dropped.overloaded and dropped.peak_ratio == 2.0
    assert observed_overload([], drops=0).overloaded is None  # not observed (an external server)


def test_verdict():
    assert verdict({"kunserve": [True, False], "recompute": [False]}) == {
        "verdict": "overloaded", "overloaded_runs": 1, "observed_runs": 3, "overloaded_rows": ["kunserve"],
        "banner": None}
    never = verdict({"kunserve": [False], "recompute": [False], "vllm": [None]})
    assert never["verdict"] == "never_overloaded" and never["observed_runs"] == 2 and "NEVER OVERLOADED" in never["banner"]
    assert verdict({"vllm": [None, None]})["verdict"] == "unknown"
