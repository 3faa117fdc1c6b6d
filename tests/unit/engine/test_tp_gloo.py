"""Tensor-parallel instances across real processes over gloo (shared/engine/tensor_parallel.py): each rank a spawned
process with its shard in its own memory pool, as a worker builds it. Rank 0 schedules and samples; the followers
run its step plans. Greedy tokens equal the whole instance's (TP1) and the dense reference's at TP2 (the embedded
model) and TP4 (a model with 4 KV heads); a dead or silent peer ends every member's work with an error instead of a
hang. Small on purpose: a handful of short requests, one torch thread per process."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from engine_testing import TP4_CONFIG
from oracle import compare_greedy

from kunserve.shared.engine.api import EngineRequest, FinishReason, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import InstanceBroken, SchedulerConfig
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.engine.tensor_parallel import TPFollower, TPGroup, TPLeader, check_same_blocks
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.model.tp_shard import sharded_source
from kunserve.shared.model.weights import ModelSource, load_model_source

MIB = 1 << 20
SCHED = SchedulerConfig(max_num_batched_tokens=32)  # the longer prompts prefill in chunks beside decodes
PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 80)), list(range(100, 170))]
MAX_TOKENS = 6
SPAWN_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def source(cfg: ModelConfig | None) -> ModelSource:
    return load_model_source(None) if cfg is None else ModelSource(cfg.name, cfg, None)


def instance(src: ModelSource) -> PooledInstance:
    return PooledInstance(
        src,
        layer_range=(0, src.config.num_layers),
        pool_bytes=24 * MIB,
        page_size=256 * 1024,
        block_size=8,
        backend="host",
        scheduler_config=SCHED,
    )


def requests() -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for i, p in enumerate(PROMPTS)]


def spawn(fn, degree: int, *args) -> None:
    """Run fn(rank, *args) in `degree` fresh processes; fail (killing them) if they do not all end in time."""
    ctx = mp.start_processes(fn, args=args, nprocs=degree, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"tensor-parallel ranks still running after {SPAWN_TIMEOUT_S}s")


def serve_rank(rank: int, degree: int, port: int, cfg: ModelConfig | None, out: str) -> None:
    """One member of a TP instance: rank 0 generates the requests, the others follow until STOP."""
    torch.set_num_threads(1)
    inst = instance(sharded_source(source(cfg), rank, degree))
    group = TPGroup(rank, degree, "127.0.0.1", port, timeout_s=60, rendezvous_timeout_s=120)
    check_same_blocks(group, inst.engine.allocator.num_blocks)
    m = inst.memory_map()
    result: dict = {"kv_blocks": m["kv"]["num_blocks"], "block_bytes": m["kv"]["block_bytes"], "weight_bytes": m["weight_bytes"]}
    if rank == 0:
        leader = TPLeader(group)
        leader.attach(inst.engine)
        result["tokens"] = inst.engine.generate(requests())
        leader.stop()
        result["steps"] = leader.steps
    else:
        follower = TPFollower(group, inst.engine)
        follower.run()
        result.update(steps=follower.steps, stopped=follower.stopped, error=follower.error)
    group.close()
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def whole_instance(cfg: ModelConfig | None) -> tuple[dict[str, list[int]], dict]:
    torch.set_num_threads(1)
    inst = instance(source(cfg))
    try:
        m = inst.memory_map()
        return inst.engine.generate(requests()), {
            "kv_blocks": m["kv"]["num_blocks"],
            "block_bytes": m["kv"]["block_bytes"],
            "weight_bytes": m["weight_bytes"],
        }
    finally:
        inst.close()


@pytest.mark.parametrize("cfg,degree", [(None, 2), (TP4_CONFIG, 4)], ids=["tiny-tp2", "kv4-tp4"])
def test_tp_instance_tokens_equal_tp1_and_the_reference(cfg, degree, tmp_path):
    spawn(serve_rank, degree, degree, free_port(), cfg, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(degree)]
    tp1, tp1_mem = whole_instance(cfg)
    src = source(cfg)
    weights = src.load_weights()
    got = ranks[0]["tokens"]
    assert set(got) == {f"r{i}" for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        ref, margins = reference_greedy(src.config, weights, prompt, MAX_TOKENS)
        compare_greedy(got[f"r{i}"], ref, margins)
        compare_greedy(tp1[f"r{i}"], ref, margins)
    # every follower ran every step rank 0 ran, and ended on STOP
    for r in ranks[1:]:
        assert r["stopped"] and r["error"] is None and r["steps"] == ranks[0]["steps"] > 0
    # each member holds 1/degree of the KV per token and of the sharded weights, so the same pool holds more blocks
    assert {r["kv_blocks"] for r in ranks} == {ranks[0]["kv_blocks"]}
    assert ranks[0]["block_bytes"] * degree == tp1_mem["block_bytes"]
    assert ranks[0]["weight_bytes"] < tp1_mem["weight_bytes"]
    assert ranks[0]["kv_blocks"] >= degree * tp1_mem["kv_blocks"]


def broken_peer_rank(rank: int, ports: tuple[int, int], out: str) -> None:
    """Two instances of two ranks, one after the other. First a silent rank 0 (it hangs without a heartbeat): the
    follower gives up after the group's timeout. Then rank 1 dies: rank 0's engine loop stops with InstanceBroken
    and its request ends ABORTED (the worker then reports it lost, so the dispatcher resumes it elsewhere)."""
    torch.set_num_threads(1)
    inst = instance(sharded_source(load_model_source(None), rank, 2))
    result: dict = {}
    group = TPGroup(rank, 2, "127.0.0.1", ports[0], timeout_s=2, rendezvous_timeout_s=120)
    if rank == 0:
        time.sleep(6)  # silent past the follower's timeout
    else:
        follower = TPFollower(group, inst.engine)
        t0 = time.monotonic()
        follower.run()
        result.update(silent_error=follower.error, stopped=follower.stopped, waited_s=time.monotonic() - t0)
    group.close()
    group = TPGroup(rank, 2, "127.0.0.1", ports[1], timeout_s=30, rendezvous_timeout_s=120)
    if rank == 1:
        pathlib.Path(out, "rank1.json").write_text(json.dumps(result))
        os._exit(0)  # a member dies
    TPLeader(group).attach(inst.engine)
    events: list[TokenEvent] = []
    loop = EngineLoop(inst.engine)
    loop.start()
    loop.submit(EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)), events.append)
    deadline = time.monotonic() + 60
    while loop.running and time.monotonic() < deadline:  # it ends on its own: InstanceBroken is not one batch's failure
        time.sleep(0.05)
    result.update(
        error=type(loop.error).__name__,
        message=str(loop.error),
        broken=group.broken,
        events=[(e.token_id, e.finish_reason.name) for e in events],
    )
    pathlib.Path(out, "rank0.json").write_text(json.dumps(result))


def test_a_dead_or_silent_peer_breaks_the_instance_instead_of_hanging(tmp_path):
    spawn(broken_peer_rank, 2, (free_port(), free_port()), str(tmp_path))
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert not follower["stopped"] and "Timed out" in follower["silent_error"]
    leader = json.loads((tmp_path / "rank0.json").read_text())
    assert leader["error"] == InstanceBroken.__name__ and leader["broken"]
    assert leader["events"] == [[-1, FinishReason.ABORTED.name]]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_member_whose_peers_never_come_gives_up_at_the_rendezvous(rank):
    with pytest.raises(RuntimeError):
        TPGroup(rank, 2, "127.0.0.1", free_port(), timeout_s=1, rendezvous_timeout_s=1)
