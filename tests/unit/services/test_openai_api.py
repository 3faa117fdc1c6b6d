"""The OpenAI-compatible front's translation layer (services/dispatcher/openai_api.py), with no server: request
bodies become GenerateRequests or ApiErrors whose `param` names the offending field (clients such as the openai
SDK show it), refused gRPC statuses become OpenAI error objects, and GenerateEvents become the response shapes
the OpenAI API reference documents. The HTTP front only moves bytes, so what a client sees is decided here."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kunserve.services.dispatcher import openai_api as oa
from kunserve.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny-llama"

# Fields that are being added to the protos: tests that need them skip until the generated code has them.
_SAMPLING_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_EVENT_FIELDS = generation_pb2.GenerateEvent.DESCRIPTOR.fields_by_name
needs_sampling_logprobs = pytest.mark.skipif("logprobs" not in _SAMPLING_FIELDS, reason="SamplingParams has no logprobs field yet")
needs_min_tokens = pytest.mark.skipif("min_tokens" not in _SAMPLING_FIELDS, reason="SamplingParams has no min_tokens field yet")
needs_event_logprobs = pytest.mark.skipif(not {"logprob", "top_logprobs"} <= set(_EVENT_FIELDS),
                                          reason="GenerateEvent has no logprob / top_logprobs fields yet")


def completion(**fields: Any) -> oa.OpenAIRequest:
    return oa.parse_completion({"model": MODEL, "prompt": "Hello", **fields}, MODEL)


def completion_error(**fields: Any) -> oa.ApiError:
    with pytest.raises(oa.ApiError) as info:
        completion(**fields)
    return info.value


class Renderer:
    """A chat template stand-in that records what parse_chat hands it."""

    def __init__(self, ids: list[int] | None = None) -> None:
        self.ids = ids if ids is not None else [1, 2, 3]
        self.calls: list[tuple[list[dict[str, Any]], bool]] = []

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        self.calls.append((messages, add_generation_prompt))
        return self.ids


USER_HI = [{"role": "user", "content": "hi"}]


def chat(render: Renderer | None = None, **fields: Any) -> oa.OpenAIRequest:
    body = {"model": MODEL, "messages": USER_HI, **fields}
    return oa.parse_chat(body, MODEL, render if render is not None else Renderer())


def chat_error(**fields: Any) -> oa.ApiError:
    with pytest.raises(oa.ApiError) as info:
        chat(**fields)
    return info.value


# -- /v1/completions bodies ------------------------------------------------------------------------------
def test_string_prompt_becomes_text_with_default_max_tokens() -> None:
    req = completion()
    assert not req.chat and not req.stream and not req.include_usage and req.logprobs is None
    assert req.generate.WhichOneof("prompt") == "text" and req.generate.text == "Hello"
    assert req.generate.sampling.max_tokens == oa.COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    s = req.generate.sampling
    assert not s.HasField("temperature") and not s.HasField("top_p") and not s.HasField("top_k") and not s.HasField("seed")
    assert list(s.stop) == [] and list(s.stop_token_ids) == [] and s.ignore_eos is False


@pytest.mark.parametrize(("prompt", "text", "ids"), [
    ("Hello", "Hello", None),
    ([5, 6, 7], None, [5, 6, 7]),
    (["Hello"], "Hello", None),
    ([[5, 6, 7]], None, [5, 6, 7]),
    ([5], None, [5]),
])
def test_prompt_forms(prompt: Any, text: str | None, ids: list[int] | None) -> None:
    gen = completion(prompt=prompt).generate
    if text is not None:
        assert gen.WhichOneof("prompt") == "text" and gen.text == text
    else:
        assert gen.WhichOneof("prompt") == "token_ids" and list(gen.token_ids.ids) == ids


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], ["a", [1]]])
def test_batched_prompts_are_refused(prompt: Any) -> None:
    err = completion_error(prompt=prompt)
    assert err.status == 400 and err.param == "prompt" and "batch of 2" in err.message


@pytest.mark.parametrize("prompt", [None, {"text": "hi"}, True, 3, 1.5, [True], [1, "a"], [{"text": "hi"}], [[1, "a"]],
                                    [[[1]]], [1.0, 2.0]])
def test_malformed_prompts_are_refused(prompt: Any) -> None:
    err = completion_error(prompt=prompt)
    assert err.status == 400 and err.param == "prompt"
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": "prompt", "code": None}}


def test_missing_prompt_is_refused() -> None:
    with pytest.raises(oa.ApiError) as info:
        oa.parse_completion({"model": MODEL}, MODEL)
    assert info.value.status == 400 and info.value.param == "prompt"


@pytest.mark.parametrize("body", [[{"prompt": "hi"}], "prompt", None, 3])
def test_non_object_body_is_refused(body: Any) -> None:
    for parse in (lambda: oa.parse_completion(body, MODEL), lambda: oa.parse_chat(body, MODEL, Renderer())):
        with pytest.raises(oa.ApiError) as info:
            parse()
        assert info.value.status == 400 and info.value.param is None


def test_model_may_be_omitted() -> None:
    assert oa.parse_completion({"prompt": "hi"}, MODEL).generate.text == "hi"
    assert oa.parse_completion({"prompt": "hi", "model": None}, MODEL).generate.text == "hi"


def test_wrong_model_is_not_found() -> None:
    err = completion_error(model="gpt-4")
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert "gpt-4" in err.message and MODEL in err.message
    assert err.body()["error"]["code"] == "model_not_found"
    with pytest.raises(oa.ApiError) as info:
        oa.parse_chat({"model": "gpt-4", "messages": USER_HI}, MODEL, Renderer())
    assert (info.value.status, info.value.code) == (404, "model_not_found")


@pytest.mark.parametrize(("fields", "param"), [
    ({"model": 3}, "model"),
    ({"max_tokens": "a"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": False}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": "5"}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 3}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ["a", None]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
    ({"logprobs": "2"}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stream": "1"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": "include_usage"}, "stream_options"),
    ({"stream": True, "stream_options": [True]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
])
def test_wrongly_typed_fields_name_the_field(fields: dict[str, Any], param: str) -> None:
    err = completion_error(**fields)
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"
    assert err.message.startswith(f"{param}: ")


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"echo": "true"}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_unsupported_fields_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    err = completion_error(**fields)
    assert err.status == 400 and err.param == param


def test_neutral_values_of_unsupported_fields_pass() -> None:
    req = completion(n=1, best_of=1, echo=False, suffix="", logit_bias={}, presence_penalty=0, frequency_penalty=0.0,
                     repetition_penalty=1, user="someone", unknown_extension={"x": 1})
    assert req.generate.text == "Hello"


def test_sampling_fields_are_carried() -> None:
    s = completion(max_tokens=7, temperature=0.5, top_p=0.75, top_k=40, seed=1234, stop="\n\n", stop_token_ids=[2, 7],
                   ignore_eos=True, min_tokens=0).generate.sampling
    assert s.max_tokens == 7 and s.temperature == 0.5 and s.top_p == 0.75 and s.top_k == 40 and s.seed == 1234
    assert list(s.stop) == ["\n\n"] and list(s.stop_token_ids) == [2, 7] and s.ignore_eos is True


def test_integer_temperature_is_a_number() -> None:
    s = completion(temperature=1, top_p=1).generate.sampling
    assert s.HasField("temperature") and s.temperature == 1.0 and s.top_p == 1.0


def test_zero_values_are_set_not_dropped() -> None:
    """temperature 0 means greedy; it must reach the worker as set, not as "use the model's default"."""
    s = completion(temperature=0, seed=0).generate.sampling
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("seed") and s.seed == 0


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_minus_one_disables(top_k: int, expected: int) -> None:
    s = completion(top_k=top_k).generate.sampling
    assert s.HasField("top_k") and s.top_k == expected


def test_stop_as_a_list() -> None:
    assert list(completion(stop=["a", "bc"]).generate.sampling.stop) == ["a", "bc"]
    assert list(completion(stop=[]).generate.sampling.stop) == []
    assert list(completion(stop=None).generate.sampling.stop) == []


def test_null_optionals_are_unset() -> None:
    s = completion(max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None, stop_token_ids=None,
                   ignore_eos=None, stream=None, logprobs=None).generate.sampling
    assert s.max_tokens == 16 and not s.HasField("temperature") and not s.HasField("top_k") and not s.HasField("seed")


@needs_min_tokens
def test_min_tokens_is_carried() -> None:
    s = completion(min_tokens=5).generate.sampling
    assert s.min_tokens == 5
    assert completion(min_tokens=0).generate.sampling.min_tokens == 0


@needs_sampling_logprobs
@pytest.mark.parametrize("n", [0, 2, 5])
def test_completion_logprobs_are_carried(n: int) -> None:
    req = completion(logprobs=n)
    assert req.logprobs == n and req.generate.sampling.logprobs == n


def test_stream_and_usage_options() -> None:
    assert completion(stream=True).stream and not completion(stream=True).include_usage
    req = completion(stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage
    req = completion(stream=True, stream_options={})
    assert req.stream and not req.include_usage
    assert not completion(stream=False).stream


def test_request_id_is_passed_through() -> None:
    req = oa.parse_completion({"prompt": "hi"}, MODEL, request_id="abc-123")
    assert req.generate.request_id == "abc-123" and req.response_id == "cmpl-abc-123"


def test_request_ids_are_generated_unique() -> None:
    a, b = completion(), completion()
    assert a.generate.request_id and a.generate.request_id != b.generate.request_id
    assert a.response_id == "cmpl-" + a.generate.request_id


# -- /v1/chat/completions bodies -------------------------------------------------------------------------
def test_chat_renders_messages_into_token_ids() -> None:
    render = Renderer([9, 8, 7])
    req = chat(render)
    assert req.chat and req.generate.WhichOneof("prompt") == "token_ids" and list(req.generate.token_ids.ids) == [9, 8, 7]
    assert render.calls == [([{"role": "user", "content": "hi"}], True)]
    assert req.response_id.startswith("chatcmpl-") and req.response_id == "chatcmpl-" + req.generate.request_id


def test_chat_request_id_is_passed_through() -> None:
    req = oa.parse_chat({"messages": USER_HI}, MODEL, Renderer(), request_id="r1")
    assert req.response_id == "chatcmpl-r1"


def test_add_generation_prompt() -> None:
    render = Renderer()
    chat(render, add_generation_prompt=False)
    chat(render, add_generation_prompt=True)
    chat(render, add_generation_prompt=None)
    assert [flag for _, flag in render.calls] == [False, True, True]
    assert chat_error(add_generation_prompt="no").param == "add_generation_prompt"


def test_conversation_is_handed_over_in_order() -> None:
    render = Renderer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "No lists."},
                {"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": None},
                {"role": "tool", "content": "42", "tool_call_id": "t1"}]
    chat(render, messages=messages)
    assert render.calls[0][0] == messages


def test_content_parts_are_joined_by_newlines() -> None:
    render = Renderer()
    chat(render, messages=[{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])
    assert render.calls[0][0] == [{"role": "user", "content": "one\ntwo"}]


@pytest.mark.parametrize("messages", [
    None, [], "hi", {"role": "user", "content": "hi"},
    ["hi"],
    [{"content": "hi"}],
    [{"role": "robot", "content": "hi"}],
    [{"role": "user", "content": 3}],
    [{"role": "user", "content": {"type": "text", "text": "hi"}}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": ["hi"]}],
])
def test_bad_messages_are_refused(messages: Any) -> None:
    render = Renderer()
    with pytest.raises(oa.ApiError) as info:
        chat(render, messages=messages)
    assert info.value.status == 400 and info.value.param == "messages"
    assert render.calls == []


def test_missing_messages_are_refused() -> None:
    with pytest.raises(oa.ApiError) as info:
        oa.parse_chat({"model": MODEL}, MODEL, Renderer())
    assert info.value.status == 400 and info.value.param == "messages"


def test_chat_max_tokens() -> None:
    assert not chat().generate.sampling.HasField("max_tokens")
    assert chat(max_tokens=12).generate.sampling.max_tokens == 12
    assert chat(max_completion_tokens=5).generate.sampling.max_tokens == 5
    assert chat(max_completion_tokens=5, max_tokens=12).generate.sampling.max_tokens == 5
    assert chat_error(max_completion_tokens="5").param == "max_completion_tokens"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": "text"}, "response_format"),
    ({"n": 2}, "n"),
    ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": "true"}, "logprobs"),
])
def test_chat_refusals(fields: dict[str, Any], param: str) -> None:
    err = chat_error(**fields)
    assert err.status == 400 and err.param == param


def test_chat_neutral_options_pass() -> None:
    req = chat(tool_choice="none", response_format={"type": "text"}, tools=[], n=1, logprobs=False, top_logprobs=None)
    assert req.logprobs is None


def test_chat_ignores_completion_only_fields() -> None:
    """`echo` and `suffix` belong to /v1/completions; a chat body that carries them is not refused for them."""
    assert chat(echo=True, suffix="x").chat


@needs_sampling_logprobs
def test_chat_logprobs() -> None:
    req = chat(logprobs=True, top_logprobs=3)
    assert req.logprobs == 3 and req.generate.sampling.logprobs == 3
    req = chat(logprobs=True)
    assert req.logprobs == 0 and req.generate.sampling.logprobs == 0
    assert chat_error(logprobs=True, top_logprobs=-1).param == "top_logprobs"


def test_chat_stream_options() -> None:
    req = chat(stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage
    assert chat_error(stream_options={"include_usage": True}).param == "stream_options"


# -- gRPC status -> OpenAI error -------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "status", "type_"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
    (grpc.StatusCode.UNKNOWN, 500, "server_error"),
])
def test_status_mapping(code: grpc.StatusCode, status: int, type_: str) -> None:
    err = oa.error_from_status(code, "something went wrong")
    assert (err.status, err.type, err.code, err.param) == (status, type_, code.name.lower(), None)
    assert err.message == "something went wrong" and err.retry_after_ms is None


def test_resource_exhausted_keeps_the_retry_hint() -> None:
    err = oa.error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the dispatcher queue is full", retry_after_ms=250)
    assert err.status == 429 and err.retry_after_ms == 250


@pytest.mark.parametrize(("message", "param", "chat_param"), [
    ("sampling.max_tokens: must be > 0", "max_tokens", "max_tokens"),
    ("sampling.temperature: must be >= 0", "temperature", "temperature"),
    ("sampling.top_p: must be in (0, 1]", "top_p", "top_p"),
    ("sampling.stop[3]: must not be empty", "stop", "stop"),
    ("sampling.stop_token_ids[0]: out of the vocabulary", "stop_token_ids", "stop_token_ids"),
    ("prompt: must not be empty", "prompt", "messages"),
    ("prompt_token_ids[2]: out of the vocabulary", "prompt", "messages"),
    ("max_tokens: prompt (5 tokens) + max_tokens (10) exceeds the context length 8", "max_tokens", "max_tokens"),
    ("sampling.logprobs: at most 20", "logprobs", "top_logprobs"),
    ("request_id: already in use", "X-Request-Id", "X-Request-Id"),
    ("no field named here", None, None),
    ("unknown_field: bad", None, None),
])
def test_param_is_read_from_the_message(message: str, param: str | None, chat_param: str | None) -> None:
    assert oa.error_from_status(grpc.StatusCode.INVALID_ARGUMENT, message).param == param
    assert oa.error_from_status(grpc.StatusCode.INVALID_ARGUMENT, message, chat=True).param == chat_param


def test_server_errors_name_no_param() -> None:
    err = oa.error_from_status(grpc.StatusCode.INTERNAL, "prompt: worker crashed")
    assert err.status == 500 and err.param is None
    assert err.body() == {"error": {"message": "prompt: worker crashed", "type": "server_error", "param": None, "code": "internal"}}


# -- response shapes -------------------------------------------------------------------------------------
def _parsed(chat_: bool, include_usage: bool = False) -> oa.OpenAIRequest:
    options = {"stream": True, "stream_options": {"include_usage": include_usage}}
    if chat_:
        return oa.parse_chat({"messages": USER_HI, **options}, MODEL, Renderer(), request_id="r7")
    return oa.parse_completion({"prompt": "hi", **options}, MODEL, request_id="r7")


def test_completion_stream_chunk() -> None:
    req = _parsed(False)
    chunk = oa.stream_chunk(req, MODEL, " world", "length", None)
    assert chunk == {"id": "cmpl-r7", "object": "text_completion", "created": req.created, "model": MODEL,
                     "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}]}
    lp = {"tokens": [" world"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [0]}
    assert oa.stream_chunk(req, MODEL, " world", None, lp, first=True)["choices"][0]["logprobs"] == lp


def test_chat_stream_chunks() -> None:
    req = _parsed(True)
    first = oa.stream_chunk(req, MODEL, "Hel", None, None, first=True)
    assert first["id"] == "chatcmpl-r7" and first["object"] == "chat.completion.chunk" and first["model"] == MODEL
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}]
    assert oa.stream_chunk(req, MODEL, "lo", None, None)["choices"][0]["delta"] == {"content": "lo"}
    last = oa.stream_chunk(req, MODEL, "", "stop", None)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert oa.stream_chunk(req, MODEL, "", None, None, first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first


@pytest.mark.parametrize("chat_", [False, True])
def test_usage_null_only_when_asked(chat_: bool) -> None:
    assert "usage" not in oa.stream_chunk(_parsed(chat_), MODEL, "x", None, None, first=True)
    chunk = oa.stream_chunk(_parsed(chat_, include_usage=True), MODEL, "x", None, None, first=True)
    assert "usage" in chunk and chunk["usage"] is None


@pytest.mark.parametrize(("chat_", "obj"), [(False, "text_completion"), (True, "chat.completion.chunk")])
def test_usage_chunk(chat_: bool, obj: str) -> None:
    req = _parsed(chat_, include_usage=True)
    chunk = oa.usage_chunk(req, MODEL, 5, 3)
    assert chunk == {"id": req.response_id, "object": obj, "created": req.created, "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_full_completion_response() -> None:
    req = oa.parse_completion({"prompt": "hi"}, MODEL, request_id="r1")
    resp = oa.full_response(req, MODEL, "hello there", "stop", None, 2, 4)
    assert resp == {"id": "cmpl-r1", "object": "text_completion", "created": req.created, "model": MODEL,
                    "choices": [{"index": 0, "text": "hello there", "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}


def test_full_chat_response() -> None:
    req = oa.parse_chat({"messages": USER_HI}, MODEL, Renderer(), request_id="r2")
    lp = {"content": []}
    resp = oa.full_response(req, MODEL, "hello", "length", lp, 3, 1)
    assert resp == {"id": "chatcmpl-r2", "object": "chat.completion", "created": req.created, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": lp,
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def test_created_is_a_unix_timestamp() -> None:
    created = completion().created
    assert isinstance(created, int) and created > 1_600_000_000


def test_models_list() -> None:
    assert oa.models_list(MODEL, "/models/tiny", 2048, 1700000000) == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "kunserve", "root": "/models/tiny",
                  "parent": None, "max_model_len": 2048}]}


@pytest.mark.parametrize(("reason", "expected"), [
    (common_pb2.FINISH_REASON_LENGTH, "length"),
    (common_pb2.FINISH_REASON_STOP, "stop"),
    (common_pb2.FINISH_REASON_EOS, "stop"),
    (common_pb2.FINISH_REASON_ABORTED, "abort"),
    (common_pb2.FINISH_REASON_UNSPECIFIED, None),
])
def test_finish_reason(reason: int, expected: str | None) -> None:
    assert oa.finish_reason(generation_pb2.GenerateEvent(finish_reason=reason)) == expected


# -- logprobs --------------------------------------------------------------------------------------------
VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "é", 6: "!"}


def event(token_id: int, logprob: float | None = None, top: tuple[tuple[int, float], ...] = ()) -> generation_pb2.GenerateEvent:
    """An event as the dispatcher streams it: `logprob` unset when the request asked for none."""
    ev = generation_pb2.GenerateEvent(token_id=token_id, text=VOCAB.get(token_id, ""))
    if logprob is not None:
        ev.logprob = logprob
    for t, lp in top:
        ev.top_logprobs.add(token_id=t, logprob=lp)
    return ev


@needs_event_logprobs
def test_completion_logprobs_shape_and_text_offset() -> None:
    lp = oa.LogprobsBuilder(False, VOCAB.__getitem__)
    first = lp.of([event(1, -0.5, ((1, -0.5), (3, -1.25))), event(2, -0.25, ((2, -0.25),))])
    assert first == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25],
                     "top_logprobs": [{"Hel": -0.5, " wor": -1.25}, {"lo": -0.25}], "text_offset": [0, 3]}
    second = lp.of([event(3, -2.0), event(4, -0.125)])
    assert second is not None and second["text_offset"] == [5, 9] and second["top_logprobs"] == [{}, {}]


@needs_event_logprobs
def test_chat_logprobs_shape() -> None:
    lp = oa.LogprobsBuilder(True, VOCAB.__getitem__)
    got = lp.of([event(5, -0.5, ((5, -0.5), (6, -1.5))), event(6, -0.0625)])
    assert got == {"content": [
        {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9],
         "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
                          {"token": "!", "logprob": -1.5, "bytes": [0x21]}]},
        {"token": "!", "logprob": -0.0625, "bytes": [0x21], "top_logprobs": []},
    ]}


@needs_event_logprobs
@pytest.mark.parametrize("chat_", [False, True])
def test_events_without_logprobs_give_none(chat_: bool) -> None:
    lp = oa.LogprobsBuilder(chat_, VOCAB.__getitem__)
    assert lp.of([]) is None
    assert lp.of([event(1), event(-1)]) is None
    assert lp.of([event(-1, -0.5)]) is None


@needs_event_logprobs
def test_events_without_logprobs_are_skipped() -> None:
    """A finish-only event (no token) or one without a logprob neither adds an entry nor moves the offset."""
    lp = oa.LogprobsBuilder(False, VOCAB.__getitem__)
    got = lp.of([event(1, -0.5), event(-1), event(2), event(3, -1.0)])
    assert got is not None and got["tokens"] == ["Hel", " wor"] and got["text_offset"] == [0, 3]


# -- request classes (ConServe): service_tier "flex" or request_class "offline" ----------------------------------
@pytest.mark.parametrize(("fields", "offline"), [
    ({}, False),
    ({"service_tier": "flex"}, True),
    ({"service_tier": "auto"}, False),
    ({"service_tier": "priority"}, False),
    ({"request_class": "offline"}, True),
    ({"request_class": "online", "service_tier": "default"}, False),
])
def test_the_request_class_comes_from_request_class_or_service_tier(fields: dict[str, Any], offline: bool) -> None:
    want = common_pb2.REQUEST_CLASS_OFFLINE if offline else common_pb2.REQUEST_CLASS_ONLINE
    assert completion(**fields).generate.request_class == want
    assert chat(**fields).generate.request_class == want


@pytest.mark.parametrize(("fields", "param"), [
    ({"request_class": "batch"}, "request_class"),
    ({"service_tier": "scale"}, "service_tier"),
    ({"request_class": "online", "service_tier": "flex"}, "service_tier"),
])
def test_unknown_or_contradicting_classes_are_refused(fields: dict[str, Any], param: str) -> None:
    err = completion_error(**fields)
    assert err.status == 400 and err.param == param
