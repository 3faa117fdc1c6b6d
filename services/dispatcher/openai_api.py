"""The OpenAI API's shapes, both ways: a `/v1/completions` or `/v1/chat/completions` body becomes a
GenerateRequest (the same message the gRPC API takes, so both fronts share every check the dispatcher makes),
and the dispatcher's GenerateEvents become OpenAI response objects and stream chunks.

No I/O here: the HTTP front (http_front.py) reads bodies and writes responses. Field conventions follow the
OpenAI API reference and vLLM's extensions to it, since that is what clients and benchmark harnesses send:
`top_k` (-1 or 0 disable), `ignore_eos`, `min_tokens`, `stop_token_ids`, `add_generation_prompt` are accepted
as extra body fields; unknown fields are ignored, as vLLM ignores them. The request class (ConServe) is OpenAI's
`service_tier` ("flex", OpenAI's cheaper tier that waits for capacity, is offline; "auto", "default" and
"priority" are online) or KunServe's `request_class` ("online" / "offline"). What the engine cannot do is refused
with a 400 naming the field (`n` > 1, `best_of` > 1, `echo`, `suffix`, `logit_bias`, penalties, tools) rather
than silently served differently.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kunserve.v1 import common_pb2, generation_pb2

# gRPC status of a refused or failed request -> (HTTP status, OpenAI error type)
_HTTP_OF_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.ABORTED: (499, "request_aborted"),
}

# The dispatcher's and the workers' field names (the part of a message before ': ') -> the OpenAI field
_PARAM_OF_FIELD = {"sampling.max_tokens": "max_tokens", "max_tokens": "max_tokens", "sampling.temperature": "temperature",
                   "temperature": "temperature", "sampling.top_p": "top_p", "top_p": "top_p", "sampling.top_k": "top_k",
                   "top_k": "top_k", "sampling.seed": "seed", "sampling.stop": "stop", "sampling.stop_token_ids": "stop_token_ids",
                   "stop_token_ids": "stop_token_ids", "sampling.logprobs": "logprobs", "logprobs": "logprobs",
                   "sampling.min_tokens": "min_tokens", "min_tokens": "min_tokens",
                   "prompt": "prompt", "prompt.text": "prompt", "prompt_token_ids": "prompt", "request_id": "X-Request-Id"}

_FINISH = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
           common_pb2.FINISH_REASON_EOS: "stop", common_pb2.FINISH_REASON_ABORTED: "abort"}
_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions


class ApiError(Exception):
    """An OpenAI error object and its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.retry_after_ms = retry_after_ms

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_from_status(code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                      chat: bool = False) -> ApiError:
    """The OpenAI error for a request the dispatcher refused or ended with `code`; `param` comes from the field
    the message starts with (the dispatcher's messages name it first)."""
    status, type_ = _HTTP_OF_GRPC.get(code, (500, "server_error"))
    head = message.split(":", 1)[0].strip() if ":" in message else ""
    param = _PARAM_OF_FIELD.get(head.split("[", 1)[0]) if status < 500 else None
    if chat and param == "prompt":
        param = "messages"
    if chat and param == "logprobs":
        param = "top_logprobs"
    return ApiError(status, message, param=param, type_=type_, code=code.name.lower(), retry_after_ms=retry_after_ms)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# -- reading a body --------------------------------------------------------------------------------------
def _int(body: Mapping[str, Any], key: str, *, minimum: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise _bad(key, f"must be >= {minimum}, got {v}")
    return v


def _number(body: Mapping[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(key, f"must be a finite number, got {v!r}")
    return float(v)


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"must be true or false, got {v!r}")
    return v


def _token_ids(v: Any) -> list[int] | None:
    """`v` as a list of token ids, or None when it is not a list of integers."""
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    return list(v)


@dataclass
class OpenAIRequest:
    """A parsed request: what to ask the dispatcher and how to shape the answer."""

    chat: bool
    generate: generation_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives to return per token (None: no logprobs)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.generate.request_id


def _check_model(body: Mapping[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad("model", f"must be a string, got {model!r}")
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist. This server serves `{served}` (GET /v1/models).",
                       param="model", code="model_not_found")


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    """Fields whose requested behaviour the engine does not have: refused, never silently ignored."""
    for key in ("n", "best_of"):
        v = _int(body, key, minimum=1)
        if v is not None and v > 1:
            raise _bad(key, f"only 1 is supported, got {v}")
    for key in ("presence_penalty", "frequency_penalty"):
        penalty = _number(body, key)
        if penalty:
            raise _bad(key, f"is not supported (only 0), got {penalty}")
    rep = _number(body, "repetition_penalty")
    if rep is not None and rep != 1.0:
        raise _bad("repetition_penalty", f"is not supported (only 1), got {rep}")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "is not supported")
    if chat:
        if body.get("tools"):
            raise _bad("tools", "tool calling is not supported")
        choice = body.get("tool_choice")
        if choice not in (None, "none"):
            raise _bad("tool_choice", "tool calling is not supported")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
            raise _bad("response_format", "only {\"type\": \"text\"} is supported")
    else:
        if _bool(body, "echo"):
            raise _bad("echo", "is not supported")
        if body.get("suffix"):
            raise _bad("suffix", "is not supported")


def _sampling(body: Mapping[str, Any], chat: bool) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    max_tokens = _int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is not None:
        s.max_tokens = max_tokens
    elif not chat:
        s.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    for key in ("temperature", "top_p"):
        v = _number(body, key)
        if v is not None:
            setattr(s, key, v)
    top_k = _int(body, "top_k", minimum=-1)
    if top_k is not None:
        s.top_k = max(top_k, 0)  # vLLM's -1 and OpenAI-style 0 both mean "disabled"
    seed = _int(body, "seed")
    if seed is not None:
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        s.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        s.stop.extend(stop)
    elif stop is not None:
        raise _bad("stop", f"must be a string or a list of strings, got {stop!r}")
    if "stop_token_ids" in body and body["stop_token_ids"] is not None:
        ids = _token_ids(body["stop_token_ids"])
        if ids is None:
            raise _bad("stop_token_ids", "must be a list of integers")
        s.stop_token_ids.extend(ids)
    s.ignore_eos = _bool(body, "ignore_eos")
    min_tokens = _int(body, "min_tokens", minimum=0)
    if min_tokens:
        s.min_tokens = min_tokens
    return s


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    if chat:
        if not _bool(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise _bad("top_logprobs", "needs logprobs: true")
            return None
        return _int(body, "top_logprobs", minimum=0) or 0
    return _int(body, "logprobs", minimum=0)


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "is allowed only when stream is true")
    if not isinstance(opts, Mapping):
        raise _bad("stream_options", f"must be an object, got {opts!r}")
    return stream, _bool(opts, "include_usage")


SERVICE_TIERS = {"auto": common_pb2.REQUEST_CLASS_ONLINE, "default": common_pb2.REQUEST_CLASS_ONLINE,
                 "priority": common_pb2.REQUEST_CLASS_ONLINE, "flex": common_pb2.REQUEST_CLASS_OFFLINE}
CLASSES = {"online": common_pb2.REQUEST_CLASS_ONLINE, "offline": common_pb2.REQUEST_CLASS_OFFLINE}


def _request_class(body: Mapping[str, Any]) -> common_pb2.RequestClass:
    """`request_class` ("online" / "offline"), else `service_tier` ("flex" = offline), else online; both given
    must agree."""
    named = body.get("request_class")
    tier = body.get("service_tier")
    if named is not None and named not in CLASSES:
        raise _bad("request_class", f"must be one of {', '.join(CLASSES)}, got {named!r}")
    if tier is not None and tier not in SERVICE_TIERS:
        raise _bad("service_tier", f"must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}")
    if named is not None and tier is not None and CLASSES[named] != SERVICE_TIERS[tier]:
        raise _bad("service_tier", f"{tier!r} contradicts request_class {named!r}")
    if named is not None:
        return CLASSES[named]
    return SERVICE_TIERS[tier] if tier is not None else common_pb2.REQUEST_CLASS_ONLINE


def _request(body: Any, served: str, chat: bool, request_id: str | None) -> OpenAIRequest:
    """What both endpoints share: the body is an object, the model, refused fields, streaming and sampling."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served)
    _refuse_unsupported(body, chat)
    stream, include_usage = _stream(body)
    gen = generation_pb2.GenerateRequest(request_id=request_id or uuid.uuid4().hex, sampling=_sampling(body, chat),
                                         request_class=_request_class(body))
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        gen.sampling.logprobs = logprobs
    return OpenAIRequest(chat, gen, stream, include_usage, logprobs)


def parse_completion(body: Any, served: str, request_id: str | None = None) -> OpenAIRequest:
    """A /v1/completions body. `prompt`: a string, a list of token ids, or a one-element list of either."""
    req = _request(body, served, False, request_id)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.generate.text = prompt
    elif (ids := _token_ids(prompt)) is not None:
        req.generate.token_ids.ids.extend(ids)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise _bad("prompt", f"a batch of {len(prompt)} prompts is not supported; send one prompt per request")
    else:
        raise _bad("prompt", "must be a string, a list of token ids, or a one-element list of either")
    return req


def _content(m: Mapping[str, Any], i: int) -> str | None:
    """A message's content as text: a string, or the text parts of a list joined by newlines (as vLLM does)."""
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("messages", f"messages[{i}].content[{j}]: only text parts are supported, got {part!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("messages", f"messages[{i}].content: must be a string or a list of text parts")


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation to render, each message checked (role, text content)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise _bad("messages", f"messages[{i}]: must be an object, got {m!r}")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad("messages", f"messages[{i}].role: must be one of {', '.join(_ROLES)}, got {role!r}")
        msg = {k: v for k, v in m.items() if k not in ("role", "content")}
        msg.update(role=role, content=_content(m, i))
        out.append(msg)
    return out


def parse_chat(body: Any, served: str, render: Callable[[list[dict[str, Any]], bool], list[int]],
               request_id: str | None = None) -> OpenAIRequest:
    """A /v1/chat/completions body; `render(messages, add_generation_prompt)` gives the prompt's token ids (the
    chat template, encoded without added special tokens)."""
    req = _request(body, served, True, request_id)
    messages = chat_messages(body)
    req.generate.token_ids.ids.extend(render(messages, _bool(body, "add_generation_prompt", default=True)))
    return req


# -- shaping an answer -----------------------------------------------------------------------------------
def finish_reason(ev: generation_pb2.GenerateEvent) -> str | None:
    return _FINISH.get(ev.finish_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LogprobsBuilder:
    """Per-token logprobs in the endpoint's shape: /v1/completions' parallel lists (tokens, token_logprobs,
    top_logprobs, text_offset) or chat's `content` list of {token, logprob, bytes, top_logprobs}."""

    def __init__(self, chat: bool, token_text: Callable[[int], str]) -> None:
        self.chat = chat
        self.token_text = token_text
        self.offset = 0

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def of(self, events: Sequence[generation_pb2.GenerateEvent]) -> dict[str, Any] | None:
        """The logprobs of these events' tokens (None when there are none)."""
        evs = [e for e in events if e.token_id >= 0 and e.HasField("logprob")]
        if not evs:
            return None
        if self.chat:
            content = []
            for e in evs:
                entry = self._entry(e.token_id, e.logprob)
                entry["top_logprobs"] = [self._entry(t.token_id, t.logprob) for t in e.top_logprobs]
                content.append(entry)
            return {"content": content}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in evs:
            text = self.token_text(e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.token_text(t.token_id): t.logprob for t in e.top_logprobs})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def stream_chunk(req: OpenAIRequest, model: str, text: str, finish: str | None, logprobs: dict[str, Any] | None,
                 *, first: bool = False) -> dict[str, Any]:
    """One SSE chunk of a streamed answer."""
    choice: dict[str, Any] = {"index": 0}
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice.update(delta=delta, logprobs=logprobs, finish_reason=finish)
        obj = "chat.completion.chunk"
    else:
        choice.update(text=text, logprobs=logprobs, finish_reason=finish)
        obj = "text_completion"
    chunk: dict[str, Any] = {"id": req.response_id, "object": obj, "created": req.created, "model": model,
                             "choices": [choice]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(req: OpenAIRequest, model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the request's usage."""
    return {"id": req.response_id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def full_response(req: OpenAIRequest, model: str, text: str, finish: str | None, logprobs: dict[str, Any] | None,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A non-streamed answer."""
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": req.response_id, "object": "chat.completion" if req.chat else "text_completion",
            "created": req.created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def models_list(served: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "kunserve",
                                        "root": root, "parent": None, "max_model_len": max_model_len}]}
