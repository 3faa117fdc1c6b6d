"""Request traces: the BurstGPT CSV loader (every error with its line), generators, upscaling."""

import math
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunserve.benchkit.trace import (
    COLUMNS,
    LENGTH_PROFILES,
    UPSCALE_NEIGHBOURS,
    Burst,
    TraceError,
    TraceRequest,
    burst_windows,
    describe,
    gamma_arrivals,
    generate_trace,
    load_burstgpt_csv,
    repeat_burst,
    save_trace_csv,
    scale_lengths,
    synth_lengths,
    upscale,
)

HEADER = ",".join(COLUMNS)


def write(tmp_path, *rows, header=HEADER, name="trace.csv"):
    path = tmp_path / name
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def row(ts, req=10, resp=5, model="ChatGPT", log="Conversation log"):
    return f"{ts},{model},{req},{resp},{req + resp},{log}"


def load_error(path, **kw) -> TraceError:
    with pytest.raises(TraceError) as info:
        load_burstgpt_csv(path, **kw)
    return info.value


# ------------------------------------------------------------------------------------------- loader


def test_round_trip_exact(tmp_path):
    trace = [TraceRequest(0.0, 12, 3), TraceRequest(0.1, 1, 1), TraceRequest(0.1, 4000, 7),
             TraceRequest(123.456789012345, 5, 600)]
    path = tmp_path / "t.csv"
    save_trace_csv(trace, path)
    assert path.read_text().splitlines()[0] == HEADER
    assert path.read_text().splitlines()[1] == "0.0,synthetic,12,3,15,Conversation log"
    loaded, skipped = load_burstgpt_csv(path)
    assert loaded == trace and skipped == 0


def test_round_trip_of_a_generated_trace_shifts_to_zero(tmp_path):
    trace = generate_trace(rate=20, cv=2, duration_s=30, seed=4)
    path = tmp_path / "g.csv"
    save_trace_csv(trace, path)
    loaded, _ = load_burstgpt_csv(path)
    assert loaded[0].arrival_s == 0.0
    def lengths(t):
        return [(r.prompt_tokens, r.output_tokens) for r in t]

    assert lengths(loaded) == lengths(trace)
    assert np.allclose([r.arrival_s for r in loaded], [r.arrival_s - trace[0].arrival_s for r in trace])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.integers(1, 10**6), st.integers(1, 10**5)),
                min_size=1, max_size=30))
def test_round_trip_property(tmp_path, rows):
    stamps = sorted(t for t, _, _ in rows)
    trace = [TraceRequest(t - stamps[0], p, o) for t, (_, p, o) in zip(stamps, rows)]
    path = tmp_path / "p.csv"
    save_trace_csv(trace, path)
    assert load_burstgpt_csv(path) == (trace, 0)


def test_save_refuses_backwards_arrivals(tmp_path):
    with pytest.raises(ValueError, match="backwards at index 1"):
        save_trace_csv([TraceRequest(1.0, 1, 1), TraceRequest(0.5, 1, 1)], tmp_path / "x.csv")


def test_loads_real_burstgpt_rows_shifted_to_zero(tmp_path):
    path = write(tmp_path, row(5.0, 472, 18), row(45.0, 1939, 0), row(118.5, 1020, 320, "GPT-4", "API log"))
    trace, skipped = load_burstgpt_csv(path)
    assert trace == [TraceRequest(0.0, 472, 18), TraceRequest(113.5, 1020, 320)]
    assert skipped == 1


def test_columns_found_by_name_in_any_order_with_extras(tmp_path):
    header = "Log Type,Extra,Response tokens,Request tokens,Model,Total tokens,Timestamp"
    path = write(tmp_path, "API log,x,7,3,GPT-4,10,2.5", "API log,y,8,4,GPT-4,12,3.0", header=header)
    assert load_burstgpt_csv(path) == ([TraceRequest(0.0, 3, 7), TraceRequest(0.5, 4, 8)], 0)


def test_integral_floats_accepted_as_token_counts(tmp_path):
    path = write(tmp_path, "0.5,ChatGPT,12.0,3.0,15.0,Conversation log")
    assert load_burstgpt_csv(path)[0] == [TraceRequest(0.0, 12, 3)]


def test_bom_and_blank_lines_ignored(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("\ufeff" + HEADER + "\n" + row(1) + "\n\n" + row(2) + "\n   \n\n\n", encoding="utf-8")
    trace, skipped = load_burstgpt_csv(path)
    assert [r.arrival_s for r in trace] == [0.0, 1.0] and skipped == 0


def test_missing_header_column_is_line_1_and_named(tmp_path):
    header = "Timestamp,Model,Request tokens,Total tokens"
    e = load_error(write(tmp_path, "1,ChatGPT,3,4", header=header))
    assert e.line == 1
    assert "Response tokens" in e.message and "Log Type" in e.message
    assert str(e).startswith(f"{tmp_path / 'trace.csv'}:1: missing column")


def test_empty_file_has_no_header(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    assert load_error(path).line == 1


def test_short_row_line(tmp_path):
    e = load_error(write(tmp_path, row(1), row(2), "3,ChatGPT,10,5"))
    assert e.line == 4 and "expected 6 fields, got 4" in e.message


def test_long_row_line(tmp_path):
    e = load_error(write(tmp_path, row(1) + ",extra"))
    assert e.line == 2


def test_empty_value_line(tmp_path):
    e = load_error(write(tmp_path, row(1), "2,ChatGPT,,5,5,Conversation log"))
    assert e.line == 3 and e.message == "empty Request tokens"


def test_non_numeric_line(tmp_path):
    e = load_error(write(tmp_path, row(1), row(2), "3,ChatGPT,ten,5,15,Conversation log"))
    assert e.line == 4 and "non-numeric Request tokens" in e.message and "ten" in e.message
    e = load_error(write(tmp_path, "soon,ChatGPT,1,5,6,Conversation log"))
    assert e.line == 2 and "non-numeric Timestamp" in e.message
    e = load_error(write(tmp_path, "nan,ChatGPT,1,5,6,Conversation log"))
    assert e.line == 2 and "non-finite Timestamp" in e.message
    e = load_error(write(tmp_path, "1,ChatGPT,1.5,5,6,Conversation log"))
    assert e.line == 2 and "non-integer" in e.message


def test_negative_tokens_message_reads_path_line_message(tmp_path):
    path = write(tmp_path, row(1), row(2), row(3), row(4), row(5), "6,ChatGPT,-3,5,2,Conversation log")
    e = load_error(path)
    assert e.line == 7
    assert str(e) == f"{path}:7: negative Request tokens: -3"
    e = load_error(write(tmp_path, "6,ChatGPT,3,-5,2,Conversation log"))
    assert e.line == 2 and e.message == "negative Response tokens: -5"


def test_backwards_timestamp_reports_the_row_that_goes_back(tmp_path):
    e = load_error(write(tmp_path, row(1), row(2), row(2), row(1.5), row(0.5)))
    assert e.line == 5 and "goes backwards" in e.message


def test_line_numbers_count_blank_lines(tmp_path):
    path = tmp_path / "gaps.csv"
    path.write_text(HEADER + "\n" + row(1) + "\n\n" + row(2) + "\n" + "x,ChatGPT,1,1,2,API log\n")
    assert load_error(path).line == 5


def test_zero_token_rows_skipped_and_counted(tmp_path):
    path = write(tmp_path, row(1, 0, 5), row(2, 10, 5), row(3, 10, 0), row(4, 0, 0), row(5, 7, 8))
    trace, skipped = load_burstgpt_csv(path)
    assert trace == [TraceRequest(0.0, 10, 5), TraceRequest(3.0, 7, 8)]
    assert skipped == 3


def test_filters_count_in_skipped(tmp_path):
    path = write(tmp_path, row(1, model="ChatGPT", log="Conversation log"), row(2, model="GPT-4", log="API log"),
                 row(3, model="GPT-4", log="Conversation log"), row(4, 0, 5, model="GPT-4"))
    trace, skipped = load_burstgpt_csv(path, model="gpt-4")
    assert [r.arrival_s for r in trace] == [0.0, 1.0] and skipped == 2
    trace, skipped = load_burstgpt_csv(path, model="GPT-4", log_type="Conversation log")
    assert [r.arrival_s for r in trace] == [0.0] and skipped == 3


def test_limit_keeps_the_first_n_and_stops_reading(tmp_path):
    path = write(tmp_path, row(1, 0, 1), row(2), row(3), row(4), "garbage")
    trace, skipped = load_burstgpt_csv(path, limit=2)
    assert [r.arrival_s for r in trace] == [0.0, 1.0] and skipped == 1
    with pytest.raises(ValueError):
        load_burstgpt_csv(path, limit=0)


def test_no_usable_rows_is_an_error(tmp_path):
    assert load_error(write(tmp_path)).message == "no requests in trace"
    assert load_error(write(tmp_path, row(1, 0, 4), row(2, 3, 0))).message == "no requests in trace"
    assert load_error(write(tmp_path, row(1)), model="GPT-4").message == "no requests in trace"


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.csv"
    e = load_error(path)
    assert e.path == str(path) and e.line is None
    assert str(e) == f"{path}: file not found"


def test_trace_error_formatting_and_pickling():
    assert str(TraceError("bad", 3, "t.csv")) == "t.csv:3: bad"
    assert str(TraceError("bad", 3)) == "line 3: bad"
    assert str(TraceError("bad")) == "bad"
    assert isinstance(TraceError("x"), ValueError)
    e = pickle.loads(pickle.dumps(TraceError("bad", 3, "t.csv")))
    assert (e.message, e.line, e.path, str(e)) == ("bad", 3, "t.csv", "t.csv:3: bad")


def test_trace_request_validates():
    for bad in [(-1.0, 1, 1), (math.nan, 1, 1), (0.0, 0, 1), (0.0, 1, 0)]:
        with pytest.raises(ValueError):
            TraceRequest(*bad)


# --------------------------------------------------------------------------------------- generators


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_rate_and_cv(cv):
    # 80k arrivals: the count's relative std is cv/sqrt(n) <= 1.4%, the sample CV's a few % at cv = 4.
    rate, duration = 200.0, 400.0
    t = np.array(gamma_arrivals(rate, cv, duration, seed=7))
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < duration
    assert len(t) / duration == pytest.approx(rate, rel=0.05)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.10)


@pytest.mark.parametrize("cv", [1.0, 2.0])
def test_burst_window_holds_factor_times_the_rate_with_the_same_cv(cv):
    rate, factor = 100.0, 4.0
    burst = Burst(start_s=80.0, duration_s=40.0, factor=factor)
    t = np.array(gamma_arrivals(rate, cv, 200.0, seed=11, burst=burst))
    inside = t[(t >= 80) & (t < 120)]
    before, after = t[t < 80], t[t >= 120]
    assert len(inside) / 40 == pytest.approx(rate * factor, rel=0.10)
    assert len(before) / 80 == pytest.approx(rate, rel=0.10)
    assert len(after) / 80 == pytest.approx(rate, rel=0.10)
    gaps = np.diff(inside)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_burst_past_the_end_or_clipped():
    plain = gamma_arrivals(10, 1, 50, seed=3)
    assert gamma_arrivals(10, 1, 50, seed=3, burst=Burst(60, 10, 5)) == plain
    t = np.array(gamma_arrivals(100, 1, 50, seed=3, burst=Burst(40, 100, 3)))
    assert t[-1] < 50 and len(t[t >= 40]) / 10 == pytest.approx(300, rel=0.15)


def test_repeated_burst_copies_the_window_gap_apart():
    copies = repeat_burst(Burst(5.0, 6.0, 7.0), 4, 2.0)
    assert [(b.start_s, b.end_s, b.factor) for b in copies] == [(5, 11, 7), (13, 19, 7), (21, 27, 7), (29, 35, 7)]
    assert repeat_burst(Burst(1.0, 2.0, 3.0), 1, 9.0) == [Burst(1.0, 2.0, 3.0)]
    back_to_back = repeat_burst(Burst(0.0, 1.5, 2.0), 3, 0.0)  # touching windows are allowed
    assert burst_windows(back_to_back) == back_to_back
    for copies, gap in ((0, 1.0), (2, -1.0), (2, math.inf), (2, math.nan)):
        with pytest.raises(ValueError):
            repeat_burst(Burst(0.0, 1.0, 2.0), copies, gap)


def test_burst_windows_are_sorted_and_must_not_overlap():
    a, b = Burst(30.0, 5.0, 2.0), Burst(5.0, 10.0, 4.0)
    assert burst_windows([a, b]) == [b, a] and burst_windows(a) == [a] and burst_windows(None) == []
    with pytest.raises(ValueError, match=r"overlap: \[5, 15\) s and \[14, 16\) s"):
        burst_windows([b, Burst(14.0, 2.0, 2.0)])


def test_several_burst_windows_each_hold_their_factor_times_the_rate():
    rate = 50.0
    windows = repeat_burst(Burst(20.0, 20.0, 4.0), 3, 20.0) + [Burst(130.0, 20.0, 2.0)]  # 20-40, 60-80, 100-120
    t = np.array(gamma_arrivals(rate, 1.0, 160.0, seed=4, burst=windows))
    assert np.all(np.diff(t) >= 0) and t[-1] < 160.0
    for lo, hi, factor in ((0, 20, 1), (20, 40, 4), (40, 60, 1), (60, 80, 4), (80, 100, 1), (100, 120, 4),
                           (120, 130, 1), (130, 150, 2), (150, 160, 1)):
        assert np.count_nonzero((t >= lo) & (t < hi)) / (hi - lo) == pytest.approx(rate * factor, rel=0.15), (lo, hi)
    # one window given alone or in a list: the same arrivals; unsorted windows are the same windows
    one = Burst(10.0, 5.0, 3.0)
    assert gamma_arrivals(5, 1, 30, seed=1, burst=one) == gamma_arrivals(5, 1, 30, seed=1, burst=[one])
    assert (gamma_arrivals(5, 1, 90, seed=1, burst=windows[::-1])
            == gamma_arrivals(5, 1, 90, seed=1, burst=windows))
    with pytest.raises(ValueError, match="overlap"):
        gamma_arrivals(5, 1, 30, seed=1, burst=[one, Burst(12.0, 5.0, 2.0)])


def test_a_later_burst_leaves_the_earlier_arrivals_alone():
    # calibration sizes the bursts in time order on this: a factor moves only the arrivals after its window starts
    first = Burst(5.0, 5.0, 3.0)
    calm = gamma_arrivals(8, 1, 40, seed=2, burst=[first, Burst(20.0, 5.0, 1.0)])
    busy = gamma_arrivals(8, 1, 40, seed=2, burst=[first, Burst(20.0, 5.0, 9.0)])
    assert [x for x in calm if x < 20] == [x for x in busy if x < 20]
    assert len([x for x in busy if 20 <= x < 25]) > 3 * len([x for x in calm if 20 <= x < 25])


def test_generators_are_deterministic_for_a_seed():
    assert gamma_arrivals(30, 2, 20, seed=5) == gamma_arrivals(30, 2, 20, seed=5)
    assert gamma_arrivals(30, 2, 20, seed=5) != gamma_arrivals(30, 2, 20, seed=6)
    assert synth_lengths("sharegpt", 100, seed=1) == synth_lengths("sharegpt", 100, seed=1)
    kw = dict(rate=10, cv=3, duration_s=30, burst=Burst(10, 5, 3))
    assert generate_trace(seed=2, **kw) == generate_trace(seed=2, **kw)
    assert generate_trace(seed=2, **kw) != generate_trace(seed=3, **kw)
    # the length profile does not move the arrivals
    assert ([r.arrival_s for r in generate_trace(seed=2, profile="longbench", **kw)]
            == [r.arrival_s for r in generate_trace(seed=2, **kw)])


@pytest.mark.parametrize("args", [(0, 1, 10), (-1, 1, 10), (1, 0, 10), (1, 1, 0), (math.inf, 1, 10),
                                  (1, math.nan, 1)])
def test_gamma_validates(args):
    with pytest.raises(ValueError):
        gamma_arrivals(*args, seed=0)


@pytest.mark.parametrize("args", [(-1, 1, 2), (0, 0, 2), (0, 1, 0.5), (0, -1, 2)])
def test_burst_validates(args):
    with pytest.raises(ValueError):
        Burst(*args)


@pytest.mark.parametrize("profile", sorted(LENGTH_PROFILES))
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_synth_lengths_means(profile, scale):
    lengths = np.array(synth_lengths(profile, 40_000, seed=9, scale=scale))
    mean_prompt, mean_output = LENGTH_PROFILES[profile]
    assert lengths[:, 0].mean() == pytest.approx(mean_prompt * scale, rel=0.05)
    assert lengths[:, 1].mean() == pytest.approx(mean_output * scale, rel=0.05)
    assert lengths.min() >= 1


def test_synth_lengths_clamps():
    lengths = np.array(synth_lengths("longbench", 5000, seed=1, max_prompt=4096, max_output=256))
    assert lengths[:, 0].max() == 4096 and lengths[:, 1].max() == 256
    tiny = np.array(synth_lengths("burstgpt", 5000, seed=1, scale=0.001))
    assert tiny.min() == 1
    assert synth_lengths("burstgpt", 0, seed=1) == []


def test_synth_lengths_validates():
    with pytest.raises(ValueError, match="burstgpt, longbench, sharegpt"):
        synth_lengths("alpaca", 10, seed=0)
    for bad in [dict(scale=0), dict(scale=-1), dict(max_prompt=0), dict(max_output=0)]:
        with pytest.raises(ValueError):
            synth_lengths("burstgpt", 10, seed=0, **bad)
    with pytest.raises(ValueError):
        generate_trace(rate=1, cv=1, duration_s=1, profile="nope")


def test_generate_trace_respects_maxima():
    trace = generate_trace(rate=50, cv=1, duration_s=20, profile="longbench", max_prompt=2048, max_output=128)
    assert max(r.prompt_tokens for r in trace) <= 2048 and max(r.output_tokens for r in trace) <= 128


# ------------------------------------------------------------------------------------------ scaling


@pytest.fixture(scope="module")
def bursty():
    return generate_trace(rate=20, cv=2, duration_s=300, burst=Burst(120, 40, 4), seed=21)


def binned(trace, width=10.0, end=300.0):
    return np.histogram([r.arrival_s for r in trace], bins=np.arange(0, end + width, width))[0]


@pytest.mark.parametrize("factor", [2.0, 3.5])
def test_upscale_multiplies_rate_and_keeps_shape_and_duration(bursty, factor):
    up = upscale(bursty, factor, seed=1)
    assert len(up) == pytest.approx(factor * len(bursty), rel=0.03)
    times = [r.arrival_s for r in up]
    assert times == sorted(times)
    assert times[0] == bursty[0].arrival_s and times[-1] == bursty[-1].arrival_s
    orig, new = binned(bursty), binned(up)
    assert np.corrcoef(orig, new)[0, 1] > 0.9
    burst_bins = slice(12, 16)
    assert new[burst_bins].sum() == pytest.approx(factor * orig[burst_bins].sum(), rel=0.1)
    pairs = {(r.prompt_tokens, r.output_tokens) for r in bursty}
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in up)


def test_upscale_lengths_come_from_nearby_requests():
    # Lengths encode the index: each copy's source must be close to the request whose gap it sits in.
    trace = [TraceRequest(float(i) + 0.01 * (i % 7), i + 1, 1) for i in range(300)]
    times = np.array([r.arrival_s for r in trace])
    up = upscale(trace, 3.0, seed=4)
    assert len(up) == 900
    for r in up:
        owner = int(np.searchsorted(times, r.arrival_s, side="right")) - 1
        assert abs((r.prompt_tokens - 1) - owner) <= UPSCALE_NEIGHBOURS + 1
    assert len({r.prompt_tokens for r in up}) > 250


def test_downscale_keeps_a_subset(bursty):
    down = upscale(bursty, 0.5, seed=2)
    assert len(down) == pytest.approx(0.5 * len(bursty), rel=0.06)
    assert set(down) <= set(bursty)
    assert np.corrcoef(binned(bursty, 30), binned(down, 30))[0, 1] > 0.9


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=40), st.integers(1, 5),
       st.integers(0, 2**16))
def test_upscale_integer_factor_property(stamps, factor, seed):
    trace = [TraceRequest(t, 1 + i, 1) for i, t in enumerate(sorted(stamps))]
    up = upscale(trace, float(factor), seed=seed)
    assert len(up) == factor * len(trace)
    times = [r.arrival_s for r in up]
    assert times == sorted(times)
    assert times[0] >= trace[0].arrival_s and times[-1] <= trace[-1].arrival_s


def test_upscale_edges():
    assert upscale([], 2.0) == []
    one = [TraceRequest(3.0, 5, 6)]
    assert upscale(one, 3.0) == one * 3
    assert upscale(one, 1.0) == one
    assert upscale([TraceRequest(0.0, 1, 1), TraceRequest(1.0, 1, 1)], 2.0, seed=0)[1].arrival_s == 0.5
    for bad in [0.0, -1.0, math.nan]:
        with pytest.raises(ValueError):
            upscale(one, bad)
    same = [TraceRequest(0.0, 1, 1)] * 5
    assert upscale(same, 0.5, seed=1) == upscale(same, 0.5, seed=1)


def test_scale_lengths():
    trace = [TraceRequest(0.0, 100, 10), TraceRequest(1.0, 3, 1), TraceRequest(2.0, 5000, 900)]
    assert scale_lengths(trace, 0.5) == [TraceRequest(0.0, 50, 5), TraceRequest(1.0, 2, 1),
                                         TraceRequest(2.0, 2500, 450)]
    assert scale_lengths(trace, 0.01) == [TraceRequest(0.0, 1, 1), TraceRequest(1.0, 1, 1),
                                          TraceRequest(2.0, 50, 9)]
    assert scale_lengths(trace, 2, max_prompt=4096, max_output=100) == [
        TraceRequest(0.0, 200, 20), TraceRequest(1.0, 6, 2), TraceRequest(2.0, 4096, 100)]
    with pytest.raises(ValueError):
        scale_lengths(trace, 0)


def test_describe():
    trace = [TraceRequest(0.0, 10, 1), TraceRequest(1.0, 20, 3), TraceRequest(3.0, 30, 2)]
    d = describe(trace)
    assert d["n"] == 3 and d["duration_s"] == 3.0 and d["mean_rate"] == pytest.approx(2 / 3)
    assert (d["mean_prompt"], d["mean_output"], d["max_prompt"], d["max_output"]) == (20.0, 2.0, 30, 3)
    assert d["cv"] == pytest.approx(0.5 / 1.5)
    assert describe([])["n"] == 0 and describe([])["mean_rate"] is None
    single = describe([TraceRequest(2.0, 1, 1)])
    assert single["duration_s"] == 0.0 and single["mean_rate"] is None and single["cv"] is None
