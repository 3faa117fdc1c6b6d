"""`kunserve bench run --endpoint` end to end against a minimal OpenAI-compatible server in a thread of the
test (127.0.0.1): the CLI finds the model, sends the API key from $OPENAI_API_KEY, and writes the same
result.json and plots as the gRPC path (the integration test does this against a real cluster's front)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

KEY = "test-key"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ThreadedServer:
    """/v1/models and streamed /v1/completions (one chunk per token, usage, [DONE]) on its own event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.requests: list[dict] = []
        self.auth: set[str] = set()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.auth.add(request.headers.get("Authorization", ""))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for k in range(n):
            await resp.write(_sse({"choices": [{"index": 0, "text": "x", "finish_reason": "length" if k == n - 1 else None}]}))
        await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def server() -> Iterator[ThreadedServer]:
    with ThreadedServer() as s:
        yield s


def test_run_against_an_endpoint_writes_the_usual_results(server, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "kunserve.cli.main", "bench", "run", "--endpoint", server.url,  # no /v1: implied
         "--duration", "2", "--rate", "4", "--no-burst", "--length-scale", "0.02", "--seed", "2",
         "--request-timeout", "30", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OPENAI_API_KEY": KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((out / "result.json").read_text())
    s = doc["summary"]
    assert doc["policy"] == "endpoint" and s["failed"] == 0 and s["completed"] == s["requests"] == doc["trace"]["n"] > 0
    assert all(r["tokens"] == r["output_tokens"] and r["ok"] for r in doc["requests"])
    assert doc["cluster"] == {"endpoint": f"{server.url}/v1", "model": "tiny", "api": "openai /v1/completions"}
    assert doc["samples"] == [] and doc["drop_periods"] == []
    assert len(server.requests) == s["requests"] and server.auth == {f"Bearer {KEY}"}
    assert all(b["model"] == "tiny" and b["stream"] and b["ignore_eos"] for b in server.requests)
    for png in ("ttft_timeline.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "endpoint" in proc.stdout and "TTFT p99" in proc.stdout
