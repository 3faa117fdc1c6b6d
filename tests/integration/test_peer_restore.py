"""Restore from peers (KunServe §4.4) on a real 2-worker cluster with engine.host_copy = false: no worker keeps a
DRAM copy of the model. A restore pulls each member's missing layers from the other member over UCX (the
transfer service's weights class); a peer that is gone leaves the survivor to fill them from the checkpoint.

The oracle: greedy tokens of requests whose life spans drop -> pipeline -> restore (or the peer's death) equal
the independent reference's.
"""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
from drop_scenarios import check_prefixes, drop_pair, drop_then_kill, generate_until, prompts_for, wait_tokens
from helpers import admin_channel, internal_channel, make_config, run

from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import common_pb2, memory_manager_pb2, memory_manager_pb2_grpc, worker_pb2_grpc

pytestmark = pytest.mark.timeout(300)

W0, W1 = "worker-0", "worker-1"


def _cluster(tmp_path) -> LocalCluster:
    cfg = make_config(2, host_copy=False)
    cfg.dispatcher.route_timeout_s = 60.0
    cfg.memory_manager.transition_timeout_s = 20.0
    c = LocalCluster(cfg, run_dir=tmp_path)
    c.start(timeout_s=180)
    return c


def _restored(logs: dict[str, pathlib.Path], worker: str) -> list[dict]:
    """The worker's `weights_restored` log events: which layers came from where."""
    out = []
    for line in logs[worker].read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "weights_restored":
            out.append(ev)
    return out


def test_restore_pulls_the_missing_layers_from_the_peer_without_a_host_copy(tmp_path):
    c = _cluster(tmp_path)
    logs = {w: c.child(w).log_path for w in (W0, W1)}
    prompts = prompts_for(8, seed=11)
    budget = 1500  # never reached: the requests are cancelled once they decode after the restore
    try:
        async def go():
            async with internal_channel(c, c.cfg.workers[0].address) as ch:
                mem = await worker_pb2_grpc.WorkerStub(ch).GetMemoryMap(common_pb2.Empty(), timeout=10)
            assert mem.host_copy_bytes == 0, "engine.host_copy = false keeps no DRAM copy of the model"
            progress: dict = {}
            stop = asyncio.Event()
            gen = asyncio.create_task(generate_until(c, prompts, budget, progress, stop))
            await wait_tokens(progress, len(prompts), 3, gen)
            drop = await drop_pair(c)
            assert drop.completed, drop.error
            await wait_tokens(progress, 2, 3, gen, since=dict(progress))  # the pair decodes
            async with admin_channel(c) as ch:
                mm = memory_manager_pb2_grpc.MemoryManagerStub(ch)
                restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
                assert restore.completed, restore.error
                layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
            assert all((w.layer_start, w.layer_end) == (0, 4) for w in layout.workers)
            await wait_tokens(progress, len(prompts), 2, gen, since=dict(progress))  # every request decodes on
            stop.set()
            return await gen

        results = run(go(), timeout=280)
    finally:
        c.stop()
    check_prefixes(prompts, results, budget)
    for me, peer in ((W0, W1), (W1, W0)):
        sources = {ev["source"] for ev in _restored(logs, me)}
        assert sources == {f"peer:{peer}"}, (me, _restored(logs, me))


def test_a_peer_killed_before_the_restore_leaves_the_survivor_to_the_checkpoint(tmp_path):
    """The stage dies while the pair decodes: the head fills the layers it lacks from the checkpoint (no host
    copy, no peer left), re-prefills its requests, and every one keeps its greedy tokens."""
    c = _cluster(tmp_path)
    logs = {w: c.child(w).log_path for w in (W0, W1)}
    prompts = prompts_for(6, seed=12)
    budget = 1500  # never reached: the requests are cancelled once they decode past the kill
    try:
        results = run(drop_then_kill(c, prompts, budget, W1), timeout=280)
    finally:
        c.stop()
    check_prefixes(prompts, results, budget)
    events = _restored(logs, W0)
    assert [ev["source"] for ev in events] == ["checkpoint"] and events[0]["layers"] == [2, 3], events
