"""Elastic tensor parallelism by cold re-form in a real 2-worker cluster (README "Elastic tensor parallelism (Gyges)").

Each worker's pool holds the whole model with KV for fewer tokens than a long request needs, while a TP2 shard leaves
room for it: the long request is refused (INVALID_ARGUMENT) by the whole instances, served after `kunctl tp` with the
whole model's greedy tokens, and after `kunctl tp-split` both workers serve alone again with a short request's tokens
unchanged. The workers re-execute in place (same pids, no pool memory carried across the exec) and stop by themselves.
Then the same workers change in place (`--in-place`): requests decoding through a merge and a split keep their KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time

import grpc
import pytest
from helpers import check_against_reference, generate_many, internal_channel, kunctl_argv, make_config, reference_for, run
from oracle import compare_greedy

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import common_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

MEMBERS = ["worker-0", "worker-1"]
# 26 MiB pools of 256 KiB pages: a whole instance keeps KV for 1280 tokens, a TP2 shard for 5632
POOL = dict(pool_mib=26, page_kib=256)
LONG = [(i * 7 + 3) % 4000 + 10 for i in range(1300)]
SHORT = [5, 6, 7, 8, 9]
DURING = 1200  # tokens of the request that runs while the cluster re-forms (prompt + these fit a whole instance)
# kunctl with its imports done, waiting for a line on stdin: the re-form starts moments after the request streams
READY_KUNCTL = "import sys; from kunserve.cli import kunctl; sys.stdin.readline(); kunctl.main(sys.argv[1:])"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = make_config(2, budget="fixed", lookahead=False, **POOL)  # no profile to measure: a quick start
    cfg.dispatcher.route_timeout_s = 120  # a handed-over request waits for the re-formed instance (restart, rendezvous)
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("tp-reform"))
    c.start(timeout_s=120)
    yield c
    c.stop()


def generate(cluster, prompt, rid: str, max_tokens: int):
    req = client.make_request(prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True)
    (res,) = run(generate_many(cluster.cfg.dispatcher.address, [req]))
    return res


def kunctl(cluster, *args) -> dict:
    out = subprocess.run(kunctl_argv(cluster, *args, "--json"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def kunctl_during_a_request(cluster, rid: str, *args) -> tuple[dict, client.GenerationResult]:
    """Run kunctl once a request has streamed its first token; the request's result (it survives the re-form: handed
    over, it re-prefills on the new layout) and the report. kunctl is started beforehand and only told to go then, so
    the re-form reaches the workers while the request still has most of its tokens to generate."""
    req = client.make_request(SHORT, request_id=rid, max_tokens=DURING, ignore_eos=True)
    argv = kunctl_argv(cluster, *args, "--json")
    assert argv[1:3] == ["-m", "kunserve.cli.kunctl"]

    async def scenario():
        started = asyncio.Event()
        proc = await asyncio.create_subprocess_exec(
            argv[0], "-c", READY_KUNCTL, *argv[3:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:
            running = asyncio.ensure_future(client.generate(ch, req, timeout=240, on_event=lambda _ev: started.set()))
            try:
                await asyncio.wait_for(started.wait(), 120)
            except BaseException:
                proc.kill()
                await proc.wait()
                raise
            out, err = await proc.communicate(b"go\n")
            assert proc.returncode == 0, err.decode()
            return json.loads(out), await running

    return run(scenario(), timeout=300)


def tp_members(cluster, worker_id: str) -> list[str]:
    async def info():
        async with internal_channel(cluster, cluster.cfg.worker(worker_id).address) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)

    return list(run(info()).tp_members)


def memfds(pid: int) -> int:
    """Memory-pool memfds the process holds (one per pool; a leak across the exec would add the old one)."""
    return sum(1 for fd in os.listdir(f"/proc/{pid}/fd") if "memfd:" in os.readlink(f"/proc/{pid}/fd/{fd}"))


def test_a_long_request_is_served_after_a_reform_and_the_split_restores_whole_instances(cluster):
    pids = {w: cluster.child(w).proc.pid for w in MEMBERS}
    pool_fds = {w: memfds(pid) for w, pid in pids.items()}
    short_before = generate(cluster, SHORT, "short-before", 8)
    compare_greedy(short_before.token_ids, *reference_for(SHORT, 8))

    refused = generate(cluster, LONG, "long-refused", 8)
    assert isinstance(refused, grpc.aio.AioRpcError), refused
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV" in refused.details()

    rep, during = kunctl_during_a_request(cluster, "during-tp", "tp", "--group", ",".join(MEMBERS))
    check_against_reference(SHORT, during.token_ids, DURING)
    assert rep["completed"] and rep["degree"] == 2 and rep["members"] == MEMBERS, rep
    assert rep["handed_over"] >= 1, rep  # the running request moved to the new instance
    assert [i["members"] for i in rep["after"]] == [MEMBERS]
    assert rep["after"][0]["kv_tokens"] >= len(LONG) + 8 > max(i["kv_tokens"] for i in rep["before"])
    assert tp_members(cluster, "worker-1") == MEMBERS

    long = generate(cluster, LONG, "long-tp2", 8)
    assert not isinstance(long, BaseException), long
    assert long.worker_id == "worker-0"  # rank 0 is the instance; the follower takes no requests
    compare_greedy(long.token_ids, *reference_for(LONG, 8))

    again = subprocess.run(kunctl_argv(cluster, "tp", "--group", ",".join(MEMBERS)), capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr and "already in tensor-parallel" in again.stderr

    rep, during = kunctl_during_a_request(cluster, "during-split", "tp-split", "--group", "worker-1")
    check_against_reference(SHORT, during.token_ids, DURING)
    assert rep["completed"] and rep["op"] == "tp-split", rep
    assert sorted(i["members"] for i in rep["after"]) == [["worker-0"], ["worker-1"]]
    assert {w: tp_members(cluster, w) for w in MEMBERS} == {w: [w] for w in MEMBERS}
    results = run(
        generate_many(
            cluster.cfg.dispatcher.address,
            [client.make_request(SHORT, request_id=f"short-after-{i}", max_tokens=8, ignore_eos=True) for i in range(4)],
        )
    )
    assert all(not isinstance(r, BaseException) for r in results), results
    assert all(r.token_ids == short_before.token_ids for r in results)

    # the same processes throughout (the launcher keeps tracking them), each with one pool's memory
    assert {w: cluster.child(w).proc.pid for w in MEMBERS} == pids
    assert all(cluster.child(w).exit_code() is None for w in MEMBERS)
    assert {w: memfds(pid) for w, pid in pids.items()} == pool_fds


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16]]
BUDGET = 1270  # each request's whole life fits a whole instance (1280 KV tokens); cancelled long before it ends
AFTER = 16  # tokens each request decodes after an in-place change before it is cancelled


def prompt_tokens(cluster) -> int:
    """Prompt tokens the workers have computed so far (a request that re-prefilled would count its prompt again)."""

    async def stats():
        out = 0
        for w in MEMBERS:
            async with internal_channel(cluster, cluster.cfg.worker(w).address) as ch:
                out += (await worker_pb2_grpc.WorkerStub(ch).GetStats(common_pb2.Empty(), timeout=10)).prompt_tokens_total
        return out

    return run(stats())


def routed_to_both(cluster, timeout_s: float = 60.0) -> None:
    """Until the dispatcher sends two requests at once to the two whole instances: after the cold split it counts
    a re-executed worker unroutable until a report taken since says it serves."""
    deadline = time.monotonic() + timeout_s
    n = 0
    while True:
        n += 1
        reqs = [client.make_request(SHORT, request_id=f"probe-{n}-{i}", max_tokens=4, ignore_eos=True) for i in range(2)]
        got = run(generate_many(cluster.cfg.dispatcher.address, reqs))
        if sorted(getattr(r, "worker_id", "") for r in got) == MEMBERS:
            return
        assert time.monotonic() < deadline, f"the dispatcher still routes to one worker only: {got}"
        time.sleep(0.5)


def moves(cluster, tag: str) -> list[tuple[str, str]]:
    """(from, to) of every move of a `tag`-* request the dispatcher logged (it re-attached the stream there)."""
    out = []
    for line in (cluster.run_dir / "dispatcher.log").read_text().splitlines():
        if '"request_moved"' in line:
            ev = json.loads(line)
            if ev["request_id"].startswith(f"{tag}-"):
                out.append((ev["from_worker"], ev["to_worker"]))
    return out


def in_place_during(cluster, tag: str, *args) -> tuple[dict, list[client.GenerationResult], list[str]]:
    """Two requests decode; once each has a token, kunctl (imports done beforehand) changes the parallelism in place;
    once each has decoded AFTER more tokens, both are cancelled. The report, the results (the tokens each had) and
    the worker each request started on."""
    argv = kunctl_argv(cluster, *args, "--json")

    async def scenario():
        progress = [0 for _ in PROMPTS]
        first = ["" for _ in PROMPTS]
        proc = await asyncio.create_subprocess_exec(
            argv[0], "-c", READY_KUNCTL, *argv[3:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:

            async def one(i: int):
                def seen(ev, i=i):
                    progress[i] += ev.token_id >= 0
                    first[i] = first[i] or ev.worker_id

                req = client.make_request(PROMPTS[i], request_id=f"{tag}-{i}", max_tokens=BUDGET, ignore_eos=True)
                return await client.generate(ch, req, timeout=240, on_event=seen)

            running = asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

            async def until(n: list[int]) -> None:
                while any(p < k for p, k in zip(progress, n, strict=True)):
                    assert not running.done(), f"the requests ended before the change: {progress}"
                    await asyncio.sleep(0.02)

            try:
                await asyncio.wait_for(until([1] * len(PROMPTS)), 120)
                out, err = await proc.communicate(b"go\n")
                assert proc.returncode == 0, err.decode()
                await asyncio.wait_for(until([p + AFTER for p in progress]), 120)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                for i in range(len(PROMPTS)):
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await client.cancel(ch, f"{tag}-{i}")
            return json.loads(out), list(await running), first

    return run(scenario(), timeout=300)


def test_requests_keep_their_kv_through_an_in_place_merge_and_split(cluster):
    """`kunctl tp --in-place` while a request decodes on each worker, `kunctl tp-split --in-place` while two decode on
    the merged instance: every request keeps running with its KV (its tokens are the reference's and no prompt is
    computed twice), the dispatcher re-attaches the one that moved where it went, and the workers are the same
    processes (no re-exec). A request longer than a whole instance's KV is served in between."""
    pids = {w: cluster.child(w).proc.pid for w in MEMBERS}
    routed_to_both(cluster)
    computed = prompt_tokens(cluster)
    rep, during, started_on = in_place_during(cluster, "merge", "tp", "--group", ",".join(MEMBERS), "--in-place")
    assert sorted(started_on) == MEMBERS, started_on  # one on each whole instance (the router counts what it sent)
    assert rep["completed"] and rep["mode"] == "in-place" and rep["degree"] == 2 and rep["members"] == MEMBERS, rep
    assert rep.get("handed_over", 0) == 0, rep  # nothing handed over to re-prefill
    assert rep["after"][0]["kv_tokens"] >= 2 * max(i["kv_tokens"] for i in rep["before"]), rep
    for prompt, res in zip(PROMPTS, during, strict=True):
        assert res.worker_id == "worker-0", res  # the one that ran on worker-1 was re-attached at rank 0
        check_against_reference(prompt, res.token_ids, len(res.token_ids))
    assert [m[0] for m in moves(cluster, "merge")] == ["worker-1"] and moves(cluster, "merge")[0][1] == "worker-0"
    assert prompt_tokens(cluster) == computed + sum(map(len, PROMPTS))  # no prompt computed twice
    assert tp_members(cluster, "worker-1") == MEMBERS

    long = generate(cluster, LONG, "long-in-place", 8)  # 1308 tokens: more than a whole instance holds
    assert not isinstance(long, BaseException), long
    compare_greedy(long.token_ids, *reference_for(LONG, 8))

    computed = prompt_tokens(cluster)
    rep, during, started_on = in_place_during(cluster, "split", "tp-split", "--group", "worker-1", "--in-place")
    assert started_on == ["worker-0", "worker-0"], started_on  # the merged instance is rank 0
    assert rep["completed"] and rep["mode"] == "in-place" and rep["op"] == "tp-split", rep
    assert sorted(i["members"] for i in rep["after"]) == [["worker-0"], ["worker-1"]], rep
    assert sorted(r.worker_id for r in during) == MEMBERS  # shared between the whole instances: one moved
    assert moves(cluster, "split") == [("worker-0", "worker-1")]
    for prompt, res in zip(PROMPTS, during, strict=True):
        check_against_reference(prompt, res.token_ids, len(res.token_ids))
    assert prompt_tokens(cluster) == computed + sum(map(len, PROMPTS))
    assert {w: tp_members(cluster, w) for w in MEMBERS} == {w: [w] for w in MEMBERS}
    assert {w: cluster.child(w).proc.pid for w in MEMBERS} == pids  # changed in place, never re-executed


def test_every_worker_stops_by_itself(cluster):
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
