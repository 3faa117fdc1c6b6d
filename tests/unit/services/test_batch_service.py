"""The batch API's three fronts over a real store and runner (a scripted executor stands in for the cluster),
served on 127.0.0.1 from a background event loop: the Batches gRPC service (chunked submit, NOT_FOUND,
INVALID_ARGUMENT naming the line with nothing stored, UNAVAILABLE for an unwritable store, results in input
order), the OpenAI Files + Batch API driven by the official `openai` SDK (its types validate every object),
and `kunserve batch` (one-line errors, non-zero exits)."""

from __future__ import annotations

import asyncio
import json
import threading
import types

import grpc
import openai
import pytest
from openai.types import Batch, FileObject

from kunserve import client
from kunserve.cli.launcher import free_port
from kunserve.cli.main import main as kunserve_main
from kunserve.services.dispatcher.batch_http import BatchRoutes
from kunserve.services.dispatcher.batch_runner import BatchRunner, Outcome, body_checker
from kunserve.services.dispatcher.batch_service import Batches, BatchesServicer
from kunserve.services.dispatcher.batch_store import BatchStore, Item
from kunserve.services.dispatcher.http_front import HttpFront
from kunserve.v1 import batch_pb2, batch_pb2_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "kunserve-tiny"
MAX_BYTES = 8192


async def answer(endpoint: str, item: Item, request_id: str) -> Outcome:
    """A completion that echoes the prompt backwards; a prompt "fail" is refused as a too-long prompt would be."""
    await asyncio.sleep(0.002)
    prompt = item.body["prompt"]
    if prompt == "fail":
        return Outcome(400, {"error": {"message": "prompt: too long", "type": "invalid_request_error",
                                       "param": "prompt", "code": "invalid_argument"}})
    return Outcome(200, {"id": f"cmpl-{request_id}", "object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": prompt[::-1], "finish_reason": "length", "logprobs": None}]})


class Served:
    """The store, runner, Batches, gRPC service and HTTP front on a loop of their own (a background thread)."""

    def __init__(self, path) -> None:
        self.store = BatchStore(path)
        self.grpc_address = f"127.0.0.1:{free_port()}"
        self.http_port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> None:
        self.runner = BatchRunner(self.store, answer, concurrency=4, poll_s=0.05)
        self.batches = Batches(self.store, self.runner, max_bytes=MAX_BYTES, max_requests=50, check_body=body_checker(MODEL))
        self.server = grpc.aio.server()
        batch_pb2_grpc.add_BatchesServicer_to_server(BatchesServicer(self.batches), self.server)
        self.server.add_insecure_port(self.grpc_address)
        await self.server.start()
        servicer = types.SimpleNamespace()  # the batch routes never reach the generation servicer
        self.front = HttpFront(servicer, served_model=MODEL, model_root="embedded", chat_template=None,
                               max_body_bytes=1024)  # smaller than the uploads: they stream past it
        self.front.batch_routes = BatchRoutes(self.batches, MODEL)
        await self.front.start("127.0.0.1", self.http_port)
        self.runner.start()

    async def _stop(self) -> None:
        await self.runner.stop()
        await self.front.stop()
        await self.server.stop(0)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.store.close()


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.delenv("KUNSERVE_CONFIG", raising=False)
    s = Served(tmp_path / "batches.sqlite3")
    yield s
    s.stop()


def jsonl(prompts: list[str], url: str = "/v1/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                               "body": {"model": MODEL, "prompt": p, "max_tokens": 4}}) + "\n"
                   for i, p in enumerate(prompts)).encode()


def call(served: Served, fn):
    async def go():
        async with client.insecure_channel(served.grpc_address) as ch:
            return await fn(batch_pb2_grpc.BatchesStub(ch))
    return asyncio.run(asyncio.wait_for(go(), 60))


def code_of(served: Served, fn) -> tuple[grpc.StatusCode, str]:
    try:
        call(served, fn)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


async def wait_ended(stub, batch_id: str) -> batch_pb2.Batch:
    while (b := await stub.GetBatch(batch_pb2.BatchRef(batch_id=batch_id))).status not in ("completed", "cancelled",
                                                                                           "expired"):
        await asyncio.sleep(0.02)
    return b


def test_grpc_submit_follow_and_read_results(served):
    data = jsonl(["abc", "fail", "xyz", "hello"])

    async def submit_and_read(stub):
        async def chunks():
            yield batch_pb2.CreateBatchChunk(completion_window="1h", metadata={"team": "a"}, filename="x.jsonl",
                                             data=data[:7])
            for i in range(7, len(data), 50):
                yield batch_pb2.CreateBatchChunk(data=data[i:i + 50])
        created = await stub.CreateBatch(chunks())
        done = await wait_ended(stub, created.id)
        lines = [r async for r in stub.GetBatchResults(batch_pb2.BatchResultsRequest(batch_id=created.id))]
        page = [r.index async for r in stub.GetBatchResults(batch_pb2.BatchResultsRequest(batch_id=created.id,
                                                                                          start_index=1, limit=2))]
        return created, done, lines, page

    created, done, lines, page = call(served, submit_and_read)
    assert (created.status, created.endpoint, created.completion_window) == ("in_progress", "/v1/completions", "1h")
    assert created.expires_at - created.created_at == 3600 and dict(created.metadata) == {"team": "a"}
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 1)
    assert done.output_file_id and done.error_file_id and done.completed_at
    assert [(r.index, r.custom_id, r.ok) for r in lines] == [(0, "c0", True), (1, "c1", False), (2, "c2", True),
                                                              (3, "c3", True)]
    assert json.loads(lines[3].line)["response"]["body"]["choices"][0]["text"] == "olleh"
    assert json.loads(lines[1].line)["response"]["status_code"] == 400
    assert page == [1, 2]
    code, msg = code_of(served, lambda stub: stub.CancelBatch(batch_pb2.BatchRef(batch_id=created.id)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "is completed" in msg


def test_grpc_refusals(served):
    def submit(data: bytes, **header):
        async def go(stub):
            async def chunks():
                yield batch_pb2.CreateBatchChunk(data=data, **header)
            return await stub.CreateBatch(chunks())
        return lambda stub: go(stub)

    for fn in (lambda s: s.GetBatch(batch_pb2.BatchRef(batch_id="batch_nope")),
               lambda s: s.CancelBatch(batch_pb2.BatchRef(batch_id="batch_nope")),
               lambda s: s.GetBatchResults(batch_pb2.BatchResultsRequest(batch_id="batch_nope")).read()):
        assert code_of(served, fn) == (grpc.StatusCode.NOT_FOUND, "no batch 'batch_nope'")
    bad = jsonl(["a"]) + b'{"custom_id": "c9", "method": "POST", "url": "/v1/completions", "body": {"prompt": 1.5}}\n'
    code, msg = code_of(served, submit(bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("line 2: body: prompt: must be a string"), msg
    code, msg = code_of(served, submit(jsonl(["a"] * 200)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"more than {MAX_BYTES} bytes" in msg
    code, msg = code_of(served, submit(jsonl(["a"]), completion_window="3d"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("completion_window")
    assert not served.store.exists()  # nothing was ever stored
    assert call(served, lambda s: s.ListBatches(batch_pb2.ListBatchesRequest())).batches == []

    call(served, submit(jsonl(["ok"])))  # creates the file
    with served.store._lock:
        served.store._db.execute("PRAGMA query_only = ON")  # as a read-only or full disk
    code, msg = code_of(served, submit(jsonl(["a", "b"])))
    assert code == grpc.StatusCode.UNAVAILABLE and "cannot be written" in msg and "dispatcher.batch_db" in msg
    with served.store._lock:
        served.store._db.execute("PRAGMA query_only = OFF")
    listed = call(served, lambda s: s.ListBatches(batch_pb2.ListBatchesRequest(limit=10)))
    assert [b.request_counts.total for b in listed.batches] == [1]  # the refused one left nothing


def test_the_openai_sdk_drives_files_and_batches(served):
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="unused", max_retries=0, timeout=30)
    prompts = ["one", "two", "fail", "four" * 300]  # larger than the front's 1024-byte body limit for prompts
    f = api.files.create(file=("input.jsonl", jsonl(prompts)), purpose="batch")
    raw = api.files.with_raw_response.retrieve(f.id).http_response.json()
    assert FileObject.model_validate(raw).bytes == len(jsonl(prompts)) and raw["purpose"] == "batch"
    assert api.files.content(f.id).content == jsonl(prompts)

    b = api.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                           metadata={"run": "sdk"})
    assert (b.status, b.input_file_id, b.metadata) == ("in_progress", f.id, {"run": "sdk"})
    while (b := api.batches.retrieve(b.id)).status != "completed":
        pass
    Batch.model_validate(api.batches.with_raw_response.retrieve(b.id).http_response.json())
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 3, 1)
    out = [json.loads(x) for x in api.files.content(b.output_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["choices"][0]["text"]) for x in out] == [
        ("c0", "eno"), ("c1", "owt"), ("c3", prompts[3][::-1])]
    err = [json.loads(x) for x in api.files.content(b.error_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"]["status_code"]) for x in err] == [("c2", 400)]
    assert api.files.retrieve(b.output_file_id).purpose == "batch_output"
    assert [x.id for x in api.batches.list(limit=5)] == [b.id]

    with pytest.raises(openai.NotFoundError, match="no batch 'batch_nope'"):
        api.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError, match="no file 'file-nope'"):
        api.files.content("file-nope")
    with pytest.raises(openai.BadRequestError, match="is completed"):
        api.batches.cancel(b.id)
    bad = api.files.create(file=("bad.jsonl", jsonl(["x"]) + b"{oops\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 2: not valid JSON"):
        api.batches.create(input_file_id=bad.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="line 1: url: '/v1/completions' differs"):
        api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.APIStatusError, match=f"more than {MAX_BYTES} bytes") as too_big:
        api.files.create(file=("big.jsonl", b"x" * (MAX_BYTES + 1)), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose: only \"batch\""):
        api.files.create(file=("tune.jsonl", b"{}"), purpose="fine-tune")
    assert len(api.batches.list().data) == 1  # the refused creates stored no batch

    listed = api.files.list()  # newest first: the refused upload stored nothing, "bad" did
    assert [x.id for x in listed.data] == [bad.id, b.error_file_id, b.output_file_id, f.id]
    assert [x.id for x in api.files.list(purpose="batch_output")] == [b.error_file_id, b.output_file_id]
    page = api.files.with_raw_response.list(extra_query={"limit": 2}).http_response.json()
    assert [x["id"] for x in page["data"]] == [bad.id, b.error_file_id] and page["has_more"] is True
    with pytest.raises(openai.BadRequestError, match=f"is the input of batch '{b.id}'"):
        api.files.delete(f.id)
    for gone in (bad.id, b.output_file_id):
        deleted = api.files.delete(gone)
        assert (deleted.id, deleted.deleted) == (gone, True)
        with pytest.raises(openai.NotFoundError, match=f"no file '{gone}'"):
            api.files.retrieve(gone)
    with pytest.raises(openai.NotFoundError):
        api.files.delete(bad.id)
    assert api.batches.retrieve(b.id).request_counts.completed == 3, "a batch outlives its output file"
    assert [x.id for x in api.files.list()] == [b.error_file_id, f.id]


def test_the_batch_cli(served, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(["ab", "fail", "cd"]))
    addr = ["--address", served.grpc_address]

    def ours(text: str) -> list[str]:  # the served side logs to the same stdout
        return [x for x in text.splitlines() if not x[:4].isdigit()]

    kunserve_main(["batch", "submit", str(src), "--wait", "--poll", "0.02", "--metadata", "k=v", *addr])
    out, err = capsys.readouterr()
    (batch_id,) = ours(out)
    assert batch_id.startswith("batch_")
    assert "] 3/3 (1 failed) completed" in err and f"{batch_id} completed: 2 completed, 1 failed, 3 total" in err

    dest = tmp_path / "out.jsonl"
    kunserve_main(["batch", "results", batch_id, "-o", str(dest), *addr])
    assert "3 result lines (1 errors) written to" in capsys.readouterr().err
    got = [json.loads(x) for x in dest.read_text().splitlines()]
    assert [x["custom_id"] for x in got] == ["c0", "c1", "c2"] and got[2]["response"]["body"]["choices"][0]["text"] == "dc"

    kunserve_main(["batch", "status", batch_id, "--json", *addr])
    (status,) = map(json.loads, ours(capsys.readouterr().out))
    assert status["status"] == "completed" and status["request_counts"] == {"total": "3", "completed": "2", "failed": "1"}
    kunserve_main(["batch", "list", *addr])
    assert ours(capsys.readouterr().out)[0].startswith(f"{batch_id} completed: 2 completed, 1 failed, 3 total  created ")

    for argv, message in ((["status", "batch_nope"], "kunserve batch: NOT_FOUND: no batch 'batch_nope'\n"),
                          (["cancel", batch_id], f"kunserve batch: FAILED_PRECONDITION: batch {batch_id!r} is completed"),
                          (["submit", str(tmp_path / "missing.jsonl")], "kunserve batch: "),
                          (["results", "batch_nope", "-o", str(tmp_path / "never.jsonl")], "kunserve batch: NOT_FOUND")):
        with pytest.raises(SystemExit) as exit_:
            kunserve_main(["batch", *argv, *addr])
        assert exit_.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "never.jsonl").exists()
    src.write_bytes(jsonl(["ok"]) + b'{"custom_id": "c1", "method": "GET"}\n')
    with pytest.raises(SystemExit):
        kunserve_main(["batch", "submit", str(src), *addr])
    assert capsys.readouterr().err == "kunserve batch: INVALID_ARGUMENT: line 2: method: must be \"POST\", got 'GET'\n"
