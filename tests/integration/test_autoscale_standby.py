"""Autoscaling behind the drop with a local standby worker (README "Discovery and autoscaling"), end to end.

Two workers and one standby (``kunserve up --standby 1``). A burst larger than even the merged pair's KV memory
makes the drop planner say "autoscale needed"; the memory manager activates the standby worker, which joins the
cluster, and the dispatcher routes requests to it. Once the burst has passed (the group restored, the cluster calm
for autoscale.scale_down_hold_s) the memory manager drains it back to standby while requests keep arriving (those
still running there resume elsewhere). Every request of every wave completes with all its tokens, and those that ran
on the worker that joined and left match the reference's greedy tokens: none is lost to the join or the leave.

Every wait is on a condition with a bound; nothing asserts on elapsed time. The bounds add up: the cluster's start
(START_S), the scenario (SCENARIO_S: the join, the routing, the burst's requests, the drain, each bounded inside it),
the stop and the reference check fit the test's timeout.
"""

from __future__ import annotations

import asyncio

import pytest
from drop_scenarios import check_all, memory_manager, prompts_for
from helpers import make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster, standby_sections
from kunserve.v1 import common_pb2

START_S = 150.0
REQUEST_S = 180.0  # one request's bound (the burst's queue behind the pair and the standby's start)
JOIN_S, ROUTE_S, DRAIN_S = 90.0, 60.0, 90.0
# the burst runs beside the join and the routing; the drain comes after both; one GetLayout (10 s) may overrun a wait
SCENARIO_S = max(JOIN_S + ROUTE_S, REQUEST_S) + DRAIN_S + 30.0
STOP_S = 30.0  # LocalCluster.stop: a 10 s grace, then SIGKILL and a 10 s wait
CHECK_S = 60.0  # the dense reference of the requests that ran on the standby (up to a second each on 2 busy cores)
pytestmark = pytest.mark.timeout(START_S + SCENARIO_S + STOP_S + CHECK_S)
STANDBY = "worker-2"


def _config():
    cfg = make_config(2, pool_mib=36, auto_drop=True)  # whole instance: 128 KV blocks; the pair: 640
    cfg.monitor.overload_hold_s = 0.5  # the drop is sized once the whole burst has arrived: more than the pair holds
    cfg.monitor.restore_hold_s = 1.0
    cfg.monitor.restore_cooldown_s = 1.0
    cfg.dispatcher.route_timeout_s = 60.0
    cfg.dispatcher.queue_timeout_s = 150.0  # the burst queues behind the pair until the standby serves
    cfg.dispatcher.max_queued_prompt_tokens = 1_000_000  # the whole burst is admitted: it must queue on the workers
    a = cfg.autoscale
    a.scaler = "local"
    a.hold_s = 600.0  # only "autoscale needed" asks for the instance here
    a.cooldown_s = 0.5
    a.scale_down_hold_s = 3.0
    a.drain_timeout_s = 0.0  # what runs there when it drains resumes elsewhere at once
    a.scale_up_timeout_s = 60.0
    return cfg


def test_a_standby_worker_joins_on_autoscale_needed_serves_and_leaves_after_the_hold(tmp_path):
    cfg = _config()
    c = LocalCluster(cfg, run_dir=tmp_path, standby=standby_sections(cfg, 1, free_ports=True))
    c.start(timeout_s=START_S)
    burst = prompts_for(96, seed=11, lo=180, hi=220)  # ~1250 blocks of prompt KV: more than the pair holds
    burst_tokens = 48
    short_tokens = 24
    try:

        async def go():
            served_by: dict[str, set[str]] = {}
            results: list[tuple[list[int], int, client.GenerationResult]] = []
            async with client.insecure_channel(c.cfg.dispatcher.address) as ch:

                async def one(rid: str, prompt: list[int], max_tokens: int) -> None:
                    def seen(ev) -> None:
                        served_by.setdefault(rid, set()).add(ev.worker_id)

                    r = await client.generate(
                        ch,
                        client.make_request(prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True),
                        timeout=REQUEST_S,
                        on_event=seen,
                    )
                    results.append((prompt, max_tokens, r))

                wave1 = asyncio.gather(*(one(f"burst-{i}", p, burst_tokens) for i, p in enumerate(burst)))
                async with memory_manager(c) as mm:
                    loop = asyncio.get_running_loop()

                    async def until(what: str, cond, timeout: float):
                        end = loop.time() + timeout
                        while True:
                            layout = await mm.GetLayout(common_pb2.Empty(), timeout=10)
                            if cond(layout):
                                return layout
                            assert loop.time() < end, f"{what}: not within {timeout:.0f} s; layout: {layout}"
                            await asyncio.sleep(0.1)

                    def member(layout, wid):
                        return next((w for w in layout.workers if w.worker_id == wid), None)

                    # last_action is set once the activation's reply is back: the layout may list the worker before
                    joined = await until(
                        "the standby worker joined and serves, and the autoscaler recorded the scale-up",
                        lambda lo: (
                            (w := member(lo, STANDBY)) is not None
                            and w.joined
                            and w.serving
                            and lo.autoscale.last_action.startswith("scale_up 1 (autoscale needed")
                        ),
                        JOIN_S,
                    )
                    assert STANDBY not in {s.worker_id for s in joined.standby}

                    # the dispatcher routes to it: new requests until one of them ran there (the pair head is the
                    # freest unit while the burst has passed and the group is not restored yet)
                    n = 0
                    end = loop.time() + ROUTE_S
                    while not any(STANDBY in w for w in served_by.values()):
                        assert loop.time() < end, f"no request reached {STANDBY}: {served_by}"
                        batch = [one(f"wave2-{n + k}", p, short_tokens) for k, p in enumerate(prompts_for(6, seed=100 + n))]
                        n += len(batch)
                        await asyncio.gather(*batch)
                    await wave1

                    # requests keep arriving while the cluster calms down and the worker is given back
                    stop = asyncio.Event()

                    async def lane(i: int) -> None:  # one request after another: three are always in flight
                        k = 0
                        while not stop.is_set():
                            (p,) = prompts_for(1, seed=1000 * i + k)
                            await one(f"trickle-{i}-{k}", p, short_tokens)
                            k += 1

                    lanes = [asyncio.create_task(lane(i)) for i in range(3)]
                    try:
                        left = await until(  # the drain's reply (last_action) comes after the worker left the layout
                            "the worker drained back to standby, and the autoscaler recorded the scale-down",
                            lambda lo: (
                                member(lo, STANDBY) is None
                                and STANDBY in {s.worker_id for s in lo.standby}
                                and lo.autoscale.last_action.startswith(f"scale_down {STANDBY}")
                            ),
                            DRAIN_S,
                        )
                    finally:
                        stop.set()
                    await asyncio.gather(*lanes)
            return left, served_by, results

        left, served_by, results = run(go(), timeout=SCENARIO_S)
    finally:
        c.stop()
    assert not left.autoscale.last_error, left.autoscale  # cleared by the scale-down that succeeded
    assert [w.worker_id for w in left.workers] == ["worker-0", "worker-1"]
    assert any(STANDBY in w for w in served_by.values())
    assert len(results) >= len(burst) + 1
    for _, max_tokens, r in results:
        assert (len(r.token_ids), r.finish_reason) == (max_tokens, "length"), r
    # The reference (a dense forward in this process: up to a second per request on a busy 2-core machine) for every
    # request the drain moved off the worker that joined and left, and three that ran there alone (test_drop.py checks
    # what a drop moves).
    on_standby = [x for x in results if STANDBY in served_by[x[2].request_id]]
    assert on_standby
    moved = [x for x in on_standby if len(served_by[x[2].request_id]) > 1]
    for prompt, max_tokens, r in moved + [x for x in on_standby if x not in moved][:3]:
        check_all([prompt], [r], max_tokens)
