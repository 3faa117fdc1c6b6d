"""Elastic tensor parallelism by cold re-form in a real 2-worker cluster (README "Elastic tensor parallelism (Gyges)").

Each worker's pool holds the whole model with KV for fewer tokens than a long request needs, while a TP2 shard leaves
room for it: the long request is refused (INVALID_ARGUMENT) by the whole instances, served after `kunctl tp --cold`
with the whole model's greedy tokens, and after `kunctl tp-split --cold` both workers serve alone again with a short
request's tokens unchanged. The workers re-execute in place (same pids, no pool memory carried across the exec) and
stop by themselves. Before that, the same workers change in place (the cluster's tp_mode, so their pools hold the
padded MLP): requests decoding through a merge and a split keep their KV (moved over the transfer service's
KV-exchange class), and the merged instance holds more KV than the two whole ones together (each member released the
MLP shards it no longer keeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass

import grpc
import pytest
from helpers import check_against_reference, generate_many, internal_channel, kunctl_argv, make_config, reference_for, run
from oracle import compare_greedy

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import common_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

MEMBERS = ["worker-0", "worker-1"]
# 30 MiB pools of 256 KiB pages: a whole instance (padded MLP) keeps KV for 1280 tokens, a cold TP2 shard for 7680, an
# in-place TP2 instance for 5632 (tp_capacity.py)
POOL = dict(pool_mib=30, page_kib=256)
LONG = [(i * 7 + 3) % 4000 + 10 for i in range(1300)]
SHORT = [5, 6, 7, 8, 9]
# kunctl with its imports done, waiting for a line on stdin: the re-form starts moments after the request streams
READY_KUNCTL = "import sys; from kunserve.cli import kunctl; sys.stdin.readline(); kunctl.main(sys.argv[1:])"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = make_config(2, budget="fixed", lookahead=False, **POOL)  # no profile to measure: a quick start
    cfg.dispatcher.route_timeout_s = 120  # a handed-over request waits for the re-formed instance (restart, rendezvous)
    cfg.memory_manager.tp_mode = "in-place"  # the cold test asks for --cold
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


def tp_members(cluster, worker_id: str) -> list[str]:
    async def info():
        async with internal_channel(cluster, cluster.cfg.worker(worker_id).address) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)

    return list(run(info()).tp_members)


def memfds(pid: int) -> int:
    """Memory-pool memfds the process holds (one per pool; a leak across the exec would add the old one)."""
    return sum(1 for fd in os.listdir(f"/proc/{pid}/fd") if "memfd:" in os.readlink(f"/proc/{pid}/fd/{fd}"))


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16]]
BUDGET = 1270  # each request's whole life fits a whole instance (1280 KV tokens); cancelled long before it ends
AFTER = 16  # tokens each request decodes after a change before it is cancelled


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


def stagger_layers(cluster, worker_id: str) -> list[int]:
    """The layers each layer-staggered split the worker took part in moved one by one."""
    lines = (cluster.run_dir / f"{worker_id}.log").read_text().splitlines()
    return [json.loads(line)["layers"] for line in lines if '"tp_stagger_done"' in line]


def kv_channels(cluster, worker_id: str) -> list[tuple[str, str]]:
    """(op, channel) of every in-place change's KV moves the worker logged: "transfer" (its KV-exchange class) or
    "gloo"."""
    out = []
    for line in (cluster.run_dir / f"{worker_id}.log").read_text().splitlines():
        if '"tp_in_place_kv"' in line:
            ev = json.loads(line)
            out.append((ev["op"], ev["via"]))
    return out


@dataclass
class During:
    """What `change_during` saw: kunctl's report, each request's result (the tokens it had when cancelled), the worker
    each started on, and how many extra times the second request was started (its prompt computed each time)."""

    report: dict
    results: list[client.GenerationResult]
    started_on: list[str]
    restarts: int = 0


def change_during(cluster, tag: str, *args, spread: bool = False) -> During:
    """Two requests decode (with `spread`, on different workers: the second is started again until the dispatcher
    puts it beside the other); once each has a token, kunctl (imports done beforehand) changes the parallelism; once
    each has decoded AFTER more tokens (after a cold re-form: resumed and re-prefilled on the new layout), both are
    cancelled."""
    argv = kunctl_argv(cluster, *args, "--json")

    async def scenario() -> During:
        progress = [0 for _ in PROMPTS]
        first = ["" for _ in PROMPTS]
        ids = ["" for _ in PROMPTS]
        tasks: list[asyncio.Task] = []
        proc = await asyncio.create_subprocess_exec(
            argv[0], "-c", READY_KUNCTL, *argv[3:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:

            def start(i: int, rid: str) -> asyncio.Task:
                progress[i], first[i], ids[i] = 0, "", rid

                def seen(ev) -> None:
                    if ev.request_id == ids[i]:
                        progress[i] += ev.token_id >= 0
                        first[i] = first[i] or ev.worker_id

                req = client.make_request(PROMPTS[i], request_id=rid, max_tokens=BUDGET, ignore_eos=True)
                return asyncio.ensure_future(client.generate(ch, req, timeout=240, on_event=seen))

            async def until(n: list[int]) -> None:
                while any(p < k for p, k in zip(progress, n, strict=True)):
                    assert not any(t.done() for t in tasks), f"a request ended before the change: {progress}"
                    await asyncio.sleep(0.02)

            restarts = 0
            try:
                tasks.append(start(0, f"{tag}-0"))
                await asyncio.wait_for(until([1, 0]), 120)
                tasks.append(start(1, f"{tag}-1"))
                await asyncio.wait_for(until([1, 1]), 120)
                while spread and first[1] == first[0]:
                    restarts += 1
                    assert restarts <= 20, f"the dispatcher keeps putting both requests on {first[0]}"
                    await client.cancel(ch, ids[1])
                    await tasks.pop()
                    tasks.append(start(1, f"{tag}-1-again{restarts}"))
                    await asyncio.wait_for(until([1, 1]), 120)
                out, err = await proc.communicate(b"go\n")
                assert proc.returncode == 0, err.decode()
                await asyncio.wait_for(until([p + AFTER for p in progress]), 120)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                for rid in ids:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await client.cancel(ch, rid)
            results = list(await asyncio.gather(*tasks))
            return During(json.loads(out), results, list(first), restarts)

    return run(scenario(), timeout=300)


def test_requests_keep_their_kv_through_an_in_place_merge_and_split(cluster):
    """`kunctl tp` (in place: the cluster's mode) while a request decodes on each worker, `kunctl tp-split` while two decode on
    the merged instance: every request keeps running with its KV (its tokens are the reference's and no prompt is
    computed twice), the dispatcher re-attaches the one that moved where it went, and the workers are the same
    processes (no re-exec). A request longer than a whole instance's KV is served in between. It runs before the cold
    test: after a re-exec a worker's transfer port stays held for a while, and the KV would move over gloo."""
    pids = {w: cluster.child(w).proc.pid for w in MEMBERS}
    routed_to_both(cluster)
    computed = prompt_tokens(cluster)
    d = change_during(cluster, "merge", "tp", "--group", ",".join(MEMBERS), spread=True)  # the cluster's mode
    rep = d.report
    assert sorted(d.started_on) == MEMBERS, d.started_on  # one on each whole instance
    assert rep["completed"] and rep["mode"] == "in-place" and rep["degree"] == 2 and rep["members"] == MEMBERS, rep
    assert rep.get("handed_over", 0) == 0, rep  # nothing handed over to re-prefill
    # more than the two whole instances' KV together: each member gave the MLP shards it no longer keeps to its KV
    assert rep["after"][0]["kv_tokens"] > 2 * max(i["kv_tokens"] for i in rep["before"]), rep
    for prompt, res in zip(PROMPTS, d.results, strict=True):
        assert res.worker_id == "worker-0", res  # the one that ran on worker-1 was re-attached at rank 0
        check_against_reference(prompt, res.token_ids, len(res.token_ids))
    assert moves(cluster, "merge") == [("worker-1", "worker-0")]
    # no prompt computed twice (a second request started again until it ran beside the first counts its own)
    assert prompt_tokens(cluster) == computed + sum(map(len, PROMPTS)) + d.restarts * len(PROMPTS[1])
    assert tp_members(cluster, "worker-1") == MEMBERS
    assert all("tp_shards_released" in (cluster.run_dir / f"{w}.log").read_text() for w in MEMBERS)
    # the KV moved over the transfer service's KV-exchange class (the memory manager named the members' listeners)
    assert all(kv_channels(cluster, w) == [("up", "transfer")] for w in MEMBERS), [kv_channels(cluster, w) for w in MEMBERS]

    long = generate(cluster, LONG, "long-in-place", 8)  # 1308 tokens: more than a whole instance holds
    assert not isinstance(long, BaseException), long
    compare_greedy(long.token_ids, *reference_for(LONG, 8))

    computed = prompt_tokens(cluster)
    d = change_during(cluster, "split", "tp-split", "--group", "worker-1")
    rep = d.report
    assert d.started_on == ["worker-0", "worker-0"], d.started_on  # the merged instance is rank 0
    assert rep["completed"] and rep["mode"] == "in-place" and rep["op"] == "tp-split", rep
    assert sorted(i["members"] for i in rep["after"]) == [["worker-0"], ["worker-1"]], rep
    assert sorted(r.worker_id for r in d.results) == MEMBERS  # shared between the whole instances: one moved
    assert moves(cluster, "split") == [("worker-0", "worker-1")]
    for prompt, res in zip(PROMPTS, d.results, strict=True):
        check_against_reference(prompt, res.token_ids, len(res.token_ids))
    assert prompt_tokens(cluster) == computed + sum(map(len, PROMPTS))
    assert {w: tp_members(cluster, w) for w in MEMBERS} == {w: [w] for w in MEMBERS}
    assert all(kv_channels(cluster, w) == [("up", "transfer"), ("down", "transfer")] for w in MEMBERS)
    # split layer by layer, last layer first, the instance computing between the layers' moves (tp_stagger.py)
    assert all(stagger_layers(cluster, w) == [4] for w in MEMBERS), [stagger_layers(cluster, w) for w in MEMBERS]
    assert {w: cluster.child(w).proc.pid for w in MEMBERS} == pids  # changed in place, never re-executed


def test_a_long_request_is_served_after_a_reform_and_the_split_restores_whole_instances(cluster):
    pids = {w: cluster.child(w).proc.pid for w in MEMBERS}
    pool_fds = {w: memfds(pid) for w, pid in pids.items()}
    short_before = generate(cluster, SHORT, "short-before", 8)
    compare_greedy(short_before.token_ids, *reference_for(SHORT, 8))

    refused = generate(cluster, LONG, "long-refused", 8)
    assert isinstance(refused, grpc.aio.AioRpcError), refused
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV" in refused.details()

    d = change_during(cluster, "cold-tp", "tp", "--group", ",".join(MEMBERS), "--cold")
    rep = d.report
    for prompt, res in zip(PROMPTS, d.results, strict=True):
        check_against_reference(prompt, res.token_ids, len(res.token_ids))
    assert rep["completed"] and rep["degree"] == 2 and rep["members"] == MEMBERS and rep["mode"] == "cold", rep
    # both running requests re-prefilled on the new instance (one may be handed over twice: rank 0 re-forms first, so
    # a request it hands over can resume on the follower before that one re-forms too)
    assert rep["handed_over"] >= 2, rep
    assert [i["members"] for i in rep["after"]] == [MEMBERS]
    assert rep["after"][0]["kv_tokens"] >= len(LONG) + 8 > max(i["kv_tokens"] for i in rep["before"])
    assert tp_members(cluster, "worker-1") == MEMBERS

    long = generate(cluster, LONG, "long-tp2", 8)
    assert not isinstance(long, BaseException), long
    assert long.worker_id == "worker-0"  # rank 0 is the instance; the follower takes no requests
    compare_greedy(long.token_ids, *reference_for(LONG, 8))

    again = subprocess.run(kunctl_argv(cluster, "tp", "--group", ",".join(MEMBERS), "--cold"), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr and "already in tensor-parallel" in again.stderr

    d = change_during(cluster, "cold-split", "tp-split", "--group", "worker-1", "--cold")
    rep = d.report
    for prompt, res in zip(PROMPTS, d.results, strict=True):
        check_against_reference(prompt, res.token_ids, len(res.token_ids))
    assert rep["completed"] and rep["op"] == "tp-split" and rep["handed_over"] >= 2, rep
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


def test_every_worker_stops_by_itself(cluster):
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
