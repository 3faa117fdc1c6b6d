"""The coordinated, non-blocking drop (KunServe §4.2) on real 2-worker clusters.

With `memory_manager.coordinated_exchange` (the default) the members resume at Commit and the moved KV lands
afterwards: only the requests whose KV is still in flight wait, a new request runs at once. A slow link is
injected (KUNSERVE_DELAY: worker-1 waits 4 s before landing what it receives) so that "in flight" lasts long
enough to observe on a loaded machine; the assertions are about order and progress, never about time.
The oracle throughout: every request's greedy tokens equal the reference.
"""

from __future__ import annotations

import asyncio

import pytest
from drop_scenarios import check_all, drop_pair, memory_manager, prompts_for, start_decoding, wait_tokens
from helpers import check_against_reference, make_config, run

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.shared.faults import DELAY_ENV, FAULT_ENV
from kunserve.v1 import memory_manager_pb2

pytestmark = pytest.mark.timeout(300)

LANDING_DELAY_S = 4


def _cluster(tmp_path, env=None, coordinated: bool = True) -> LocalCluster:
    cfg = make_config(2)
    cfg.dispatcher.route_timeout_s = 60.0
    cfg.memory_manager.transition_timeout_s = 20.0
    cfg.memory_manager.coordinated_exchange = coordinated
    c = LocalCluster(cfg, run_dir=tmp_path, env=env)
    c.start(timeout_s=180)
    return c


def test_a_new_request_runs_while_the_moved_requests_wait_for_their_kv(tmp_path):
    c = _cluster(tmp_path, env={DELAY_ENV: f"slow_landing:worker-1:{LANDING_DELAY_S}"})
    prompts = prompts_for(6, seed=11)
    fresh_prompt = prompts_for(1, seed=12)[0]
    max_tokens = 400  # still decoding when the drop's Prepare snapshots them, however busy the machine

    async def go():
        progress: dict = {}
        gen = await start_decoding(c, prompts, max_tokens, progress)
        drop = await drop_pair(c)
        assert drop.completed and drop.kv_in_background, drop
        await asyncio.sleep(0.3)  # tokens made before the drop's Prepare reach the client
        frozen = dict(progress)
        seen_at_first_token: list[dict] = []

        def first(ev) -> None:
            if not seen_at_first_token and ev.token_id >= 0:
                seen_at_first_token.append(dict(progress))

        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            fresh = await client.generate(ch, client.make_request(fresh_prompt, request_id="fresh", max_tokens=8),
                                          timeout=120, on_event=first)
        return drop, frozen, seen_at_first_token[0], fresh, await gen

    try:
        drop, frozen, at_first, fresh, results = run(go(), timeout=280)
        log = (tmp_path / "worker-1.log").read_text()
    finally:
        c.stop()
    assert drop.requests_moved == len(prompts)
    # the new request's first token came while every moved request still waited for its KV to land
    assert at_first == frozen, (at_first, frozen)
    check_against_reference(fresh_prompt, fresh.token_ids, 8)
    check_all(prompts, results, max_tokens)
    assert "delay_injected" in log and "kv_landed" in log


def test_a_member_dying_while_its_kv_is_in_flight_loses_no_request(tmp_path):
    """worker-1 dies when its landing starts (after the commit): the head notices, heals to a whole instance and
    re-prefills the requests it held; every request ends with the reference tokens."""
    c = _cluster(tmp_path, env={FAULT_ENV: "die_in_landing:worker-1"})
    prompts = prompts_for(6, seed=13)
    max_tokens = 400  # still decoding when the drop's Prepare snapshots them, however busy the machine

    async def go():
        progress: dict = {}
        gen = await start_decoding(c, prompts, max_tokens, progress)
        drop = await drop_pair(c)  # completed or rolled back: worker-1 may die before its commit's answer is out
        assert drop.requests_moved == len(prompts) or not drop.completed, drop
        return await gen

    try:
        results = run(go(), timeout=280)
        log = (tmp_path / "worker-1.log").read_text()
    finally:
        c.stop()
    assert "die_in_landing" in log
    check_all(prompts, results, max_tokens)


def test_the_blocking_exchange_still_keeps_every_token_through_drop_and_restore(tmp_path):
    """memory_manager.coordinated_exchange = false (the kunserve-no-coord ablation): Execute lands the whole
    exchange while the members are paused."""
    c = _cluster(tmp_path, coordinated=False)
    prompts = prompts_for(6, seed=14)
    max_tokens = 400  # still decoding when the drop's Prepare snapshots them, however busy the machine (and however
    # many attempts the drop needs: a drop rolled back under load is tried again at the next epoch)

    async def go():
        progress: dict = {}
        gen = await start_decoding(c, prompts, max_tokens, progress)
        drop = await drop_pair(c)
        assert drop.completed and not drop.kv_in_background and drop.requests_moved == len(prompts), drop
        await wait_tokens(progress, 2, 2, gen, since=dict(progress))
        async with memory_manager(c) as mm:
            restore = await mm.Restore(memory_manager_pb2.RestoreRequest(), timeout=120)
        assert restore.completed and not restore.kv_in_background, restore
        return await gen

    try:
        results = run(go(), timeout=280)
    finally:
        c.stop()
    check_all(prompts, results, max_tokens)
