"""OpenAI's Files and Batch API on the HTTP front: `POST /v1/files` (multipart, purpose "batch"), `GET /v1/files`
(list), `GET /v1/files/{id}` and `/content`, `DELETE /v1/files/{id}`,
`POST /v1/batches`, `GET /v1/batches[/{id}]`, `POST /v1/batches/{id}/cancel`.

The objects have OpenAI's fields (openai.types.Batch, FileObject), so the official SDK's
`files.create` / `batches.create` / `batches.retrieve` / `files.content` work as they do against OpenAI. Files
live in the batch store, beside the batches; a batch's `output_file_id` is its successful result lines and
`error_file_id` the rest, both in input order, written when it ends. The routes sit behind the front's
middleware, so they take the same API key and answer the same error objects.
"""

from __future__ import annotations

from typing import Any

from aiohttp import BodyPartReader, web

from kunserve.services.dispatcher import openai_api as oa
from kunserve.services.dispatcher.batch_format import BatchFormatError
from kunserve.services.dispatcher.batch_service import DEFAULT_LIST_LIMIT, MAX_FILES_LIST, Batches
from kunserve.services.dispatcher.batch_store import BatchInfo, Conflict, FileInfo, NotFound, StoreError, StoreUnavailable

UPLOAD_CHUNK = 1 << 16


def _api_error(exc: Exception) -> oa.ApiError:
    if isinstance(exc, BatchFormatError):
        return oa.ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, NotFound):
        return oa.ApiError(404, str(exc), code="not_found")
    if isinstance(exc, Conflict):
        return oa.ApiError(400, str(exc), code="invalid_state")
    assert isinstance(exc, StoreUnavailable)
    return oa.ApiError(503, str(exc), type_="service_unavailable_error")


def file_object(f: FileInfo) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at, "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "status_details": None, "expires_at": None}


def batch_object(b: BatchInfo, model: str) -> dict[str, Any]:
    return {"id": b.id, "object": "batch", "endpoint": b.endpoint, "model": model, "errors": None,
            "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
            "output_file_id": b.output_file_id, "error_file_id": b.error_file_id, "created_at": b.created_at,
            "in_progress_at": b.in_progress_at, "expires_at": b.expires_at, "finalizing_at": b.finalizing_at,
            "completed_at": b.completed_at, "failed_at": b.failed_at, "expired_at": b.expired_at,
            "cancelling_at": b.cancelling_at, "cancelled_at": b.cancelled_at,
            "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
            "metadata": b.metadata}


def _limit(request: web.Request, default: int) -> int:
    raw = request.query.get("limit", str(default))
    try:
        return int(raw)
    except ValueError:
        raise oa.ApiError(400, f"limit: must be an integer, got {raw!r}", param="limit") from None


def _string(body: dict[str, Any], key: str, required: bool = True) -> str:
    v = body.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or not v:
        raise oa.ApiError(400, f"{key}: must be a non-empty string, got {v!r}", param=key)
    return v


class BatchRoutes:
    def __init__(self, batches: Batches, served_model: str) -> None:
        self.batches = batches
        self.served_model = served_model

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{file_id}", self.file)
        app.router.add_delete("/v1/files/{file_id}", self.delete_file)
        app.router.add_get("/v1/files/{file_id}/content", self.file_content)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{batch_id}", self.get)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    async def upload(self, request: web.Request) -> web.Response:
        """Multipart `file` + `purpose`. The file streams in and is refused once it passes dispatcher.batch_max_bytes
        (the front's request size limit is for prompts, far smaller)."""
        if not request.content_type.startswith("multipart/"):
            raise oa.ApiError(400, "send the file as multipart/form-data with the fields file and purpose")
        reader = await request.multipart()
        purpose, filename, content = "", "", None
        limit = self.batches.max_bytes
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise oa.ApiError(400, "nested multipart bodies are not supported")
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                data = bytearray()
                while chunk := await part.read_chunk(UPLOAD_CHUNK):
                    data += chunk
                    if len(data) > limit:
                        raise oa.ApiError(413, f"file: more than {limit} bytes (dispatcher.batch_max_bytes)", param="file")
                content = bytes(data)
        if content is None:
            raise oa.ApiError(400, "file: missing (multipart field `file`)", param="file")
        try:
            return web.json_response(file_object(await self.batches.upload(content, filename, purpose)))
        except (BatchFormatError, StoreError) as exc:
            raise _api_error(exc) from None

    async def file(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(file_object(await self.batches.file(request.match_info["file_id"])))
        except StoreError as exc:
            raise _api_error(exc) from None

    async def file_content(self, request: web.Request) -> web.Response:
        try:
            content = await self.batches.file_content(request.match_info["file_id"])
        except StoreError as exc:
            raise _api_error(exc) from None
        return web.Response(body=content, content_type="application/octet-stream")

    async def list_files(self, request: web.Request) -> web.Response:
        limit = _limit(request, MAX_FILES_LIST)
        try:
            files, more = await self.batches.list_files(limit, request.query.get("after", ""),
                                                        request.query.get("purpose", ""))
        except (BatchFormatError, StoreError) as exc:
            raise _api_error(exc) from None
        data = [file_object(f) for f in files]
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        try:
            await self.batches.delete_file(file_id)
        except StoreError as exc:
            raise _api_error(exc) from None
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def create(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as exc:
            raise oa.ApiError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise oa.ApiError(400, "the request body must be a JSON object")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise oa.ApiError(400, f"metadata: must be an object, got {metadata!r}", param="metadata")
        try:
            b = await self.batches.create(_string(body, "input_file_id"), endpoint=_string(body, "endpoint"),
                                          window=_string(body, "completion_window"), metadata=metadata)
        except (BatchFormatError, StoreError) as exc:
            raise _api_error(exc) from None
        return web.json_response(batch_object(b, self.served_model))

    async def get(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(batch_object(await self.batches.get(request.match_info["batch_id"]),
                                                  self.served_model))
        except StoreError as exc:
            raise _api_error(exc) from None

    async def list_batches(self, request: web.Request) -> web.Response:
        limit = _limit(request, DEFAULT_LIST_LIMIT)
        try:
            batches, more = await self.batches.list_batches(limit, request.query.get("after", ""))
        except (BatchFormatError, StoreError) as exc:
            raise _api_error(exc) from None
        data = [batch_object(b, self.served_model) for b in batches]
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def cancel(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(batch_object(await self.batches.cancel(request.match_info["batch_id"]),
                                                  self.served_model))
        except StoreError as exc:
            raise _api_error(exc) from None
