"""The batch API behind both fronts: `Batches` (what the gRPC service and the HTTP front's /v1/files and
/v1/batches call: checks, the store off the event loop, waking the runner) and `BatchesServicer` (the gRPC
service over it).

Store calls run in a thread: a 100 MiB submit is parsed and written (fsync) without stalling the event loop
that streams the online requests' tokens. Errors are the store's (NotFound, Conflict, StoreUnavailable) and
the format's (BatchFormatError); each front maps them to its own statuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn

import grpc

from kunserve.services.dispatcher.batch_format import (
    DEFAULT_COMPLETION_WINDOW,
    BatchFormatError,
    BatchRequest,
    check_metadata,
    completion_window_s,
    parse_batch,
)
from kunserve.services.dispatcher.batch_runner import BatchRunner
from kunserve.services.dispatcher.batch_store import (
    BatchInfo,
    BatchStore,
    Conflict,
    FileInfo,
    ItemResult,
    NotFound,
    StoreError,
    StoreUnavailable,
)
from kunserve.v1 import batch_pb2, batch_pb2_grpc

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
MAX_FILES_LIST = 10_000  # OpenAI's bound (and default) for GET /v1/files
RESULTS_PAGE = 1000


class Batches:
    """Submit, look at, cancel and read batches. `check_body(url, body)` vets every request body at submit."""

    def __init__(self, store: BatchStore, runner: BatchRunner | None, *, max_bytes: int, max_requests: int,
                 check_body: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.store = store
        self.runner = runner
        self.max_bytes = max_bytes
        self.max_requests = max_requests
        self.check_body = check_body

    def _parse(self, content: bytes, endpoint: str, window: str,
               metadata: Mapping[str, Any]) -> tuple[str, str, int, list[BatchRequest], dict[str, str]]:
        window = window or DEFAULT_COMPLETION_WINDOW
        window_s = completion_window_s(window)
        meta = check_metadata(metadata)
        endpoint, requests = parse_batch(content, endpoint=endpoint, max_bytes=self.max_bytes,
                                         max_requests=self.max_requests, check_body=self.check_body)
        return endpoint, window, window_s, requests, meta

    def _woken(self, b: BatchInfo) -> BatchInfo:
        if self.runner is not None:
            self.runner.wake()
        return b

    async def submit(self, content: bytes, filename: str, *, endpoint: str = "", window: str = "",
                     metadata: Mapping[str, Any] | None = None) -> BatchInfo:
        """A batch from the file's bytes (the gRPC API): the file and the batch are stored together or not at all."""
        def work() -> BatchInfo:
            ep, win, win_s, requests, meta = self._parse(content, endpoint, window, metadata or {})
            return self.store.submit(content, filename, endpoint=ep, window=win, window_s=win_s, requests=requests,
                                     metadata=meta)
        return self._woken(await asyncio.to_thread(work))

    async def upload(self, content: bytes, filename: str, purpose: str) -> FileInfo:
        """A file for a later create (the HTTP API's /v1/files); checked when a batch is created from it."""
        if purpose != "batch":
            raise BatchFormatError(f"purpose: only \"batch\" files are accepted, got {purpose!r}", param="purpose")
        if len(content) > self.max_bytes:
            raise BatchFormatError(f"the file is {len(content)} bytes; at most {self.max_bytes} "
                                   "(dispatcher.batch_max_bytes)", param="file")
        return await asyncio.to_thread(self.store.add_file, content, filename, purpose)

    async def create(self, input_file_id: str, *, endpoint: str, window: str,
                     metadata: Mapping[str, Any] | None = None) -> BatchInfo:
        """A batch over an uploaded file (the HTTP API's POST /v1/batches)."""
        def work() -> BatchInfo:
            f = self.store.file(input_file_id)
            if f.purpose != "batch":
                raise BatchFormatError(f"input_file_id: {input_file_id!r} is a {f.purpose!r} file, not a batch input",
                                       param="input_file_id")
            ep, win, win_s, requests, meta = self._parse(self.store.file_content(input_file_id), endpoint, window,
                                                         metadata or {})
            return self.store.create_batch(input_file_id, endpoint=ep, window=win, window_s=win_s, requests=requests,
                                           metadata=meta)
        return self._woken(await asyncio.to_thread(work))

    async def get(self, batch_id: str) -> BatchInfo:
        return await asyncio.to_thread(self.store.batch, batch_id)

    async def list_batches(self, limit: int, after: str = "") -> tuple[list[BatchInfo], bool]:
        if not 0 < limit <= MAX_LIST_LIMIT:
            raise BatchFormatError(f"limit: must be 1 to {MAX_LIST_LIMIT}, got {limit}", param="limit")
        return await asyncio.to_thread(self.store.list_batches, limit, after)

    async def cancel(self, batch_id: str) -> BatchInfo:
        return self._woken(await asyncio.to_thread(self.store.cancel, batch_id))

    async def results(self, batch_id: str, start_index: int = 0, limit: int = 0) -> AsyncIterator[ItemResult]:
        """Recorded results in input order from `start_index`, `limit` of them (0: all), a page at a time."""
        after, left = start_index - 1, limit or -1
        while left:
            page = await asyncio.to_thread(self.store.results, batch_id, after,
                                           RESULTS_PAGE if left < 0 else min(left, RESULTS_PAGE))
            for r in page:
                yield r
            if len(page) < RESULTS_PAGE:
                return
            after, left = page[-1].index, left - len(page) if left > 0 else left

    async def file(self, file_id: str) -> FileInfo:
        return await asyncio.to_thread(self.store.file, file_id)

    async def file_content(self, file_id: str) -> bytes:
        return await asyncio.to_thread(self.store.file_content, file_id)

    async def list_files(self, limit: int, after: str = "", purpose: str = "") -> tuple[list[FileInfo], bool]:
        if not 1 <= limit <= MAX_FILES_LIST:
            raise BatchFormatError(f"limit: must be 1 to {MAX_FILES_LIST}, got {limit}", param="limit")
        return await asyncio.to_thread(self.store.list_files, limit, after, purpose)

    async def delete_file(self, file_id: str) -> None:
        await asyncio.to_thread(self.store.delete_file, file_id)


def batch_to_pb(b: BatchInfo) -> batch_pb2.Batch:
    return batch_pb2.Batch(
        id=b.id, status=b.status, endpoint=b.endpoint, completion_window=b.completion_window,
        input_file_id=b.input_file_id, output_file_id=b.output_file_id or "", error_file_id=b.error_file_id or "",
        request_counts=batch_pb2.BatchRequestCounts(total=b.total, completed=b.completed, failed=b.failed),
        metadata=b.metadata, created_at=b.created_at, in_progress_at=b.in_progress_at or 0, expires_at=b.expires_at,
        finalizing_at=b.finalizing_at or 0, completed_at=b.completed_at or 0, expired_at=b.expired_at or 0,
        cancelling_at=b.cancelling_at or 0, cancelled_at=b.cancelled_at or 0)


_CODE_OF_ERROR: list[tuple[type[Exception], grpc.StatusCode]] = [
    (BatchFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
]


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    code = next(c for kind, c in _CODE_OF_ERROR if isinstance(exc, kind))
    await context.abort(code, str(exc))
    raise AssertionError("abort returned")


class BatchesServicer(batch_pb2_grpc.BatchesServicer):
    """The Batches gRPC service: the batch API's errors become INVALID_ARGUMENT (a malformed file, naming its
    line), NOT_FOUND, FAILED_PRECONDITION (cancel an ended batch) and UNAVAILABLE (the store cannot be written)."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    async def CreateBatch(self, request_iterator: AsyncIterator[batch_pb2.CreateBatchChunk],
                          context: grpc.aio.ServicerContext) -> batch_pb2.Batch:
        header: batch_pb2.CreateBatchChunk | None = None
        data = bytearray()
        limit = self.batches.max_bytes
        async for chunk in request_iterator:
            header = header or chunk
            data += chunk.data
            if len(data) > limit:  # refused while it streams: the rest is never held
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the file is more than {limit} bytes (dispatcher.batch_max_bytes)")
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no data: send the JSONL file in CreateBatchChunk.data")
        assert header is not None
        try:
            b = await self.batches.submit(bytes(data), header.filename or "batch.jsonl", endpoint=header.endpoint,
                                          window=header.completion_window, metadata=dict(header.metadata))
        except (StoreError, BatchFormatError) as exc:
            await _abort(context, exc)
        return batch_to_pb(b)

    async def GetBatch(self, request: batch_pb2.BatchRef, context: grpc.aio.ServicerContext) -> batch_pb2.Batch:
        try:
            return batch_to_pb(await self.batches.get(request.batch_id))
        except StoreError as exc:
            await _abort(context, exc)

    async def ListBatches(self, request: batch_pb2.ListBatchesRequest,
                          context: grpc.aio.ServicerContext) -> batch_pb2.BatchList:
        try:
            batches, more = await self.batches.list_batches(request.limit or DEFAULT_LIST_LIMIT, request.after)
        except (StoreError, BatchFormatError) as exc:
            await _abort(context, exc)
        return batch_pb2.BatchList(batches=[batch_to_pb(b) for b in batches], has_more=more)

    async def CancelBatch(self, request: batch_pb2.BatchRef, context: grpc.aio.ServicerContext) -> batch_pb2.Batch:
        try:
            return batch_to_pb(await self.batches.cancel(request.batch_id))
        except StoreError as exc:
            await _abort(context, exc)

    async def GetBatchResults(self, request: batch_pb2.BatchResultsRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[batch_pb2.BatchResultLine]:
        if request.start_index < 0 or request.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_index and limit must be >= 0")
        try:
            async for r in self.batches.results(request.batch_id, request.start_index, request.limit):
                yield batch_pb2.BatchResultLine(index=r.index, custom_id=r.custom_id, ok=r.ok, line=r.line)
        except StoreError as exc:
            await _abort(context, exc)
