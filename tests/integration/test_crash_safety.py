"""Nothing a client or a crash does may take the cluster down (issue 12, defects 1 and 2), on real processes.

* A request with a pathological temperature (1e-40 used to overflow the sampler and kill every worker it
  was retried on) is served, the workers stay up and healthy, and the next request gets the reference
  greedy tokens.
* The memory manager is SIGKILLed (``os._exit`` at an injected fault point) at each step of a drop while
  requests decode: after prepare, while the members execute, after they executed, and with one member
  committed. Every worker ends up serving (not paused, whole) within a bounded time — on its own, by its
  transition lease — and every stream completes with the reference greedy tokens. A memory manager whose
  lease is long dies after prepare; its restarted successor rolls the orphaned transition back at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import admin_channel, check_against_reference, internal_channel, make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.faults import FAULT_ENV, FAULT_EXIT_CODE
from kunserve.v1 import common_pb2, memory_manager_pb2, memory_manager_pb2_grpc, worker_pb2_grpc

pytestmark = pytest.mark.timeout(400)

LEASE_S = 2.0
MM = "memory-manager"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = make_config(2)
    cfg.dispatcher.route_timeout_s = 60.0
    cfg.memory_manager.transition_timeout_s = 20.0
    cfg.memory_manager.transition_lease_s = LEASE_S
    c = LocalCluster(cfg, run_dir=tmp_path_factory.mktemp("crash"))
    c.start(timeout_s=180)
    yield c
    c.stop()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 4000) for _ in range(rng.randrange(8, 30))] for _ in range(n)]


async def _workers(c: LocalCluster) -> dict[str, object]:
    out = {}
    for w in c.cfg.workers:
        async with internal_channel(c, w.address) as ch:
            out[w.id] = await worker_pb2_grpc.WorkerStub(ch).GetInfo(common_pb2.Empty(), timeout=10)
    return out


async def _healthy(address: str) -> int:
    """The health status of a service; UNKNOWN while it does not answer (restarting)."""
    async with grpc.aio.insecure_channel(address) as ch:  # the health service is open (probes)
        try:
            return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)).status
        except grpc.aio.AioRpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN


def test_a_pathological_temperature_is_served_and_takes_no_worker_down(cluster):
    prompt = _prompts(1, seed=7)[0]

    async def go():
        async with client.insecure_channel(cluster.cfg.dispatcher.address) as ch:
            odd = [await client.generate(ch, client.make_request(prompt, max_tokens=8, temperature=t, seed=1),
                                         timeout=60) for t in (1e-40, 1e-45, 3e38)]
            greedy = await client.generate(ch, client.make_request(prompt, max_tokens=16), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.generate(ch, client.make_request(prompt, max_tokens=8, temperature=float("inf")),
                                      timeout=60)
        health = [await _healthy(w.address) for w in cluster.cfg.workers]
        return odd, greedy, bad.value, health

    odd, greedy, bad, health = run(go())
    assert [len(r.token_ids) for r in odd] == [8, 8, 8]
    assert odd[0].token_ids == odd[1].token_ids == greedy.token_ids[:8]  # a vanishing temperature is greedy
    check_against_reference(prompt, greedy.token_ids, 16)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.details()
    assert health == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert not cluster.dead_children()


async def _generate(c: LocalCluster, prompts, max_tokens: int, progress: dict):
    async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
        async def one(i, p):
            def seen(ev):
                progress[i] = progress.get(i, 0) + (ev.token_id >= 0)
            return await client.generate(ch, client.make_request(p, max_tokens=max_tokens), timeout=240,
                                         on_event=seen)
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def _until_decoding(progress: dict, n: int, gen: asyncio.Task, timeout: float = 120) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while sum(1 for v in progress.values() if v >= 2) < n:
        if gen.done():
            gen.result()
            raise AssertionError(f"the requests ended before the drop: {progress}")
        assert loop.time() < end, f"requests made no progress: {progress}"
        await asyncio.sleep(0.05)


async def _until_serving_whole(c: LocalCluster, within_s: float) -> float:
    """Seconds until every worker is whole, serving and not transitioning (fails after within_s)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        infos = await _workers(c)
        if all(i.serving and not i.transitioning and (i.layer_start, i.layer_end) == (0, i.num_layers_model)
               for i in infos.values()):
            return loop.time() - start
        assert loop.time() - start < within_s, {w: (i.serving, i.transitioning, i.layer_start, i.layer_end,
                                                     i.group_id) for w, i in infos.items()}
        await asyncio.sleep(0.1)


def _restart_mm(c: LocalCluster, fault: str | None, lease_s: float | None = None) -> None:
    c.env.pop(FAULT_ENV, None)
    c.env.pop("KUNSERVE__MEMORY_MANAGER__TRANSITION_LEASE_S", None)
    if fault:
        c.env[FAULT_ENV] = f"{fault}:{MM}"
    if lease_s is not None:
        c.env["KUNSERVE__MEMORY_MANAGER__TRANSITION_LEASE_S"] = str(lease_s)
    c.restart(MM)


def _drop_while_decoding(c: LocalCluster, seed: int, heal_within_s: float, restart_after_death: bool = False):
    """Requests decode on both workers; a drop is asked for and the memory manager dies during it (and is
    restarted, when asked). Returns (the drop call's error, seconds until every worker serves whole again).

    The client side runs on a thread of its own: the restart must be made by this (the main) thread, since a
    child gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG is per thread)."""
    prompts = _prompts(4, seed)
    max_tokens = 64
    died, restarted = threading.Event(), threading.Event()

    async def go():
        progress: dict = {}
        gen = asyncio.create_task(_generate(c, prompts, max_tokens, progress))
        await _until_decoding(progress, len(prompts), gen)
        async with admin_channel(c) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await memory_manager_pb2_grpc.MemoryManagerStub(ch).Drop(memory_manager_pb2.DropRequest(groups=[
                    memory_manager_pb2.GroupMembers(worker_ids=["worker-0", "worker-1"])]), timeout=60)
        code = await asyncio.to_thread(c.child(MM).proc.wait, 30)
        died.set()
        if restart_after_death:
            assert await asyncio.to_thread(restarted.wait, 120)
        healed = await _until_serving_whole(c, heal_within_s)
        return error.value, code, healed, await asyncio.wait_for(gen, 200)

    box: dict = {}

    def client_side() -> None:
        try:
            box["value"] = run(go(), timeout=300)
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc
        finally:
            died.set()

    t = threading.Thread(target=client_side, name="client-side")
    t.start()
    died.wait(300)
    if restart_after_death and "error" not in box:
        _restart_mm(c, None)
        restarted.set()
    t.join(330)
    if "error" in box:
        raise box["error"]
    drop_error, code, healed, results = box["value"]
    assert code == FAULT_EXIT_CODE
    for p, r in zip(prompts, results):
        check_against_reference(p, r.token_ids, max_tokens)
    return drop_error, healed


STEPS = ["after_prepare", "in_execute", "after_execute", "in_commit"]


@pytest.mark.parametrize("step", STEPS)
def test_memory_manager_killed_at_each_step_of_a_drop_leaves_every_worker_serving(cluster, step):
    _restart_mm(cluster, step)
    died, healed = _drop_while_decoding(cluster, seed=STEPS.index(step), heal_within_s=LEASE_S + 15)
    assert died.code() == grpc.StatusCode.UNAVAILABLE
    assert healed <= LEASE_S + 15


@pytest.mark.parametrize("step", ["after_prepare", "in_commit"])
def test_a_restarted_memory_manager_rolls_back_the_transition_it_finds_half_done(cluster, step):
    """The dead memory manager gave a 10-minute lease: the workers would stay paused that long on their own.
    Its successor finds them transitioning in an epoch it never started and aborts it at once; after
    `in_commit` the member that had committed hears that the other left and heals too."""
    _restart_mm(cluster, step, lease_s=600)
    died, healed = _drop_while_decoding(cluster, seed=11 + STEPS.index(step), heal_within_s=30,
                                        restart_after_death=True)
    assert died.code() == grpc.StatusCode.UNAVAILABLE
    assert "orphaned_transition_aborting" in cluster.child(MM).log_path.read_text()

    async def drop_and_restore():  # the rebuilt layout is consistent: a real drop and restore still work
        async with admin_channel(cluster) as ch:
            mm = memory_manager_pb2_grpc.MemoryManagerStub(ch)
            drop = await mm.Drop(memory_manager_pb2.DropRequest(groups=[
                memory_manager_pb2.GroupMembers(worker_ids=["worker-0", "worker-1"])]), timeout=120)
            restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
            return drop, restore

    drop, restore = run(drop_and_restore(), timeout=250)
    assert drop.completed and restore.completed, (drop.error, restore.error)
    assert restore.epoch > drop.epoch


def test_the_supervisor_restarts_a_crashed_and_a_frozen_service(fresh_cluster):
    """`kunserve up` supervision: a SIGKILLed worker and a SIGSTOPped (hung) monitor are restarted; the cluster
    serves the reference tokens through the restarted worker and the monitor sees every worker again."""
    import signal
    import time

    from kunserve.cli.supervisor import RestartPolicy
    from kunserve.v1 import monitor_pb2_grpc

    c = fresh_cluster(2)
    lines: list[str] = []
    sup = c.supervise(RestartPolicy(backoff_s=0.2, unhealthy_s=2.0, probe_interval_s=0.5), report=lines.append)
    c.kill("worker-1")
    os.kill(c.child("monitor").proc.pid, signal.SIGSTOP)
    end = time.monotonic() + 90
    while not (sup.restarts("worker-1") >= 1 and sup.restarts("monitor") >= 1):
        assert time.monotonic() < end, lines
        time.sleep(0.2)
    prompt = _prompts(1, seed=5)[0]

    async def go():
        loop = asyncio.get_running_loop()
        until = loop.time() + 90
        while not all([await _healthy(w.address) == health_pb2.HealthCheckResponse.SERVING
                       for w in (c.cfg.workers[1], c.cfg.monitor)]):
            assert loop.time() < until, lines
            await asyncio.sleep(0.2)
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            results = [await client.generate(ch, client.make_request(prompt, max_tokens=12), timeout=60)
                       for _ in range(4)]  # the router spreads them: the restarted worker serves some
        async with internal_channel(c, c.cfg.monitor.address) as ch:
            while True:
                status = await monitor_pb2_grpc.MonitorStub(ch).GetClusterStatus(common_pb2.Empty(), timeout=10)
                if sorted(w.stats.worker_id for w in status.workers if w.healthy) == ["worker-0", "worker-1"]:
                    return results
                assert loop.time() < until, status
                await asyncio.sleep(0.2)

    results = run(go(), timeout=200)
    for r in results:
        check_against_reference(prompt, r.token_ids, 12)
    assert any("worker-1 exited with code -9" in line for line in lines), lines
    assert any("monitor has not answered SERVING" in line for line in lines), lines


def test_a_worker_whose_engine_keeps_failing_reports_not_serving_and_no_request_is_carried(fresh_cluster):
    """Injected: every forward pass of worker-1 raises. The requests it takes fail alone with INTERNAL naming
    them (the dispatcher does not carry them to worker-0); after MAX_FAILED_STEPS failing batches its engine
    stops, its health answers NOT_SERVING, and everything else is served by worker-0."""
    from kunserve.shared.engine.loop import MAX_FAILED_STEPS

    c = fresh_cluster(2, env={FAULT_ENV: "engine_fails:worker-1"})
    prompt = _prompts(1, seed=9)[0]

    async def go():
        failed, served = [], []
        loop = asyncio.get_running_loop()
        until = loop.time() + 120
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            while await _healthy(c.cfg.workers[1].address) == health_pb2.HealthCheckResponse.SERVING:
                assert loop.time() < until, (len(failed), len(served))
                try:
                    served.append(await client.generate(ch, client.make_request(prompt, max_tokens=6), timeout=60))
                except grpc.aio.AioRpcError as exc:
                    failed.append(exc)
            after = [await client.generate(ch, client.make_request(prompt, max_tokens=6), timeout=60)
                     for _ in range(4)]
        return failed, served, after

    failed, served, after = run(go(), timeout=200)
    assert len(failed) >= MAX_FAILED_STEPS
    assert all(e.code() == grpc.StatusCode.INTERNAL and "injected engine fault" in e.details()
               and "on worker worker-1" in e.details() for e in failed), [e.details() for e in failed]
    for r in served + after:
        check_against_reference(prompt, r.token_ids, 6)
    assert {r.worker_id for r in after} == {"worker-0"}
    assert "injected engine fault" in c.child("worker-1").log_path.read_text()
