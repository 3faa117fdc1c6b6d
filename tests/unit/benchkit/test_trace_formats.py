"""The JSONL trace formats (vLLM timed_trace, Mooncake): round trips, every bad row with its line, format
detection, and the issue's check that a BurstGPT slice converted to timed_trace keeps its request count and
arrival schedule."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunserve.benchkit.trace import (
    COLUMNS,
    MOONCAKE,
    TIMED_TRACE,
    TraceError,
    TraceRequest,
    detect_trace_format,
    format_from_path,
    load_burstgpt_csv,
    load_jsonl_trace,
    load_trace,
    save_jsonl_trace,
    save_trace,
    save_trace_csv,
)

TRACE = [TraceRequest(0.0, 12, 3), TraceRequest(0.1, 1, 1), TraceRequest(0.1, 4000, 7),
         TraceRequest(123.456789012345, 513, 600)]


def lines(path) -> list[dict]:
    return [json.loads(t) for t in path.read_text().splitlines()]


def jsonl(tmp_path, *rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(ts, inp=10, out=5, ids=(1,)):
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(ids)}


def load_error(path, fmt="timed_trace") -> TraceError:
    with pytest.raises(TraceError) as info:
        load_jsonl_trace(path, fmt)
    return info.value


# ------------------------------------------------------------------------------------------ round trips


def test_timed_trace_round_trip_exact_in_seconds_with_16_token_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    save_jsonl_trace(TRACE, path, TIMED_TRACE)
    rows = lines(path)
    assert rows[0] == {"timestamp": 0.0, "input_length": 12, "output_length": 3, "hash_ids": [0]}
    assert rows[3]["timestamp"] == 123.456789012345
    # vLLM expands each id to 16 tokens: enough ids for the whole prompt, never shared between requests
    assert [len(r["hash_ids"]) for r in rows] == [1, 1, 250, 33]
    ids = [h for r in rows for h in r["hash_ids"]]
    assert ids == list(range(len(ids)))
    assert load_jsonl_trace(path, "timed_trace") == (TRACE, 0)


def test_mooncake_round_trip_to_the_millisecond_with_512_token_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    save_jsonl_trace(TRACE, path, MOONCAKE)
    rows = lines(path)
    assert [r["timestamp"] for r in rows] == [0, 100, 100, 123457]
    assert all(isinstance(r["timestamp"], int) for r in rows)
    assert [len(r["hash_ids"]) for r in rows] == [1, 1, 8, 2]
    loaded, skipped = load_jsonl_trace(path, "mooncake")
    assert skipped == 0 and [(r.prompt_tokens, r.output_tokens) for r in loaded] == [(r.prompt_tokens, r.output_tokens)
                                                                                    for r in TRACE]
    assert all(abs(a.arrival_s - b.arrival_s) <= 0.0005 for a, b in zip(loaded, TRACE))


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.integers(1, 10_000), st.integers(1, 5_000)),
                min_size=1, max_size=30))
def test_round_trip_property(tmp_path, rows):
    trace = [TraceRequest(t, p, o) for t, p, o in sorted(rows)]
    path = tmp_path / "p.jsonl"
    save_jsonl_trace(trace, path, "timed_trace")
    assert load_jsonl_trace(path, "timed_trace")[0] == trace
    save_jsonl_trace(trace, path, "mooncake")
    moon, _ = load_jsonl_trace(path, "mooncake")
    assert [m.arrival_s for m in moon] == sorted(m.arrival_s for m in moon)  # rounding never reorders
    assert all(math.isclose(m.arrival_s, r.arrival_s, abs_tol=0.0005) for m, r in zip(moon, trace))


def test_save_refuses_backwards_arrivals(tmp_path):
    with pytest.raises(ValueError, match="backwards at index 1"):
        save_jsonl_trace([TraceRequest(1.0, 1, 1), TraceRequest(0.5, 1, 1)], tmp_path / "t.jsonl")


def test_burstgpt_slice_to_timed_trace_keeps_count_and_arrival_schedule(tmp_path):
    """The issue's check on this side: a BurstGPT slice (absolute timestamps, a failed row, rows past the
    slice) converted to timed_trace loads back with the same requests at the same offsets, which are the
    offsets vLLM's --self-timed replay sends them at (timestamp x 1 s from the start)."""
    csv_path = tmp_path / "burstgpt.csv"
    csv_path.write_text(",".join(COLUMNS) + "\n" + "".join(
        f"{1000 + 0.37 * i * i},ChatGPT,{10 + 7 * i},{0 if i == 3 else 5 + i},0,Conversation log\n" for i in range(40)))
    sliced, skipped = load_burstgpt_csv(csv_path, limit=25)
    out = tmp_path / "slice.jsonl"
    assert save_trace(sliced, out) == "timed_trace"
    back, back_skipped, fmt = load_trace(out)
    assert fmt == "timed_trace" and back_skipped == 0 and skipped == 1
    assert len(back) == len(sliced) == 25
    assert [r.arrival_s for r in back] == [r.arrival_s for r in sliced]
    assert [r["timestamp"] for r in lines(out)] == [r.arrival_s for r in sliced]  # what vLLM waits for
    assert back == sliced


# ------------------------------------------------------------------------------------------- loading


def test_mooncake_rows_load_as_published(tmp_path):
    """The first rows of the Mooncake FAST'25 conversation trace: integer ms since the first request."""
    path = jsonl(tmp_path, row(0, 6758, 500, range(14)), row(0, 2290, 316, [0, 42, 43, 44, 45]),
                 row(3000, 13544, 71, range(27)), row(5999, 1053, 26, [0, 773, 774]))
    trace, skipped, fmt = load_trace(path)
    assert fmt == "mooncake" and skipped == 0
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 6758, 500), (0.0, 2290, 316), (3.0, 13544, 71), (5.999, 1053, 26)]


def test_timestamps_are_offsets_not_shifted_to_zero(tmp_path):
    path = jsonl(tmp_path, row(2.5), row(4))
    assert [r.arrival_s for r in load_jsonl_trace(path)[0]] == [2.5, 4.0]


def test_hash_ids_optional_extra_fields_ignored_blank_lines_skipped(tmp_path):
    path = jsonl(tmp_path, {"timestamp": 0, "input_length": 3, "output_length": 2, "session": "x"}, "",
                 "   ", {**row(1.5), "input_length": 8.0})
    trace, skipped = load_jsonl_trace(path)
    assert trace == [TraceRequest(0.0, 3, 2), TraceRequest(1.5, 8, 5)] and skipped == 0


def test_zero_length_rows_skipped_and_counted_and_limit(tmp_path):
    path = jsonl(tmp_path, row(0, inp=0), row(1, out=0), row(2), row(3), row(4), '{"broken"')
    assert load_jsonl_trace(path, limit=2) == ([TraceRequest(2.0, 10, 5), TraceRequest(3.0, 10, 5)], 2)
    with pytest.raises(ValueError):
        load_jsonl_trace(path, limit=0)


@pytest.mark.parametrize("bad, message", [
    ('{"timestamp": 0, "input_length": 1', "t.jsonl:2: invalid JSON"),
    ("[1, 2]", "t.jsonl:2: expected a JSON object, got list"),
    ('{"input_length": 1, "output_length": 1}', "t.jsonl:2: missing field 'timestamp'"),
    ('{"timestamp": 1, "output_length": 1}', "t.jsonl:2: missing field 'input_length'"),
    ('{"timestamp": 1, "input_length": 1}', "t.jsonl:2: missing field 'output_length'"),
    ('{"timestamp": "1", "input_length": 1, "output_length": 1}', "t.jsonl:2: non-numeric timestamp: '1'"),
    ('{"timestamp": true, "input_length": 1, "output_length": 1}', "t.jsonl:2: non-numeric timestamp: True"),
    ('{"timestamp": -1, "input_length": 1, "output_length": 1}', "t.jsonl:2: negative timestamp: -1"),
    ('{"timestamp": NaN, "input_length": 1, "output_length": 1}', "t.jsonl:2: non-finite timestamp"),
    ('{"timestamp": 1, "input_length": 1.5, "output_length": 1}', "t.jsonl:2: non-integer input_length: 1.5"),
    ('{"timestamp": 1, "input_length": 1, "output_length": -4}', "t.jsonl:2: negative output_length: -4"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, "a"]}',
     "t.jsonl:2: hash_ids must be a list of integers"),
    ('{"timestamp": 0.5, "input_length": 1, "output_length": 1}', "t.jsonl:2: timestamp goes backwards: 0.5 after 1"),
])
def test_bad_rows_name_file_and_line(tmp_path, bad, message):
    path = jsonl(tmp_path, row(1), bad, row(2))
    err = load_error(path)
    assert str(err).startswith(f"{path}:2: {message[len('t.jsonl:2: '):]}"), str(err)
    assert err.line == 2 and err.path == str(path)


def test_line_numbers_count_blank_lines(tmp_path):
    path = jsonl(tmp_path, row(0), "", "", '{"timestamp": 1}')
    assert load_error(path).line == 4


def test_file_level_errors(tmp_path):
    assert "file not found" in str(load_error(tmp_path / "missing.jsonl"))
    assert "no requests in trace" in str(load_error(jsonl(tmp_path, row(0, out=0), name="empty.jsonl")))
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00{")
    assert "not a text file" in str(load_error(binary))
    assert "is a directory" in str(load_error(tmp_path))


# ----------------------------------------------------------------------------------- detection, choice


def test_detect_by_content(tmp_path):
    csv_path = tmp_path / "trace.jsonl"  # a CSV whatever its name
    save_trace_csv(TRACE, csv_path)
    assert detect_trace_format(csv_path) == "csv"
    saved = tmp_path / "a.jsonl"
    save_jsonl_trace(TRACE, saved, "mooncake")
    assert detect_trace_format(saved) == "mooncake"
    save_jsonl_trace(TRACE, saved, "timed_trace")
    assert detect_trace_format(saved) == "timed_trace"


def test_detect_undecided_jsonl_falls_back_to_the_name(tmp_path):
    # prompts of <= 16 tokens fit one block in both formats; no hash_ids at all says nothing either
    rows = [row(0, inp=16, ids=[7]), {"timestamp": 1, "input_length": 900, "output_length": 1}]
    assert detect_trace_format(jsonl(tmp_path, *rows, name="t.jsonl")) == "timed_trace"
    assert detect_trace_format(jsonl(tmp_path, *rows, name="my_Mooncake_slice.jsonl")) == "mooncake"


def test_detect_majority_and_leading_blank_lines(tmp_path):
    path = jsonl(tmp_path, "", row(0, inp=600, ids=[1, 2]), row(1, inp=600, ids=[3, 4]), row(2, inp=40, ids=[5, 6, 7]),
                 "not json at all")
    assert detect_trace_format(path) == "mooncake"


def test_load_trace_with_explicit_format_and_filters(tmp_path):
    path = tmp_path / "t.jsonl"
    save_jsonl_trace(TRACE, path, "timed_trace")
    trace, _, fmt = load_trace(path, "mooncake")  # told otherwise: read in milliseconds
    assert fmt == "mooncake" and trace[3].arrival_s == pytest.approx(0.123456789012345)
    with pytest.raises(TraceError, match="no Model / Log Type columns"):
        load_trace(path, model="ChatGPT")
    with pytest.raises(TraceError, match="unknown trace format 'parquet'"):
        load_trace(path, "parquet")


@pytest.mark.parametrize("name, fmt", [("a.csv", "csv"), ("A.CSV", "csv"), ("a.jsonl", "timed_trace"),
                                       ("a.json", "timed_trace"), ("mooncake_a.jsonl", "mooncake"),
                                       ("dir.mooncake/a.jsonl", "timed_trace"), ("a.txt", None), ("a", None)])
def test_format_from_path(name, fmt):
    assert format_from_path(name) == fmt


def test_save_trace_by_name_or_format(tmp_path):
    assert save_trace(TRACE, tmp_path / "x.csv") == "csv"
    assert (tmp_path / "x.csv").read_text().startswith(",".join(COLUMNS))
    assert save_trace(TRACE, tmp_path / "x.csv.out", "mooncake") == "mooncake"
    assert lines(tmp_path / "x.csv.out")[3]["timestamp"] == 123457
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        save_trace(TRACE, tmp_path / "x.txt")
