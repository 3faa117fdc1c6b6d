"""Benchmark statistics: percentiles, SLO attainment (§5.2), run summaries and the TTFT timeline."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunserve.benchkit.stats import (
    PERCENTILES,
    RequestResult,
    best_p50,
    percentiles,
    slo_attainment,
    summarize,
    timeline,
)


def done(index, sent, token_times, e2e=None, **kw):
    return RequestResult(index=index, arrival_s=sent, sent_s=sent, prompt_tokens=10, output_tokens=8,
                         ttft_s=token_times[0] if token_times else None, token_times_s=list(token_times),
                         e2e_s=e2e if e2e is not None else (token_times[-1] if token_times else None),
                         ok=True, finish_reason="length", **kw)


def failed(index, sent, error="timeout", token_times=()):
    return RequestResult(index=index, arrival_s=sent, sent_s=sent, prompt_tokens=10, output_tokens=8,
                         ttft_s=token_times[0] if token_times else None, token_times_s=list(token_times),
                         ok=False, error=error)


# ---------------------------------------------------------------------------------------- results


def test_tokens_and_tpot():
    r = done(0, 0.0, [0.1, 0.2, 0.3, 0.5])
    assert r.tokens == 4 and r.tpot_s == pytest.approx(0.4 / 3)
    assert done(0, 0.0, [0.1]).tpot_s is None
    assert failed(0, 0.0).tokens == 0 and failed(0, 0.0).tpot_s is None


def test_to_dict_from_dict_round_trip_through_json():
    r = done(7, 1.25, [0.3, 0.35, 0.41], worker_id="w2")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["tokens"] == 3 and d["tpot_s"] == pytest.approx(0.055)
    assert RequestResult.from_dict(d) == r
    f = failed(3, 2.0, "connection reset")
    assert RequestResult.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    assert RequestResult.from_dict({**f.to_dict(), "from_a_newer_version": 1}) == f


def test_to_dict_copies_the_token_list():
    r = done(0, 0.0, [0.1, 0.2])
    r.to_dict()["token_times_s"].append(9.0)
    assert r.token_times_s == [0.1, 0.2]


# ------------------------------------------------------------------------------------ percentiles


def test_percentiles_of_1_to_100():
    p = percentiles([float(v) for v in range(100, 0, -1)])
    assert p["n"] == 100
    assert p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert p["p999"] == pytest.approx(99.901)
    assert p["max"] == 100.0
    assert set(p) == {"mean", "max", "n", *(name for name, _ in PERCENTILES)}


def test_percentiles_small_and_empty():
    assert percentiles([2.0]) == {"mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0, "p999": 2.0, "max": 2.0, "n": 1}
    p = percentiles([0.0, 10.0])
    assert (p["p50"], p["p90"], p["p99"]) == pytest.approx((5.0, 9.0, 9.9))
    empty = percentiles([])
    assert empty["n"] == 0 and all(empty[k] is None for k in empty if k != "n")
    assert percentiles([None, 1.0, math.nan, 3.0]) == percentiles([1.0, 3.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_are_ordered(values):
    p = percentiles(values)
    assert min(values) <= p["p50"] <= p["p90"] <= p["p99"] <= p["p999"] <= p["max"] == max(values)
    assert p["n"] == len(values)


# -------------------------------------------------------------------------------------------- SLO


def test_slo_attainment_counts_failures_as_violations():
    values = [1.0, 2.0, 3.0, 4.0, None]
    att = slo_attainment(values, 1.0)
    assert list(att) == [str(n) for n in range(1, 11)]
    assert att["1"] == 0.2 and att["2"] == 0.4 and att["4"] == 0.8 and att["10"] == 0.8
    att = slo_attainment([1.0, 2.0, 3.0, 4.0], 1.0, (1, 1.5, 2.5, 4), total=10)
    assert att == {"1": 0.1, "1.5": 0.1, "2.5": 0.2, "4": 0.4}
    assert slo_attainment([0.5, 1.0, 1.5], 0.5, [2.0])["2"] == pytest.approx(2 / 3)  # 1.0 <= 2 x 0.5: within
    assert slo_attainment([], 1.0, [1]) == {"1": 0.0}


def test_slo_attainment_validates():
    for ref in [0.0, -1.0, math.nan]:
        with pytest.raises(ValueError):
            slo_attainment([1.0], ref)
    with pytest.raises(ValueError):
        slo_attainment([1.0, 2.0], 1.0, total=1)
    with pytest.raises(ValueError):
        slo_attainment([1.0], 1.0, [0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0, 100, allow_nan=False)), max_size=100),
       st.floats(0.01, 10), st.integers(0, 20))
def test_slo_attainment_is_a_monotone_fraction(values, ref, extra_failures):
    att = slo_attainment(values, ref, total=len(values) + extra_failures)
    fractions = list(att.values())
    assert all(0.0 <= a <= 1.0 for a in fractions)
    assert fractions == sorted(fractions)


def test_best_p50_is_the_lowest_median_with_data():
    assert best_p50({"kunserve": [1.0, 2.0, 3.0], "swap": [2.0, 4.0], "queue": [], "dead": [None]}) == 2.0
    assert best_p50({"a": [5.0], "b": [0.5, 10.0, 0.7]}) == 0.7
    assert best_p50({"a": []}) is None and best_p50({}) is None


# -------------------------------------------------------------------------------------- summarize


@pytest.fixture
def run():
    return [
        done(0, 0.0, [0.1, 0.2, 0.3, 0.4, 0.5]),   # ttft 0.1, tpot 0.1
        done(1, 0.5, [0.2, 0.4, 0.6]),             # ttft 0.2, tpot 0.2
        done(2, 1.0, [1.5]),                       # ttft 1.5 (queued), no tpot
        failed(3, 1.5, "timeout", token_times=[0.3]),
    ]


def test_summarize_counts_throughput_and_latency(run):
    s = summarize(run, 2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"timeout": 1}
    assert s["duration_s"] == 2.0
    assert s["throughput"]["requests_per_s"] == pytest.approx(1.5)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(9 / 2)   # completed requests' tokens
    assert s["ttft"]["n"] == 3 and s["ttft"]["p50"] == pytest.approx(0.2) and s["ttft"]["max"] == 1.5
    assert s["tpot"]["n"] == 2 and s["tpot"]["p50"] == pytest.approx(0.15)
    assert s["tpot"]["mean"] == pytest.approx(0.15)
    assert s["e2e"]["n"] == 3 and s["e2e"]["max"] == 1.5
    json.dumps(s)


def test_summarize_slo_with_own_references(run):
    s = summarize(run, 2.0)
    assert s["slo_reference"]["ttft_p50_s"] == pytest.approx(0.2)
    ttft = s["slo"]["ttft"]
    assert ttft["1"] == 0.5            # 0.1, 0.2 of 4 requests (the failure is a violation)
    assert ttft["7"] == 0.5 and ttft["8"] == 0.75
    tpot = s["slo"]["tpot"]            # denominator 3: the one-token request has no TPOT to judge
    assert tpot["1"] == pytest.approx(1 / 3) and tpot["2"] == pytest.approx(2 / 3)
    assert s["ttft_over_5x_p50"] == 1


def test_summarize_with_shared_references(run):
    s = summarize(run, 2.0, reference_ttft_p50=0.05, reference_tpot_p50=0.5)
    assert s["slo_reference"] == {"ttft_p50_s": 0.05, "tpot_p50_s": 0.5}
    assert s["slo"]["ttft"]["1"] == 0.0 and s["slo"]["ttft"]["4"] == 0.5
    assert s["slo"]["tpot"]["1"] == pytest.approx(2 / 3)
    assert s["ttft_over_5x_p50"] == 1   # only 1.5 > 0.25
    assert summarize(run, 2.0, reference_ttft_p50=1.0)["ttft_over_5x_p50"] == 0


def test_summarize_all_failed_and_top_errors():
    results = [failed(i, 0.1 * i, f"e{i % 7}") for i in range(70)] + [failed(70, 8.0, "e0"), failed(71, 8.0, "")]
    s = summarize(results, 10.0)
    assert s["completed"] == 0 and s["failed"] == 72
    assert len(s["errors"]) == 5 and s["errors"]["e0"] == 11
    assert s["ttft"]["n"] == 0 and s["ttft"]["p50"] is None
    assert s["slo"] == {"ttft": {}, "tpot": {}} and s["ttft_over_5x_p50"] is None
    assert s["throughput"] == {"requests_per_s": 0.0, "output_tokens_per_s": 0.0}
    assert summarize([failed(0, 0.0, "")], 1.0)["errors"] == {"(no message)": 1}


def test_summarize_validates_duration(run):
    for bad in [0.0, -1.0, math.inf]:
        with pytest.raises(ValueError):
            summarize(run, bad)


# --------------------------------------------------------------------------------------- timeline


def test_timeline_bins_by_send_time():
    results = [done(0, 0.1, [0.1, 0.2]), done(1, 0.5, [0.3]), failed(2, 0.9), done(3, 3.7, [2.0])]
    bins = timeline(results)
    assert [b["t_s"] for b in bins] == [0.0, 1.0, 2.0, 3.0]
    assert [b["requests"] for b in bins] == [3, 0, 0, 1]
    assert [(b["completed"], b["failed"]) for b in bins] == [(2, 1), (0, 0), (0, 0), (1, 0)]
    assert bins[0]["ttft_p50_s"] == pytest.approx(0.2) and bins[0]["ttft_p99_s"] == pytest.approx(0.298)
    assert bins[1]["ttft_p50_s"] is None and bins[1]["ttft_p99_s"] is None
    assert bins[3]["ttft_p50_s"] == 2.0


def test_timeline_bin_width_and_edges():
    results = [done(i, 0.25 * i, [0.1]) for i in range(10)]   # sent 0 .. 2.25
    bins = timeline(results, bin_s=0.5)
    assert [b["t_s"] for b in bins] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [b["requests"] for b in bins] == [2, 2, 2, 2, 2]
    assert timeline([]) == []
    with pytest.raises(ValueError):
        timeline(results, bin_s=0)
