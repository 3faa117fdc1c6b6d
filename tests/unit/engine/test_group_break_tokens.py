"""A pipeline group that breaks while the head collects its microbatches' results: the tokens sampled from the
results taken before the break are delivered, each once, and the requests go on after them (a token the head
sampled but never reported would be skipped, since the heal's recompute continues from `generated`).

The break is forced at the one interleaving where it matters: the head has just taken one microbatch's logits
while another is still in flight, so the same `_collect` call meets the break on its next result."""

from __future__ import annotations

import random
import threading

from engine_testing import one_torch_thread, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine.api import EngineRequest, FinishReason, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine, GroupBroken, SchedulerConfig
from kunserve.shared.engine.local_link import LocalPipelineLink, local_group
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.architecture import TINY_CONFIG

CFG = TINY_CONFIG
BS = 8
SCHED = SchedulerConfig(max_num_batched_tokens=64)
MAX_TOKENS = 12
TIMEOUT = 60.0


def requests() -> list[EngineRequest]:
    rng = random.Random(3)
    return [
        EngineRequest(
            f"r{i}",
            [rng.randrange(258, CFG.vocab_size) for _ in range(rng.randint(5, 40))],
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        for i in range(6)
    ]


def break_after_a_result(head: Engine, link: LocalPipelineLink, after_tokens: int) -> threading.Event:
    """Once the head has generated `after_tokens` tokens, the group is lost right after the head takes a
    microbatch that samples tokens while another is in flight. Returns the event set when it broke."""
    real = link.result
    broke = threading.Event()

    def result(mb_id: int, block: bool):
        inflight = head._inflight
        armed = (
            not broke.is_set()
            and len(inflight) >= 2
            and bool(inflight[0].sampled)
            and sum(len(s.generated) for s in head.seqs.values()) >= after_tokens
        )
        if not armed:
            return real(mb_id, block)
        out = real(mb_id, True)
        link._results.lost("group member stage-1 lost")
        broke.set()
        return out

    link.result = result  # type: ignore[method-assign]
    return broke


class Stream:
    """A request's events as its client sees them: each index once, in order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.final: TokenEvent | None = None
        self.done = threading.Event()
        self.wrong: list[str] = []  # recorded, not raised: the engine loop swallows a callback's exception

    def __call__(self, ev: TokenEvent) -> None:
        if self.final is not None:
            self.wrong.append(f"an event after the last one: {ev}")
        if ev.index != len(self.tokens):
            self.wrong.append(f"index {ev.index} after {len(self.tokens)} tokens: {ev}")
        if ev.token_id >= 0:
            self.tokens.append(ev.token_id)
        if ev.finished:
            self.final = ev
            self.done.set()


def test_tokens_sampled_before_the_break_are_raised_with_it_and_the_recompute_goes_on_after_them():
    w = weights_for(CFG)
    reqs = requests()
    expected = Engine(CFG, w, num_kv_blocks=400, block_size=BS, scheduler_config=SCHED).generate(
        [EngineRequest(r.request_id, list(r.prompt_token_ids), r.sampling) for r in reqs]
    )
    streams = {r.request_id: Stream() for r in reqs}

    def deliver(events: list[TokenEvent]) -> None:
        for ev in events:
            streams[ev.request_id](ev)

    head, link = local_group(CFG, w, [(0, 2), (2, 4)], num_kv_blocks=400, block_size=BS, scheduler_config=SCHED)
    broke = break_after_a_result(head, link, after_tokens=len(reqs) + 2)
    with link:
        for r in reqs:
            head.add_request(r)
        try:
            while head.has_work():
                deliver(head.step())
        except GroupBroken as exc:
            assert broke.is_set() and exc.events, "the break came right after a result the same step took"
            deliver(exc.events)
        assert broke.is_set(), "the group never broke"
        head.leave_group()  # what the heal does: every request a recompute preemption
        snaps = head.snapshot()
    assert snaps, "requests were left to recompute"
    for s in snaps:
        assert s.generated == streams[s.request.request_id].tokens, "every generated token was delivered"
    whole = Engine(CFG, w, num_kv_blocks=400, block_size=BS, scheduler_config=SCHED)
    whole.become_whole(snaps, recompute=True)
    while whole.has_work():
        deliver(whole.step())
    assert all(not s.wrong for s in streams.values()), [s.wrong for s in streams.values()]
    assert {rid: s.tokens for rid, s in streams.items()} == expected
    assert all(s.final is not None and s.final.finish_reason is FinishReason.LENGTH for s in streams.values())


def test_the_engine_loop_delivers_them_before_it_stops():
    """Without a heal the loop stops: each stream gets the tokens sampled before the break, then ABORTED at
    the index that follows them."""
    w = weights_for(CFG)
    reqs = requests()
    head, link = local_group(CFG, w, [(0, 2), (2, 4)], num_kv_blocks=400, block_size=BS, scheduler_config=SCHED)
    broke = break_after_a_result(head, link, after_tokens=len(reqs) + 2)
    streams = {r.request_id: Stream() for r in reqs}
    loop = EngineLoop(head)
    with link:
        loop.start()
        try:
            for r in reqs:
                loop.submit(r, streams[r.request_id])
            for rid, s in streams.items():
                assert s.done.wait(TIMEOUT), f"{rid} never ended"
        finally:
            loop.stop(timeout=TIMEOUT)
    assert broke.is_set() and isinstance(loop.error, GroupBroken)
    assert all(not s.wrong for s in streams.values()), [s.wrong for s in streams.values()]
    aborted = [s for s in streams.values() if s.final is not None and s.final.finish_reason is FinishReason.ABORTED]
    assert aborted and all(s.tokens for s in aborted), "the break came mid-decode"
