"""The OpenAI-compatible HTTP front of a real local cluster, driven by the official `openai` SDK and by a raw
HTTP client: the same greedy tokens as the gRPC API (and the dense reference), SSE framing byte for byte, chat
through the model's template, a client that disconnects mid-stream frees its KV on the worker, and every bad
field is a 400 naming it (never a 500, never a traceback in the dispatcher's log)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

import openai
import pytest
from helpers import check_against_reference, generate_many, make_config, run, worker_stats

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.model.chat_template import chat_template_for
from kunserve.shared.model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

MODEL = "kunserve-tiny"
PROMPT_IDS = [300 + (7 * i) % 900 for i in range(40)]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    c = LocalCluster(make_config(1), run_dir=tmp_path_factory.mktemp("front"))
    c.start(timeout_s=120)
    log_path = c.child("dispatcher").log_path
    yield c
    c.stop()
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log and "http_request_failed" not in log, "the front failed on a request"


def sdk(c: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{c.cfg.dispatcher.http_address}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def grpc_text(c: LocalCluster, prompt, max_tokens: int) -> tuple[list[int], str]:
    (res,) = run(generate_many(c.cfg.dispatcher.address, [client.make_request(prompt, max_tokens=max_tokens,
                                                                             ignore_eos=True)]))
    assert not isinstance(res, BaseException), res
    return res.token_ids, res.text



def test_models_health_version(front):
    models = sdk(front).models.list()
    assert [m.id for m in models.data] == [MODEL]
    conn = http.client.HTTPConnection(front.cfg.dispatcher.http_address, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b""
    conn.request("GET", "/version")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["version"]


def test_completions_equal_the_grpc_api_and_the_reference(front):
    ids, text = grpc_text(front, PROMPT_IDS, 12)
    check_against_reference(PROMPT_IDS, ids, 12)
    api = sdk(front)
    whole = api.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text == ByteTokenizer().decode(ids)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT_IDS), 12)

    chunks = list(api.completions.create(model=MODEL, prompt=[PROMPT_IDS], max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *tokens, last = chunks
    assert "".join(ch.choices[0].text for ch in tokens) == text
    assert [ch.choices[0].finish_reason for ch in tokens] == [None] * 11 + ["length"]
    assert last.choices == [] and last.usage.completion_tokens == 12 and last.usage.prompt_tokens == len(PROMPT_IDS)


def test_text_prompt_and_stop_string(front):
    api = sdk(front)
    base = api.completions.create(model=MODEL, prompt="Hello there", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert len(base.text) >= 4
    stop = base.text[2:4]
    cut = api.completions.create(model=MODEL, prompt="Hello there", max_tokens=10, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == base.text[:base.text.index(stop)] and cut.finish_reason == "stop"


def test_chat_renders_the_template_stream_and_not(front):
    api = sdk(front)
    whole = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    rendered = chat_template_for(ByteTokenizer()).render(CHAT)
    prompt = ByteTokenizer().encode_chat(rendered)
    ids, text = grpc_text(front, prompt, 8)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(prompt) and whole.id.startswith("chatcmpl-")
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def _raw_post(address: str, body: dict, headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def test_sse_framing_byte_for_byte(front):
    status, headers, raw = _raw_post(front.cfg.dispatcher.http_address,
                                     {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 5, "stream": True,
                                      "ignore_eos": True, "stream_options": {"include_usage": True}},
                                     {"X-Request-Id": "sse-framing"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    bodies = []
    for ev in events[:-2]:
        assert re.fullmatch(rb"data: \{.*\}", ev, re.S), ev  # one data line per event, nothing else
        bodies.append(json.loads(ev[len(b"data: "):]))
    assert len(bodies) == 6  # 5 tokens + the usage chunk
    assert {b["id"] for b in bodies} == {"cmpl-sse-framing"}
    assert all(b["object"] == "text_completion" and b["model"] == MODEL for b in bodies)
    assert [b["choices"][0]["finish_reason"] for b in bodies[:5]] == [None] * 4 + ["length"]
    assert all(b["usage"] is None for b in bodies[:5])
    assert bodies[5]["choices"] == [] and bodies[5]["usage"] == {"prompt_tokens": len(PROMPT_IDS),
                                                                   "completion_tokens": 5, "total_tokens": 45}


def test_a_client_that_disconnects_mid_stream_frees_its_kv(front):
    host, port = front.cfg.dispatcher.http_address.rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:  # a few tokens: the request runs on the worker and holds KV
        chunk = sock.recv(65536)
        assert chunk, "the stream ended early"
        got += chunk
    assert worker_stats(front).kv_blocks_used > 0
    sock.close()
    deadline = time.monotonic() + 30
    while True:
        s = worker_stats(front)
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            break
        assert time.monotonic() < deadline, f"KV still held after the client left: {s}"
        time.sleep(0.1)
    assert s.generated_tokens_total < 1500 + 200, "the request ran to its end after the client left"


BAD = [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "seed": "s"}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["y"] * 17}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "b"]}, "prompt"),
    ({"prompt": [5] * 3000}, "prompt"),
    ({"prompt": [10 ** 7]}, "prompt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_every_bad_field_is_a_400_naming_it(front, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk(front).completions.create(model=MODEL, prompt=body.pop("prompt", None), extra_body=body)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param and err["message"], err


def test_unknown_model_malformed_json_and_bad_chat_are_4xx_errors(front):
    api = sdk(front)
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[])
    host, port = front.cfg.dispatcher.http_address.rsplit(":", 1)
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 400, raw
        assert json.loads(resp.read())["error"]["type"] == "invalid_request_error"
    conn.request("GET", "/v1/nothing")
    resp = conn.getresponse()
    assert resp.status == 404 and "error" in json.loads(resp.read())


def test_the_payloads_vllm_bench_serve_sends_are_served(front):
    """`vllm bench serve --backend openai` / `--backend openai-chat` send exactly these bodies (vLLM's
    benchmarks/lib/endpoint_request_func.py): its neutral repetition_penalty, a null logprobs, text parts in
    chat content, max_completion_tokens, usage at the end of the stream, and an x-request-id header."""
    completions = {"model": MODEL, "prompt": PROMPT_IDS, "repetition_penalty": 1.0, "max_tokens": 6, "logprobs": None,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}],
            "max_completion_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    host, port = front.cfg.dispatcher.http_address.rsplit(":", 1)
    for path, body in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                      "x-request-id": f"vllm-bench-{path.count('/')}"})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, raw
        chunks = [json.loads(m.removeprefix(b"data: ")) for m in raw.split(b"\n\n") if m and m != b"data: [DONE]"]
        tokens = [c for c in chunks if c["choices"]]
        assert len(tokens) == 6 and chunks[-1]["usage"]["completion_tokens"] == 6


def test_logprobs_are_the_reference_models_and_do_not_change_tokens(front):
    """Completions' `logprobs: N` and chat's `logprobs` + `top_logprobs`: per token the chosen one's raw
    log-softmax (equal to the dense reference's) and the N most likely, in the endpoint's shape."""
    import torch
    from helpers import _embedded_model

    from kunserve.shared.model.reference import reference_logits

    ids, text = grpc_text(front, PROMPT_IDS, 6)
    out = sdk(front).completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=3,
                                        extra_body={"ignore_eos": True}).choices[0]
    assert out.text == text
    lp = out.logprobs
    cfg, weights = _embedded_model()
    ref = torch.log_softmax(reference_logits(cfg, weights, PROMPT_IDS + ids[:-1])[len(PROMPT_IDS) - 1:], dim=-1)
    tok = ByteTokenizer()
    assert lp.tokens == [tok.decode([t]) for t in ids]
    for i, t in enumerate(ids):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, t].item(), abs=2e-3)
        assert len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(ref[i].max().item(),
                                                                                                  abs=2e-3)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(6)]
    chat = sdk(front).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                              top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    assert len(chat.logprobs.content) == 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= c.top_logprobs[0].logprob + 1e-6 for c in chat.logprobs.content)
    streamed = list(sdk(front).completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                                  logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    assert [c.choices[0].logprobs.token_logprobs[0] for c in streamed] == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_min_tokens_holds_back_a_stop_token(front):
    ids, _ = grpc_text(front, PROMPT_IDS, 6)
    plain = sdk(front).completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "stop_token_ids": [ids[0]]})
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    held = sdk(front).completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [ids[0]], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
