"""Offline batches on a real one-worker cluster: the OpenAI SDK's Files + Batch API end to end (a request the
cluster refuses is recorded with its error, the rest complete), and a dispatcher SIGKILLed mid-batch and
restarted on the same store: every custom_id gets exactly one result, in input order, whose text is the greedy
text the same request gets online (and the online tokens are the dense reference's)."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import openai
import pytest
from helpers import check_against_reference, generate_many, make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import batch_pb2, batch_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "kunserve-tiny"
TOKENS = 24


def prompt(i: int) -> list[int]:
    return [200 + (13 * i + 7 * j) % 700 for j in range(12 + i)]


def body(i: int) -> dict:
    return {"model": MODEL, "prompt": prompt(i), "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


def jsonl(bodies: list[dict], url: str = "/v1/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": b}) + "\n"
                   for i, b in enumerate(bodies)).encode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("batch")
    cfg = make_config(1)
    cfg.dispatcher.batch_db = str(run_dir / "batches.sqlite3")
    cfg.dispatcher.batch_concurrency = 2
    c = LocalCluster(cfg, run_dir=run_dir)
    c.start(timeout_s=120)
    log_path = c.child("dispatcher").log_path
    yield c
    c.stop()
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log and "batch_request_crashed" not in log


def online(c: LocalCluster, indices) -> dict[int, tuple[list[int], str]]:
    """The same requests as online gRPC requests: their greedy token ids (checked against the reference) and text."""
    results = run(generate_many(c.cfg.dispatcher.address, [client.make_request(prompt(i), max_tokens=TOKENS,
                                                                               ignore_eos=True) for i in indices]))
    out = {}
    for i, res in zip(indices, results):
        assert not isinstance(res, BaseException), res
        check_against_reference(prompt(i), res.token_ids, TOKENS)
        out[i] = (res.token_ids, res.text)
    return out


def test_the_openai_sdk_runs_a_batch(cluster):
    api = openai.OpenAI(base_url=f"http://{cluster.cfg.dispatcher.http_address}/v1", api_key="unused", max_retries=0,
                        timeout=60)
    too_long = {"model": MODEL, "prompt": [5] * 2040, "max_tokens": 16}  # prompt + max_tokens exceed the context
    f = api.files.create(file=("in.jsonl", jsonl([body(0), too_long, body(1)])), purpose="batch")
    b = api.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    while b.status not in ("completed", "expired", "cancelled"):
        b = api.batches.retrieve(b.id)
    assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 2, 1)
    out = [json.loads(x) for x in api.files.content(b.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in api.files.content(b.error_file_id).text.splitlines()]
    expected = online(cluster, [0, 1])
    assert [(x["custom_id"], x["response"]["body"]["choices"][0]["text"]) for x in out] == [
        ("req-0", expected[0][1]), ("req-2", expected[1][1])]
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == TOKENS
    assert err[0]["custom_id"] == "req-1" and err[0]["response"]["status_code"] == 400
    assert "exceeds the model context" in err[0]["response"]["body"]["error"]["message"]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}
    f = api.files.create(file=("chat.jsonl", jsonl([chat], "/v1/chat/completions")), purpose="batch")
    b = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while b.status not in ("completed", "expired", "cancelled"):
        b = api.batches.retrieve(b.id)
    (line,) = [json.loads(x) for x in api.files.content(b.output_file_id).text.splitlines()]
    reply = line["response"]["body"]
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == api.chat.completions.create(**chat).choices[0].message.model_dump(
        include={"role", "content"})


async def _batches(c: LocalCluster, fn):
    async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
        return await fn(batch_pb2_grpc.BatchesStub(ch))


def test_a_dispatcher_killed_mid_batch_loses_and_duplicates_nothing(cluster):
    n = 10

    async def submit(stub):
        async def chunks():
            yield batch_pb2.CreateBatchChunk(data=jsonl([body(i) for i in range(n)]))
        batch = await stub.CreateBatch(chunks())
        while (batch := await stub.GetBatch(batch_pb2.BatchRef(batch_id=batch.id))).request_counts.completed < 2:
            await asyncio.sleep(0.01)
        return batch.id

    batch_id = run(_batches(cluster, submit))
    cluster.kill("dispatcher")  # SIGKILL, mid-batch
    db = sqlite3.connect(cluster.cfg.dispatcher.batch_db)
    done = db.execute("SELECT count(*) FROM items WHERE batch_id = ? AND state != 'pending'", (batch_id,)).fetchone()[0]
    db.close()
    assert 2 <= done < n, "the batch was not in progress when the dispatcher died"
    cluster.restart("dispatcher")  # the same command, config and store

    async def results(stub):
        while (batch := await stub.GetBatch(batch_pb2.BatchRef(batch_id=batch_id))).status == "in_progress":
            await asyncio.sleep(0.05)
        return batch, [r async for r in stub.GetBatchResults(batch_pb2.BatchResultsRequest(batch_id=batch_id))]

    batch, lines = run(_batches(cluster, results))
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", n, 0)
    assert [(r.index, r.custom_id, r.ok) for r in lines] == [(i, f"req-{i}", True) for i in range(n)]
    expected = online(cluster, range(n))
    for r in lines:
        response = json.loads(r.line)["response"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["text"] == expected[r.index][1], r.custom_id
