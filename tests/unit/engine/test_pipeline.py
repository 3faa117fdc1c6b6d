"""The in-process pipeline executor: greedy tokens identical to the dense reference and to the
single-instance engine for 2, 3 and 4 stages with lookahead on and off; per-stage busy / idle
accounting; a failing stage ends the run with an error instead of a hang. Plus the busy / idle clock
itself, on a fake clock. No assertion on wall-clock speed."""

from __future__ import annotations

import random

import pytest

from engine_testing import check_greedy, one_torch_thread, weights_for  # noqa: F401 - fixture
from kunserve.shared.policy.costmodel import KunServeCostModel
from kunserve.shared.engine.accounting import BusyIdleClock
from kunserve.shared.engine.api import EngineRequest, InvalidRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.pipeline import (PipelineConfig, PipelineError, PipelineExecutor,
                                             balanced_layer_ranges)
from kunserve.shared.model.config import TINY_CONFIG
from kunserve.shared.model.reference import reference_greedy
from oracle import compare_greedy

CFG = TINY_CONFIG  # 4 layers: up to 4 stages
MODEL = KunServeCostModel(alpha=9e-8, beta=8.5e-5, gamma=3.7e-3, lam=3.5e-3)


def requests(seed: int, n: int = 10) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"r{i}", [rng.randrange(258, CFG.vocab_size) for _ in range(rng.randint(1, 300))],
                          SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)) for i in range(n)]


@pytest.mark.parametrize("stages,lookahead", [(2, False), (2, True), (3, True), (4, False), (4, True)])
def test_pipeline_tokens_match_the_reference(stages, lookahead):
    w = weights_for(CFG)
    reqs = requests(seed=stages * 10 + lookahead)
    ex = PipelineExecutor(CFG, w, PipelineConfig(num_stages=stages, lookahead=lookahead, min_tokens=48, chunk_tokens=64,
                                                 num_kv_blocks=400, block_size=8), cost_model=MODEL)
    run = ex.generate(reqs)
    assert all(len(run.tokens[r.request_id]) == r.sampling.max_tokens for r in reqs)
    ties = sum(check_greedy(CFG, w, r.prompt_token_ids, run.tokens[r.request_id]) for r in reqs)
    assert ties <= 1
    # the step-by-step greedy reference (oracle.compare_greedy) for two of them
    for r in reqs[:2]:
        ref, margins = reference_greedy(CFG, w, r.prompt_token_ids, r.sampling.max_tokens)
        compare_greedy(run.tokens[r.request_id], ref, margins)
    # what was run: microbatches mixing requests, lookahead plans when on, per-stage accounting
    assert any(mb["lookahead"] for mb in run.microbatches) == lookahead
    assert any(mb["chunks"] > 1 for mb in run.microbatches)
    assert len(run.stages) == stages and [s.layers for s in run.stages] == balanced_layer_ranges(4, stages)
    for s in run.stages:
        assert s.busy_s > 0 and s.idle_s >= 0 and 0 <= s.bubble_ratio < 1
        assert s.busy_s <= run.window_s + 1e-6
    assert 0 <= run.bubble_ratio < 1 and run.tokens_per_s > 0
    assert run.generated_tokens == sum(r.sampling.max_tokens for r in reqs)
    rep = run.replay()
    assert 0 <= rep["bubble_ratio"] < 1 and rep["makespan_s"] > 0
    assert all(len(mb["stage_times"]) == stages for mb in run.microbatches)
    for mb in run.microbatches:  # a microbatch runs on stage s+1 after stage s
        times = mb["stage_times"]
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(times, times[1:]))


def test_pipeline_equals_the_single_instance_engine_and_frees_its_kv():
    w = weights_for(CFG)
    reqs = requests(seed=99, n=8)
    eng = Engine(CFG, w, num_kv_blocks=400, block_size=8, scheduler_config=SchedulerConfig(max_num_batched_tokens=64))
    single = eng.generate([EngineRequest(r.request_id, list(r.prompt_token_ids), r.sampling) for r in reqs])
    # tight KV: requests must wait for earlier ones to finish (admission is whole-request, FCFS)
    largest = max(-(-(len(r.prompt_token_ids) + r.sampling.max_tokens) // 8) for r in reqs)
    ex = PipelineExecutor(CFG, w, PipelineConfig(num_stages=2, lookahead=True, min_tokens=32, num_kv_blocks=largest + 4,
                                                 block_size=8), cost_model=MODEL)
    run = ex.generate(reqs)
    diverged = 0
    for r in reqs:
        if run.tokens[r.request_id] != single[r.request_id]:
            diverged += 1
            check_greedy(CFG, w, r.prompt_token_ids, run.tokens[r.request_id])  # only a near-tie may differ
    assert diverged <= 1
    assert ex._alloc.num_used == 0  # every request's blocks are back


def test_sampled_requests_and_stop_tokens():
    w = weights_for(CFG)
    rng = random.Random(3)
    prompt = [rng.randrange(258, CFG.vocab_size) for _ in range(40)]
    greedy = PipelineExecutor(CFG, w, PipelineConfig(num_stages=2)).generate(
        [EngineRequest("g", prompt, SamplingParams(max_tokens=6, ignore_eos=True))]).tokens["g"]
    stop = greedy[2]
    run = PipelineExecutor(CFG, w, PipelineConfig(num_stages=2)).generate([
        EngineRequest("stop", prompt, SamplingParams(max_tokens=6, stop_token_ids=(stop,), ignore_eos=True)),
        EngineRequest("s1", prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=7)),
        EngineRequest("s2", prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=7)),
    ])
    assert run.tokens["stop"] == greedy[: greedy.index(stop) + 1]
    assert run.tokens["s1"] == run.tokens["s2"]  # a seed gives the same tokens whatever shares the batch


def test_bad_requests_and_configs_are_rejected():
    w = weights_for(CFG)
    ex = PipelineExecutor(CFG, w, PipelineConfig(num_stages=2, num_kv_blocks=4, block_size=8))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        ex.generate([EngineRequest("big", [1] * 40, SamplingParams(max_tokens=2))])
    with pytest.raises(InvalidRequest, match="twice"):
        ex.generate([EngineRequest("a", [1], SamplingParams(max_tokens=1))] * 2)
    with pytest.raises(ValueError):
        PipelineExecutor(CFG, w, PipelineConfig(num_stages=2, layer_ranges=[(0, 1), (2, 4)]))
    with pytest.raises(ValueError):
        balanced_layer_ranges(4, 5)
    assert balanced_layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]


def test_a_failing_stage_ends_the_run_with_an_error():
    w = weights_for(CFG)
    ex = PipelineExecutor(CFG, w, PipelineConfig(num_stages=3))

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    ex.stages[1].runner.forward = broken
    with pytest.raises(PipelineError, match="stage 1.*boom"):
        ex.generate(requests(seed=5, n=3))
    assert all(st.thread is None for st in ex.stages)  # stage threads were stopped


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
