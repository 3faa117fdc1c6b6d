"""The dispatcher's guards against clients and stuck workers, against in-process fake workers (see
test_dispatcher_resume.py): admission bounds with a retry hint, the queue timeout, prompt limits checked
before tokenizing or forwarding, cancel ownership, and liveness (a frozen worker's requests resume elsewhere
with the same tokens; it rejoins when it answers again)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from test_dispatcher_resume import PROMPT, FakeCluster, FakeWorker, reference, run

from kunserve import client
from kunserve.services.dispatcher.limits import EMBEDDED_CONTEXT_LEN, DispatcherLimits, limits_from_config, model_context_len
from kunserve.services.dispatcher.servicer import RETRY_PUSHBACK_KEY
from kunserve.shared.config import load_config
from kunserve.shared.model.tokenizer import ByteTokenizer
from kunserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class FreezableWorker(FakeWorker):
    """A fake worker that can freeze like a SIGSTOPped process: stats polls and token streams hang until
    thawed (`stats_frozen` alone models a hung engine behind a live server when the stats still answer)."""

    def __init__(self, wid, cluster) -> None:
        super().__init__(wid, cluster)
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.stats_answer = asyncio.Event()
        self.stats_answer.set()

    def freeze(self, stats_too: bool = True) -> None:
        self.thawed.clear()
        if stats_too:
            self.stats_answer.clear()

    def thaw(self) -> None:
        self.thawed.set()
        self.stats_answer.set()

    async def Generate(self, request, context):
        async for ev in super().Generate(request, context):
            await self.thawed.wait()
            yield ev

    async def GetStats(self, request, context):
        await self.stats_answer.wait()
        return await super().GetStats(request, context)


class GuardCluster(FakeCluster):
    def __init__(self, n: int, limits: DispatcherLimits | None = None, stall_timeout_s: float = 3.0, **kw) -> None:
        super().__init__(n, **kw)
        self.workers = {w.id: FreezableWorker(w.id, self) for w in self.cfg.workers}
        self.limits = limits
        self.stall_timeout_s = stall_timeout_s

    async def __aenter__(self) -> GuardCluster:
        await super().__aenter__()
        if self.limits is not None:
            self.servicer.limits = self.limits
        self.pool.liveness.stall_timeout_s = self.stall_timeout_s
        return self


async def until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def start(fc, rid: str, n: int, channel=None, prompt=PROMPT):
    got: list = []
    task = asyncio.create_task(client.generate(channel or fc.channel,
                                               client.make_request(prompt, request_id=rid, max_tokens=n),
                                               timeout=30, on_event=got.append))
    return task, got


async def refused(fc, prompt=PROMPT, n: int = 4, channel=None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate(channel or fc.channel, client.make_request(prompt, max_tokens=n), timeout=30)
    return e.value


def pushback_ms(err: grpc.aio.AioRpcError) -> int:
    return int(dict(err.trailing_metadata() or ())[RETRY_PUSHBACK_KEY])


# -- admission ------------------------------------------------------------------------------------------------

def test_inflight_bound_per_routable_worker_refuses_with_a_retry_hint():
    async def scenario():
        async with GuardCluster(2, DispatcherLimits(max_inflight_per_worker=2)) as fc:
            for w in fc.workers.values():
                w.plan = ["slow"]
            streams = [start(fc, f"long-{i}", 200) for i in range(4)]  # 2 per routable worker
            await until(lambda: all(got for _, got in streams), what="4 streams running")
            err = await refused(fc)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "4 requests in flight" in err.details() and "max_inflight_per_worker" in err.details()
            assert "retry in" in err.details() and 0 < pushback_ms(err) <= 10_000
            assert fc.servicer.admission.refused_total == 1
            for i in range(4):
                assert await client.cancel(fc.channel, f"long-{i}")
            results = [await t for t, _ in streams]
            assert all(r.finish_reason == "aborted" for r in results)
            res, events = await fc.generate(PROMPT, 5)  # room again
            assert res.token_ids == reference(PROMPT, 5)
            assert fc.servicer.admission.inflight == 0 and fc.servicer.admission.queued_tokens == 0

    run(scenario())


def test_queued_prompt_token_bound_counts_requests_without_a_first_token():
    async def scenario():
        async with GuardCluster(1, DispatcherLimits(max_queued_prompt_tokens=10), route_timeout_s=20) as fc:
            fc.workers["worker-0"].stats.serving = False  # nothing starts: prompts stay queued
            await fc.pool.refresh()
            task, _ = start(fc, "queued", 4, prompt=list(range(1, 9)))  # 8 tokens
            await until(lambda: fc.servicer.admission.queued_tokens == 8, what="8 queued tokens")
            err = await refused(fc, prompt=[1, 2, 3])
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queued_prompt_tokens" in err.details() and "8 prompt tokens are queued" in err.details()
            assert pushback_ms(err) > 0
            fc.workers["worker-0"].stats.serving = True
            res = await task
            assert res.token_ids == reference(list(range(1, 9)), 4)
            assert fc.servicer.admission.queued_tokens == 0
            res, _ = await fc.generate([1, 2, 3], 3)  # the queue drained: admitted
            assert res.finish_reason == "length"

    run(scenario())


def test_an_accepted_request_without_a_first_token_gets_resource_exhausted_at_the_queue_timeout():
    async def scenario():
        async with GuardCluster(1, DispatcherLimits(queue_timeout_s=0.5), route_timeout_s=20) as fc:
            w = fc.workers["worker-0"]
            w.freeze(stats_too=False)  # it takes the request but never emits a token
            t0 = time.monotonic()
            err = await refused(fc)
            took = time.monotonic() - t0
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and 0.4 <= took < 5
            assert "no first token within dispatcher.queue_timeout_s = 0.5 s" in err.details()
            assert pushback_ms(err) > 0
            await until(lambda: not w.active, what="the worker's call to be cancelled")
            assert fc.servicer.admission.inflight == 0 and not fc.servicer.records

    run(scenario())


# -- prompt limits ----------------------------------------------------------------------------------------------

class SpyTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text)


@pytest.mark.parametrize("prompt, max_tokens, needle, tokenized", [
    (list(range(1, 10)), 4, "prompt: 9 token ids exceed dispatcher.max_prompt_tokens = 8", False),
    ("x" * 17, 4, "prompt.text: 17 bytes or more exceed dispatcher.max_prompt_bytes = 16", False),
    ("é" * 9, 4, "prompt.text: 18 bytes or more exceed dispatcher.max_prompt_bytes = 16", False),
    ("y" * 9, 4, "prompt: 9 tokens exceed dispatcher.max_prompt_tokens = 8", True),
    ([1] * 8, 13, "exceeds the model context of 20", False),
])
def test_prompts_over_the_limits_are_refused_before_tokenizing_or_forwarding(prompt, max_tokens, needle, tokenized):
    async def scenario():
        limits = DispatcherLimits(context_len=20, max_prompt_tokens=8, max_prompt_bytes=16, auto_prompt_tokens=False)
        async with GuardCluster(1, limits) as fc:
            spy = fc.servicer.tokenizer = SpyTokenizer()
            err = await refused(fc, prompt=prompt, n=max_tokens)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert needle in err.details(), err.details()
            assert bool(spy.encoded) == tokenized
            assert not fc.workers["worker-0"].calls  # never forwarded
            res, _ = await fc.generate("abc", 4)  # within the limits: served
            assert res.finish_reason == "length"

    run(scenario())


def test_limits_resolve_from_the_config_and_the_model(tmp_path):
    from kunserve.shared.model.architecture import TINY_CONFIG

    assert EMBEDDED_CONTEXT_LEN == TINY_CONFIG.max_position_embeddings
    cfg = load_config(None, environ={})
    lim = limits_from_config(cfg)
    assert (lim.context_len, lim.max_prompt_tokens, lim.max_prompt_bytes) == (2048, 2048, 2048 * 32)
    assert lim.max_inflight_per_worker == cfg.engine.max_num_seqs and lim.max_queued_prompt_tokens == 0
    assert 2048 * 32 < lim.max_message_bytes < 1024 * 1024  # a 10 MB prompt is refused by gRPC itself
    assert lim.server_options() == [("grpc.max_receive_message_length", lim.max_message_bytes)]
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert model_context_len(str(tmp_path)) == 8192
    cfg.model.path = str(tmp_path)
    cfg.dispatcher.max_prompt_tokens = 1000
    cfg.dispatcher.max_inflight_per_worker = 5
    lim = limits_from_config(cfg)
    assert (lim.context_len, lim.max_prompt_tokens, lim.max_prompt_bytes) == (8192, 1000, 32_000)
    assert lim.max_inflight_per_worker == 5 and not lim.auto_prompt_tokens


# -- cancel ownership -------------------------------------------------------------------------------------------

def other_client(address: str) -> grpc.aio.Channel:
    """A channel on a connection of its own, as another client process has (channels of one process with
    the same options share one connection through gRPC's global subchannel pool: they are one client)."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def test_only_the_sending_connection_may_cancel():
    async def scenario():
        async with GuardCluster(1) as fc:
            fc.workers["worker-0"].plan = ["slow"]
            task, got = start(fc, "mine", 30)
            await until(lambda: got, what="a first token")
            async with other_client(fc.address) as other:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.cancel(other, "mine")
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "'mine'" in e.value.details() and "another client" in e.value.details()
            res = await task  # untouched: every token
            assert res.token_ids == reference(PROMPT, 30) and res.finish_reason == "length"
            assert fc.workers["worker-0"].cancels == []

    run(scenario())


def test_with_a_credential_the_owner_is_the_credential_not_the_connection():
    async def scenario():
        async with GuardCluster(1) as fc:
            fc.workers["worker-0"].plan = ["slow"]
            stub = generation_pb2_grpc.GenerationStub(fc.channel)
            key_a = (("authorization", "Bearer key-a"),)
            call = stub.Generate(client.make_request(PROMPT, request_id="keyed", max_tokens=200), metadata=key_a)
            first = await call.read()
            assert first.token_id >= 0
            async with other_client(fc.address) as other:
                other_stub = generation_pb2_grpc.GenerationStub(other)
                with pytest.raises(grpc.aio.AioRpcError) as e:  # same connection as the sender, other key
                    await stub.Cancel(client.common_pb2.CancelRequest(request_id="keyed"),
                                      metadata=(("authorization", "Bearer key-b"),))
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                # another connection with the same key may
                resp = await other_stub.Cancel(client.common_pb2.CancelRequest(request_id="keyed"), metadata=key_a)
                assert resp.cancelled
            events = []
            while (ev := await call.read()) != grpc.aio.EOF:
                events.append(ev)
            assert events[-1].finish_reason == client.common_pb2.FINISH_REASON_ABORTED

    run(scenario())


# -- liveness ---------------------------------------------------------------------------------------------------

def test_frozen_worker_requests_resume_elsewhere_and_it_rejoins_when_thawed():
    async def scenario():
        async with GuardCluster(2, stall_timeout_s=1.0) as fc:
            w0, w1 = fc.workers["worker-0"], fc.workers["worker-1"]
            w1.stats.kv_blocks_used = 50  # worker-0 is chosen first
            await fc.pool.refresh()
            w0.plan = ["slow"]
            task, got = start(fc, "victim", 60)
            await until(lambda: len(got) >= 5, what="5 tokens")
            w0.freeze()  # SIGSTOP: no token, no stats answer
            frozen_at = time.monotonic()
            res = await task
            assert res.token_ids == reference(PROMPT, 60) and res.finish_reason == "length"
            moved = next(e for e in got if e.worker_id == "worker-1")
            assert moved.index >= 5 and time.monotonic() - frozen_at < 5
            assert fc.pool.router.choose() == "worker-1"  # out of routing while frozen
            res, _ = await fc.generate(PROMPT, 4)
            assert res.worker_id == "worker-1"
            w0.thaw()  # SIGCONT: the abandoned call was cancelled, so its request is freed
            await until(lambda: not w0.active, what="the abandoned request to be freed")
            await until(lambda: fc.pool.router.routable("worker-0"), what="worker-0 to rejoin")
            res, _ = await fc.generate(PROMPT, 4)
            assert res.worker_id == "worker-0" and res.token_ids == reference(PROMPT, 4)

    run(scenario())


def test_engine_without_progress_behind_a_live_server_counts_as_stalled():
    async def scenario():
        async with GuardCluster(2, stall_timeout_s=1.0) as fc:
            w0, w1 = fc.workers["worker-0"], fc.workers["worker-1"]
            w1.stats.kv_blocks_used = 50
            await fc.pool.refresh()
            w0.plan = ["slow"]
            task, got = start(fc, "hung", 40)
            await until(lambda: len(got) >= 3, what="3 tokens")
            w0.stats.num_running = 1  # it still reports work, but its counters stop and no token comes
            w0.freeze(stats_too=False)
            res = await task
            assert res.token_ids == reference(PROMPT, 40) and res.worker_id == "worker-1"
            assert not fc.pool.router.routable("worker-0")
            await asyncio.sleep(0.3)  # polls keep answering: a stuck engine stays out of routing
            assert not fc.pool.router.routable("worker-0")
            w0.thaw()
            w0.stats.num_running = 0  # its requests are gone: nothing left that could stall
            await until(lambda: fc.pool.router.routable("worker-0"), what="worker-0 to rejoin")

    run(scenario())


def test_the_request_class_reaches_the_worker_and_an_unknown_one_is_refused():
    from kunserve.v1 import common_pb2

    async def scenario():
        async with GuardCluster(1, DispatcherLimits()) as fc:
            req = client.make_request(PROMPT, max_tokens=2)
            req.request_class = common_pb2.REQUEST_CLASS_OFFLINE
            await client.generate(fc.channel, req, timeout=30)
            assert [c.request_class for c in fc.workers["worker-0"].calls] == [common_pb2.REQUEST_CLASS_OFFLINE]
            bad = client.make_request(PROMPT, max_tokens=2)
            bad.request_class = 7  # type: ignore[assignment]  # an open enum takes any number on the wire
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate(fc.channel, bad, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_class" in e.value.details()
            assert len(fc.workers["worker-0"].calls) == 1  # never forwarded

    run(scenario())
