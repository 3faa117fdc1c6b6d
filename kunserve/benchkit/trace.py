"""Request traces for the bursty-trace benchmark (KunServe §5).

The paper replays the BurstGPT trace (arrival times and lengths of ChatGPT / GPT-4 requests), takes
request lengths from BurstGPT, ShareGPT or LongBench, and raises the load with TraceUpscaler
(EuroSys'24) instead of squeezing timestamps, because squeezing distorts the temporal pattern that
makes the trace bursty in the first place. This module gives the benchmark client those pieces:

- :func:`load_burstgpt_csv` / :func:`save_trace_csv`: the BurstGPT CSV format, validated line by line so a
  broken trace fails with ``path:line: what`` instead of a skewed benchmark.
- :func:`load_jsonl_trace` / :func:`save_jsonl_trace`: vLLM's ``timed_trace`` JSONL (what ``vllm bench serve
  --dataset-name timed_trace`` replays) and the Mooncake trace JSONL, validated the same way, so one trace
  file drives both this harness and vLLM's. :func:`load_trace` / :func:`save_trace` pick the format from the
  content (:func:`detect_trace_format`) or the file name (:func:`format_from_path`).
- :func:`gamma_arrivals`, :func:`synth_lengths`, :func:`generate_trace`: synthetic traces when the real one
  is not at hand: a Gamma renewal process (the CV controls burstiness; cv = 1 is Poisson) with optional
  :class:`Burst` windows (:func:`repeat_burst` replays one window again and again, as KunServe §5.6 does), and
  lognormal lengths matching a dataset's mean prompt / output lengths.
- :func:`upscale`, :func:`scale_lengths`: load knobs that keep the trace's shape over time.
- :func:`describe`: the numbers a benchmark report prints about its trace.

Everything is pure and deterministic for a seed; only the load / save / detect functions touch files.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# BurstGPT's CSV header, in the order save_trace_csv writes it. The loader finds columns by name, so
# files with the columns in another order or with extra columns load as well.
TIMESTAMP = "Timestamp"
MODEL = "Model"
REQUEST_TOKENS = "Request tokens"
RESPONSE_TOKENS = "Response tokens"
TOTAL_TOKENS = "Total tokens"
LOG_TYPE = "Log Type"
COLUMNS: tuple[str, ...] = (TIMESTAMP, MODEL, REQUEST_TOKENS, RESPONSE_TOKENS, TOTAL_TOKENS, LOG_TYPE)

SYNTHETIC_MODEL = "synthetic"
SYNTHETIC_LOG_TYPE = "Conversation log"

# Mean prompt and output tokens of the datasets the paper draws lengths from (KunServe §5, Table 2).
LENGTH_PROFILES: dict[str, tuple[int, int]] = {
    "burstgpt": (642, 262),
    "sharegpt": (1660, 373),
    "longbench": (5900, 499),
}

# Lognormal shape of synthetic lengths: prompts spread wider than outputs, as in the real datasets.
PROMPT_SIGMA = 1.0
OUTPUT_SIGMA = 0.8

# upscale() draws each copy's lengths from a request at most this many positions away from the original.
UPSCALE_NEIGHBOURS = 5

# Separates the random stream of generate_trace's lengths from that of its arrivals (same user seed).
_LENGTHS_STREAM = 0x1E5


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is.

    Validated on construction so a bad request fails where it is made, not mid-benchmark.
    """

    arrival_s: float      # seconds since the trace start (first request at 0 after loading a CSV)
    prompt_tokens: int    # >= 1
    output_tokens: int    # >= 1

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")


class TraceError(ValueError):
    """A trace that cannot be used; `line` is the 1-based line number in the file (a CSV header is line 1) or None.

    ``str()`` reads like a compiler error (``trace.csv:7: negative Request tokens: -3``) so the user can
    jump straight to the offending line.
    """

    def __init__(self, message: str, line: int | None = None, path: str | None = None) -> None:
        self.message = message
        self.line = line
        self.path = path
        super().__init__(self._format())

    def _format(self) -> str:
        if self.path is not None and self.line is not None:
            return f"{self.path}:{self.line}: {self.message}"
        if self.path is not None:
            return f"{self.path}: {self.message}"
        if self.line is not None:
            return f"line {self.line}: {self.message}"
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling passes only the formatted text back to __init__; keep the parts.
        return (type(self), (self.message, self.line, self.path))


# --------------------------------------------------------------------------------------------- CSV


def _parse_tokens(raw: str, column: str, line: int, path: str) -> int:
    """A token count: an integer (``12`` or an integral float such as ``12.0`` from pandas exports)."""
    try:
        value = int(raw)
    except ValueError:
        try:
            as_float = float(raw)
        except ValueError:
            raise TraceError(f"non-numeric {column}: {raw!r}", line, path) from None
        if not as_float.is_integer():
            raise TraceError(f"non-integer {column}: {raw!r}", line, path) from None
        value = int(as_float)
    if value < 0:
        raise TraceError(f"negative {column}: {value}", line, path)
    return value


def _parse_timestamp(raw: str, line: int, path: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"non-numeric {TIMESTAMP}: {raw!r}", line, path) from None
    if not math.isfinite(value):
        raise TraceError(f"non-finite {TIMESTAMP}: {raw!r}", line, path)
    return value


def _is_blank(row: list[str]) -> bool:
    # csv yields [] for an empty line; a line of spaces comes back as one whitespace-only field.
    return not row or (len(row) == 1 and not row[0].strip())


def load_burstgpt_csv(
    path: str | os.PathLike[str],
    *,
    model: str | None = None,
    log_type: str | None = None,
    limit: int | None = None,
) -> tuple[list[TraceRequest], int]:
    """Load a BurstGPT-format CSV; return ``(requests, skipped)``.

    Columns (header row, exact names, any order, extra columns ignored):
    ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``; Timestamp in seconds.

    Every row is checked (field count, empty values, numbers, negative tokens, non-decreasing
    timestamps) and the first problem raises :class:`TraceError` with its line number, because a
    silently repaired trace would benchmark something other than what the user asked for. Total tokens
    must be a non-negative integer but is not checked against the sum (nothing uses it).

    ``skipped`` counts the rows read but not kept: those with 0 request or 0 response tokens (failed
    requests in the real BurstGPT, which never reached a model) and those filtered out by ``model`` /
    ``log_type`` (matched case-insensitively, surrounding spaces ignored). Blank lines are ignored and
    not counted. With ``limit``, reading stops once ``limit`` requests are kept, so rows past that point
    are neither validated nor counted. Arrivals are shifted so the first kept request arrives at 0.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    where = os.fspath(path)
    want_model = model.strip().casefold() if model is not None else None
    want_log = log_type.strip().casefold() if log_type is not None else None

    stamps: list[float] = []
    lengths: list[tuple[int, int]] = []
    skipped = 0
    try:
        # utf-8-sig: spreadsheet exports often start with a byte-order mark that would glue onto "Timestamp".
        with open(where, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or _is_blank(header):
                raise TraceError("empty file: no header row", 1, where)
            names = [h.strip() for h in header]
            missing = [c for c in COLUMNS if c not in names]
            if missing:
                raise TraceError(f"missing column(s): {', '.join(missing)}", 1, where)
            col = {c: names.index(c) for c in COLUMNS}
            width = len(names)
            previous: float | None = None
            for row in reader:
                line = reader.line_num
                if _is_blank(row):
                    continue
                if len(row) != width:
                    raise TraceError(f"expected {width} fields, got {len(row)}", line, where)
                values = {c: row[i].strip() for c, i in col.items()}
                for c in COLUMNS:
                    if not values[c]:
                        raise TraceError(f"empty {c}", line, where)
                stamp = _parse_timestamp(values[TIMESTAMP], line, where)
                prompt = _parse_tokens(values[REQUEST_TOKENS], REQUEST_TOKENS, line, where)
                output = _parse_tokens(values[RESPONSE_TOKENS], RESPONSE_TOKENS, line, where)
                _parse_tokens(values[TOTAL_TOKENS], TOTAL_TOKENS, line, where)
                if previous is not None and stamp < previous:
                    raise TraceError(f"{TIMESTAMP} goes backwards: {stamp} after {previous}", line, where)
                previous = stamp
                if (
                    prompt == 0
                    or output == 0
                    or (want_model is not None and values[MODEL].casefold() != want_model)
                    or (want_log is not None and values[LOG_TYPE].casefold() != want_log)
                ):
                    skipped += 1
                    continue
                stamps.append(stamp)
                lengths.append((prompt, output))
                if limit is not None and len(stamps) >= limit:
                    break
    except FileNotFoundError:
        raise TraceError("file not found", None, where) from None
    except UnicodeDecodeError as e:
        raise TraceError(f"not a text file: {e.reason}", None, where) from None
    except csv.Error as e:
        raise TraceError(f"malformed CSV: {e}", None, where) from None
    except IsADirectoryError:
        raise TraceError("is a directory, not a CSV file", None, where) from None
    except PermissionError:
        raise TraceError("permission denied", None, where) from None

    if not stamps:
        raise TraceError("no requests in trace", None, where)
    start = stamps[0]
    trace = [TraceRequest(s - start, p, o) for s, (p, o) in zip(stamps, lengths)]
    return trace, skipped


def _format_float(x: float) -> str:
    # repr is the shortest text that parses back to the same float: the CSV round-trips exactly.
    return repr(float(x))


def _check_forward(trace: Sequence[TraceRequest]) -> None:
    for i in range(1, len(trace)):
        if trace[i].arrival_s < trace[i - 1].arrival_s:
            raise ValueError(f"trace arrivals go backwards at index {i}: "
                             f"{trace[i].arrival_s} after {trace[i - 1].arrival_s}")


def save_trace_csv(trace: Sequence[TraceRequest], path: str | os.PathLike[str]) -> None:
    """Write ``trace`` in BurstGPT format so it round-trips through :func:`load_burstgpt_csv`.

    Model is ``synthetic``, Log Type ``Conversation log``, Total tokens the sum. A trace whose
    arrivals go backwards is refused (ValueError) because the loader would refuse the file anyway;
    better to fail when it is written than when a benchmark starts.
    """
    _check_forward(trace)
    with open(os.fspath(path), "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        for r in trace:
            writer.writerow((
                _format_float(r.arrival_s), SYNTHETIC_MODEL, r.prompt_tokens, r.output_tokens,
                r.prompt_tokens + r.output_tokens, SYNTHETIC_LOG_TYPE,
            ))


# ------------------------------------------------------------------------- JSONL: timed_trace, Mooncake


@dataclass(frozen=True)
class JsonlFormat:
    """One of the two JSONL trace formats. Both are one object per line, ``{"timestamp", "input_length",
    "output_length", "hash_ids"}``: what differs is the time unit and how many prompt tokens one hash id covers.

    - ``timed_trace``: vLLM's ``vllm bench serve --dataset-name timed_trace`` dataset. Its loader multiplies
      ``timestamp`` by ``--timed-trace-sec-multiplier`` (default 1, so seconds) and, with ``--self-timed``,
      sends each request that many seconds after the benchmark starts (without ``--self-timed`` the timestamps
      are ignored). Each hash id expands to ``--timed-trace-chunk-hash-size`` (default 16) random prompt tokens,
      so the prompt is ``min(input_length, 16 × len(hash_ids))`` tokens long: a file must carry enough ids.
    - ``mooncake``: the Mooncake (FAST'25) traces: integer milliseconds since the first request, one hash id
      per 512-token block (equal ids are shared prefixes). vLLM replays them as timed_trace with
      ``--timed-trace-sec-multiplier 0.001 --timed-trace-chunk-hash-size 512``.
    """

    name: str
    units_per_second: float  # timestamps count these (a division, so 5999 ms is exactly 5.999 s)
    block_tokens: int
    integer_time: bool


TIMED_TRACE = JsonlFormat("timed_trace", 1.0, 16, integer_time=False)
MOONCAKE = JsonlFormat("mooncake", 1000.0, 512, integer_time=True)
JSONL_FORMATS: dict[str, JsonlFormat] = {f.name: f for f in (TIMED_TRACE, MOONCAKE)}
CSV_FORMAT = "csv"
TRACE_FORMATS: tuple[str, ...] = (CSV_FORMAT, TIMED_TRACE.name, MOONCAKE.name)
JSONL_TIMESTAMP = "timestamp"
JSONL_INPUT = "input_length"
JSONL_OUTPUT = "output_length"
JSONL_HASH_IDS = "hash_ids"

# detect_trace_format() reads at most this many JSONL rows to tell the hash-id block size.
DETECT_ROWS = 200


def _json_number(entry: dict[str, Any], key: str, line: int, path: str) -> float:
    if key not in entry:
        raise TraceError(f"missing field {key!r}", line, path)
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"non-numeric {key}: {value!r}", line, path)
    if not math.isfinite(value):
        raise TraceError(f"non-finite {key}: {value!r}", line, path)
    if value < 0:
        raise TraceError(f"negative {key}: {value!r}", line, path)
    return float(value)


def _json_tokens(entry: dict[str, Any], key: str, line: int, path: str) -> int:
    value = _json_number(entry, key, line, path)
    if not value.is_integer():
        raise TraceError(f"non-integer {key}: {entry[key]!r}", line, path)
    return int(value)


def _json_rows(f: Any, where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is a TraceError."""
    for line, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"invalid JSON: {e.msg} (column {e.colno})", line, where) from None
        if not isinstance(entry, dict):
            raise TraceError(f"expected a JSON object, got {type(entry).__name__}", line, where)
        yield line, entry


def _open_text(where: str, what: str) -> Any:
    """Open a trace for reading, with the loader's one-line errors for the usual OS failures."""
    try:
        return open(where, encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise TraceError("file not found", None, where) from None
    except IsADirectoryError:
        raise TraceError(f"is a directory, not a {what} file", None, where) from None
    except PermissionError:
        raise TraceError("permission denied", None, where) from None


def load_jsonl_trace(
    path: str | os.PathLike[str], fmt: str | JsonlFormat = TIMED_TRACE, *, limit: int | None = None
) -> tuple[list[TraceRequest], int]:
    """Load a ``timed_trace`` or ``mooncake`` JSONL trace (see :class:`JsonlFormat`); return ``(requests, skipped)``.

    Arrivals are ``timestamp`` in seconds (``/ units_per_second``) *without* shifting the first to 0, because that is when
    ``vllm bench serve --self-timed`` sends them (the offset from the start of the run). ``hash_ids`` is
    optional but must be a list of integers when present; the replay sends ``input_length`` tokens whatever it
    holds. Like the CSV loader, every row is checked (JSON object, required fields, non-negative integral
    lengths, finite non-negative timestamps that never go backwards) and the first problem raises
    :class:`TraceError` with its line; rows with 0 input or 0 output tokens are skipped and counted; blank lines
    are ignored; ``limit`` stops reading once that many requests are kept.
    """
    spec = JSONL_FORMATS[fmt] if isinstance(fmt, str) else fmt
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    where = os.fspath(path)
    trace: list[TraceRequest] = []
    skipped = 0
    previous: float | None = None
    with _open_text(where, "JSONL") as f:
        try:
            for line, entry in _json_rows(f, where):
                stamp = _json_number(entry, JSONL_TIMESTAMP, line, where)
                prompt = _json_tokens(entry, JSONL_INPUT, line, where)
                output = _json_tokens(entry, JSONL_OUTPUT, line, where)
                ids = entry.get(JSONL_HASH_IDS, [])
                if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
                    raise TraceError(f"{JSONL_HASH_IDS} must be a list of integers", line, where)
                if previous is not None and stamp < previous:
                    raise TraceError(f"{JSONL_TIMESTAMP} goes backwards: {stamp:g} after {previous:g}", line, where)
                previous = stamp
                if prompt == 0 or output == 0:
                    skipped += 1
                    continue
                trace.append(TraceRequest(stamp / spec.units_per_second, prompt, output))
                if limit is not None and len(trace) >= limit:
                    break
        except UnicodeDecodeError as e:
            raise TraceError(f"not a text file: {e.reason}", None, where) from None
    if not trace:
        raise TraceError("no requests in trace", None, where)
    return trace, skipped


def save_jsonl_trace(trace: Sequence[TraceRequest], path: str | os.PathLike[str],
                     fmt: str | JsonlFormat = TIMED_TRACE) -> None:
    """Write ``trace`` as ``timed_trace`` or ``mooncake`` JSONL so it round-trips through :func:`load_jsonl_trace`
    (timed_trace exactly; Mooncake to the millisecond, its integer unit).

    Every request gets ``ceil(input_length / block_tokens)`` fresh hash ids, consecutive and never reused: the
    replay's prompts are independent random tokens, so no two requests share a prefix, and vLLM's timed_trace
    loader (at its default chunk size for timed_trace, 512 for Mooncake) rebuilds prompts of exactly
    ``input_length`` tokens. Backwards arrivals are refused (ValueError), as by :func:`save_trace_csv`.
    """
    spec = JSONL_FORMATS[fmt] if isinstance(fmt, str) else fmt
    _check_forward(trace)
    next_id = 0
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        for r in trace:
            blocks = -(-r.prompt_tokens // spec.block_tokens)
            stamp = r.arrival_s * spec.units_per_second
            entry = {JSONL_TIMESTAMP: round(stamp) if spec.integer_time else float(stamp), JSONL_INPUT: r.prompt_tokens,
                     JSONL_OUTPUT: r.output_tokens, JSONL_HASH_IDS: list(range(next_id, next_id + blocks))}
            next_id += blocks
            f.write(json.dumps(entry) + "\n")


def _vote_block_size(entry: dict[str, Any]) -> str | None:
    """Which format's block size this row's hash_ids fit (None when neither or both: too short to tell)."""
    ids, prompt = entry.get(JSONL_HASH_IDS), entry.get(JSONL_INPUT)
    if not isinstance(ids, list) or isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 1:
        return None
    fits = [f.name for f in JSONL_FORMATS.values() if len(ids) == -(-prompt // f.block_tokens)]
    return fits[0] if len(fits) == 1 else None


def detect_trace_format(path: str | os.PathLike[str]) -> str:
    """``csv``, ``timed_trace`` or ``mooncake``, from the file's content.

    A file whose first non-blank line is a JSON object is JSONL, otherwise a BurstGPT CSV. The two JSONL
    formats have the same fields, so the hash ids decide: over the first ``DETECT_ROWS`` rows, the majority of
    those whose ``hash_ids`` cover ``input_length`` in 512-token blocks (Mooncake) or 16-token blocks (vLLM's
    default) wins; with no such row (no hash ids, or prompts of 16 tokens or fewer) a file named ``*mooncake*``
    is Mooncake and any other timed_trace. Unreadable rows are left for the loader to report with their line.
    """
    where = os.fspath(path)
    votes: Counter[str] = Counter()
    with _open_text(where, "trace") as f:
        try:
            first = next((line for line in f if line.strip()), "")
            if not first.lstrip().startswith("{"):
                return CSV_FORMAT
            for text in itertools.chain([first], itertools.islice(f, DETECT_ROWS - 1)):
                try:
                    entry = json.loads(text)
                except json.JSONDecodeError:
                    continue
                if isinstance(entry, dict) and (vote := _vote_block_size(entry)) is not None:
                    votes[vote] += 1
        except UnicodeDecodeError as e:
            raise TraceError(f"not a text file: {e.reason}", None, where) from None
    if votes and votes[MOONCAKE.name] != votes[TIMED_TRACE.name]:
        return votes.most_common(1)[0][0]
    return MOONCAKE.name if MOONCAKE.name in os.path.basename(where).lower() else TIMED_TRACE.name


def format_from_path(path: str | os.PathLike[str]) -> str | None:
    """The format a file name asks for when writing: ``.csv`` is BurstGPT CSV, ``.jsonl`` / ``.json`` is
    Mooncake when the name contains ``mooncake`` and timed_trace otherwise; None for any other extension."""
    name = os.path.basename(os.fspath(path)).lower()
    if name.endswith(".csv"):
        return CSV_FORMAT
    if name.endswith((".jsonl", ".json")):
        return MOONCAKE.name if MOONCAKE.name in name else TIMED_TRACE.name
    return None


def _check_format(fmt: str, where: str) -> None:
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (known: {', '.join(TRACE_FORMATS)})", None, where)


def load_trace(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    model: str | None = None,
    log_type: str | None = None,
    limit: int | None = None,
) -> tuple[list[TraceRequest], int, str]:
    """Load a trace in any of ``TRACE_FORMATS`` (``fmt``, or :func:`detect_trace_format` when None); return
    ``(requests, skipped, format)``. ``model`` / ``log_type`` filter BurstGPT CSV rows; the JSONL formats have
    no such columns, so asking for them there is a TraceError rather than a filter that silently keeps all."""
    where = os.fspath(path)
    fmt = fmt or detect_trace_format(where)
    _check_format(fmt, where)
    if fmt == CSV_FORMAT:
        trace, skipped = load_burstgpt_csv(where, model=model, log_type=log_type, limit=limit)
        return trace, skipped, fmt
    if model is not None or log_type is not None:
        raise TraceError(f"a {fmt} trace has no Model / Log Type columns to filter on", None, where)
    trace, skipped = load_jsonl_trace(where, fmt, limit=limit)
    return trace, skipped, fmt


def save_trace(trace: Sequence[TraceRequest], path: str | os.PathLike[str], fmt: str | None = None) -> str:
    """Write ``trace`` in ``fmt`` (or the format :func:`format_from_path` reads in the name); return the format."""
    where = os.fspath(path)
    fmt = fmt or format_from_path(where)
    if fmt is None:
        raise TraceError("cannot tell the trace format from the file name (.csv, .jsonl or *mooncake*.jsonl): "
                         f"give one of {', '.join(TRACE_FORMATS)}", None, where)
    _check_format(fmt, where)
    if fmt == CSV_FORMAT:
        save_trace_csv(trace, where)
    else:
        save_jsonl_trace(trace, where, fmt)
    return fmt


# ------------------------------------------------------------------------------------- generators


@dataclass(frozen=True)
class Burst:
    """A window in which the arrival rate is multiplied by ``factor``: ``[start_s, start_s + duration_s)``.

    This is the memory-overloading burst KunServe is about: for a while, many more requests than the
    cluster's KV cache can hold.
    """

    start_s: float
    duration_s: float
    factor: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.start_s) or self.start_s < 0:
            raise ValueError(f"burst start_s must be finite and >= 0, got {self.start_s}")
        if not math.isfinite(self.duration_s) or self.duration_s <= 0:
            raise ValueError(f"burst duration_s must be finite and > 0, got {self.duration_s}")
        if not math.isfinite(self.factor) or self.factor < 1:
            raise ValueError(f"burst factor must be finite and >= 1, got {self.factor}")

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


def repeat_burst(burst: Burst, copies: int, gap_s: float) -> list[Burst]:
    """``copies`` windows like ``burst``, each starting ``gap_s`` after the previous one ends.

    KunServe §5.6 (Fig. 17) replays a burst again and again to find how long each system holds before it runs
    out of memory; the copies keep the window's length and factor, so the load they add stacks up whenever
    the gap is too short for the cluster to drain.
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if not (math.isfinite(gap_s) and gap_s >= 0):
        raise ValueError(f"gap_s must be finite and >= 0, got {gap_s}")
    step = burst.duration_s + gap_s
    return [Burst(burst.start_s + k * step, burst.duration_s, burst.factor) for k in range(copies)]


BurstArg = Burst | Sequence[Burst] | None  # one window, several, or none


def burst_windows(burst: BurstArg) -> list[Burst]:
    """The windows of ``burst`` sorted by start; ValueError when two overlap (a rate cannot be multiplied by
    two factors at once, and the benchmark's per-burst metrics need each request in one window at most).
    Windows that merely touch (one ends where the next starts) are allowed."""
    if burst is None:
        return []
    windows = sorted([burst] if isinstance(burst, Burst) else list(burst), key=lambda b: b.start_s)
    for a, b in zip(windows, windows[1:]):
        if b.start_s < a.end_s:
            raise ValueError(f"burst windows overlap: [{a.start_s:g}, {a.end_s:g}) s and [{b.start_s:g}, {b.end_s:g}) s")
    return windows


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")


def gamma_arrivals(rate: float, cv: float, duration_s: float, *, seed: int, burst: BurstArg = None) -> list[float]:
    """Arrival times in ``[0, duration_s)`` of a Gamma renewal process with mean rate ``rate``.

    Inter-arrival gaps are Gamma(shape = 1/cv², scale = cv²/rate): mean 1/rate, coefficient of variation
    ``cv`` (cv = 1 is Poisson; larger is burstier). The process is an ordinary renewal process: the first
    arrival comes one gap after 0.

    With ``burst`` (one :class:`Burst` or several non-overlapping ones), the rate is ``rate × factor`` inside
    each window. A renewal process cannot simply switch rates mid-gap, so the process runs in *operational
    time* ``u(t) = ∫₀ᵗ λ(s)/rate ds``, which advances ``factor`` times faster inside a window, and each arrival
    is mapped back to wall time with the inverse of that piecewise-linear map. Inside a window the gaps shrink
    by its ``factor`` (``factor`` × the arrivals) while keeping the same CV; outside nothing changes.

    Deterministic for a seed (``numpy.random.default_rng(seed)``).
    """
    _positive("rate", rate)
    _positive("cv", cv)
    _positive("duration_s", duration_s)
    windows = burst_windows(burst)
    rng = np.random.default_rng(seed)

    # Knots of the operational-time map, clipped to the trace: wall times t_k, operational times u_k, and the
    # slope (the factor) on the segment starting at each knot.
    wall, oper, slope = [0.0], [0.0], [1.0]
    for w in windows:
        a, b = w.start_s, min(w.end_s, duration_s)
        if a >= duration_s:
            break
        for t, f in ((a, w.factor), (b, 1.0)):
            oper.append(oper[-1] + slope[-1] * (t - wall[-1]))
            wall.append(t)
            slope.append(f)
    u_end = oper[-1] + slope[-1] * (duration_s - wall[-1])

    shape = 1.0 / (cv * cv)
    scale = cv * cv / rate
    expected = u_end * rate
    chunk = int(expected + 6.0 * cv * math.sqrt(expected) + 16)
    parts: list[np.ndarray] = []
    total = 0.0
    while total < u_end:
        times = total + np.cumsum(rng.gamma(shape, scale, size=chunk))
        parts.append(times)
        total = float(times[-1])
        chunk = max(16, chunk // 4)
    u = np.concatenate(parts)
    u = u[u < u_end]

    # Inverse map back to wall time, segment by segment.
    segment = np.searchsorted(np.asarray(oper), u, side="right") - 1
    t = np.asarray(wall)[segment] + (u - np.asarray(oper)[segment]) / np.asarray(slope)[segment]
    t = t[t < duration_s]  # guard against rounding at the edge
    return [float(x) for x in t]


def _profile(profile: str) -> tuple[int, int]:
    key = profile.strip().lower()
    if key not in LENGTH_PROFILES:
        raise ValueError(f"unknown length profile {profile!r}; known: {', '.join(sorted(LENGTH_PROFILES))}")
    return LENGTH_PROFILES[key]


def _check_max(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _lognormal_ints(rng: np.random.Generator, mean: float, sigma: float, n: int, cap: int | None) -> np.ndarray:
    # mu = ln(mean) - sigma²/2 gives E[X] = mean.
    mu = math.log(mean) - sigma * sigma / 2.0
    x = np.rint(rng.lognormal(mu, sigma, size=n))
    x = np.maximum(x, 1.0)
    if cap is not None:
        x = np.minimum(x, float(cap))
    return x.astype(np.int64)


def synth_lengths(
    profile: str,
    n: int,
    *,
    seed: int,
    scale: float = 1.0,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> list[tuple[int, int]]:
    """``n`` (prompt, output) token lengths drawn like the named dataset's.

    Lognormal (long right tail, as real prompt / output lengths have), independent for prompt and output,
    with the profile's means × ``scale``; sigma 1.0 for prompts, 0.8 for outputs. Rounded and clamped to
    ``>= 1`` and to the optional maxima (so a model's context limit can be respected; clamping lowers the
    mean). Deterministic for a seed.
    """
    mean_prompt, mean_output = _profile(profile)
    _positive("scale", scale)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _check_max("max_prompt", max_prompt)
    _check_max("max_output", max_output)
    rng = np.random.default_rng(seed)
    prompts = _lognormal_ints(rng, mean_prompt * scale, PROMPT_SIGMA, n, max_prompt)
    outputs = _lognormal_ints(rng, mean_output * scale, OUTPUT_SIGMA, n, max_output)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def _derived_seed(seed: int, stream: int) -> int:
    # An independent stream for the same user seed (seed + 1 would collide with another run's seed).
    return int(np.random.SeedSequence([seed, stream]).generate_state(1, dtype=np.uint64)[0])


def generate_trace(
    *,
    rate: float,
    cv: float,
    duration_s: float,
    profile: str = "burstgpt",
    seed: int = 0,
    scale: float = 1.0,
    burst: BurstArg = None,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> list[TraceRequest]:
    """A synthetic trace: :func:`gamma_arrivals` times with :func:`synth_lengths` lengths.

    Arrivals and lengths use independent random streams derived from ``seed``, so changing the length
    profile does not move the arrivals. Deterministic for a seed.
    """
    _profile(profile)  # fail on a bad profile before generating arrivals
    arrivals = gamma_arrivals(rate, cv, duration_s, seed=seed, burst=burst)
    lengths = synth_lengths(profile, len(arrivals), seed=_derived_seed(seed, _LENGTHS_STREAM), scale=scale,
                            max_prompt=max_prompt, max_output=max_output)
    return [TraceRequest(t, p, o) for t, (p, o) in zip(arrivals, lengths)]


# ------------------------------------------------------------------------------------------ scaling


def upscale(trace: Sequence[TraceRequest], factor: float, *, seed: int = 0) -> list[TraceRequest]:
    """Multiply the trace's arrival rate by ``factor`` while keeping its duration and its shape over time.

    Dividing timestamps by ``factor`` would compress a 1-hour trace into minutes and shorten every burst;
    TraceUpscaler's idea (EuroSys'24) is instead to decouple the arrival times from the request data and
    upscale the arrivals in place. What is implemented:

    - every original request i is emitted ``floor(factor)`` times, plus once more with probability
      ``frac(factor)``, so the expected count is ``factor × n`` locally, in every stretch of the trace;
    - copy j of request i arrives at ``t_i + j × (t_{i+1} − t_i) / copies``, evenly inside the gap to the
      next original arrival (copy 0 is the original, at ``t_i``). The last request has no next arrival,
      so its copies go into the gap *before* it, keeping the trace's end; a one-request trace stacks its
      copies at ``t_0``;
    - copy 0 keeps its own lengths; every other copy takes the lengths of a request drawn uniformly from
      those at most ``UPSCALE_NEIGHBOURS`` positions away, so lengths stay locally distributed (a phase of
      long prompts stays long) without duplicating one request verbatim.

    The rate shape is preserved at the scale of one original inter-arrival gap and above; burstiness
    finer than that is smoothed by the even spacing. For ``factor < 1`` the same rule downsamples: each
    request is kept with probability ``factor`` (times unchanged, so the span may shrink at the ends).
    The input is sorted by arrival first (stable); the result is sorted by arrival.
    """
    _positive("factor", factor)
    reqs = sorted(trace, key=lambda r: r.arrival_s)
    n = len(reqs)
    if n == 0:
        return []
    rng = np.random.default_rng(seed)
    t = np.fromiter((r.arrival_s for r in reqs), dtype=np.float64, count=n)

    whole = math.floor(factor)
    frac = factor - whole
    copies = np.full(n, whole, dtype=np.int64)
    if frac > 0:
        copies += (rng.random(n) < frac).astype(np.int64)
    total = int(copies.sum())
    if total == 0:
        return []

    # Gap each request's copies spread into: forward to the next arrival; the last one looks backward.
    gap = np.zeros(n)
    if n > 1:
        gap[:-1] = np.diff(t)
        gap[-1] = -(t[-1] - t[-2])
    owner = np.repeat(np.arange(n), copies)
    first_of_owner = np.repeat(np.cumsum(copies) - copies, copies)
    j = np.arange(total) - first_of_owner
    times = t[owner] + j * gap[owner] / copies[owner]

    # Lengths: copy 0 keeps its own; others draw a neighbour within ±UPSCALE_NEIGHBOURS.
    lo = np.maximum(owner - UPSCALE_NEIGHBOURS, 0)
    hi = np.minimum(owner + UPSCALE_NEIGHBOURS, n - 1)
    neighbour = lo + np.floor(rng.random(total) * (hi - lo + 1)).astype(np.int64)
    neighbour = np.minimum(neighbour, hi)
    source = np.where(j == 0, owner, neighbour)

    order = np.argsort(times, kind="stable")
    out: list[TraceRequest] = []
    for k in order:
        src = reqs[int(source[k])]
        # max(): the backward copies of the last request cannot go below the previous arrival, but guard
        # the 0 boundary against rounding anyway.
        out.append(TraceRequest(max(float(times[k]), 0.0), src.prompt_tokens, src.output_tokens))
    return out


def scale_lengths(
    trace: Sequence[TraceRequest],
    factor: float,
    *,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> list[TraceRequest]:
    """Multiply every prompt and output length by ``factor`` (rounded, ``>= 1``, clamped to the maxima).

    For fitting a trace to a smaller model's context, or for stressing KV memory harder, while keeping
    the arrivals and the relative lengths.
    """
    _positive("factor", factor)
    _check_max("max_prompt", max_prompt)
    _check_max("max_output", max_output)

    def scaled(tokens: int, cap: int | None) -> int:
        value = max(1, round(tokens * factor))
        return min(value, cap) if cap is not None else value

    return [TraceRequest(r.arrival_s, scaled(r.prompt_tokens, max_prompt), scaled(r.output_tokens, max_output))
            for r in trace]


def describe(trace: Sequence[TraceRequest]) -> dict[str, Any]:
    """The numbers a benchmark report prints about its trace.

    Keys: ``n``, ``duration_s`` (last − first arrival), ``mean_rate`` (1 / mean inter-arrival gap, i.e.
    ``(n − 1) / duration_s``; None with fewer than 2 requests or zero duration), ``mean_prompt``,
    ``mean_output``, ``max_prompt``, ``max_output`` (None when empty) and ``cv`` (coefficient of
    variation of the inter-arrival gaps, population std / mean; None without a positive mean gap).
    """
    n = len(trace)
    if n == 0:
        return {"n": 0, "duration_s": 0.0, "mean_rate": None, "mean_prompt": None, "mean_output": None,
                "max_prompt": None, "max_output": None, "cv": None}
    t = np.sort(np.fromiter((r.arrival_s for r in trace), dtype=np.float64, count=n))
    prompts = np.fromiter((r.prompt_tokens for r in trace), dtype=np.int64, count=n)
    outputs = np.fromiter((r.output_tokens for r in trace), dtype=np.int64, count=n)
    duration = float(t[-1] - t[0])
    gaps = np.diff(t)
    mean_gap = float(gaps.mean()) if gaps.size else 0.0
    return {
        "n": n,
        "duration_s": duration,
        "mean_rate": (n - 1) / duration if duration > 0 else None,
        "mean_prompt": float(prompts.mean()),
        "mean_output": float(outputs.mean()),
        "max_prompt": int(prompts.max()),
        "max_output": int(outputs.max()),
        "cv": float(gaps.std()) / mean_gap if mean_gap > 0 else None,
    }
