"""EngineLoop: the engine on its own thread; submit / abort / stop from other threads; events by callback.
Every wait is bounded by an event with a timeout, never a sleep-and-hope."""

from __future__ import annotations

import threading
import time

import pytest
from engine_testing import one_torch_thread, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop, EngineStopped
from kunserve.shared.model.architecture import TINY_CONFIG

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
TIMEOUT = 30.0


class Collector:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, ev: TokenEvent) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(ev)
        if ev.finished:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id >= 0]


@pytest.fixture
def loop():
    lp = EngineLoop(Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8), num_threads=1)
    lp.start()
    yield lp
    lp.stop(timeout=TIMEOUT)


def test_generates_on_the_engine_thread(loop):
    expected = Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8).generate(
        [EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=5))])["x"]
    cols = {rid: Collector() for rid in ("a", "b")}
    for rid, col in cols.items():
        loop.submit(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=5)), col)
    for col in cols.values():
        assert col.done.wait(TIMEOUT)
        assert col.tokens == expected and [e.index for e in col.events] == list(range(5))
        assert col.events[-1].finish_reason is FinishReason.LENGTH
        assert col.threads == {"engine"}
    st = loop.stats()
    assert st.generated_tokens_total == 10 and st.kv_blocks_used == 0 and st.num_running == 0


def test_invalid_requests_fail_synchronously(loop):
    with pytest.raises(InvalidRequest) as e:
        loop.submit(EngineRequest("bad", [1], SamplingParams(top_p=0.0)), Collector())
    assert e.value.field == "top_p"
    col = Collector()
    loop.submit(EngineRequest("dup", [1], SamplingParams(max_tokens=200)), col)
    with pytest.raises(InvalidRequest) as e:
        loop.submit(EngineRequest("dup", [1]), Collector())
    assert e.value.field == "request_id"
    assert loop.abort("dup") and col.done.wait(TIMEOUT)


def test_abort_frees_blocks_and_ends_the_stream(loop):
    col = Collector()
    first = threading.Event()
    orig = col.__call__

    def on_event(ev):
        orig(ev)
        first.set()

    loop.submit(EngineRequest("long", list(range(1, 50)), SamplingParams(max_tokens=400, ignore_eos=True)), on_event)
    assert first.wait(TIMEOUT)
    assert loop.abort("long")
    assert col.done.wait(TIMEOUT)
    last = col.events[-1]
    assert last.finish_reason is FinishReason.ABORTED and last.token_id == -1 and last.index == len(col.tokens)
    assert not loop.abort("long") and not loop.abort("never-seen")
    assert loop.engine.allocator.num_used == 0  # freed before the ABORTED event was emitted


def test_stop_aborts_everything_and_rejects_new_work():
    lp = EngineLoop(Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8))
    lp.start()
    cols = [Collector() for _ in range(3)]
    for i, col in enumerate(cols):
        lp.submit(EngineRequest(f"s{i}", [1, 2], SamplingParams(max_tokens=400, ignore_eos=True)), col)
    assert lp.stop(timeout=TIMEOUT)
    for col in cols:
        assert col.done.is_set() and col.events[-1].finish_reason is FinishReason.ABORTED
    assert not lp.running
    with pytest.raises(EngineStopped):
        lp.submit(EngineRequest("late", [1]), Collector())


def test_stop_before_start_answers_submitted_requests():
    lp = EngineLoop(Engine(CFG, weights_for(CFG), num_kv_blocks=8, block_size=8))
    col = Collector()
    lp.submit(EngineRequest("q", [1]), col)
    assert lp.stop() and col.done.is_set() and col.events[-1].finish_reason is FinishReason.ABORTED


def test_idle_loop_does_not_spin(loop):
    col = Collector()
    loop.submit(EngineRequest("w", [1], SamplingParams(max_tokens=2)), col)
    assert col.done.wait(TIMEOUT)
    before = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - before < 0.2  # a spinning thread would burn ~0.5 s of CPU


def test_a_failing_callback_does_not_kill_the_engine(loop):
    def bad(ev):
        raise RuntimeError("consumer bug")

    loop.submit(EngineRequest("bad-cb", [1], SamplingParams(max_tokens=3)), bad)
    col = Collector()
    loop.submit(EngineRequest("good", [2], SamplingParams(max_tokens=3)), col)
    assert col.done.wait(TIMEOUT) and loop.running and loop.error is None


def test_stats_count_requests_submitted_but_not_yet_taken_by_the_engine():
    """A report must not miss a request the engine has not picked up yet: the router stops counting a routed request
    once a report taken after the routing arrives, and would otherwise see this worker as still free."""
    from engine_testing import weights_for

    from kunserve.shared.engine.api import EngineRequest, SamplingParams
    from kunserve.shared.engine.engine import Engine
    from kunserve.shared.engine.loop import EngineLoop
    from kunserve.shared.model.architecture import TINY_CONFIG

    loop = EngineLoop(Engine(TINY_CONFIG, weights_for(TINY_CONFIG), num_kv_blocks=32, block_size=8))  # not started
    before = loop.stats()
    loop.submit(EngineRequest("on", list(range(1, 18)), SamplingParams(max_tokens=2), arrival_time=5.0), lambda e: None)
    loop.submit(EngineRequest("off", list(range(1, 9)), SamplingParams(max_tokens=2), offline=True), lambda e: None)
    s = loop.stats()
    assert (s.num_waiting, s.queued_demand_blocks) == (before.num_waiting + 2, before.queued_demand_blocks + 3 + 1)
    assert (s.num_offline_waiting, s.offline_queued_demand_blocks) == (1, 1)
    assert s.oldest_waiting_arrival == s.oldest_online_waiting_arrival == 5.0  # the unstamped offline one is not aged
    loop._apply_commands()  # what the engine thread does at an iteration's start: taken, and still counted
    t = loop.stats()
    assert (t.num_waiting, t.queued_demand_blocks, t.num_offline_waiting) == (s.num_waiting, s.queued_demand_blocks, 1)
    loop.stop()
