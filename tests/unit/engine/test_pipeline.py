"""A pipeline group in one process (shared/engine/local_link.py): the live head path
(`Engine._step_pipelined`) and stage path (`Engine.forward_stage`), each later stage an Engine on its own
thread. Greedy tokens identical to the whole instance's and to the dense reference's for 2, 3 and 4
stages whatever the split; per-stage busy / idle accounting; a failing stage breaks the group instead of
hanging it. Plus the busy / idle clock itself, on a fake clock. No assertion on wall-clock speed."""

from __future__ import annotations

import functools
import random
import time

import pytest
from engine_testing import check_greedy, one_torch_thread, weights_for  # noqa: F401 - fixture
from oracle import compare_greedy

from kunserve.shared.engine.accounting import BusyIdleClock
from kunserve.shared.engine.api import EngineRequest, InvalidRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, GroupBroken, SchedulerConfig
from kunserve.shared.engine.local_link import LocalPipelineLink, local_group
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.policy.planner import balanced_split

CFG = TINY_CONFIG  # 4 layers: up to 4 stages
BS = 8
SCHED = SchedulerConfig(max_num_batched_tokens=64)
SPLITS = [[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 3), (3, 4)],
          [(0, 1), (1, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)], [(0, 2), (2, 3), (3, 4)],
          balanced_split(4, 4)]


def requests(seed: int, n: int = 10) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"r{i}", [rng.randrange(258, CFG.vocab_size) for _ in range(rng.randint(1, 300))],
                          SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)) for i in range(n)]


def clone(reqs: list[EngineRequest]) -> list[EngineRequest]:
    return [EngineRequest(r.request_id, list(r.prompt_token_ids), r.sampling) for r in reqs]


@functools.lru_cache(maxsize=1)
def whole(seed: int) -> dict[str, list[int]]:
    """The whole instance's tokens, checked against the dense reference once (every split must equal them)."""
    w = weights_for(CFG)
    reqs = requests(seed)
    got = Engine(CFG, w, num_kv_blocks=400, block_size=BS, scheduler_config=SCHED).generate(clone(reqs))
    assert all(len(got[r.request_id]) == r.sampling.max_tokens for r in reqs)
    ties = sum(check_greedy(CFG, w, r.prompt_token_ids, got[r.request_id]) for r in reqs)
    assert ties <= 1
    for r in reqs[:2]:  # the step-by-step greedy reference (oracle.compare_greedy)
        ref, margins = reference_greedy(CFG, w, r.prompt_token_ids, r.sampling.max_tokens)
        compare_greedy(got[r.request_id], ref, margins)
    return got


@pytest.mark.parametrize("ranges", SPLITS, ids=lambda r: "|".join(f"{a}-{b}" for a, b in r))
def test_group_tokens_equal_the_whole_instance_and_the_reference(ranges):
    w = weights_for(CFG)
    reqs = requests(seed=7)
    head, link = local_group(CFG, w, ranges, num_kv_blocks=400, block_size=BS, scheduler_config=SCHED)
    sent = []
    send = link.send
    link.send = lambda batch, hidden: (sent.append(batch), send(batch, hidden))[1]
    with link:
        t0 = time.perf_counter()
        got = head.generate(clone(reqs))
        window = time.perf_counter() - t0
    assert not link.running  # close() stopped the stage threads
    assert got == whole(7)  # identical tokens; whole() holds them against the reference
    # what was run: microbatches mixing requests, several in flight, every stage over its own layers
    assert any(len(b.decodes) + len(b.prefills) > 1 for b in sent)
    assert [(s.runner.start, s.runner.end) for s in [head, *link.stages]] == [tuple(r) for r in ranges]
    assert link.max_inflight == len(ranges)
    st = head.stats()
    assert st.generated_tokens_total == sum(r.sampling.max_tokens for r in reqs)
    assert st.prompt_tokens_total == sum(len(r.prompt_token_ids) for r in reqs)
    assert head.allocator.num_used == 0 and not head.scheduler.pinned and not head.has_work()
    for eng in [head, *link.stages]:  # per-stage accounting
        b = eng.busy_idle()
        assert b.busy_s > 0 and b.idle_s >= 0 and 0 <= b.bubble_ratio < 1
        assert b.busy_s <= window + 1e-3
    for stage in link.stages:
        assert not stage.seqs and stage.allocator.num_used == 0  # a later stage owns no requests


def test_group_equals_the_single_instance_engine_on_a_tight_cache_and_frees_its_kv():
    """Tight KV: requests wait for earlier ones and get preempted while microbatches are in flight."""
    w = weights_for(CFG)
    reqs = requests(seed=99, n=8)
    largest = max(-(-(len(r.prompt_token_ids) + r.sampling.max_tokens) // BS) for r in reqs)
    single = Engine(CFG, w, num_kv_blocks=largest + 4, block_size=BS, scheduler_config=SCHED)
    want = single.generate(clone(reqs))
    assert single.scheduler.num_preemptions > 0
    head, link = local_group(CFG, w, balanced_split(4, 2), num_kv_blocks=largest + 4, block_size=BS,
                             scheduler_config=SCHED)
    with link:
        got = head.generate(clone(reqs))
    diverged = 0
    for r in reqs:
        if got[r.request_id] != want[r.request_id]:
            diverged += 1
            check_greedy(CFG, w, r.prompt_token_ids, got[r.request_id])  # only a near-tie may differ
    assert diverged <= 1
    assert head.allocator.num_used == 0  # every request's blocks are back


def test_sampled_requests_and_stop_tokens():
    w = weights_for(CFG)
    rng = random.Random(3)
    prompt = [rng.randrange(258, CFG.vocab_size) for _ in range(40)]
    head, link = local_group(CFG, w, balanced_split(4, 2), num_kv_blocks=64, block_size=BS)
    with link:
        greedy = head.generate([EngineRequest("g", prompt, SamplingParams(max_tokens=6, ignore_eos=True))])["g"]
        stop = greedy[2]
        got = head.generate([
            EngineRequest("stop", prompt, SamplingParams(max_tokens=6, stop_token_ids=(stop,), ignore_eos=True)),
            EngineRequest("s1", prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=7)),
            EngineRequest("s2", prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=7)),
        ])
    assert got["stop"] == greedy[: greedy.index(stop) + 1]
    assert got["s1"] == got["s2"]  # a seed gives the same tokens whatever shares the batch


def test_bad_requests_and_configs_are_rejected():
    w = weights_for(CFG)
    head, link = local_group(CFG, w, balanced_split(4, 2), num_kv_blocks=4, block_size=BS)
    with link:
        with pytest.raises(InvalidRequest, match="KV"):
            head.add_request(EngineRequest("big", [1] * 40, SamplingParams(max_tokens=2)))
        head.add_request(EngineRequest("a", [1], SamplingParams(max_tokens=1)))
        with pytest.raises(InvalidRequest, match="already running"):
            head.add_request(EngineRequest("a", [1], SamplingParams(max_tokens=1)))
    for ranges in ([(0, 1), (2, 4)], [(0, 4)], [(1, 2), (2, 4)], [(0, 2), (2, 3)]):
        with pytest.raises(ValueError):
            local_group(CFG, w, ranges, num_kv_blocks=4)
    with pytest.raises(ValueError):
        balanced_split(4, 5)
    assert balanced_split(7, 3) == [(0, 3), (3, 5), (5, 7)]


def test_a_failing_stage_breaks_the_group_instead_of_hanging():
    head, link = local_group(CFG, weights_for(CFG), balanced_split(4, 3), num_kv_blocks=400, block_size=BS,
                             timeout_s=60)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    link.stages[0].runner.forward = broken
    with link:
        for r in requests(seed=5, n=3):
            head.add_request(r)
        with pytest.raises(GroupBroken, match="stage 1.*boom"):
            while head.has_work():
                head.step()
        with pytest.raises(GroupBroken, match="stage 1.*boom"):  # and stays broken
            link.result(0, block=True)
    assert not link.running  # stage threads were stopped


def test_a_link_needs_contiguous_stages_ending_at_the_last_layer():
    w = weights_for(CFG)
    _, link = local_group(CFG, w, [(0, 1), (1, 2), (2, 4)], num_kv_blocks=4)
    with link:
        mid, last = link.stages
        with pytest.raises(ValueError, match="last layer"):
            LocalPipelineLink([mid])
        with pytest.raises(ValueError, match="contiguous"):
            LocalPipelineLink([last, mid])
        with pytest.raises(ValueError):
            LocalPipelineLink([])


def test_the_head_waiting_on_its_stages_is_bubble_and_a_stage_running_is_busy():
    head, link = local_group(CFG, weights_for(CFG), balanced_split(4, 2), num_kv_blocks=64, block_size=BS)
    stage = link.stages[0]
    forward = stage.runner.forward
    calls = []

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(0.05)
        return forward(*args, **kwargs)

    stage.runner.forward = slow
    with link:
        head.generate([EngineRequest("a", list(range(300, 320)), SamplingParams(max_tokens=4, ignore_eos=True))])
    slept = 0.05 * len(calls)
    assert len(calls) == 4
    assert stage.busy_idle().busy_s >= slept
    h = head.busy_idle()
    assert h.bubble_s >= 0.9 * slept and h.busy_s < h.bubble_s  # one request: the head mostly waits


def test_busy_idle_clock_on_a_fake_clock():
    now = [0.0]
    clock = BusyIdleClock(lambda: now[0])
    now[0] = 5.0  # idle with nothing queued: idle, not bubble
    clock.work_waiting()
    now[0] = 6.0  # queued for 1 s before the stage started: bubble
    clock.begin_busy()
    now[0] = 8.0
    clock.end_busy(still_waiting=True)  # more work queued: the gap until the next batch is bubble
    now[0] = 8.5
    clock.begin_busy()
    now[0] = 9.5
    clock.end_busy(still_waiting=False)
    now[0] = 20.0
    s = clock.snapshot()
    assert (s.busy_s, s.bubble_s, s.idle_s) == (3.0, 1.5, 17.0)
    assert s.bubble_ratio == pytest.approx(1.5 / 4.5) and s.utilization == pytest.approx(3 / 20)
    clock.work_waiting()
    clock.work_waiting()  # idempotent
    now[0] = 21.0
    assert clock.snapshot().bubble_s == 2.5  # a wait in progress counts up to now
    clock.idle_turn(still_waiting=False)
    now[0] = 30.0
    assert clock.snapshot().bubble_s == 2.5
