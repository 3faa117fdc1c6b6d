"""Elastic tensor parallelism in place in a real 2-worker cluster (README "Elastic tensor parallelism (Gyges)"):
`kunctl tp --in-place` merges the two whole instances into one TP2 instance while a request decodes on each, and
`kunctl tp-split --in-place` splits it back while two decode on it. Every request keeps running with its KV: its
tokens equal the dense reference's and no prompt is computed twice (the workers' prompt-token counters); a request
that moved between workers is re-attached by the dispatcher where it went. A long request that no whole instance
holds is refused before the merge and served after it. The workers are the same processes throughout (no re-exec).
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import grpc
import pytest
from helpers import check_against_reference, generate_many, internal_channel, kunctl_argv, make_config, reference_for, run
from oracle import compare_greedy

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import common_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

MEMBERS = ["worker-0", "worker-1"]
# 26 MiB pools of 256 KiB pages: a whole instance keeps KV for 1280 tokens; merged in place (the pool keeps the whole
# model) the TP2 instance holds twice that
POOL = dict(pool_mib=26, page_kib=256)
LONG = [(i * 7 + 3) % 4000 + 10 for i in range(1300)]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16]]
DURING = 1200  # tokens of each request that runs through a change (prompt + these fit a whole instance)
READY_KUNCTL = "import sys; from kunserve.cli import kunctl; sys.stdin.readline(); kunctl.main(sys.argv[1:])"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = make_config(2, budget="fixed", lookahead=False, **POOL)
    cfg.memory_manager.tp_mode = "in-place"
    cfg.dispatcher.route_timeout_s = 120
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("tp-in-place"))
    c.start(timeout_s=120)
    yield c
    c.stop()


def generate(cluster, prompt, rid: str, max_tokens: int):
    req = client.make_request(prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True)
    (res,) = run(generate_many(cluster.cfg.dispatcher.address, [req]))
    return res


def worker_info(cluster, worker_id: str):
    async def info():
        async with internal_channel(cluster, cluster.cfg.worker(worker_id).address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return await stub.GetInfo(common_pb2.Empty(), timeout=10), await stub.GetStats(common_pb2.Empty(), timeout=10)

    return run(info())


def prompt_tokens(cluster) -> int:
    """Prompt tokens the workers have computed so far (a request that re-prefilled would count its prompt again)."""
    return sum(worker_info(cluster, w)[1].prompt_tokens_total for w in MEMBERS)


def kunctl_during(cluster, tag: str, *args) -> tuple[dict, list[client.GenerationResult]]:
    """Run kunctl once every one of two requests has streamed a token: its report and the requests' results. kunctl is
    started beforehand and told to go then, so the change reaches the workers while the requests decode."""
    reqs = [client.make_request(p, request_id=f"{tag}-{i}", max_tokens=DURING, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    argv = kunctl_argv(cluster, *args, "--json")

    async def scenario():
        seen = [asyncio.Event() for _ in reqs]
        proc = await asyncio.create_subprocess_exec(
            argv[0], "-c", READY_KUNCTL, *argv[3:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:
            running = [
                asyncio.ensure_future(client.generate(ch, r, timeout=240, on_event=lambda _ev, e=e: e.set()))
                for r, e in zip(reqs, seen, strict=True)
            ]
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), 120)
            except BaseException:
                proc.kill()
                await proc.wait()
                raise
            out, err = await proc.communicate(b"go\n")
            assert proc.returncode == 0, err.decode()
            assert not any(r.done() for r in running), "a request ended before the change: nothing was moved"
            return json.loads(out), list(await asyncio.gather(*running))

    return run(scenario(), timeout=300)


def test_requests_keep_their_kv_through_an_in_place_merge_and_split(cluster):
    pids = {w: cluster.child(w).proc.pid for w in MEMBERS}
    refused = generate(cluster, LONG, "long-refused", 8)
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused

    computed = prompt_tokens(cluster)
    rep, during = kunctl_during(cluster, "merge", "tp", "--group", ",".join(MEMBERS), "--in-place")
    assert rep["completed"] and rep["mode"] == "in-place" and rep["degree"] == 2 and rep["members"] == MEMBERS, rep
    assert rep["after"][0]["kv_tokens"] >= len(LONG) + 8 > max(i["kv_tokens"] for i in rep["before"]), rep
    assert rep.get("handed_over", 0) == 0, rep  # nothing handed over to re-prefill
    for prompt, res in zip(PROMPTS, during, strict=True):
        assert not isinstance(res, BaseException), res
        assert res.worker_id == "worker-0", res.worker_id  # the one on worker-1 was re-attached at rank 0
        check_against_reference(prompt, res.token_ids, DURING)
    assert prompt_tokens(cluster) == computed + sum(map(len, PROMPTS))  # no prompt computed twice
    info, _ = worker_info(cluster, "worker-1")
    assert list(info.tp_members) == MEMBERS and not info.serving

    long = generate(cluster, LONG, "long-tp2", 8)
    assert not isinstance(long, BaseException), long
    assert long.worker_id == "worker-0"
    compare_greedy(long.token_ids, *reference_for(LONG, 8))

    computed = prompt_tokens(cluster)
    rep, during = kunctl_during(cluster, "split", "tp-split", "--group", "worker-1", "--in-place")
    assert rep["completed"] and rep["mode"] == "in-place" and rep["op"] == "tp-split", rep
    assert sorted(i["members"] for i in rep["after"]) == [["worker-0"], ["worker-1"]], rep
    for prompt, res in zip(PROMPTS, during, strict=True):
        assert not isinstance(res, BaseException), res
        check_against_reference(prompt, res.token_ids, DURING)
    assert sorted(r.worker_id for r in during) == MEMBERS  # shared between the whole instances: one moved
    assert prompt_tokens(cluster) == computed + sum(map(len, PROMPTS))
    for w in MEMBERS:
        info, _ = worker_info(cluster, w)
        assert list(info.tp_members) == [w] and info.serving
    after = generate(cluster, PROMPTS[0], "after-split", 8)
    assert not isinstance(after, BaseException), after
    compare_greedy(after.token_ids, *reference_for(PROMPTS[0], 8))
    assert {w: cluster.child(w).proc.pid for w in MEMBERS} == pids  # changed in place, never re-executed


def test_every_worker_stops_by_itself(cluster):
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
