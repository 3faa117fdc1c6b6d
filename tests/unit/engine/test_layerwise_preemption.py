"""Layer-wise preemption (ConServe §4.3, Algorithm 2) in a whole instance, and a group head budgeting its
microbatches under its group's measured step.

An online arrival during a forward pass that carries offline rows raises the engine's flag (from the arrival
check, as a worker's submit does); the next safepoint drops the offline rows and the iteration ends for the
online ones. The arrival is injected at a chosen layer by wrapping that layer's first projection (the only
way to make "arrives while layer 1 runs" deterministic). Oracle: every request's greedy tokens equal the dense
reference's (and the offline ones' equal their uninterrupted run), whatever was cut."""

from __future__ import annotations

import random

from engine_testing import check_greedy, clone, one_torch_thread, weights_for  # noqa: F401 - fixture
from test_group_engine import make_group

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.policy.costmodel import ConServeLatencyModel
from kunserve.shared.policy.measured_latency import MeasuredLatencyModel
from kunserve.shared.policy.token_budget import SLOTokenBudget

CFG = TINY_CONFIG  # 4 layers
SCHED = SchedulerConfig(max_num_batched_tokens=64)


def _requests(seed: int = 5) -> tuple[list[EngineRequest], list[EngineRequest]]:
    rng = random.Random(seed)
    offline = [EngineRequest(f"off{i}", [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(40, 90))],
                             SamplingParams(max_tokens=12, ignore_eos=True), offline=True) for i in range(3)]
    online = [EngineRequest(f"on{i}", [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(10, 30))],
                            SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(2)]
    return offline, online


class ArrivalAt:
    """Calls engine.online_arrived while layer `layer` computes, on chosen calls of the engine's forward pass."""

    def __init__(self, engine: Engine, layer: int) -> None:
        self.engine = engine
        self.armed = False
        self.raised = 0
        lin = engine.runner.layers[layer].qkv
        self.inner = lin.__call__

        def wrapped(x):
            if self.armed:
                self.armed = False
                self.raised += engine.online_arrived(16)
            return self.inner(x)
        engine.runner.layers[layer].qkv = wrapped  # type: ignore[assignment]


def test_an_online_arrival_cuts_the_offline_rows_at_the_next_safepoint_and_every_token_stays_the_reference():
    w = weights_for(CFG)
    offline, online = _requests()
    alone = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED).generate([clone(r) for r in offline])
    eng = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED)
    eng.enable_layerwise_preemption(every=2, ttft_s=0.5)
    arrival = ArrivalAt(eng, layer=1)  # safepoints before layer 2: an arrival in layer 1 cuts there
    got: dict[str, list[int]] = {r.request_id: [] for r in offline + online}
    for r in offline:
        eng.add_request(clone(r))
    for ev in eng.step():  # offline prompts only: nothing to cut for
        got[ev.request_id].append(ev.token_id)
    before = {rid: s.num_computed for rid, s in eng.seqs.items()}
    eng.add_request(clone(online[0]))
    arrival.armed = True
    for ev in eng.step():
        got[ev.request_id].append(ev.token_id)
    assert arrival.raised == 1 and eng.layerwise_preemptions == 1
    assert {rid: eng.seqs[rid].num_computed for rid in before} == before, "the cut offline rows advanced"
    assert eng.seqs["on0"].num_computed > 0, "the online request ran in the cut iteration"
    assert not eng.preempt_offline.is_set() or eng.in_flight is None
    step = 0
    while eng.has_work():
        if step == 3:
            eng.add_request(clone(online[1]))
            arrival.armed = True
        for ev in eng.step():
            got[ev.request_id].append(ev.token_id)
        step += 1
        assert step < 500
    assert eng.layerwise_preemptions >= 2 and eng.allocator.num_used == 0
    for r in offline:
        tie = check_greedy(CFG, w, r.prompt_token_ids, got[r.request_id])
        assert len(got[r.request_id]) == 12 and (tie or got[r.request_id] == alone[r.request_id])
    for r in online:
        assert len(got[r.request_id]) == 8
        check_greedy(CFG, w, r.prompt_token_ids, got[r.request_id])


def test_online_only_iterations_are_never_cut_and_an_unmet_prediction_does_not_cut():
    w = weights_for(CFG)
    offline, online = _requests(seed=9)
    eng = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED)
    eng.enable_layerwise_preemption(every=1, ttft_s=0.5)
    arrival = ArrivalAt(eng, layer=0)
    eng.add_request(clone(online[0]))
    arrival.armed = True
    eng.step()
    assert arrival.raised == 0 and eng.layerwise_preemptions == 0, "no offline rows: nothing to cut"
    # with a latency model that says the rest of the iteration plus the prefill fits the SLO, nothing is cut
    fast = SLOTokenBudget(ConServeLatencyModel(1e-9, 0.0, 0.0, 0.0, 1e-6), tbt_s=1.0)
    eng2 = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED, budget=fast)
    eng2.enable_layerwise_preemption(every=1, ttft_s=0.5)
    arrival2 = ArrivalAt(eng2, layer=1)
    eng2.add_request(clone(offline[0]))
    arrival2.armed = True
    eng2.step()
    assert arrival2.raised == 0 and eng2.layerwise_preemptions == 0


def test_a_group_head_budgets_under_its_measured_step_and_gets_its_own_budget_back():
    model = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)
    sched = SchedulerConfig(max_num_batched_tokens=40)
    eng, link = make_group(2, 2, sched=sched)
    assert not isinstance(eng.scheduler.budget, SLOTokenBudget), "a fixed budget stays fixed in a group"
    whole = Engine(CFG, weights_for(CFG), num_kv_blocks=48, block_size=8, scheduler_config=sched,
                   budget=SLOTokenBudget(model, tbt_s=0.2))
    whole.use_weights(weights_for(CFG), (0, 2))
    whole.become_head(link, 48, [])
    budget = whole.scheduler.budget
    assert isinstance(budget, SLOTokenBudget) and isinstance(budget.model, MeasuredLatencyModel)
    group = budget.model
    assert group.assumed_scale == 2 and group.scale == 2.0 and group.base == model
    whole.add_request(EngineRequest("r", list(range(1, 30)), SamplingParams(max_tokens=6, ignore_eos=True)))
    while whole.has_work():
        whole.step()
    assert group.observations >= 6 and group.scale != 2.0, "the measured round trips replaced the assumption"
    whole.leave_group()
    back = whole.scheduler.budget
    assert isinstance(back, SLOTokenBudget) and back.tbt_s == 0.2 and isinstance(back.model, MeasuredLatencyModel)
    assert back.model.base == model and back.model.assumed_scale == 1 and back.model.observations == 0


def test_a_whole_instance_budgets_under_its_measured_iterations():
    """A profile that predicts 10x too little: once measured, the budget admits what really fits the SLO."""
    truth = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)
    optimistic = ConServeLatencyModel(k1=truth.k1 / 10, k2=truth.k2 / 10, k3=0.0, k4=truth.k4 / 10, k5=truth.k5 / 10)
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=96, block_size=8, scheduler_config=SCHED,
                 budget=SLOTokenBudget(optimistic, tbt_s=0.05))
    latency = eng.scheduler.budget.model
    assert isinstance(latency, MeasuredLatencyModel) and latency.scale == 1.0
    offline, _ = _requests()
    eng.generate([clone(r) for r in offline])
    assert latency.observations > 0 and latency.scale > 1.0, "slower than the optimistic profile says"


def test_an_arrival_between_the_schedule_and_the_pass_is_checked_once_the_pass_starts():
    """The worker submits a request (its add waits for the engine's next look at its queue) and then runs the
    arrival check. Arriving after the engine took its queue and scheduled, but before the forward pass began,
    nothing is in flight yet: the request is not in this iteration and would wait for all of it. The check is
    run again as the pass starts, and cuts it."""
    w = weights_for(CFG)
    offline, online = _requests(seed=11)
    eng = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED)
    eng.enable_layerwise_preemption(every=2, ttft_s=0.5)
    for r in offline:
        eng.add_request(clone(r))
    eng.step()
    arrived: list[bool] = []
    eng.on_schedule = lambda chunks: arrived.append(eng.online_arrived(16, "on0")) if not arrived else None
    eng.step()
    assert arrived == [False] and eng.layerwise_preemptions == 1, "the late arrival did not cut the pass"
    eng.on_schedule = None

    # announced between iterations with its add already taken: it is in the next iteration, which is not cut for it
    eng.add_request(clone(online[0]))
    assert not eng.online_arrived(16, "on0")
    eng.step()
    assert eng.layerwise_preemptions == 1 and eng.seqs["on0"].num_computed > 0
    got: dict[str, list[int]] = {}
    while eng.has_work():
        for ev in eng.step():
            got.setdefault(ev.request_id, []).append(ev.token_id)
    assert eng.allocator.num_used == 0


def test_the_arrival_check_counts_the_online_prompts_queued_ahead_of_the_arrival():
    """Algorithm 2 predicts the prefill of the online requests that wait (Q_on), not only the new one's: a long
    online prompt still queued behind the pass plus the arrival misses the TTFT SLO, though the arrival alone
    would not. Per-token cost 1 ms: 64 tokens in flight, 568 online prompt tokens queued, 16 arriving; TTFT 0.5 s.
    The arrival comes in the first pass, before any measurement rescales the profile."""
    w = weights_for(CFG)
    per_token = ConServeLatencyModel(k1=1e-3, k2=0.0, k3=0.0, k4=0.0, k5=0.0)
    sched = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=32)
    rng = random.Random(12)
    long_online = EngineRequest("on-long", [rng.randrange(CFG.vocab_size) for _ in range(600)],
                                SamplingParams(max_tokens=2, ignore_eos=True))
    off = EngineRequest("off", [rng.randrange(CFG.vocab_size) for _ in range(60)],
                        SamplingParams(max_tokens=2, ignore_eos=True), offline=True)
    for queued, cut in ((True, 1), (False, 0)):
        eng = Engine(CFG, w, num_kv_blocks=128, block_size=8, scheduler_config=sched,
                     budget=SLOTokenBudget(per_token, tbt_s=10.0, max_tokens=64))
        eng.enable_layerwise_preemption(every=2, ttft_s=0.5)
        if queued:
            eng.add_request(clone(long_online))
        eng.add_request(clone(off))
        arrival = ArrivalAt(eng, layer=1)
        arrival.armed = True
        eng.step()
        assert eng.layerwise_preemptions == cut and arrival.raised == cut, f"queued online prompt: {queued}"


def test_an_arrival_checked_against_the_previous_pass_never_cuts_the_next_one():
    """An arrival that took the lock during pass 1 may raise the flag only for pass 1: the engine lowers it as pass 2
    is published, under the same lock, so pass 2 keeps its offline rows. The arrival is held inside its check (under
    the lock) until the engine thread waits for the lock, the moment at which a flag lowered outside it would be
    raised again too late."""
    import threading

    class WatchedLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.contended = threading.Event()

        def __enter__(self) -> WatchedLock:
            if not self.lock.acquire(blocking=False):
                self.contended.set()
                self.lock.acquire()
            return self

        def __exit__(self, *exc) -> None:
            self.lock.release()

    w = weights_for(CFG)
    offline, _ = _requests(seed=13)
    eng = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED)  # no latency model: any check cuts
    eng.enable_layerwise_preemption(every=2, ttft_s=0.5)
    lock = WatchedLock()
    eng._arrivals = lock  # type: ignore[assignment]
    inside, go = threading.Event(), threading.Event()
    check = eng._check_arrival

    def held_check(*args, **kw):
        inside.set()
        assert go.wait(30)
        return check(*args, **kw)

    eng._check_arrival = held_check  # type: ignore[method-assign]
    arrival = threading.Thread(target=eng.online_arrived, args=(16,))
    lin = eng.runner.layers[1].qkv
    fired = []

    def at_layer_1(x):
        if not fired:  # pass 1: an arrival takes the lock and is checked against it
            fired.append(True)
            arrival.start()
            assert inside.wait(30)
        return lin(x)

    eng.runner.layers[1].qkv = at_layer_1  # type: ignore[assignment]
    for r in offline:
        eng.add_request(clone(r))
    steps = threading.Thread(target=lambda: (eng.step(), eng.step()))
    steps.start()
    assert lock.contended.wait(30), "the engine thread never waited for the arrival lock"
    go.set()
    steps.join(60)
    arrival.join(30)
    assert not steps.is_alive() and fired
    assert eng.layerwise_preemptions == 0, "pass 2 lost its offline rows to an arrival checked against pass 1"


def test_a_late_arrival_counts_the_time_it_has_waited():
    """Announced before the pass began (its add not taken), it has waited since: a pass predicted short cuts for it
    once that wait plus the prefill exceeds the TTFT SLO. Here it waited 1 s against an SLO of 0.5 s."""
    w = weights_for(CFG)
    offline, _ = _requests(seed=14)
    fast = SLOTokenBudget(ConServeLatencyModel(1e-9, 0.0, 0.0, 0.0, 1e-6), tbt_s=1.0)
    eng = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED, budget=fast)
    eng.enable_layerwise_preemption(every=2, ttft_s=0.5)
    for r in offline:
        eng.add_request(clone(r))

    def announced_a_second_ago(chunks) -> None:
        eng.on_schedule = None
        assert not eng.online_arrived(16, "on0")
        when, n = eng._unseen_arrivals["on0"]
        eng._unseen_arrivals["on0"] = (when - 1.0, n)

    eng.on_schedule = announced_a_second_ago
    eng.step()
    assert eng.layerwise_preemptions == 1


def test_a_request_that_left_before_the_pass_is_not_a_late_arrival():
    """Announced between iterations, then taken and aborted before the next schedule: it waits for nothing, so the
    next pass (with offline rows, under no latency model: any late arrival would cut it) is not cut."""
    w = weights_for(CFG)
    offline, online = _requests(seed=15)
    eng = Engine(CFG, w, num_kv_blocks=96, block_size=8, scheduler_config=SCHED)
    eng.enable_layerwise_preemption(every=2, ttft_s=0.5)
    for r in offline:
        eng.add_request(clone(r))
    eng.step()
    assert not eng.online_arrived(16, online[0].request_id)  # nothing in flight: its add not taken yet
    eng.add_request(clone(online[0]))
    assert eng.abort(online[0].request_id)
    eng.step()
    assert eng.layerwise_preemptions == 0
