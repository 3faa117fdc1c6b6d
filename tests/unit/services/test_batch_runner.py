"""The batch runner over a real store and a scripted executor: bounded concurrency, a failing request is recorded
and the rest go on, "not now" refusals wait instead of failing, cancel and expiry stop the running requests and
end the batch, and a runner that stopped mid-batch (its requests cancelled, nothing recorded for them) is
continued by a new one on the same file with exactly one result per request. Also the executor that runs a
request through the dispatcher's lifecycle (OpenAIItems) against a fake front and servicer."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kunserve.services.dispatcher import openai_api as oa
from kunserve.services.dispatcher.batch_format import BatchRequest
from kunserve.services.dispatcher.batch_runner import BatchRunner, OpenAIItems, Outcome, Retry
from kunserve.services.dispatcher.batch_store import BatchStore, Item
from kunserve.services.dispatcher.servicer import RequestError
from kunserve.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.timeout(60)


class Script:
    """An executor whose behaviour is in each body: {"fail": status}, {"retries": n} (Retry n times first),
    {"block": true} (waits for `release`), {"crash": true}; else 200 with {"text": prompt}."""

    def __init__(self) -> None:
        self.active = 0
        self.max_active = 0
        self.calls: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()
        self.retried: dict[str, int] = {}

    async def __call__(self, endpoint: str, item: Item, request_id: str) -> Outcome:
        self.calls.append(item.custom_id)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            body = item.body
            await asyncio.sleep(0.005)
            if self.retried.get(item.custom_id, 0) < body.get("retries", 0):
                self.retried[item.custom_id] = self.retried.get(item.custom_id, 0) + 1
                raise Retry("admission is full", 0.001)
            if "fail" in body:
                return Outcome(body["fail"], {"error": {"message": f"{item.custom_id} is bad"}})
            if body.get("crash"):
                raise KeyError("boom")
            if body.get("block"):
                await self.release.wait()
            return Outcome(200, {"text": body["prompt"]})
        except asyncio.CancelledError:
            self.cancelled.append(item.custom_id)
            raise
        finally:
            self.active -= 1


def make_batch(store: BatchStore, bodies: list[dict], window_s: int = 3600) -> str:
    reqs = [BatchRequest(i + 1, f"r{i}", "/v1/completions", b) for i, b in enumerate(bodies)]
    return store.submit(b"in", "in.jsonl", endpoint="/v1/completions", window="1h", window_s=window_s,
                        requests=reqs, metadata={}).id


async def until(pred, timeout: float = 20.0) -> None:
    async def wait() -> None:
        while not pred():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(wait(), timeout)


def lines(store: BatchStore, batch_id: str) -> list[dict]:
    return [json.loads(r.line) for r in store.results(batch_id)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 50))


def test_runs_every_request_with_bounded_concurrency_and_records_failures(tmp_path):
    async def main() -> None:
        store = BatchStore(tmp_path / "b.sqlite3")
        bodies = [{"prompt": f"p{i}"} for i in range(12)]
        bodies[3] = {"fail": 400}
        bodies[5] = {"prompt": "p5", "retries": 3}
        bodies[7] = {"crash": True}
        bid = make_batch(store, bodies)
        script = Script()
        runner = BatchRunner(store, script, concurrency=3, poll_s=0.01)
        runner.start()
        await until(lambda: store.batch(bid).status == "completed")
        await runner.stop()
        b = store.batch(bid)
        assert (b.completed, b.failed, b.total) == (10, 2, 12)
        assert script.max_active <= 3 and script.retried == {"r5": 3}
        got = lines(store, bid)
        assert [x["custom_id"] for x in got] == [f"r{i}" for i in range(12)]  # input order, one line each
        assert got[5]["response"]["body"] == {"text": "p5"}
        assert got[3]["response"]["status_code"] == 400 and got[3]["response"]["body"]["error"]["message"] == "r3 is bad"
        assert got[7]["response"]["status_code"] == 500
        assert got[0]["response"]["request_id"] == f"{bid}-0-1" and got[0]["id"].startswith("batch_req_")
        err = [json.loads(x) for x in store.file_content(b.error_file_id).decode().splitlines()]
        assert [x["custom_id"] for x in err] == ["r3", "r7"]
        store.close()

    run(main())


def test_cancel_stops_running_requests_and_ends_the_batch(tmp_path):
    async def main() -> None:
        store = BatchStore(tmp_path / "b.sqlite3")
        bid = make_batch(store, [{"prompt": "p0"}] + [{"prompt": f"p{i}", "block": True} for i in range(1, 6)])
        script = Script()
        runner = BatchRunner(store, script, concurrency=2, poll_s=0.01)
        runner.start()
        await until(lambda: script.active == 2 and store.batch(bid).completed == 1)
        store.cancel(bid)
        runner.wake()
        await until(lambda: store.batch(bid).status == "cancelled")
        assert sorted(script.cancelled) == ["r1", "r2"]
        b = store.batch(bid)
        assert (b.completed, b.failed) == (1, 5)
        got = lines(store, bid)
        assert [x["custom_id"] for x in got] == [f"r{i}" for i in range(6)]
        assert {x["error"]["code"] for x in got[1:]} == {"batch_cancelled"}
        await runner.stop()
        store.close()

    run(main())


def test_expiry_ends_the_batch_with_what_was_done(tmp_path):
    async def main() -> None:
        now = [1000.0]
        store = BatchStore(tmp_path / "b.sqlite3", clock=lambda: now[0])
        bid = make_batch(store, [{"prompt": "p0"}, {"prompt": "p1", "block": True}, {"prompt": "p2"}], window_s=60)
        script = Script()
        runner = BatchRunner(store, script, concurrency=1, poll_s=0.01)
        runner.start()
        await until(lambda: script.calls == ["r0", "r1"])
        now[0] = 1060.0
        await until(lambda: store.batch(bid).status == "expired")
        got = lines(store, bid)
        assert got[0]["response"]["body"] == {"text": "p0"}
        assert [x["error"]["code"] for x in got[1:]] == ["batch_expired", "batch_expired"]
        assert script.cancelled == ["r1"] and script.calls == ["r0", "r1"]
        await runner.stop()
        store.close()

    run(main())


def test_a_new_runner_continues_a_stopped_one_with_one_result_per_request(tmp_path):
    path = tmp_path / "b.sqlite3"

    async def first() -> str:
        store = BatchStore(path)
        bid = make_batch(store, [{"prompt": f"p{i}", "block": i >= 2} for i in range(6)])
        script = Script()
        runner = BatchRunner(store, script, concurrency=2, poll_s=0.01)
        runner.start()
        await until(lambda: store.batch(bid).completed == 2 and script.active == 2)
        await runner.stop()  # the dispatcher stops: r2 and r3 were running
        assert sorted(script.cancelled) == ["r2", "r3"]
        store.close()
        return bid

    async def second(bid: str) -> None:
        store = BatchStore(path)
        script = Script()
        script.release.set()
        runner = BatchRunner(store, script, concurrency=2, poll_s=0.01)
        runner.start()
        await until(lambda: store.batch(bid).status == "completed")
        await runner.stop()
        assert sorted(script.calls) == ["r2", "r3", "r4", "r5"]
        res = store.results(bid)
        assert [(r.custom_id, r.ok) for r in res] == [(f"r{i}", True) for i in range(6)]
        assert [r.attempts for r in res] == [1, 1, 2, 2, 1, 1]
        assert [json.loads(r.line)["response"]["body"]["text"] for r in res] == [f"p{i}" for i in range(6)]
        store.close()

    bid = run(first())
    run(second(bid))


def test_batches_run_oldest_first_and_a_new_one_wakes_the_runner(tmp_path):
    async def main() -> None:
        store = BatchStore(tmp_path / "b.sqlite3")
        script = Script()
        runner = BatchRunner(store, script, concurrency=1, poll_s=30)  # only wake-ups make it look again
        runner.start()
        await asyncio.sleep(0.05)
        a = make_batch(store, [{"prompt": "a0"}, {"prompt": "a1"}])
        b = make_batch(store, [{"prompt": "b0"}])
        runner.wake()
        await until(lambda: store.batch(b).status == "completed")
        assert store.batch(a).status == "completed" and script.calls == ["r0", "r1", "r0"]
        await runner.stop()
        store.close()

    run(main())


# -- OpenAIItems: a request through the front's parsing and the dispatcher's lifecycle ----------------------
class FakeFront:
    def openai_request(self, chat, body, request_id):
        return oa.parse_completion(body, "tiny", request_id)

    async def whole(self, req, events):
        return {"text": "".join([ev.text async for ev in events])}


class FakeServicer:
    def __init__(self, refuse: RequestError | None = None) -> None:
        self.refuse = refuse
        self.opened: list[generation_pb2.GenerateRequest] = []

    async def open(self, request, owner):
        if self.refuse is not None:
            raise self.refuse
        self.opened.append(request)
        return request

    async def events(self, record):
        for t in ("a", "b"):
            yield generation_pb2.GenerateEvent(request_id=record.request_id, text=t)


def test_openai_items_run_offline_and_map_refusals():
    item = Item("batch_1", 0, "c", {"prompt": "hi", "max_tokens": 2, "request_class": "online"})

    async def main() -> None:
        servicer = FakeServicer()
        out = await OpenAIItems(FakeFront(), servicer)("/v1/completions", item, "batch_1-0")
        assert out == Outcome(200, {"text": "ab"})
        (sent,) = servicer.opened
        assert sent.request_class == common_pb2.REQUEST_CLASS_OFFLINE and sent.request_id == "batch_1-0"

        bad = await OpenAIItems(FakeFront(), servicer)("/v1/completions", Item("b", 1, "d", {"prompt": 3}), "r")
        assert bad.status_code == 400 and bad.body["error"]["param"] == "prompt"

        too_long = FakeServicer(RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 9000 tokens exceed the model"))
        refused = await OpenAIItems(FakeFront(), too_long)("/v1/completions", item, "r")
        assert refused.status_code == 400 and refused.body["error"]["message"].startswith("prompt: 9000 tokens")

        for code, hint in ((grpc.StatusCode.RESOURCE_EXHAUSTED, 250), (grpc.StatusCode.UNAVAILABLE, None),
                           (grpc.StatusCode.ALREADY_EXISTS, None)):
            with pytest.raises(Retry) as err:
                await OpenAIItems(FakeFront(), FakeServicer(RequestError(code, "not now", hint)))(
                    "/v1/completions", item, "r")
            assert err.value.after_s == (0.25 if hint else None)

    run(main())


class Cluster:
    """A dispatcher lifecycle whose request ids outlive the runner that opened them, as on a worker that still runs
    the requests of a dispatcher that was just restarted: an id it holds is refused with ALREADY_EXISTS (the
    servicer's and the worker's answer) until it ends there."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.opened: list[str] = []
        self.hold = asyncio.Event()

    async def open(self, request, owner):
        rid = request.request_id
        if rid in self.running:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running on this worker")
        self.running.add(rid)
        self.opened.append(rid)
        return request

    async def events(self, record):
        await self.hold.wait()
        self.running.discard(record.request_id)
        yield generation_pb2.GenerateEvent(request_id=record.request_id, text="ok")


def test_a_request_re_run_while_its_last_attempt_still_runs_gets_a_new_id_and_succeeds(tmp_path):
    """The dispatcher stops mid-batch (its requests keep running on the workers a while) and a new one continues
    the batch at once: every attempt has an id of its own, so the re-run is not refused as a duplicate of the
    one still running, and each request still has exactly one result."""
    path = tmp_path / "b.sqlite3"
    cluster = Cluster()

    async def first() -> str:
        store = BatchStore(path)
        bid = make_batch(store, [{"prompt": f"p{i}", "max_tokens": 2} for i in range(3)])
        runner = BatchRunner(store, OpenAIItems(FakeFront(), cluster), concurrency=2, poll_s=0.01)  # type: ignore[arg-type]
        runner.start()
        await until(lambda: len(cluster.running) == 2)
        await runner.stop()  # r0 and r1 were running, and still are on the workers
        store.close()
        return bid

    async def second(bid: str) -> None:
        store = BatchStore(path)
        cluster.hold.set()
        runner = BatchRunner(store, OpenAIItems(FakeFront(), cluster), concurrency=2, poll_s=0.01)  # type: ignore[arg-type]
        runner.start()
        await until(lambda: store.batch(bid).status == "completed")
        await runner.stop()
        b = store.batch(bid)
        assert (b.completed, b.failed) == (3, 0)
        res = store.results(bid)
        assert [(r.custom_id, r.ok, r.attempts) for r in res] == [("r0", True, 2), ("r1", True, 2), ("r2", True, 1)]
        ids = [json.loads(r.line)["response"]["request_id"] for r in res]
        assert ids == [f"{bid}-0-2", f"{bid}-1-2", f"{bid}-2-1"]
        assert len(set(cluster.opened)) == len(cluster.opened) == 5, "no id was opened twice"
        store.close()

    bid = run(first())
    run(second(bid))
