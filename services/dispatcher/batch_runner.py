"""Runs the stored batches: an asyncio task in the dispatcher's event loop that feeds every pending batch request
through the dispatcher's own request lifecycle (DispatcherServicer.open / events) as an offline request, and
records each one's result line in the store.

Why through open/events rather than a client call: a batch request then gets everything an online one gets
(admission, routing, resume after a worker failure, re-attach after a drop), with no extra hop, and the
workers' schedulers see it as offline work to harvest idle capacity with.

* At most `concurrency` requests are in flight, oldest batch first, each batch in input order.
* A request the cluster cannot take now (admission full, no routable worker, the dispatcher stopping) waits
  and tries again: it is never recorded as failed for that. One the endpoint refuses (a bad field, a prompt
  too long) is recorded with its error, and the rest continue.
* A cancelled or expired batch has its running requests cancelled (the worker frees their KV); what never
  ran gets an error line, and the batch ends.
* On start-up it simply continues: everything without a result is pending in the store, including what was
  running when the process died, and runs (again). The store keeps one result per request.
* Every attempt has a request id of its own, `<batch id>-<index>-<attempt>` (the store counts attempts durably):
  after a quick restart the previous attempt may still run on a worker, and reusing its id would be refused as a
  duplicate. ALREADY_EXISTS is still "not now" (a request of that id, say a client's, runs and will end).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kunserve.services.dispatcher import openai_api as oa
from kunserve.services.dispatcher.batch_format import CHAT_URL, response_line
from kunserve.services.dispatcher.batch_store import BatchInfo, BatchStore, Item, StoreUnavailable, line_id
from kunserve.services.dispatcher.servicer import DispatcherServicer, RequestError
from kunserve.shared.log import get_logger
from kunserve.v1 import common_pb2

POLL_S = 1.0  # how often expiry is checked when nothing else wakes the runner
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0
OWNER = "batch"  # the owner of batch requests: no client can Cancel them through the Generation API
# Refusals that mean "not now", not "never": admission is full, no worker can take it yet, the dispatcher stops,
# or a request of the same id still runs.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS)


class Retry(Exception):
    """The request could not run now; `after_s` is the cluster's hint of when to try again (None: back off)."""

    def __init__(self, message: str, after_s: float | None = None) -> None:
        super().__init__(message)
        self.after_s = after_s


@dataclass(frozen=True)
class Outcome:
    """What the endpoint answered: 200 and its response body, or an error status and an OpenAI error object."""

    status_code: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status_code == 200


# (the batch's endpoint, the request, the request id) -> its outcome; raises Retry
Execute = Callable[[str, Item, str], Awaitable[Outcome]]


class OpenAIFront(Protocol):
    """What the runner needs from the HTTP front (http_front.HttpFront): the endpoints' parsing and answers."""

    def openai_request(self, chat: bool, body: Any, request_id: str | None) -> oa.OpenAIRequest: ...

    async def whole(self, req: oa.OpenAIRequest, events: Any) -> dict[str, Any]: ...


class OpenAIItems:
    """Execute: a batch request exactly as its endpoint would serve it over HTTP (non-streamed), but offline."""

    def __init__(self, front: OpenAIFront, servicer: DispatcherServicer) -> None:
        self.front = front
        self.servicer = servicer

    async def __call__(self, endpoint: str, item: Item, request_id: str) -> Outcome:
        try:
            req = self.front.openai_request(endpoint == CHAT_URL, item.body, request_id)
        except oa.ApiError as err:
            return Outcome(err.status, err.body())
        req.generate.request_class = common_pb2.REQUEST_CLASS_OFFLINE  # a batch is offline whatever the body says
        try:
            record = await self.servicer.open(req.generate, OWNER)
            events = self.servicer.events(record)
            try:
                return Outcome(200, await self.front.whole(req, events))
            finally:
                await events.aclose()
        except RequestError as exc:
            if exc.code in _RETRYABLE:
                raise Retry(exc.message, exc.retry_after_ms / 1000 if exc.retry_after_ms is not None else None) from None
            refused = oa.error_from_status(exc.code, exc.message, exc.retry_after_ms, chat=req.chat)
            return Outcome(refused.status, refused.body())


def body_checker(served_model: str) -> Callable[[str, dict[str, Any]], None]:
    """What a submitted file's bodies are checked with before the batch is accepted: the endpoint's own parser
    (every field, the model id) without rendering or running anything; and no streaming."""

    def check(url: str, body: dict[str, Any]) -> None:
        if body.get("stream"):
            raise ValueError("stream: a batch request cannot stream")
        try:
            if url == CHAT_URL:
                oa.parse_chat(body, served_model, lambda messages, add_generation_prompt: [])
            else:
                oa.parse_completion(body, served_model)
        except oa.ApiError as err:
            raise ValueError(err.message) from None

    return check


def _internal_error(message: str) -> Outcome:
    return Outcome(500, {"error": {"message": message, "type": "server_error", "param": None, "code": None}})


class BatchRunner:
    """The loop over the store's active batches (see the module docstring). `execute` runs one request; the
    runner owns when, how many at once, and what is recorded."""

    def __init__(self, store: BatchStore, execute: Execute, *, concurrency: int, poll_s: float = POLL_S) -> None:
        self.store = store
        self.execute = execute
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.log = get_logger()
        self._inflight: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._cursor: dict[str, int] = {}  # per batch: the last request index started (input order)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._store_down = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        """Something changed (a submit, a cancel, a request ended): look again now."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop starting requests and cancel the running ones, recording nothing for them: they run again after
        the next start."""
        tasks = [t for t in (self._task, *self._inflight.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    def _store_failed(self, exc: StoreUnavailable) -> None:
        if not self._store_down:
            self._store_down = True
            self.log.error("batch_store_unavailable", error=str(exc))

    def _store_ok(self) -> None:
        if self._store_down:
            self._store_down = False
            self.log.info("batch_store_available_again", path=self.store.path)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except StoreUnavailable as exc:
                self._store_failed(exc)
            if self._store_down:  # no busy loop on a store that fails: look again after a poll interval
                await asyncio.sleep(self.poll_s)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):  # not wait_for: in 3.11 it can swallow a cancel that races
                    await self._wake.wait()               # a wake-up, and stop() would wait forever

    async def tick(self) -> None:
        """End the batches that are done, cancelled or expired; then fill the free slots with pending requests."""
        batches = await asyncio.to_thread(self.store.active_batches)
        now = self.store.clock()
        open_batches: list[BatchInfo] = []
        for b in batches:
            running = [t for (bid, _), t in self._inflight.items() if bid == b.id]
            if b.status == "cancelling" or now >= b.expires_at:
                for t in running:
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                await self._finish(b, "cancelled" if b.status == "cancelling" else "expired")
            elif not running and b.completed + b.failed >= b.total:
                await self._finish(b, "completed")
            else:
                open_batches.append(b)
        for b in open_batches:
            free = self.concurrency - len(self._inflight)
            if free <= 0:
                break
            # a request picked up again (the cursor went back for it) may have running ones after it: skip those
            mine = sum(1 for bid, _ in self._inflight if bid == b.id)
            for item in await asyncio.to_thread(self.store.pending_items, b.id, self._cursor.get(b.id, -1), free + mine):
                key = (b.id, item.index)
                if key in self._inflight:
                    continue
                if free == 0:
                    break
                free -= 1
                self._cursor[b.id] = max(self._cursor.get(b.id, -1), item.index)
                self._inflight[key] = asyncio.create_task(self._run_item(b.endpoint, item), name=f"batch-{b.id}-{item.index}")

    async def _finish(self, b: BatchInfo, status: str) -> None:
        done = await asyncio.to_thread(self.store.finish, b.id, status)
        self._store_ok()
        self._cursor.pop(b.id, None)
        self.log.info("batch_ended", batch=b.id, status=done.status, total=done.total, completed=done.completed,
                      failed=done.failed)

    async def _run_item(self, endpoint: str, item: Item) -> None:
        key = (item.batch_id, item.index)
        settled = False  # it has a result in the store (this one, or an earlier run's)
        try:
            attempt = await asyncio.to_thread(self.store.start_item, item.batch_id, item.index)
            request_id = f"{item.batch_id}-{item.index}-{attempt}"
            outcome = await self._execute(endpoint, item, request_id)
            line = response_line(line_id(), item.custom_id, outcome.status_code, request_id, outcome.body)
            fresh = await asyncio.to_thread(self.store.record, item.batch_id, item.index, line, outcome.ok)
            settled = True
            self._store_ok()
            if not fresh:
                self.log.info("batch_result_already_recorded", batch=item.batch_id, index=item.index, attempt=attempt)
            elif not outcome.ok:
                self.log.info("batch_request_failed", batch=item.batch_id, index=item.index, custom_id=item.custom_id,
                              status=outcome.status_code, error=outcome.body.get("error", {}).get("message"),
                              attempt=attempt)
        except StoreUnavailable as exc:
            self._store_failed(exc)
        finally:
            self._inflight.pop(key, None)
            if not settled:  # cancelled, or the store failed: still pending, so it must be picked up again
                cursor = self._cursor.get(item.batch_id)
                if cursor is not None and cursor >= item.index:
                    self._cursor[item.batch_id] = item.index - 1
            self.wake()

    async def _execute(self, endpoint: str, item: Item, request_id: str) -> Outcome:
        """The request's outcome, trying again (with backoff, or when the cluster's hint says) for as long as
        the cluster cannot take it; the batch's end (cancel, expiry) or the runner's stop cancels the wait."""
        backoff = RETRY_FIRST_S
        while True:
            try:
                return await self.execute(endpoint, item, request_id)
            except Retry as exc:
                wait = exc.after_s if exc.after_s is not None else backoff
                backoff = min(RETRY_MAX_S, backoff * 2)
                self.log.debug("batch_request_waiting", request_id=request_id, retry_in_s=round(wait, 3), reason=str(exc))
                await asyncio.sleep(min(wait, RETRY_MAX_S))
            except Exception as exc:  # a bug, not the request's fault: recorded, so the batch can still end
                self.log.exception("batch_request_crashed", request_id=request_id)
                return _internal_error(f"internal error running the request: {type(exc).__name__} (see the dispatcher log)")
