"""The HTTP replay against OpenAI-compatible servers: SSE framing on byte strings, token counting from the
chunks and the usage chunk, the shared open-loop schedule, and a whole replay against a small in-process
aiohttp server on 127.0.0.1 that answers each request differently (tokens, refusal, error event, cut stream)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from fake_openai import FakeServer, chunk, sse, usage

from kunserve.benchkit.openai_replay import (
    CompletionStream,
    EndpointError,
    SseParser,
    completion_body,
    list_models,
    normalize_base_url,
    replay_openai,
)
from kunserve.benchkit.replay import open_loop, prompt_ids
from kunserve.benchkit.stats import RequestResult, summarize
from kunserve.benchkit.trace import TraceRequest


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def events_of(*pieces: bytes) -> list[str]:
    p = SseParser()
    out = [e for piece in pieces for e in p.feed(piece)]
    return out + p.close()


# ----------------------------------------------------------------------------------------------- SSE


STREAM = sse(chunk("Hé")) + b": keep-alive\n\n" + sse(chunk("llo", "length")) + sse(usage(2)) + b"data: [DONE]\n\n"


def test_sse_events_whatever_the_chunking():
    expected = [json.dumps(chunk("Hé")), json.dumps(chunk("llo", "length")), json.dumps(usage(2)), "[DONE]"]
    assert events_of(STREAM) == expected
    assert events_of(*(bytes([b]) for b in STREAM)) == expected  # split inside lines and inside "é"
    assert events_of(STREAM.replace(b"\n", b"\r\n")) == expected
    crlf = STREAM.replace(b"\n", b"\r\n")
    assert events_of(*(crlf[i:i + 3] for i in range(0, len(crlf), 3))) == expected
    assert events_of(STREAM.replace(b"\n", b"\r")) == expected


def test_sse_fields_comments_multiline_and_unterminated_tail():
    raw = b"event: completion\nid: 7\ndata:{\"a\":\ndata: 1}\nretry: 10\n\n:comment\n\n\n\ndata: last"
    assert events_of(raw) == ['{"a":\n1}', "last"]
    assert events_of(b"") == [] and events_of(b"\n\n: only a comment\n\n") == []


# ------------------------------------------------------------------------------------ token counting


def stream_of(*objs, times=None) -> CompletionStream:
    s = CompletionStream()
    for i, obj in enumerate(objs):
        s.on_data(obj if isinstance(obj, str) else json.dumps(obj), times[i] if times else float(i))
    return s


def test_one_chunk_per_token_with_usage_and_done():
    s = stream_of(chunk("a"), chunk("b"), chunk("c", "length"), usage(3), "[DONE]")
    assert s.ok and s.done and s.finish_reason == "length" and s.token_times() == [0.0, 1.0, 2.0]


def test_empty_text_tokens_count_and_a_bare_finishing_chunk_only_when_usage_says_so():
    # a token whose text is empty mid-stream (finish_reason null) is a token
    assert stream_of(chunk("a"), chunk(""), chunk("b", "length"), usage(3)).token_times() == [0.0, 1.0, 2.0]
    # the last token decoded to nothing: usage counts 3, so the finishing chunk carried it
    assert stream_of(chunk("a"), chunk("b"), chunk("", "length"), usage(3)).token_times() == [0.0, 1.0, 2.0]
    # a finishing chunk without a token (usage 2): not a token
    assert stream_of(chunk("a"), chunk("b"), chunk("", "stop"), usage(2)).token_times() == [0.0, 1.0]
    # no usage chunk: chunks are all we have
    assert stream_of(chunk("a"), chunk("b"), chunk("", "stop")).token_times() == [0.0, 1.0]


def test_chunks_carrying_several_tokens_are_counted_by_usage():
    s = stream_of(chunk("ab"), chunk("cde", "length"), usage(5), times=[0.5, 1.5, 1.6])
    assert s.token_times() == [0.5, 1.5, 1.5, 1.5, 1.5]
    r = RequestResult(0, 0.0, 0.0, 4, 5, ttft_s=0.5, token_times_s=s.token_times(), ok=True)
    assert r.tokens == 5 and r.tpot_s == pytest.approx((1.5 - 0.5) / 4)  # vLLM's TPOT definition
    # usage below the chunk count: the first and the last token times are kept
    assert stream_of(chunk("a"), chunk("b"), chunk("c", "stop"), usage(2)).token_times() == [0.0, 2.0]
    assert stream_of(chunk("a", "stop"), usage(0)).token_times() == []


@pytest.mark.parametrize("data, error", [
    ({"error": {"message": "KV cache exhausted", "type": "server_error"}}, "server error: KV cache exhausted"),
    ({"object": "error", "message": "old vLLM style"}, "server error: old vLLM style"),
    ("{not json", "unreadable SSE data"),
    ("[1, 2]", "unexpected SSE data"),
])
def test_error_events(data, error):
    s = stream_of(chunk("a"), data)
    assert not s.ok and s.error.startswith(error)


def test_aborted_or_unfinished_streams_are_not_ok():
    assert not stream_of(chunk("a"), chunk("", "abort"), "[DONE]").ok
    assert not stream_of(chunk("a"), chunk("b")).ok


# ------------------------------------------------------------------------------------------ base URL


@pytest.mark.parametrize("url, base", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("https://host/openai/v1", "https://host/openai/v1"),
])
def test_base_url(url, base):
    assert normalize_base_url(url) == base


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h/v1", "http:///v1", "http://h/v1?x=1"])
def test_bad_base_url(url):
    with pytest.raises(EndpointError):
        normalize_base_url(url)


def test_body_is_what_vllm_bench_sends_plus_greedy():
    body = completion_body("m", [301, 302], 7)
    assert body == {"model": "m", "prompt": [301, 302], "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}


# -------------------------------------------------------------------------------------- open loop


def test_open_loop_sends_at_arrival_and_stop_counts_the_unsent():
    async def main():
        stop = asyncio.Event()
        sent: list[int] = []
        done: list[int] = []

        async def send(index: int, req: TraceRequest, t0: float) -> RequestResult:
            sent.append(index)
            if index == 1:
                stop.set()
            return RequestResult(index, req.arrival_s, 0.0, req.prompt_tokens, req.output_tokens, ok=True)

        trace = [TraceRequest(0.0, 1, 1), TraceRequest(0.05, 1, 1), TraceRequest(3600.0, 1, 1)]
        out = await open_loop(trace, send, stop=stop, on_done=lambda r: done.append(r.index))
        return out, sent, done

    out, sent, done = run(main())
    assert out.interrupted and out.not_sent == 1 and sent == [0, 1] == done
    assert [r.index for r in out.results] == [0, 1]


# ------------------------------------------------------------------------------ against a fake server


def with_server(server: FakeServer, fn):
    async def main():
        await server.start()
        try:
            return await fn(server)
        finally:
            await server.stop()

    return run(main())


TRACE = [TraceRequest(0.0, 5, 3), TraceRequest(0.01, 7, 4), TraceRequest(0.02, 3, 2), TraceRequest(0.03, 4, 3),
         TraceRequest(0.04, 2, 2)]


def test_replay_measures_every_request_and_reports_each_failure():
    kinds = {1: "refuse", 2: "error", 3: "cut", 4: "json"}
    server = FakeServer(lambda i: kinds.get(i, "tokens"), key="sekret")
    done: list[int] = []

    outcome = with_server(server, lambda s: replay_openai(TRACE, s.url, api_key="sekret", seed=5,
                                                          on_done=lambda r: done.append(r.index)))
    res = {r.index: r for r in outcome.results}
    assert sorted(done) == sorted(res) == [0, 1, 2, 3, 4] and not outcome.interrupted
    ok = res[0]
    assert ok.ok and ok.error == "" and ok.finish_reason == "length" and ok.tokens == 3
    assert ok.ttft_s == ok.token_times_s[0] and ok.e2e_s >= ok.token_times_s[-1] and ok.sent_s >= ok.arrival_s
    assert res[1].error == "HTTP 429: too many requests" and res[1].e2e_s is None
    assert res[2].error == "server error: worker lost" and res[2].tokens == 1
    assert res[3].error.startswith("the stream ended before the request finished")
    assert res[4].error == "HTTP 200 but not an event stream (Content-Type: application/json)"
    assert not any(res[i].ok for i in (1, 2, 3, 4))
    # the same prompts the gRPC replay sends for this seed, the first model listed
    for i, req in enumerate(TRACE):
        assert server.bodies[i] == completion_body("fake-model", prompt_ids(i, req.prompt_tokens, 5), req.output_tokens)
    s = summarize(outcome.results, outcome.duration_s)
    assert s["completed"] == 1 and s["failed"] == 4 and s["errors"]["HTTP 429: too many requests"] == 1


def test_replay_with_a_named_model():
    server = FakeServer()
    outcome = with_server(server, lambda s: replay_openai(TRACE[:1], s.url, model="other"))
    assert outcome.results[0].ok and server.bodies[0]["model"] == "other"


@pytest.mark.parametrize("models, key, message", [
    ("<html>hello</html>", None, "did not answer like an OpenAI server"),
    ({"object": "list", "data": []}, None, "lists no model"),
    ({"data": [{"name": "x"}]}, None, "did not answer like an OpenAI server"),
    (None, "sekret", "HTTP 401: bad key (give --api-key or set OPENAI_API_KEY)"),
])
def test_models_probe_errors(models, key, message):
    server = FakeServer(models=models, key=key)
    with pytest.raises(EndpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with_server(server, lambda s: list_models(s.url))


def test_wrong_path_and_unreachable_port():
    server = FakeServer()
    with pytest.raises(EndpointError, match="HTTP 404.*is http://127.0.0.1:.*/api the base of an OpenAI API"):
        with_server(server, lambda s: list_models(s.url.replace("/v1", "/api")))
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EndpointError, match=f"cannot reach the OpenAI endpoint at http://127.0.0.1:{port}/v1"):
        run(replay_openai(TRACE, f"http://127.0.0.1:{port}/v1"))
