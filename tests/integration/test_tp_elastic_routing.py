"""Transformation-aware routing in a real 2-worker cluster that changes TP in place (README "Elastic tensor parallelism
(Gyges)", `dispatcher.elastic_tp = true`, `memory_manager.tp_mode = "in-place"`): with no kunctl, a request longer than
either whole instance's KV makes the dispatcher ask the memory manager, which merges the two co-located workers in
place into one TP2 instance (the same processes; each releases the MLP shards it no longer keeps to its KV) and
routes the request to its rank 0 (tokens equal the dense reference's); a request no layout of the cluster could hold
is refused with INVALID_ARGUMENT naming the cluster's maximum (the in-place rule's), and triggers no change; once idle
for memory_manager.tp_idle_split_s the merged instance splits back into whole ones by itself, in place.

The model is the embedded one saved as a checkpoint with a context of 8192 tokens, so a request may be longer than
the TP2 instance's KV (5632 tokens) without exceeding the model's context (which the dispatcher checks first)."""

from __future__ import annotations

import time

import grpc
import pytest
from helpers import generate_many, make_config, reference_for, run
from oracle import compare_greedy
from test_tp_reform import LONG, MEMBERS, POOL, SHORT, kv_channels, tp_members

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.tp_capacity import in_place_kv_tokens_by_degree
from kunserve.shared.model.weights import random_weights, save_checkpoint

pytestmark = pytest.mark.integration

CONTEXT = 8192
IDLE_SPLIT_S = 5.0


@pytest.fixture(scope="module")
def capacity() -> dict[int, int]:
    pages = POOL["pool_mib"] * 1024 // POOL["page_kib"]
    return in_place_kv_tokens_by_degree(TINY_CONFIG, num_pages=pages, page_size=POOL["page_kib"] * 1024, block_size=16,
                                        device_type="cpu", padded_mlp=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = save_checkpoint(
        tmp_path_factory.mktemp("tiny-8k"), TINY_CONFIG.replace(max_position_embeddings=CONTEXT), random_weights(TINY_CONFIG, seed=0)
    )
    cfg = make_config(2, budget="fixed", lookahead=False, **POOL)
    cfg.model.path = str(model)
    cfg.dispatcher.elastic_tp = True
    cfg.memory_manager.tp_mode = "in-place"
    # the wait covers a cold re-form (two process re-executions and model loads) on a loaded machine
    cfg.dispatcher.route_timeout_s = 240.0
    cfg.dispatcher.queue_timeout_s = 240.0
    # long enough that the checks right after the long request still see the instance merged (an in-place merge is
    # done before the long request is sent on)
    cfg.memory_manager.tp_idle_split_s = IDLE_SPLIT_S
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("tp-elastic"))
    c.start(timeout_s=120)
    yield c
    c.stop()


def generate(cluster, prompt, rid: str, max_tokens: int):
    req = client.make_request(prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True)
    (res,) = run(generate_many(cluster.cfg.dispatcher.address, [req], timeout=280), timeout=300)
    return res


def test_the_dispatcher_scales_up_for_a_long_request_and_refuses_one_no_layout_holds(cluster, capacity):
    assert capacity[1] < len(LONG) + 8 <= capacity[2] < CONTEXT  # the premise: TP1 cannot hold it, TP2 can
    pids = {w: cluster.child(w).proc.pid for w in MEMBERS}

    too_long = CONTEXT - len(LONG)  # prompt + max_tokens = the model's context, more than TP2 holds
    refused = generate(cluster, LONG, "no-layout", too_long)
    assert isinstance(refused, grpc.aio.AioRpcError), refused
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert f"the cluster's maximum: {capacity[2]} KV tokens" in refused.details(), refused.details()
    assert {w: tp_members(cluster, w) for w in MEMBERS} == {w: [w] for w in MEMBERS}  # no re-form for it

    long = generate(cluster, LONG, "long-elastic", 8)
    assert not isinstance(long, BaseException), long
    assert long.worker_id == "worker-0"  # rank 0 of the instance the memory manager formed for it
    compare_greedy(long.token_ids, *reference_for(LONG, 8))
    assert {w: tp_members(cluster, w) for w in MEMBERS} == {w: MEMBERS for w in MEMBERS}
    assert {w: cluster.child(w).proc.pid for w in MEMBERS} == pids  # merged in place, never re-executed
    assert "tp_shards_released" in (cluster.run_dir / "worker-1.log").read_text()

    short = generate(cluster, SHORT, "short-after", 8)
    assert not isinstance(short, BaseException), short
    compare_greedy(short.token_ids, *reference_for(SHORT, 8))

    # idle for memory_manager.tp_idle_split_s, the instance splits back into whole ones by itself
    deadline = time.monotonic() + 180
    while True:
        try:
            members = {w: tp_members(cluster, w) for w in MEMBERS}
        except grpc.aio.AioRpcError:  # a member re-executing
            members = {}
        if members == {w: [w] for w in MEMBERS}:
            break
        assert time.monotonic() < deadline, f"still merged: {members}"
        time.sleep(0.5)
    again = generate(cluster, SHORT, "short-whole", 8)
    assert not isinstance(again, BaseException), again
    compare_greedy(again.token_ids, *reference_for(SHORT, 8))
    assert {w: cluster.child(w).proc.pid for w in MEMBERS} == pids  # split in place too
    assert "tp_shards_reclaimed" in (cluster.run_dir / "worker-1.log").read_text()
    assert all(kv_channels(cluster, w) == [("up", "transfer"), ("down", "transfer")] for w in MEMBERS)


def test_every_worker_stops_by_itself(cluster):
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
