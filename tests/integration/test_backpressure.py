"""Backpressure and liveness against a real cluster with small bounds (issue 12, defects 5-8):

* a storm beyond the admission bound gets RESOURCE_EXHAUSTED (with a retry hint) and every accepted request
  completes with all its tokens;
* oversize prompts (text and token ids, several MB) are refused with a clear status while the dispatcher's
  memory stays flat and its health answers promptly;
* a Cancel from another client's connection does not cancel;
* SIGSTOP of a worker mid-stream: its request continues on the other worker with the reference greedy tokens,
  new requests go elsewhere, and after SIGCONT the worker serves again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from helpers import check_against_reference, make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.services.dispatcher.servicer import RETRY_PUSHBACK_KEY
from kunserve.shared.rpc import health_check

pytestmark = pytest.mark.integration

PER_WORKER = 4  # dispatcher.max_inflight_per_worker: 8 in flight on 2 workers
STALL_S = 1.5
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = make_config(2)
    cfg.dispatcher.max_inflight_per_worker = PER_WORKER
    cfg.dispatcher.stall_timeout_s = STALL_S
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("backpressure"))
    c.start(timeout_s=120)
    yield c
    c.stop()


def other_client(address: str) -> grpc.aio.Channel:
    """A channel on a connection of its own, as another client process has (channels of one process with the
    same options share one connection through gRPC's global subchannel pool)."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_storm_beyond_the_bound_is_refused_and_every_accepted_request_completes(cluster):
    n, max_tokens = 40, 16
    prompts = [[20 + i, 21, 22] for i in range(n)]

    async def one(ch, prompt):
        t0 = time.monotonic()
        try:
            res = await client.generate(ch, client.make_request(prompt, max_tokens=max_tokens, ignore_eos=True),
                                        timeout=60)
            return res, time.monotonic() - t0
        except grpc.aio.AioRpcError as exc:
            return exc, time.monotonic() - t0

    async def scenario():
        channels = [client.insecure_channel(cluster.cfg.dispatcher.address) for _ in range(4)]
        try:
            return await asyncio.gather(*(one(channels[i % 4], p) for i, p in enumerate(prompts)))
        finally:
            for ch in channels:
                await ch.close()

    outcomes = run(scenario())
    accepted = [(p, r) for p, (r, _) in zip(prompts, outcomes) if not isinstance(r, grpc.aio.AioRpcError)]
    refused = [r for r, _ in outcomes if isinstance(r, grpc.aio.AioRpcError)]
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert "max_inflight_per_worker" in err.details() and "retry in" in err.details()
        assert int(dict(err.trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
    assert len(refused) >= 1, "nothing was refused: the storm did not exceed the bound"
    assert len(accepted) >= 2 * PER_WORKER
    for prompt, res in accepted:
        assert res.finish_reason == "length"
        check_against_reference(prompt, res.token_ids, max_tokens)
    # refusals are immediate: nobody waited behind the accepted ones to be told
    assert max(t for r, t in outcomes if isinstance(r, grpc.aio.AioRpcError)) < 10


def test_oversize_prompts_are_refused_and_the_dispatcher_memory_stays_flat(cluster):
    address = cluster.cfg.dispatcher.address
    pid = cluster.child("dispatcher").proc.pid
    huge_text = "x" * (10 * MIB)
    huge_ids = [7] * (1024 * 1024)  # ~1 MiB of ids on the wire, far beyond the context

    async def expect(ch, request, code, needle):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(ch, request, timeout=60)
        assert e.value.code() == code, (e.value.code(), e.value.details())
        assert needle in e.value.details(), e.value.details()

    async def scenario():
        async with client.insecure_channel(address) as ch:
            # warm up: the first requests allocate what a dispatcher keeps anyway
            await expect(ch, client.make_request(huge_text), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
            before = rss_bytes(pid)
            for _ in range(24):
                await expect(ch, client.make_request(huge_text), grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "larger than max")
            for _ in range(8):
                await expect(ch, client.make_request(huge_ids), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
            # under the message limit but over the prompt limits: refused by the dispatcher, naming the bound
            await expect(ch, client.make_request("y" * 70_000), grpc.StatusCode.INVALID_ARGUMENT,
                         "dispatcher.max_prompt_bytes")
            await expect(ch, client.make_request([5] * 3000), grpc.StatusCode.INVALID_ARGUMENT,
                         "3000 token ids exceed the model context of 2048")
            after = rss_bytes(pid)
            t0 = time.monotonic()
            healthy = await health_check(address, timeout=2.0, tls=cluster.tls)
            health_s = time.monotonic() - t0
            res = await client.generate(ch, client.make_request([1, 2, 3], max_tokens=4, ignore_eos=True), timeout=60)
            return before, after, healthy, health_s, res

    before, after, healthy, health_s, res = run(scenario(), timeout=240)
    # Kept prompts would be >= 240 MiB here (the defect: 2.3 GiB); gRPC's transient buffers come and go (10-30 MiB
    # seen between samples on a loaded machine, flat over 120 refusals), so the bound leaves room for them.
    assert after - before < 64 * MIB, f"dispatcher RSS grew {(after - before) / MIB:.1f} MiB"
    assert healthy and health_s < 1.0
    check_against_reference([1, 2, 3], res.token_ids, 4)


def test_the_http_front_refuses_a_storm_with_429_and_oversize_bodies_with_4xx(cluster):
    """The same bounds through the OpenAI front: refusals are 429 OpenAI errors with Retry-After, every accepted
    request completes with all its tokens, and a body beyond the message limit is a 4xx error object."""
    import aiohttp

    url = f"http://{cluster.cfg.dispatcher.http_address}/v1/completions"
    n, max_tokens = 40, 16

    async def one(session, i):
        body = {"prompt": [20 + i, 21, 22], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        async with session.post(url, json=body) as resp:
            return resp.status, dict(resp.headers), await resp.json()

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            storm = await asyncio.gather(*(one(session, i) for i in range(n)))
            async with session.post(url, data=b"{\"prompt\": \"" + b"x" * (10 * MIB) + b"\"}",
                                    headers={"Content-Type": "application/json"}) as resp:
                return storm, resp.status, await resp.json()

    storm, big_status, big = run(scenario(), timeout=180)
    refused = [(h, b) for status, h, b in storm if status == 429]
    accepted = [b for status, _, b in storm if status == 200]
    assert len(refused) + len(accepted) == n, [s for s, _, _ in storm]
    assert refused and len(accepted) >= 2 * PER_WORKER
    for headers, body in refused:
        assert body["error"]["type"] == "rate_limit_error" and "max_inflight_per_worker" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
    assert all(b["usage"]["completion_tokens"] == max_tokens for b in accepted)
    assert 400 <= big_status < 500 and "exceeds" in big["error"]["message"]


def test_cancel_from_another_client_does_not_cancel(cluster):
    address = cluster.cfg.dispatcher.address
    n = 200

    async def scenario():
        async with client.insecure_channel(address) as ch, other_client(address) as other:
            got: list = []
            task = asyncio.create_task(client.generate(
                ch, client.make_request([4, 5, 6], request_id="not-yours", max_tokens=n, ignore_eos=True),
                timeout=120, on_event=got.append))
            while not got:
                if task.done():
                    await task
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.cancel(other, "not-yours")
            return e.value, await task

    err, res = run(scenario())
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "another client" in err.details()
    assert res.finish_reason == "length"
    check_against_reference([4, 5, 6], res.token_ids, n)


def test_frozen_worker_requests_resume_elsewhere_and_it_rejoins_after_sigcont(cluster):
    address = cluster.cfg.dispatcher.address
    n = 400
    prompt = [9, 10, 11]
    stopped: list[int] = []

    async def scenario():
        async with client.insecure_channel(address) as ch:
            got: list = []
            arrived: list[float] = []

            def on_event(ev):
                got.append(ev)
                arrived.append(time.monotonic())

            task = asyncio.create_task(client.generate(
                ch, client.make_request(prompt, request_id="frozen", max_tokens=n, ignore_eos=True), timeout=120,
                on_event=on_event))
            while len(got) < 3:
                if task.done():
                    await task
                await asyncio.sleep(0.005)
            victim = got[0].worker_id
            pid = cluster.child(victim).proc.pid
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            frozen_at = time.monotonic()
            res = await task
            moved_at = next(t for ev, t in zip(got, arrived) if ev.worker_id != victim)
            # while it is frozen, new requests go to the other worker
            others = await asyncio.gather(*(client.generate(
                ch, client.make_request([30 + i, 31], max_tokens=4, ignore_eos=True), timeout=60) for i in range(3)))
            os.kill(pid, signal.SIGCONT)
            stopped.remove(pid)
            # it rejoins: within a bounded time a request lands on it again
            deadline = time.monotonic() + 30
            back = []
            while not back and time.monotonic() < deadline:
                batch = await asyncio.gather(*(client.generate(
                    ch, client.make_request([40 + i, 41], max_tokens=4, ignore_eos=True), timeout=60)
                    for i in range(4)))
                back = [r for r in batch if r.worker_id == victim]
            return victim, res, got, moved_at - frozen_at, others, back

    try:
        victim, res, events, resume_s, others, back = run(scenario(), timeout=180)
    finally:
        for pid in stopped:  # never leave a stopped process behind for the teardown
            os.kill(pid, signal.SIGCONT)
    check_against_reference(prompt, res.token_ids, n)
    tokens = [e for e in events if e.token_id >= 0]
    assert [e.index for e in tokens] == list(range(n))
    assert tokens[0].worker_id == victim and tokens[-1].worker_id != victim
    assert resume_s < STALL_S + 8, f"resumed {resume_s:.1f} s after the freeze"
    assert all(r.worker_id != victim for r in others)
    for i, r in enumerate(others):
        check_against_reference([30 + i, 31], r.token_ids, 4)
    assert back, f"{victim} did not serve again within 30 s of SIGCONT"
    log = cluster.child("dispatcher").log_path.read_text()
    assert "worker_stalled" in log and "requests_leaving_stalled_worker" in log
