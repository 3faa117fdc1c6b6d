"""The OpenAI Batch file format: a valid file parses in input order; every malformed line is refused with its
(1-based) line number before anything else of the file counts; the size and request limits; the bodies are
checked by the endpoint's own parser; result lines have OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from kunserve.services.dispatcher.batch_format import (
    BatchFormatError,
    check_metadata,
    completion_window_s,
    never_ran_line,
    parse_batch,
    response_line,
)
from kunserve.services.dispatcher.batch_runner import body_checker

LIMITS = {"max_bytes": 1 << 20, "max_requests": 100}


def line(custom_id: str = "a", url: str = "/v1/completions", **over) -> dict:
    obj = {"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "hi", "max_tokens": 4}}
    obj.update(over)
    return obj


def jsonl(*objs) -> bytes:
    return b"\n".join(o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs) + b"\n"


def test_a_valid_file_parses_in_input_order():
    data = jsonl(line("x"), b"", b"   ", line("y"), line("z"))
    endpoint, reqs = parse_batch(data, **LIMITS)
    assert endpoint == "/v1/completions"
    assert [(r.custom_id, r.line) for r in reqs] == [("x", 1), ("y", 4), ("z", 5)]
    assert reqs[0].body == {"prompt": "hi", "max_tokens": 4}
    chat = line("c", url="/v1/chat/completions", body={"messages": [{"role": "user", "content": "hi"}]})
    assert parse_batch(jsonl(chat), endpoint="/v1/chat/completions", **LIMITS)[0] == "/v1/chat/completions"
    assert len(parse_batch(jsonl(line("a")).rstrip(b"\n").replace(b"\n", b"\r\n"), **LIMITS)[1]) == 1


@pytest.mark.parametrize("bad, message", [
    (b"{not json", "line 2: not valid JSON"),
    (b"[1, 2]", "line 2: must be a JSON object"),
    (b"\xff\xfe", "line 2: not UTF-8"),
    (line("b", method="GET"), "line 2: method: must be \"POST\""),
    (line("b", url="/v1/embeddings"), "line 2: url: must be one of"),
    (line("b", url="/v1/chat/completions"), "line 2: url: '/v1/chat/completions' differs from the batch's endpoint"),
    (line("b", body="hi"), "line 2: body: must be a JSON object"),
    (line(""), "line 2: custom_id: must be a string"),
    ({k: v for k, v in line("b").items() if k != "custom_id"}, "line 2: custom_id"),
    (line("a"), "line 2: custom_id: 'a' is also the custom_id of line 1"),
])
def test_the_first_bad_line_refuses_the_file_naming_its_number(bad, message):
    data = jsonl(line("a"), bad, line("c"))
    with pytest.raises(BatchFormatError) as err:
        parse_batch(data, **LIMITS)
    assert str(err.value).startswith(message), str(err.value)
    assert err.value.line == 2


def test_limits_and_empty_files():
    data = jsonl(line("a"), line("b"), line("c"))
    with pytest.raises(BatchFormatError, match=r"^line 3: more than 2 requests \(dispatcher.batch_max_requests\)"):
        parse_batch(data, max_bytes=1 << 20, max_requests=2)
    assert len(parse_batch(data, max_bytes=len(data), max_requests=3)[1]) == 3
    with pytest.raises(BatchFormatError, match=rf"the file is {len(data)} bytes; at most {len(data) - 1}"):
        parse_batch(data, max_bytes=len(data) - 1, max_requests=3)
    for empty in (b"", b"\n\n  \n"):
        with pytest.raises(BatchFormatError, match="the file has no requests"):
            parse_batch(empty, **LIMITS)
    with pytest.raises(BatchFormatError, match="endpoint: must be one of"):
        parse_batch(data, endpoint="/v1/embeddings", **LIMITS)
    with pytest.raises(BatchFormatError, match="^line 1: url: '/v1/completions' differs"):
        parse_batch(data, endpoint="/v1/chat/completions", **LIMITS)


def test_bodies_are_checked_by_the_endpoints_parser():
    check = body_checker("kunserve-tiny")
    ok = line("ok", body={"model": "kunserve-tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    for body, message in [({"prompt": "hi", "temperature": "hot"}, "body: temperature: must be a finite number"),
                          ({"prompt": "hi", "model": "gpt-4"}, "body: The model `gpt-4` does not exist"),
                          ({"prompt": "hi", "stream": True}, "body: stream: a batch request cannot stream"),
                          ({"prompt": "hi", "n": 2}, "body: n: only 1 is supported"),
                          ({"max_tokens": 3}, "body: prompt: must be a string")]:
        with pytest.raises(BatchFormatError) as err:
            parse_batch(jsonl(ok, line("bad", body=body)), check_body=check, **LIMITS)
        assert str(err.value).startswith(f"line 2: {message}"), str(err.value)
        assert err.value.param == "body"
    chat_ok = line("c1", url="/v1/chat/completions", body={"messages": [{"role": "user", "content": "hi"}]})
    chat_bad = line("c2", url="/v1/chat/completions", body={"messages": [{"role": "robot", "content": "hi"}]})
    assert len(parse_batch(jsonl(chat_ok), check_body=check, **LIMITS)[1]) == 1
    with pytest.raises(BatchFormatError, match=r"^line 2: body: messages: messages\[0\].role"):
        parse_batch(jsonl(chat_ok, chat_bad), check_body=check, **LIMITS)


def test_completion_window_and_metadata():
    assert completion_window_s("24h") == 86400
    assert completion_window_s("90s") == 90 and completion_window_s("5m") == 300
    for bad in ("", "0h", "24", "1d", "169h", "-1h", "1.5h"):
        with pytest.raises(BatchFormatError, match="completion_window"):
            completion_window_s(bad)
    assert check_metadata({"k": "v"}) == {"k": "v"}
    with pytest.raises(BatchFormatError, match="at most 16 keys"):
        check_metadata({str(i): "" for i in range(17)})
    with pytest.raises(BatchFormatError, match="keys must be strings of 1 to 64"):
        check_metadata({"k" * 65: "v"})
    with pytest.raises(BatchFormatError, match="at most 512 characters"):
        check_metadata({"k": "v" * 513})
    with pytest.raises(BatchFormatError, match="at most 512 characters"):
        check_metadata({"k": 3})


def test_result_lines_have_openais_shape():
    ok = json.loads(response_line("batch_req_1", "a", 200, "rid", {"choices": []}))
    assert ok == {"id": "batch_req_1", "custom_id": "a", "error": None,
                  "response": {"status_code": 200, "request_id": "rid", "body": {"choices": []}}}
    gone = json.loads(never_ran_line("batch_req_2", "b", "batch_expired"))
    assert gone["response"] is None and gone["custom_id"] == "b"
    assert gone["error"]["code"] == "batch_expired" and "completion window" in gone["error"]["message"]
