"""A static TP2 instance in a real cluster: two worker processes, each with a shard of every layer, rank 0 serving.
Greedy tokens equal the whole model's (the dense reference, within the near-tie rule); kunctl status shows the
instance's degree and members; the follower takes no requests of its own; a drop naming a member is refused; every
process stops by itself."""

from __future__ import annotations

import json
import subprocess
import time

import grpc
import pytest
from helpers import generate_many, internal_channel, kunctl_argv, make_config, reference_for, rpc_outcome, run
from oracle import compare_greedy

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.config import TensorParallelSection
from kunserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

MEMBERS = ["worker-0", "worker-1"]


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    cfg = make_config(2, budget="fixed", lookahead=False)  # no profile to measure: a quick start
    cfg.tensor_parallel = [TensorParallelSection(members=list(MEMBERS))]  # port 0: the launcher picks one
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("tp-cluster"))
    c.start(timeout_s=120)
    yield c
    c.stop()


def test_tp2_tokens_equal_the_whole_model(tp_cluster):
    prompts = [[7, 8, 9], list(range(300, 340)), list(range(1000, 1090))]
    reqs = [client.make_request(p, request_id=f"tp{i}", max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts)]
    results = run(generate_many(tp_cluster.cfg.dispatcher.address, reqs))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert {r.worker_id for r in results} == {"worker-0"}  # rank 0 is the instance
    for p, res in zip(prompts, results):
        ref, margins = reference_for(p, 8)
        compare_greedy(res.token_ids, ref, margins)


def test_kunctl_status_shows_the_degree_and_members(tp_cluster):
    deadline = time.monotonic() + 30
    while True:  # the memory manager lists a worker once a layout refresh reached it
        out = subprocess.run(kunctl_argv(tp_cluster, "status", "--json"), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        if len(status["layout"]["workers"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    workers = {w["stats"]["worker_id"]: w["stats"] for w in status["cluster"]["workers"]}
    assert {w: (s["tp_degree"], s["tp_members"]) for w, s in workers.items()} == {w: (2, MEMBERS) for w in MEMBERS}
    assert workers["worker-0"]["serving"] and not workers["worker-1"].get("serving", False)
    table = subprocess.run(kunctl_argv(tp_cluster, "status"), capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "worker-0 (tensor-parallel instance, TP2, serving): worker-0 (rank 0) + worker-1 (rank 1)" in table.stdout


def test_the_follower_takes_no_requests_and_drops_are_refused(tp_cluster):
    follower = tp_cluster.cfg.worker("worker-1")

    async def direct():
        async with internal_channel(tp_cluster, follower.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return await rpc_outcome(
                lambda: stub.Generate(worker_pb2.WorkerGenerateRequest(request_id="direct", prompt_token_ids=[1, 2, 3]), timeout=30)
            )

    code, details = run(direct())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "send requests to worker-0" in details
    out = subprocess.run(kunctl_argv(tp_cluster, "drop", "--group", "worker-0,worker-1"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr and "tensor-parallel" in out.stderr


def test_every_member_stops_by_itself(tp_cluster):
    codes = tp_cluster.stop()
    assert codes["worker-0"] == 0 and codes["worker-1"] == 0, codes
