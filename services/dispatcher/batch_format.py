"""OpenAI Batch files, both ways: the input JSONL a client submits (one request per line: `custom_id`,
`method`, `url`, `body`) and the result lines the batch produces (`id`, `custom_id`, `response`, `error`).

Pure: no I/O, no clock. Why the whole file is checked before anything is stored: a batch is accepted or
refused as a unit, so a client never has to work out which half of a file ran. Every error names its
line (1-based, as an editor shows it) and the field at fault; the first bad line refuses the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS_URL, CHAT_URL)
MAX_CUSTOM_ID_LEN = 512
# OpenAI's limits on batch metadata
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512
DEFAULT_COMPLETION_WINDOW = "24h"
MAX_COMPLETION_WINDOW_S = 7 * 24 * 3600
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}

# Error codes of result lines for requests that never ran (OpenAI's)
EXPIRED = "batch_expired"
CANCELLED = "batch_cancelled"
NEVER_RAN = {EXPIRED: "This request could not be executed before the completion window expired.",
             CANCELLED: "This request could not be executed before the batch was cancelled."}


class BatchFormatError(ValueError):
    """The submitted batch is malformed; `line` (1-based) is the offending line when there is one."""

    def __init__(self, message: str, *, line: int | None = None, param: str | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line, self.param = line, param


@dataclass(frozen=True)
class BatchRequest:
    """One parsed input line."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch(data: bytes, *, endpoint: str = "", max_bytes: int, max_requests: int,
                check_body: Callable[[str, dict[str, Any]], None] | None = None) -> tuple[str, list[BatchRequest]]:
    """(the batch's endpoint, its requests in input order), or BatchFormatError for the first problem.

    `endpoint` empty: the first request's url, which every other line must then share (OpenAI runs one
    endpoint per batch). Blank lines are skipped (a trailing newline is not a request). `check_body(url,
    body)` raises ValueError for a body its endpoint would refuse (a bad field, another model, streaming);
    its message becomes the line's error."""
    if len(data) > max_bytes:
        raise BatchFormatError(f"the file is {len(data)} bytes; at most {max_bytes} (dispatcher.batch_max_bytes)")
    if endpoint and endpoint not in ENDPOINTS:
        raise BatchFormatError(f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(requests) == max_requests:
            raise BatchFormatError(f"more than {max_requests} requests (dispatcher.batch_max_requests)", line=number)
        req = _parse_line(raw, number)
        endpoint = endpoint or req.url
        if req.url != endpoint:
            raise BatchFormatError(f"url: {req.url!r} differs from the batch's endpoint {endpoint!r}; a batch runs one "
                                   "endpoint", line=number, param="url")
        if req.custom_id in seen:
            raise BatchFormatError(f"custom_id: {req.custom_id!r} is also the custom_id of line {seen[req.custom_id]}; "
                                   "each request needs its own", line=number, param="custom_id")
        seen[req.custom_id] = number
        if check_body is not None:
            try:
                check_body(req.url, req.body)
            except ValueError as exc:
                raise BatchFormatError(f"body: {exc}", line=number, param="body") from None
        requests.append(req)
    if not requests:
        raise BatchFormatError("the file has no requests (one JSON object per line)")
    return endpoint, requests


def _parse_line(raw: bytes, number: int) -> BatchRequest:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchFormatError(f"not UTF-8 text (byte {exc.start + 1})", line=number) from None
    try:
        obj = json.loads(text.removeprefix("\ufeff") if number == 1 else text)  # an editor's byte-order mark
    except json.JSONDecodeError as exc:
        raise BatchFormatError(f"not valid JSON: {exc.msg} (column {exc.colno})", line=number) from None
    if not isinstance(obj, dict):
        raise BatchFormatError(f"must be a JSON object, got {type(obj).__name__}", line=number)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_LEN:
        raise BatchFormatError(f"custom_id: must be a string of 1 to {MAX_CUSTOM_ID_LEN} characters, got {custom_id!r}",
                               line=number, param="custom_id")
    method = obj.get("method")
    if method != "POST":
        raise BatchFormatError(f"method: must be \"POST\", got {method!r}", line=number, param="method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise BatchFormatError(f"url: must be one of {', '.join(ENDPOINTS)}, got {url!r}", line=number, param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchFormatError(f"body: must be a JSON object, got {body!r}", line=number, param="body")
    return BatchRequest(number, custom_id, url, body)


def completion_window_s(window: str) -> int:
    """Seconds of a completion window: `24h` (OpenAI's only value), or any `<N>s`, `<N>m`, `<N>h` up to 7 days."""
    m = _WINDOW.match(window)
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_COMPLETION_WINDOW_S:
        raise BatchFormatError(f"completion_window: must look like \"24h\" (<N>s, <N>m or <N>h, up to 168h), got {window!r}",
                               param="completion_window")
    return seconds


def check_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if len(metadata) > MAX_METADATA_KEYS:
        raise BatchFormatError(f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param="metadata")
    for k, v in metadata.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_METADATA_KEY_LEN:
            raise BatchFormatError(f"metadata: keys must be strings of 1 to {MAX_METADATA_KEY_LEN} characters, got {k!r}",
                                   param="metadata")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_LEN:
            raise BatchFormatError(f"metadata[{k!r}]: must be a string of at most {MAX_METADATA_VALUE_LEN} characters",
                                   param="metadata")
    return dict(metadata)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def response_line(line_id: str, custom_id: str, status_code: int, request_id: str, body: Mapping[str, Any]) -> str:
    """The result of a request that ran: its HTTP status and the body the endpoint answered (an error object
    for a status other than 200), as OpenAI writes it."""
    return _dumps({"id": line_id, "custom_id": custom_id,
                   "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None})


def never_ran_line(line_id: str, custom_id: str, code: str) -> str:
    """The result of a request the batch ended before it ran (expired, cancelled)."""
    return _dumps({"id": line_id, "custom_id": custom_id, "response": None,
                   "error": {"code": code, "message": NEVER_RAN[code]}})
