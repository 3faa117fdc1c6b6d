"""Replay a request trace against any OpenAI-compatible server (KunServe's HTTP front, vLLM, ...) over HTTP,
measuring what the gRPC replay measures: TTFT, per-token times and end-to-end latency from the SSE stream.

Same prompts, same schedule: the requests go out on :func:`kunserve.benchkit.replay.open_loop` (one task per
request, at its arrival time) and carry the token-id prompts of :func:`kunserve.benchkit.replay.prompt_ids`, so
a seed sends the same tokens over gRPC and over HTTP and the two runs compare request for request. The body is
what ``vllm bench serve --backend openai`` sends to ``/v1/completions`` (``stream``, ``stream_options.
include_usage``, ``max_tokens``, ``ignore_eos``) plus ``temperature: 0``, so every request generates exactly its
trace output length.

Counting tokens from an SSE stream: a chunk whose ``choices[0]`` has text, or no finish reason yet, carries a
token. The usage chunk then settles what chunks cannot say: a finishing chunk with empty text counts when usage
says a token is missing (a token that decodes to nothing), and a server that packs several tokens into one chunk
has the missing ones timed at its last token chunk (when they had all arrived), so ``tokens`` and TPOT agree
with vLLM's definition (TPOT = (last token - first token) / (tokens - 1)).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kunserve.benchkit.replay import ReplayOutcome, open_loop, prompt_ids
from kunserve.benchkit.stats import RequestResult
from kunserve.benchkit.trace import TraceRequest

CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 10.0
MAX_ERROR_BODY = 64 * 1024  # an error answer is read up to this many bytes for its message
DONE = "[DONE]"


class EndpointError(RuntimeError):
    """The base URL does not lead to an OpenAI-compatible server: `bench` reports it in one line."""


def normalize_base_url(url: str) -> str:
    """``http(s)://HOST:PORT[/path]`` without a trailing slash; a URL with no path means ``/v1`` (where the OpenAI
    API lives on vLLM and on KunServe's front), so ``http://127.0.0.1:8000`` works as well."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EndpointError(f"not an http(s) URL: {url!r} (expected http://HOST:PORT/v1)")
    if parsed.query or parsed.fragment:
        raise EndpointError(f"the endpoint is a base URL, without ?query or #fragment: {url!r}")
    path = parsed.path.rstrip("/") or "/v1"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error object (``{"error": {"message": ...}}``, or vLLM's older ``{"object":
    "error", "message": ...}``), else the body's first line."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return text.splitlines()[0][:200] if text else "(empty body)"
    message = _error_of(doc)
    return message if message is not None else text[:200]


def _error_of(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err:
        return str(err)
    if doc.get("object") == "error":
        return str(doc.get("message") or "error")
    return None


async def list_models(base_url: str, *, api_key: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The model ids of ``GET {base}/models``: the reachability check of a replay, with one-line errors that say
    what is wrong (unreachable, refused credentials, not an OpenAI server)."""
    url = f"{base_url}/models"
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(CONNECT_TIMEOUT_S, timeout_s))
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=_headers(api_key)) as session:
            async with session.get(url) as resp:
                body = await resp.content.read(MAX_ERROR_BODY)
                status = resp.status
    except TimeoutError:
        raise EndpointError(f"no answer from {url} in {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise EndpointError(f"cannot reach the OpenAI endpoint at {base_url}: {exc}") from None
    if status == 401:
        raise EndpointError(f"{url}: HTTP 401: {_error_message(body)} (give --api-key or set OPENAI_API_KEY)")
    if status != 200:
        raise EndpointError(f"{url}: HTTP {status}: {_error_message(body)} (is {base_url} the base of an OpenAI API, "
                            "like http://HOST:PORT/v1?)")
    try:
        doc = json.loads(body)
        ids = [str(m["id"]) for m in doc["data"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise EndpointError(f"{url} did not answer like an OpenAI server (expected {{\"data\": [{{\"id\": ...}}]}})") from None
    if not ids:
        raise EndpointError(f"{url} lists no model: give --model")
    return ids


class SseParser:
    """Server-sent events from a byte stream, chunk boundaries anywhere (inside a line, a CRLF or a UTF-8
    character): ``feed`` returns the ``data`` of every event a chunk completes (multi-line data joined with
    newlines); comments and the other fields are dropped. ``close`` flushes an event the stream ended without
    its blank line, as vLLM's client accepts."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        text = self._text + self._decoder.decode(chunk)
        held = ""
        if text.endswith("\r"):  # may be the first half of a CRLF
            text, held = text[:-1], "\r"
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._text = lines.pop() + held
        return [event for line in lines if (event := self._line(line)) is not None]

    def close(self) -> list[str]:
        tail = (self._text + self._decoder.decode(b"", final=True)).replace("\r", "")
        self._text = ""
        events = [event for line in (tail, "") if (event := self._line(line)) is not None]
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass
class CompletionStream:
    """What one streamed ``/v1/completions`` answer said, event by event (``on_data`` with the client time of
    each event since the request was sent)."""

    finish_reason: str = ""
    error: str = ""
    done: bool = False          # data: [DONE] arrived
    usage_tokens: int | None = None
    _times: list[float] = field(default_factory=list)
    _finish_time: float | None = None  # a finishing chunk with empty text: a token only if usage says so

    def on_data(self, data: str, t: float) -> None:
        """One event's data; sets ``done`` at ``[DONE]`` and ``error`` on an error object or unreadable data."""
        if data.strip() == DONE:
            self.done = True
            return
        try:
            doc = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"unreadable SSE data: {data[:120]!r}"
            return
        message = _error_of(doc)
        if message is not None:
            self.error = f"server error: {message}"
            return
        if not isinstance(doc, dict):
            self.error = f"unexpected SSE data: {data[:120]!r}"
            return
        choices = doc.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            finish = choice.get("finish_reason")
            if choice.get("text") or finish is None:
                self._times.append(t)
            else:
                self._finish_time = t
            if finish:
                self.finish_reason = str(finish)
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]

    def token_times(self) -> list[float]:
        """Each received token's time since send, reconciled with the usage count (see the module docstring)."""
        times = list(self._times)
        n = self.usage_tokens
        if n is None or n == len(times):
            return times
        if n > len(times) and self._finish_time is not None:
            times.append(self._finish_time)
        if n > len(times) and times:
            times += [times[-1]] * (n - len(times))
        elif n < len(times):
            times = times[: n - 1] + times[-1:] if n > 0 else []
        return times

    @property
    def ok(self) -> bool:
        return not self.error and self.finish_reason not in ("", "abort")


def completion_body(model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """What a request sends: vLLM's openai backend body (its ``repetition_penalty`` and ``logprobs`` left to the
    server's defaults) with ``ignore_eos`` and greedy decoding."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def _one(session: aiohttp.ClientSession, url: str, model: str, req: TraceRequest, index: int, t0: float,
               seed: int, timeout_s: float, request_prefix: str) -> RequestResult:
    sent = time.monotonic()
    res = RequestResult(index=index, arrival_s=req.arrival_s, sent_s=sent - t0, prompt_tokens=req.prompt_tokens,
                        output_tokens=req.output_tokens)
    stream = CompletionStream()
    body = completion_body(model, prompt_ids(index, req.prompt_tokens, seed), req.output_tokens)
    try:
        async with session.post(url, json=body, headers={"X-Request-Id": f"{request_prefix}{index}"}) as resp:
            if resp.status != 200:
                stream.error = f"HTTP {resp.status}: {_error_message(await resp.content.read(MAX_ERROR_BODY))}"
            elif resp.content_type != "text/event-stream":
                stream.error = f"HTTP 200 but not an event stream (Content-Type: {resp.content_type})"
            else:
                parser = SseParser()
                async for chunk in resp.content.iter_any():
                    for data in parser.feed(chunk):
                        stream.on_data(data, time.monotonic() - sent)
                    if stream.done or stream.error:
                        break
                else:
                    for data in parser.close():
                        stream.on_data(data, time.monotonic() - sent)
        if not stream.error and not stream.finish_reason:
            stream.error = "the stream ended before the request finished (no finish_reason)"
        elif stream.ok:
            res.e2e_s = time.monotonic() - sent
    except TimeoutError:
        stream.error = f"timeout: the stream did not end within {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        stream.error = "interrupted"
    times = stream.token_times()
    res.ok = stream.ok
    res.error = stream.error or ("" if res.ok else f"stream ended with finish_reason {stream.finish_reason!r}")
    res.ttft_s = times[0] if times else None
    res.token_times_s = times
    res.finish_reason = stream.finish_reason
    return res


async def replay_openai(trace: Sequence[TraceRequest], base_url: str, *, model: str | None = None,
                        api_key: str | None = None, seed: int = 0, timeout_s: float = 600.0,
                        stop: asyncio.Event | None = None, on_done: Callable[[RequestResult], None] | None = None,
                        request_prefix: str = "bench-") -> ReplayOutcome:
    """Send every request to ``{base_url}/completions`` at its arrival time and wait for all streams; `model`
    defaults to the first id of ``GET {base_url}/models`` (which is asked either way, so an unreachable or
    non-OpenAI URL is one EndpointError, not N failed requests). `stop` interrupts as in the gRPC replay: open
    streams are closed, which cancels the requests on a server that notices disconnects (vLLM, KunServe)."""
    base = normalize_base_url(base_url)
    models = await list_models(base, api_key=api_key)
    name = model or models[0]
    url = f"{base}/completions"
    # No connection limit: a bounded pool would queue requests in the client and turn the open loop closed.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=_headers(api_key)) as session:
        async def send(index: int, req: TraceRequest, t0: float) -> RequestResult:
            return await _one(session, url, name, req, index, t0, seed, timeout_s, request_prefix)

        return await open_loop(trace, send, stop=stop, on_done=on_done)


__all__ = ["CompletionStream", "EndpointError", "SseParser", "completion_body", "list_models", "normalize_base_url",
           "replay_openai"]
