"""Cluster parameter drop end to end (KunServe §4): 4 real workers, UCX KV exchange, pipeline groups.

The oracle: greedy tokens of requests whose life spans normal -> drop (mid-decode, KV exchanged) ->
pipeline -> restore (KV exchanged back) -> normal equal the independent reference.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from drop_scenarios import check_all, check_prefixes, drop_pair, drop_then_kill, generate_all, memory_manager, prompts_for, wait_tokens
from helpers import internal_channel, make_config, run

from kunserve.cli.launcher import LocalCluster, free_port
from kunserve.v1 import common_pb2, memory_manager_pb2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster4(tmp_path_factory):
    cfg = make_config(4)
    cfg.dispatcher.route_timeout_s = 60.0
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("drop"))
    c.start(timeout_s=180)
    yield c
    c.stop()


def test_workers_link_their_transfer_services_before_any_drop(cluster4):
    """The memory manager has every worker pair linked over UCX soon after start, so the first drop does not
    open links while requests wait. ConnectPeers refuses a nameless peer and reports one it cannot reach."""
    from kunserve.v1 import worker_pb2, worker_pb2_grpc

    ids = [w.id for w in cluster4.cfg.workers]

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            stubs = {w.id: worker_pb2_grpc.WorkerStub(await stack.enter_async_context(
                internal_channel(cluster4, w.address))) for w in cluster4.cfg.workers}
            loop = asyncio.get_running_loop()
            end = loop.time() + 60
            while True:
                infos = {w: await s.GetInfo(common_pb2.Empty(), timeout=10) for w, s in stubs.items()}
                peers = {w: sorted(i.transfer_peers) for w, i in infos.items()}
                if all(peers[w] == [x for x in ids if x != w] for w in ids):
                    break
                assert loop.time() < end, f"workers not linked: {peers}"
                await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stubs["worker-0"].ConnectPeers(worker_pb2.PeerAddresses(
                    peers=[worker_pb2.PeerAddress(transfer_address="127.0.0.1:1")]), timeout=10)
            nobody = free_port()
            linked = worker_pb2.PeerAddress(worker_id="worker-1", transfer_address=infos["worker-1"].transfer_address)
            reply = await stubs["worker-0"].ConnectPeers(worker_pb2.PeerAddresses(
                peers=[worker_pb2.PeerAddress(worker_id="worker-9", transfer_address=f"127.0.0.1:{nobody}"), linked]),
                timeout=30)
            return bad.value, reply

    bad, reply = run(go())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in bad.details()
    assert "worker-9" in reply.failed and "cannot reach" in reply.failed["worker-9"]
    assert "worker-1" not in reply.failed and sorted(reply.linked) == ["worker-1", "worker-2", "worker-3"]


def test_drop_then_restore_mid_decode_keeps_greedy_tokens(cluster4):
    prompts = prompts_for(12, seed=1)
    max_tokens = 128  # the restore must find them still decoding, however long the drop took

    async def go():
        progress: dict = {}
        gen = asyncio.create_task(generate_all(cluster4, prompts, max_tokens, progress))
        await wait_tokens(progress, len(prompts), 3, gen)
        async with memory_manager(cluster4) as mm:
            drop = await mm.Drop(memory_manager_pb2.DropRequest(groups=[
                memory_manager_pb2.GroupMembers(worker_ids=["worker-0", "worker-1"]),
                memory_manager_pb2.GroupMembers(worker_ids=["worker-2", "worker-3"])], reason="manual"), timeout=120)
            assert drop.completed, drop.error
            assert drop.requests_moved > 0 and drop.kv_bytes_moved > 0
            layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
            ranges = {w.worker_id: (w.layer_start, w.layer_end, w.group_id) for w in layout.workers}
            assert ranges["worker-0"][:2] == (0, 2) and ranges["worker-1"][:2] == (2, 4)
            assert ranges["worker-0"][2] == ranges["worker-1"][2] == "worker-0+worker-1"
            await wait_tokens(progress, 2, 3, gen, since=dict(progress))  # the pipeline groups decode
            restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
            assert restore.completed, restore.error
            assert restore.epoch > drop.epoch
            layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
            assert all((w.layer_start, w.layer_end) == (0, 4) for w in layout.workers)
        return drop, restore, await gen

    drop, restore, results = run(go(), timeout=280)
    check_all(prompts, results, max_tokens)


def test_drop_bad_input_is_refused_and_layout_unchanged(cluster4):
    async def go():
        async with memory_manager(cluster4) as mm:
            epoch = (await mm.GetLayout(common_pb2.Empty(), timeout=10)).epoch
            codes = []
            for groups in (["worker-0", "nope"], ["worker-0"], ["worker-0", "worker-0"]):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await mm.Drop(memory_manager_pb2.DropRequest(
                        groups=[memory_manager_pb2.GroupMembers(worker_ids=groups)]), timeout=30)
                codes.append((e.value.code(), e.value.details()))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mm.Restore(memory_manager_pb2.RestoreRequest(group_id="worker-1"), timeout=30)
            codes.append((e.value.code(), e.value.details()))
            after = (await mm.GetLayout(common_pb2.Empty(), timeout=10)).epoch
            return codes, epoch, after

    codes, epoch, after = run(go())
    assert codes[0][0] == grpc.StatusCode.NOT_FOUND and "nope" in codes[0][1]
    assert codes[1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert codes[2][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert codes[3][0] == grpc.StatusCode.FAILED_PRECONDITION and "not a dropped group" in codes[3][1]
    assert after == epoch


# -- faults ---------------------------------------------------------------------------------------------


def _fault_cluster(tmp_path, env=None) -> LocalCluster:
    cfg = make_config(2)
    cfg.dispatcher.route_timeout_s = 60.0
    cfg.memory_manager.transition_timeout_s = 10.0
    c = LocalCluster(cfg, run_dir=tmp_path, env=env)
    c.start(timeout_s=180)
    return c


async def _worker_epochs(c: LocalCluster) -> dict[str, int]:
    from kunserve.v1 import worker_pb2_grpc

    out = {}
    for w in c.cfg.workers:
        async with internal_channel(c, w.address) as ch:
            out[w.id] = (await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)).epoch
    return out


@pytest.mark.parametrize("victim", ["worker-1", "worker-0"])
def test_killing_a_group_member_mid_decode_loses_no_request(tmp_path, victim):
    """Stage killed: the head heals (restores every layer from its host copy) and re-prefills its requests.
    Head killed: the dispatcher resumes its requests on the survivor, which healed to a whole instance."""
    c = _fault_cluster(tmp_path)
    prompts = prompts_for(8, seed=3)
    budget = 1500  # never reached: the requests are cancelled once they decode past the kill
    try:
        results = run(drop_then_kill(c, prompts, budget, victim), timeout=280)
    finally:
        c.stop()
    check_prefixes(prompts, results, budget)


def test_worker_dying_during_the_kv_exchange_rolls_back_and_loses_no_request(tmp_path):
    c = _fault_cluster(tmp_path, env={"KUNSERVE_FAULT": "die_in_exchange:worker-1"})
    prompts = prompts_for(8, seed=4)
    max_tokens = 32
    try:
        async def go():
            progress: dict = {}
            gen = asyncio.create_task(generate_all(c, prompts, max_tokens, progress))
            await wait_tokens(progress, len(prompts), 2, gen)
            drop = await drop_pair(c)
            return drop, await gen

        drop, results = run(go(), timeout=280)
    finally:
        c.stop()
    assert not drop.completed and drop.rolled_back
    assert "worker-1" in drop.error
    check_all(prompts, results, max_tokens)


def test_a_burst_that_overflows_kv_memory_drops_automatically(tmp_path):
    """The monitor sees head-of-line blocking on both instances, the memory manager merges them into one
    pipeline group, and once the group is ready every request of the burst runs: none waits for memory
    the drop made available (whole instance: 128 blocks each; the pair: 640 blocks; burst: ~450, decoding long
    enough that the monitor's drop lands while it runs, however fast the engine)."""
    cfg = make_config(2, pool_mib=36, auto_drop=True)
    cfg.monitor.restore_hold_s = 600.0  # no restore during the test
    cfg.dispatcher.route_timeout_s = 60.0
    c = LocalCluster(cfg, run_dir=tmp_path)
    c.start(timeout_s=180)
    prompts = prompts_for(20, seed=5, lo=180, hi=220)
    max_tokens = 160
    try:
        async def go():
            from kunserve.v1 import worker_pb2_grpc

            progress: dict = {}
            gen = asyncio.create_task(generate_all(c, prompts, max_tokens, progress))
            waiting_after_ready = None
            async with memory_manager(c) as mm:
                loop = asyncio.get_running_loop()
                end = loop.time() + 120
                group = None
                while group is None and not gen.done():
                    assert loop.time() < end, "no automatic drop"
                    layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
                    heads = [w for w in layout.workers if w.group_id != w.worker_id and w.serving]
                    group = heads[0] if heads else None
                    await asyncio.sleep(0.1)
                assert group is not None, "the burst finished before any drop"
                head_addr = next(w.address for w in c.cfg.workers if w.id == group.worker_id)
                async with internal_channel(c, head_addr) as wch:
                    stub = worker_pb2_grpc.WorkerStub(wch)
                    for _ in range(100):  # the moved requests are installed at once; stragglers routed in
                        s = await stub.GetStats(common_pb2.Empty(), timeout=10)
                        if s.num_waiting == 0 or gen.done():
                            waiting_after_ready = s.num_waiting
                            break
                        await asyncio.sleep(0.05)
            return waiting_after_ready, await gen

        waiting, results = run(go(), timeout=280)
    finally:
        c.stop()
    assert waiting == 0
    check_all(prompts, results, max_tokens)


# -- the baselines that share the machinery --------------------------------------------------------------


def test_migrate_moves_running_requests_with_their_kv(cluster4):
    """The Llumnix-like baseline: requests move (KV and all) from one whole instance to another mid-decode
    and keep their reference tokens."""
    prompts = prompts_for(10, seed=6)
    max_tokens = 128

    async def go():
        progress: dict = {}
        gen = asyncio.create_task(generate_all(cluster4, prompts, max_tokens, progress))
        await wait_tokens(progress, len(prompts), 3, gen)
        async with memory_manager(cluster4) as mm:
            rep = await mm.Migrate(memory_manager_pb2.MigrateRequest(src_worker="worker-0", dst_worker="worker-1",
                                                                     blocks=1000), timeout=120)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mm.Migrate(memory_manager_pb2.MigrateRequest(src_worker="worker-0", dst_worker="worker-0",
                                                                   blocks=1), timeout=30)
        return rep, e.value.code(), await gen

    rep, bad, results = run(go(), timeout=280)
    assert rep.completed, rep.error
    assert rep.requests_moved > 0 and rep.kv_bytes_moved > 0
    assert bad == grpc.StatusCode.INVALID_ARGUMENT
    check_all(prompts, results, max_tokens)


def test_static_pp_serves_from_pairs_formed_at_start(tmp_path):
    cfg = make_config(2)
    cfg.policy.overload = "static-pp"
    c = LocalCluster(cfg, run_dir=tmp_path)
    c.start(timeout_s=180)
    prompts = prompts_for(6, seed=7)
    try:
        async def go():
            async with memory_manager(c) as mm:
                await asyncio.sleep(0.3)
                layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
            return layout, await generate_all(c, prompts, 24, {})

        layout, results = run(go())
    finally:
        c.stop()
    assert {w.worker_id: (w.layer_start, w.layer_end) for w in layout.workers} == {"worker-0": (0, 2),
                                                                                   "worker-1": (2, 4)}
    assert all(r.worker_id == "worker-0" for r in results)  # the pair's head serves
    check_all(prompts, results, 24)


def test_memory_manager_rebuilds_the_layout_after_a_restart(tmp_path):
    """The layout lives in the workers: a memory manager that crashed after a drop learns the group back from
    them, and can restore it."""
    c = _fault_cluster(tmp_path)
    prompts = prompts_for(4, seed=8)
    max_tokens = 24
    try:
        async def layout():
            async with memory_manager(c) as mm:
                return await mm.GetLayout(common_pb2.Empty(), timeout=30)

        drop = run(drop_pair(c))
        assert drop.completed, drop.error
        before = run(layout())
        c.restart("memory-manager")
        after = run(layout())
        groups = {w.worker_id: (w.group_id, w.layer_start, w.layer_end) for w in after.workers}
        assert groups == {w.worker_id: (w.group_id, w.layer_start, w.layer_end) for w in before.workers}
        assert groups["worker-0"][0] == groups["worker-1"][0]
        # The old memory manager's own bumps (a worker seen, lost, seen again) are not remembered, so `after` may
        # be below `before`; what must hold is that it is not behind any worker's transition epoch, so the next
        # transition is newer than every earlier one (the restore below would be refused otherwise).
        assert after.epoch >= max(run(_worker_epochs(c)).values()) > 0

        async def restore_while_serving():
            progress: dict = {}
            gen = asyncio.create_task(generate_all(c, prompts, max_tokens, progress))
            await wait_tokens(progress, len(prompts), 2, gen)
            async with memory_manager(c) as mm:
                rep = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
            assert rep.completed, rep.error
            return await gen

        results = run(restore_while_serving(), timeout=200)
        final = run(layout())
        assert len({w.group_id for w in final.workers}) == 2 and final.epoch > after.epoch
    finally:
        c.stop()
    check_all(prompts, results, max_tokens)
