"""A minimal OpenAI-compatible server for the benchmark client's tests (127.0.0.1, a free port): /v1/models and
streamed /v1/completions, each request answered as the test asks (tokens, a refusal, an error mid-stream, a cut
stream, a JSON body). `ThreadedServer` runs one on its own event loop, for tests that drive the CLI in a
subprocess."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

from aiohttp import web


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                      "finish_reason": finish}], "usage": None}


def usage(n: int) -> dict:
    return {"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n,
                                                                  "total_tokens": 4 + n}}


class FakeServer:
    """/v1/models and streamed /v1/completions; request `bench-<i>` is answered by `behaviour(i)`."""

    def __init__(self, behaviour: Callable[[int], str] = lambda i: "tokens", key: str | None = None,
                 models: object = None) -> None:
        self.behaviour = behaviour
        self.key = key
        self.models = models if models is not None else {"object": "list", "data": [{"id": "fake-model"}]}
        self.bodies: dict[int, dict] = {}
        self.auth: set[str] = set()  # the Authorization headers completions came with
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeServer:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def _authorized(self, request: web.Request) -> bool:
        return self.key is None or request.headers.get("Authorization") == f"Bearer {self.key}"

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if isinstance(self.models, str):
            return web.Response(text=self.models, content_type="text/html")
        return web.json_response(self.models)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.auth.add(request.headers.get("Authorization", ""))
        index = int(request.headers["X-Request-Id"].removeprefix("bench-"))
        self.bodies[index] = body
        kind = self.behaviour(index)
        if kind == "refuse":
            return web.json_response({"error": {"message": "too many requests", "type": "rate_limit"}}, status=429)
        if kind == "json":
            return web.json_response({"choices": [{"text": "x"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for k in range(n):
            if kind == "error" and k == 1:
                await resp.write(sse({"error": {"message": "worker lost"}}) + b"data: [DONE]\n\n")
                return resp
            if kind == "cut" and k == 1:
                return resp  # ends the body without a finish_reason or [DONE]
            await resp.write(sse(chunk(f"t{k}", "length" if k == n - 1 else None)))
        await resp.write(sse(usage(n)) + b"data: [DONE]\n\n")
        return resp


class ThreadedServer:
    """A FakeServer on an event loop of its own thread, started and stopped as a context manager."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
