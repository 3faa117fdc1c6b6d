"""End to end through real service processes: dispatcher -> workers, monitor, memory manager, kunctl."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import grpc
import pytest
from helpers import generate_many, internal_channel, kunctl_argv, reference_for, run
from oracle import compare_greedy

from kunserve import client

pytestmark = pytest.mark.integration


def test_32_concurrent_streams_match_the_reference(cluster):
    rng = random.Random(7)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(1, 120))] for _ in range(32)]
    lengths = [rng.randint(1, 24) for _ in range(32)]
    reqs = [client.make_request(p, request_id=f"r{i}", max_tokens=n, ignore_eos=True)
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    results = run(generate_many(cluster.cfg.dispatcher.address, reqs))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    workers_used = {r.worker_id for r in results}
    assert workers_used == {"worker-0", "worker-1"}, f"router used only {workers_used}"
    near_ties = 0
    for p, n, res in zip(prompts, lengths, results):
        ref, margins = reference_for(p, n)
        assert res.finish_reason == "length" and res.num_prompt_tokens == len(p)
        assert res.ttft_s is not None and len(res.token_times_s) == n
        near_ties += compare_greedy(res.token_ids, ref, margins)
    assert near_ties <= 2


def test_text_prompt_streams_text_and_timing(cluster):
    res = run(generate_many(cluster.cfg.dispatcher.address, [client.make_request("Hello, KunServe", max_tokens=8,
                                                                                 ignore_eos=True)]))[0]
    assert not isinstance(res, BaseException), res
    assert len(res.token_ids) == 8 and len(res.text) > 0 and res.ttft_s > 0


def test_kunctl_status_shows_worker_stats(cluster):
    # Traffic first, so the counters are non-zero.
    run(generate_many(cluster.cfg.dispatcher.address, [client.make_request([1, 2, 3], max_tokens=4)]))
    # The memory manager refreshes its layout from the workers every second; one that was not accepting
    # connections at its first refresh joins the layout at a later one: wait (bounded) for both.
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(kunctl_argv(cluster, "status", "--json"), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        if len(status["layout"]["workers"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    workers = {w["stats"]["worker_id"]: w for w in status["cluster"]["workers"]}
    assert set(workers) == {"worker-0", "worker-1"}
    assert all(w["healthy"] for w in workers.values())
    assert sum(int(w["stats"].get("generated_tokens_total", 0)) for w in workers.values()) >= 4
    assert all(int(w["stats"]["kv_blocks_total"]) > 0 for w in workers.values())
    assert {w["worker_id"] for w in status["layout"]["workers"]} == {"worker-0", "worker-1"}
    table = subprocess.run(kunctl_argv(cluster, "status"), capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "worker-0" in table.stdout and "KV" in table.stdout


def test_generate_cli_json(cluster):
    out = subprocess.run([sys.executable, "-m", "kunserve.cli.main", "generate", "--address",
                          cluster.cfg.dispatcher.address, "--token-ids", "5,6,7", "--max-tokens", "6",
                          "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    ref, margins = reference_for([5, 6, 7], 6)
    compare_greedy(obj["token_ids"], ref, margins)
    assert obj["ttft_s"] > 0 and obj["mean_tpot_s"] > 0


async def _expect_error(address, request):
    async with client.insecure_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(ch, request, timeout=60)
    return e.value


@pytest.mark.parametrize("request_kwargs, code, needle", [
    (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt=[1, 2, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (dict(prompt=[-1]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (dict(prompt=[1] * 2000, max_tokens=100), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    (dict(prompt=[1], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt=[1], max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt=[1], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt=[1], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt=[1], top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(prompt=[1], stop_token_ids=[5000]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
])
def test_bad_input_gets_a_precise_status(cluster, request_kwargs, code, needle):
    prompt = request_kwargs.pop("prompt")
    err = run(_expect_error(cluster.cfg.dispatcher.address, client.make_request(prompt, **request_kwargs)))
    assert err.code() == code, err
    assert needle in err.details(), err.details()


def test_duplicate_request_id_and_cancel(cluster):
    async def scenario():
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.cancel(ch, "no-such-request")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            long_req = client.make_request([1, 2, 3], request_id="long-1", max_tokens=1500, ignore_eos=True)
            got = []
            task = asyncio.create_task(client.generate(ch, long_req, timeout=120, on_event=got.append))
            while not got:
                await asyncio.sleep(0.01)
            dup = await _expect_error(cluster.cfg.dispatcher.address, client.make_request([1], request_id="long-1"))
            assert dup.code() == grpc.StatusCode.ALREADY_EXISTS
            assert await client.cancel(ch, "long-1")
            res = await task
            assert res.finish_reason == "aborted" and len(res.token_ids) < 1500
    run(scenario())
    _wait_for_idle_kv(cluster)


def _wait_for_idle_kv(cluster, timeout=20.0):
    """Cancelled and disconnected requests must give back every KV block."""
    from kunserve.v1 import common_pb2, worker_pb2_grpc

    async def used():
        total = 0
        for w in cluster.cfg.workers:
            async with internal_channel(cluster, w.address) as ch:
                total += (await worker_pb2_grpc.WorkerStub(ch).GetStats(common_pb2.Empty(), timeout=5)).kv_blocks_used
        return total

    deadline = time.monotonic() + timeout
    while (u := run(used())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert u == 0, f"{u} KV blocks still in use"


def test_client_disconnect_frees_kv(cluster):
    async def scenario():
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:
            got = []
            task = asyncio.create_task(client.generate(
                ch, client.make_request([3] * 300, max_tokens=1500, ignore_eos=True), timeout=120, on_event=got.append))
            while len(got) < 3:
                await asyncio.sleep(0.01)
            task.cancel()  # the client goes away mid-stream
            with pytest.raises(asyncio.CancelledError):
                await task
    run(scenario())
    _wait_for_idle_kv(cluster)
