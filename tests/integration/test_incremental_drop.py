"""Incremental drops end to end (KunServe §5.6): 4 real workers drop into two pairs, the pairs merge into a
quad (`kunctl plan` shows it, `kunctl drop` executes it), then restores undo one merge at a time: the quad
splits into the pairs it came from, the pairs into whole instances.

The oracle: greedy requests streaming through all four transitions (KV exchanged each time, mid-decode)
finish with the independent reference's tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess

import pytest
from helpers import admin_channel, check_against_reference, kunctl_argv, run

from kunserve import client
from kunserve.v1 import common_pb2, memory_manager_pb2, memory_manager_pb2_grpc

pytestmark = pytest.mark.timeout(300)

QUAD = "worker-0+worker-2+worker-1+worker-3"


def _layout(layout) -> dict[str, tuple[int, int, str]]:
    return {w.worker_id: (w.layer_start, w.layer_end, w.group_id) for w in layout.workers}


async def _kunctl(cluster, *args: str) -> str:
    proc = await asyncio.to_thread(subprocess.run, kunctl_argv(cluster, *args), capture_output=True, text=True,
                                   timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_pairs_merge_into_a_quad_and_restore_step_by_step_while_requests_stream(fresh_cluster):
    c = fresh_cluster(4, pool_mib=36)
    rng = random.Random(21)
    prompts = [[rng.randrange(4, 4000) for _ in range(rng.randrange(8, 40))] for _ in range(8)]
    max_tokens = 500  # still decoding after four transitions, which no longer pause serving for their KV exchange
    progress: dict[int, int] = {}

    async def stream():
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            async def one(i: int, p: list[int]):
                def seen(ev) -> None:
                    progress[i] = progress.get(i, 0) + (ev.token_id >= 0)
                return await client.generate(ch, client.make_request(p, request_id=f"r{i}", max_tokens=max_tokens),
                                             timeout=240, on_event=seen)
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    async def more_tokens(gen: asyncio.Task, n: int = 2) -> None:
        """Every request makes n more tokens in the layout now in force (none may have finished)."""
        since = dict(progress)
        loop = asyncio.get_running_loop()
        end = loop.time() + 120
        while not all(progress.get(i, 0) - since.get(i, 0) >= n for i in range(len(prompts))):
            if gen.done():
                gen.result()
                raise AssertionError(f"the requests ended before the step under test: {progress}")
            assert loop.time() < end, f"no progress: {progress} (since {since})"
            await asyncio.sleep(0.05)

    async def go():
        gen = asyncio.create_task(stream())
        async with admin_channel(c) as ch:
            mm = memory_manager_pb2_grpc.MemoryManagerStub(ch)
            await more_tokens(gen)
            pairs = await mm.Drop(memory_manager_pb2.DropRequest(groups=[
                memory_manager_pb2.GroupMembers(worker_ids=["worker-0", "worker-1"]),
                memory_manager_pb2.GroupMembers(worker_ids=["worker-2", "worker-3"])]), timeout=120)
            assert pairs.completed, pairs.error
            await more_tokens(gen)

            plan = await _kunctl(c, "plan")
            assert f"{QUAD} (group of 4, changed): worker-0 [0, 1) -> worker-2 [1, 2) -> worker-1 [2, 3) -> " \
                   "worker-3 [3, 4)" in plan, plan
            merged = json.loads(await _kunctl(c, "drop", "--json"))  # the planner's next merge: the two pairs
            assert merged["completed"] and [g["group_id"] for g in merged["groups"]] == [QUAD], merged
            # the second pair's requests moved to the quad's head with the KV of the layers that changed hands
            assert merged["requests_moved"] > 0 and int(merged["kv_bytes_moved"]) > 0, merged
            layout = _layout(await mm.GetLayout(common_pb2.Empty(), timeout=10))
            assert layout == {"worker-0": (0, 1, QUAD), "worker-2": (1, 2, QUAD), "worker-1": (2, 3, QUAD),
                              "worker-3": (3, 4, QUAD)}
            await more_tokens(gen)  # the quad decodes through four stages

            to_pairs = await mm.Restore(memory_manager_pb2.RestoreRequest(group_id=QUAD), timeout=120)
            assert to_pairs.completed, to_pairs.error
            assert sorted(g.group_id for g in to_pairs.groups) == ["worker-0+worker-1", "worker-2+worker-3"]
            layout = _layout(await mm.GetLayout(common_pb2.Empty(), timeout=10))
            assert layout["worker-0"] == (0, 2, "worker-0+worker-1") and layout["worker-3"] == (2, 4, "worker-2+worker-3")
            await more_tokens(gen)

            whole = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
            assert whole.completed, whole.error
            layout = _layout(await mm.GetLayout(common_pb2.Empty(), timeout=10))
            assert all(v == (0, 4, w) for w, v in layout.items()), layout
            epochs = [pairs.epoch, whole.epoch]
        return epochs, await gen

    (first, last), results = run(go(), timeout=280)
    assert last > first
    for p, r in zip(prompts, results):
        check_against_reference(p, r.token_ids, max_tokens)
