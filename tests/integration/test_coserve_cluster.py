"""Co-serving composed with the parameter drop on a real 2-worker cluster (ConServe request classes under KunServe).

Offline requests fill every worker's KV and queue far beyond it (and wait longer than the TTFT SLO): the monitor, with
``monitor.auto_drop`` on, sees no overload and drops nothing, since offline work only harvests what online work
leaves. That backlog is cancelled once the monitor has been watched through enough of it (its budget only keeps it
queued for as long as watching takes, however slow the machine). An online burst beyond the cluster's capacity then
makes it drop. Two long offline requests decode across that drop and a restore (and are cancelled once they have
decoded a few tokens after it: their budget is only there to keep them decoding until the restore, whenever it comes);
every token of every request, offline and online, is the reference's greedy one. The assertions are about what the
monitor saw and decided, never about time.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from drop_scenarios import check_all, memory_manager, prompts_for, wait_tokens
from helpers import check_against_reference, internal_channel, make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import common_pb2, memory_manager_pb2, monitor_pb2_grpc

pytestmark = pytest.mark.timeout(300)

WORKERS = ("worker-0", "worker-1")
LONG_TOKENS = 1200    # the long offline requests: still decoding when the restore comes
AFTER_RESTORE = 8     # tokens each of them decodes after the restore before it is cancelled
FILLER_BUDGET = 400   # the offline backlog: still queued beyond the KV when the watching ends, then cancelled
ONLINE_TOKENS = 48
BLIND_REPORTS = 10    # fresh reports per worker in which a class-blind monitor would have dropped


def _cluster(tmp_path) -> LocalCluster:
    cfg = make_config(2, pool_mib=36, auto_drop=True)  # 128 KV blocks per whole instance
    cfg.slo.ttft_ms = 1000.0  # queued offline requests wait longer than this: no overload either
    cfg.monitor.restore_hold_s = 600.0  # the test restores by hand
    cfg.dispatcher.route_timeout_s = 60.0
    cfg.dispatcher.queue_timeout_s = 240.0
    cfg.dispatcher.max_queued_prompt_tokens = 1_000_000  # the offline backlog is admitted whole
    cfg.dispatcher.max_inflight_per_worker = 256
    cfg.memory_manager.transition_timeout_s = 20.0
    c = LocalCluster(cfg, run_dir=tmp_path)
    c.start(timeout_s=180)
    return c


def _stream(ch, prompts, max_tokens: int, progress: dict, tag: str, offline: bool) -> asyncio.Task:
    """Greedy generations of every prompt at once (progress[tag, i] counts request i's tokens); the task gives the
    results in order (a cancelled request's: the tokens it had, finish reason "aborted")."""
    async def one(i, p):
        req = client.make_request(p, request_id=f"{tag}{i}", max_tokens=max_tokens)
        if offline:
            req.request_class = common_pb2.REQUEST_CLASS_OFFLINE

        def seen(ev) -> None:
            progress[tag, i] = progress.get((tag, i), 0) + (ev.token_id >= 0)
        return await client.generate(ch, req, timeout=240, on_event=seen)

    async def gather():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return asyncio.create_task(gather())


async def _offline_overload_is_no_overload(monitor, gen: asyncio.Task) -> None:
    """Until the monitor has seen BLIND_REPORTS fresh reports of every worker in which offline requests alone hold
    its KV and their queued demand goes beyond it (a class-blind monitor's overload), asserting each time that the
    monitor does not call it overload."""
    counted = {w: 0 for w in WORKERS}
    last: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    end = loop.time() + 120
    while min(counted.values()) < BLIND_REPORTS:
        assert not gen.done(), f"the offline backlog ended first: {counted}"
        assert loop.time() < end, counted
        status = await monitor.GetClusterStatus(common_pb2.Empty(), timeout=10)
        assert not status.overloaded, status
        for w in status.workers:
            s = w.stats
            blind = s.kv_blocks_used + s.queued_demand_blocks > s.kv_blocks_total
            offline_only = s.num_offline_running + s.num_offline_waiting == s.num_running + s.num_waiting
            if w.healthy and blind and offline_only and s.timestamp_unix_s != last.get(s.worker_id):
                last[s.worker_id] = s.timestamp_unix_s
                counted[s.worker_id] += 1
        await asyncio.sleep(0.05)


async def _cancel_if_running(ch, request_id: str) -> None:
    try:
        await client.cancel(ch, request_id)
    except grpc.aio.AioRpcError as exc:  # it finished (or never started) before the cancel: nothing to stop
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc


async def _wait_for_group(mm, gen: asyncio.Task) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 120
    while True:
        layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
        if any(w.group_id != w.worker_id and w.serving for w in layout.workers):
            return
        assert not gen.done(), "the online burst finished before any drop"
        assert loop.time() < end, "no automatic drop"
        await asyncio.sleep(0.1)


def test_offline_work_is_harvested_not_dropped_for_and_lives_through_drop_and_restore(tmp_path):
    c = _cluster(tmp_path)
    long_prompts = prompts_for(2, seed=21, lo=8, hi=16)
    fillers = prompts_for(40, seed=22, lo=150, hi=250)
    online = prompts_for(20, seed=5, lo=180, hi=220)  # ~320 blocks of online demand: beyond 2 x 128

    async def go():
        progress: dict = {}
        async with (client.insecure_channel(c.cfg.dispatcher.address) as ch,
                    internal_channel(c, c.cfg.monitor.address) as mch, memory_manager(c) as mm):
            long = _stream(ch, long_prompts, LONG_TOKENS, progress, "long", offline=True)
            await wait_tokens(progress, len(long_prompts), 1, long)  # the oldest offline requests: never the victims
            backlog = _stream(ch, fillers, FILLER_BUDGET, progress, "fill", offline=True)
            await _offline_overload_is_no_overload(monitor_pb2_grpc.MonitorStub(mch), backlog)
            for i in range(len(fillers)):
                await _cancel_if_running(ch, f"fill{i}")
            filler_results = await backlog
            layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
            assert all(w.group_id == w.worker_id for w in layout.workers), layout
            burst = _stream(ch, online, ONLINE_TOKENS, progress, "on", offline=False)
            await _wait_for_group(mm, burst)
            online_results = await burst
            assert not long.done(), "the long offline requests ended before the restore"
            before = dict(progress)
            restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
            assert restore.completed, restore
            await wait_tokens(progress, len(long_prompts), AFTER_RESTORE, long, since=before)
            for i in range(len(long_prompts)):
                assert await client.cancel(ch, f"long{i}")
            return await long, filler_results, online_results

    try:
        long_results, filler_results, online_results = run(go(), timeout=280)
        monitor_log = (tmp_path / "monitor.log").read_text()
    finally:
        c.stop()
    for p, r in zip(long_prompts, long_results):  # every token up to the cancel, across the drop and the restore
        assert r.finish_reason == "aborted" and AFTER_RESTORE < len(r.token_ids) < LONG_TOKENS, r
        check_against_reference(p, r.token_ids, len(r.token_ids))
    for p, r in zip(fillers, filler_results):  # cancelled queued or mid-decode: every token it had is the reference's
        assert r.finish_reason == "aborted" or len(r.token_ids) == FILLER_BUDGET, r
        check_against_reference(p, r.token_ids, len(r.token_ids))
    check_all(online, online_results, ONLINE_TOKENS)
    assert monitor_log.count("policy_drop_decided") == 1, monitor_log  # the online burst's, nothing for offline work
