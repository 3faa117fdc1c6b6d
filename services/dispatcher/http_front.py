"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models, /health, /version (and the
batch API's /v1/files and /v1/batches, batch_http.py).

It runs in the dispatcher's process and event loop and drives the same request lifecycle as the gRPC API
(DispatcherServicer.open / events): routing, admission, resume after a worker failure and re-attach after a
move are the same code, with no extra hop per token.

Why the response waits for the first event before it sends a status line: until then anything can still
refuse the request (the worker's validation, admission's queue timeout, no routable worker), and an OpenAI
client expects those as an HTTP status with an error object, not as a 200 whose stream then fails. After the
first token, an error ends the stream with an error chunk and `data: [DONE]` (vLLM's convention).

A client that disconnects cancels its handler (aiohttp's handler_cancellation), which closes the event
iterator, which cancels the worker's call: the worker frees the request's KV at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import ssl
import tempfile
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kunserve import __version__
from kunserve.services.dispatcher import openai_api as oa
from kunserve.services.dispatcher.batch_http import BatchRoutes
from kunserve.services.dispatcher.servicer import DispatcherServicer, RequestError
from kunserve.shared.log import get_logger
from kunserve.shared.model.chat_template import ChatTemplate, ChatTemplateError
from kunserve.v1 import generation_pb2

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
MAX_REQUEST_ID_HEADER = 256
SHUTDOWN_GRACE_S = 5.0  # in-flight streams end with an error chunk at once on shutdown; this bounds the rest


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def _json_error(err: oa.ApiError) -> web.Response:
    headers = {}
    if err.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-err.retry_after_ms // 1000)))  # whole seconds, rounded up
        headers["Retry-After-Ms"] = str(err.retry_after_ms)
    return web.json_response(err.body(), status=err.status, headers=headers)


class HttpFront:
    """The aiohttp application over a DispatcherServicer. `chat_template` is None when the model has none:
    chat requests then get a 400 naming the model (and --chat-template)."""

    def __init__(self, servicer: DispatcherServicer, *, served_model: str, model_root: str,
                 chat_template: ChatTemplate | None, chat_template_error: str = "", api_key: str | None = None,
                 max_body_bytes: int = 1 << 20) -> None:
        self.servicer = servicer
        self.served_model = served_model
        self.model_root = model_root
        self.chat_template = chat_template
        self.chat_template_error = chat_template_error
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.log = get_logger()
        self.batch_routes: BatchRoutes | None = None  # /v1/files and /v1/batches, when the dispatcher runs batches
        self._runner: web.AppRunner | None = None

    # -- the application -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        if self.batch_routes is not None:
            self.batch_routes.add_to(app)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()
        self.log.info("http_front_started", address=f"{host}:{port}", tls=ssl_context is not None,
                      model=self.served_model)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """Every answer is an OpenAI error object: aiohttp's own (unknown route, wrong method, body too large)
        and an unexpected failure (logged once, with its traceback) included."""
        try:
            if request.path.startswith("/v1/"):
                self._authorize(request)
            return await handler(request)
        except oa.ApiError as err:
            return _json_error(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _json_error(oa.ApiError(exc.status, exc.reason if exc.status != 413 else
                                           f"the request body exceeds {self.max_body_bytes} bytes",
                                           type_="invalid_request_error" if exc.status < 500 else "server_error"))
        except Exception:
            self.log.exception("http_request_failed", path=request.path)
            return _json_error(oa.ApiError(500, "internal error (see the dispatcher log)", type_="server_error"))

    def _authorize(self, request: web.Request) -> None:
        if not self.api_key:
            return
        given = request.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise oa.ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              type_="authentication_error", code="invalid_api_key")

    # -- small endpoints -------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(oa.models_list(self.served_model, self.model_root,
                                                self.servicer.limits.context_len, self.created))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the dispatcher accepts requests and can reach a worker; 503 (and why) otherwise."""
        if self.servicer.stopping:
            return _json_error(oa.ApiError(503, "the dispatcher is shutting down", type_="service_unavailable_error"))
        live, _ = self.servicer.pool.capacity()
        if live == 0:
            return _json_error(oa.ApiError(503, "no worker is reachable", type_="service_unavailable_error"))
        return web.Response(status=200)

    # -- generation ----------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise oa.ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def _request_id(self, request: web.Request) -> str | None:
        rid = request.headers.get("X-Request-Id")
        if rid is not None and not (0 < len(rid) <= MAX_REQUEST_ID_HEADER):
            raise oa.ApiError(400, f"X-Request-Id: must have 1 to {MAX_REQUEST_ID_HEADER} characters",
                              param="X-Request-Id")
        return rid

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        if self.chat_template is None:
            raise oa.ApiError(400, self.chat_template_error or "the served model has no chat template", param="messages")
        try:
            text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise oa.ApiError(400, str(exc), param="messages") from None
        limit = self.servicer.limits.max_prompt_bytes
        if len(text.encode("utf-8")) > limit:
            raise oa.ApiError(400, f"messages: the rendered conversation exceeds dispatcher.max_prompt_bytes = {limit}",
                              param="messages")
        return list(self.servicer.tokenizer.encode_chat(text))

    def openai_request(self, chat: bool, body: Any, request_id: str | None) -> oa.OpenAIRequest:
        """A /v1/chat/completions (`chat`) or /v1/completions body as the dispatcher's request (raises
        oa.ApiError): the endpoints and the offline batch runner's requests go through this one path."""
        if not chat:
            return oa.parse_completion(body, self.served_model, request_id)
        if self.servicer.tokenizer is None:
            raise oa.ApiError(400, "the served model has no tokenizer, so it cannot chat; use /v1/completions "
                                   "with a list of token ids", param="messages")
        req = oa.parse_chat(body, self.served_model, self._render_chat, request_id)
        sampling = req.generate.sampling
        if not sampling.HasField("max_tokens") and self.servicer.generation.max_new_tokens is None:
            # a chat without a bound may use the rest of the context (the model's EOS ends it before), as vLLM does
            sampling.max_tokens = max(1, self.servicer.limits.context_len - len(req.generate.token_ids.ids))
        return req

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self.openai_request(False, await self._body(request),
                                                                 self._request_id(request)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._generate(request, self.openai_request(True, body, self._request_id(request)))

    def _owner(self, request: web.Request) -> str:
        """As the gRPC API's: the hashed credential, else the connection."""
        auth = request.headers.get("Authorization")
        if auth:
            return "credential:" + hashlib.sha256(auth.encode("utf-8")).hexdigest()
        return f"http:{request.remote}"

    async def _generate(self, request: web.Request, req: oa.OpenAIRequest) -> web.StreamResponse:
        try:
            record = await self.servicer.open(req.generate, self._owner(request))
        except RequestError as exc:
            raise oa.error_from_status(exc.code, exc.message, exc.retry_after_ms, chat=req.chat) from None
        events = self.servicer.events(record)
        try:
            return await (self._stream(request, req, events) if req.stream else self._whole(req, events))
        finally:
            await events.aclose()

    def _token_text(self, token_id: int) -> str:
        tok = self.servicer.tokenizer
        return tok.decode([token_id]) if tok is not None else ""

    async def whole(self, req: oa.OpenAIRequest, events: Any) -> dict[str, Any]:
        """The non-streamed answer's body, from the request's events (raises RequestError)."""
        got: list[generation_pb2.GenerateEvent] = [ev async for ev in events]
        last = got[-1]
        completion = sum(1 for e in got if e.token_id >= 0)
        logprobs = oa.LogprobsBuilder(req.chat, self._token_text).of(got) if req.logprobs is not None else None
        return oa.full_response(req, self.served_model, "".join(e.text for e in got), oa.finish_reason(last),
                                logprobs, last.num_prompt_tokens, completion)

    async def _whole(self, req: oa.OpenAIRequest, events: Any) -> web.Response:
        try:
            return web.json_response(await self.whole(req, events))
        except RequestError as exc:
            raise oa.error_from_status(exc.code, exc.message, exc.retry_after_ms, chat=req.chat) from None

    async def _stream(self, request: web.Request, req: oa.OpenAIRequest, events: Any) -> web.StreamResponse:
        lp = oa.LogprobsBuilder(req.chat, self._token_text) if req.logprobs is not None else None
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        prompt_tokens = completion = 0
        try:
            async for ev in events:
                prompt_tokens = ev.num_prompt_tokens
                completion += ev.token_id >= 0
                chunk = oa.stream_chunk(req, self.served_model, ev.text, oa.finish_reason(ev),
                                        lp.of([ev]) if lp is not None else None, first=not resp.prepared)
                if not resp.prepared:
                    await resp.prepare(request)
                await resp.write(sse(chunk))
            if req.include_usage:
                await resp.write(sse(oa.usage_chunk(req, self.served_model, prompt_tokens, completion)))
            await resp.write(DONE)
            await resp.write_eof()
        except RequestError as exc:
            err = oa.error_from_status(exc.code, exc.message, exc.retry_after_ms, chat=req.chat)
            if not resp.prepared:
                raise err from None
            self.log.warning("http_stream_failed", request_id=req.generate.request_id, code=exc.code.name,
                             error=exc.message)
            with contextlib.suppress(ConnectionResetError):  # the client may be gone by now as well
                await resp.write(sse(err.body()))
                await resp.write(DONE)
        except ConnectionResetError:  # the client went away mid-write: the caller closes `events`, freeing the KV
            self.log.info("http_client_disconnected", request_id=req.generate.request_id, tokens=completion)
        return resp


def ssl_context_of(cert_chain: bytes, private_key: bytes) -> ssl.SSLContext:
    """A server TLS context from the PEM bytes the gRPC server uses (the same certificate on both ports)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as d:
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        with open(cert, "wb") as f:
            f.write(cert_chain)
        with open(key, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(private_key)
        ctx.load_cert_chain(cert, key)
    return ctx
