"""The engine as the head of a pipeline group (KunServe §3): the head runs layers [0, k) and ships each
microbatch through a PipelineLink; later stages run the rest over their own KV caches. Here the link is an
in-process fake that runs the later stages itself, lazily (only when the head asks for a result) and with
random interleaving across stages, always FIFO per stage, so several microbatches really are in flight.

Oracle: the group's greedy tokens equal the single whole engine's (and the dense reference's) for 2 and 3
stages and 1..3 microbatches in flight, with waiting, preemption and chunked prefill. Plus: abort while in
flight, snapshot / clear / install (same engine, and a fresh one with renumbered blocks), NotServing,
GroupBroken, and the scheduler's pins."""

from __future__ import annotations

import collections
import functools
import random

import pytest
import torch
from engine_testing import MID_DECODE_REQS, clone, finish, one_torch_thread, run_until_mid_decode, weights_for  # noqa: F401 - fixture
from oracle import compare_greedy

from kunserve.shared.engine import stage_wire
from kunserve.shared.engine.api import EngineRequest, FinishReason, SamplingParams, SeqSnapshot, TokenEvent
from kunserve.shared.engine.engine import Engine, GroupBroken, NotServing, SchedulerConfig
from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockTable
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.reference import reference_scores
from kunserve.shared.policy.batch_scheduler import Scheduler, Sequence
from kunserve.shared.policy.costmodel import KunServeCostModel
from kunserve.shared.policy.microbatch import DecodeSplit, MicrobatchFormer, token_microbatches

CFG = TINY_CONFIG  # 4 layers
BS = 8
NUM_BLOCKS = 48  # the largest request (200 + 40 - 1 tokens) needs 30: tight, so requests wait and get preempted
SCHED = SchedulerConfig(max_num_batched_tokens=40)
STAGE_RANGES = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}


class FakeLink:
    """Runs stages 1.. of the group in-process. send() only queues the wire message; result() does a random
    amount of queued stage work (a random stage each time, FIFO within a stage), and for block=True as much
    as that microbatch needs. Checks the head's contract: results asked oldest first, never twice."""

    def __init__(self, weights, ranges: list[tuple[int, int]], max_inflight: int, seed: int = 0,
                 num_blocks: int = NUM_BLOCKS, max_spontaneous: int = 2, block_size: int = BS) -> None:
        self.max_inflight = max_inflight
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.max_spontaneous = max_spontaneous  # stage work done per result() call before looking
        self.stages = []
        for layers in ranges[1:]:
            stage = Engine(CFG, weights, num_kv_blocks=num_blocks, block_size=block_size, layer_range=layers)
            stage.become_stage()
            self.stages.append(stage)
        self.queues: list[collections.deque] = [collections.deque() for _ in self.stages]
        self.done: dict[int, torch.Tensor] = {}
        self.outstanding: collections.deque[int] = collections.deque()  # sent, result not taken yet
        self.max_outstanding = 0
        self.sent = 0
        self.out_of_order_stage_work = 0  # a later microbatch ran on stage i before an earlier one finished

    def send(self, batch, hidden) -> None:
        assert len(self.outstanding) < self.max_inflight, "the head exceeded max_inflight"
        self.queues[0].append(stage_wire.encode(batch, hidden))
        self.outstanding.append(batch.mb_id)
        self.sent += 1
        self.max_outstanding = max(self.max_outstanding, len(self.outstanding))

    def _work_one(self) -> bool:
        ready = [i for i, q in enumerate(self.queues) if q]
        if not ready:
            return False
        i = self.rng.choice(ready)
        if any(self.queues[j] for j in range(i + 1, len(self.queues))):
            self.out_of_order_stage_work += 1
        batch, hidden = stage_wire.decode(self.queues[i].popleft(), CFG.torch_dtype)
        stage = self.stages[i]
        out = stage.forward_stage(batch, hidden)
        if stage.runner.is_last:
            self.done[batch.mb_id] = out.float()
        else:
            self.queues[i + 1].append(stage_wire.encode(batch, out))
        return True

    def result(self, mb_id: int, block: bool):
        assert self.outstanding and self.outstanding[0] == mb_id, (mb_id, list(self.outstanding))
        for _ in range(self.rng.randint(0, self.max_spontaneous)):
            self._work_one()
        while block and mb_id not in self.done:
            assert self._work_one(), f"microbatch {mb_id} was never sent"
        if mb_id not in self.done:
            return None
        self.outstanding.popleft()
        return self.done.pop(mb_id)


def make_whole(num_blocks: int = NUM_BLOCKS, sched: SchedulerConfig = SCHED, block_size: int = BS) -> Engine:
    return Engine(CFG, weights_for(CFG), num_kv_blocks=num_blocks, block_size=block_size, scheduler_config=sched)


def make_group(stages: int, max_inflight: int, seed: int = 0, num_blocks: int = NUM_BLOCKS,
               sched: SchedulerConfig = SCHED, block_size: int = BS) -> tuple[Engine, FakeLink]:
    w = weights_for(CFG)
    ranges = STAGE_RANGES[stages]
    eng = make_whole(num_blocks, sched, block_size)
    eng.use_weights(w, ranges[0])  # the head holds layers [0, k) only
    link = FakeLink(w, ranges, max_inflight, seed, num_blocks, block_size=block_size)
    eng.become_head(link, num_blocks, [])
    return eng, link


def mixed_requests(seed: int = 11, n: int = 16) -> list[EngineRequest]:
    rng = random.Random(seed)
    lens = [5, 200] + [rng.randint(5, 40) if i % 2 else rng.randint(40, 200) for i in range(n - 2)]
    outs = [40, 1] + [rng.randint(1, 40) for _ in range(n - 2)]
    return [EngineRequest(f"r{i}", [rng.randrange(258, CFG.vocab_size) for _ in range(lens[i])],
                          SamplingParams(max_tokens=outs[i], ignore_eos=True)) for i in range(n)]


def drive(eng: Engine, reqs: list[EngineRequest], arrivals: list[int] | None = None,
          max_steps: int = 20_000) -> dict[str, list[int]]:
    """Add requests at their arrival step, step until done; checks every request's event stream."""
    arrivals = arrivals or [0] * len(reqs)
    events: dict[str, list[TokenEvent]] = {r.request_id: [] for r in reqs}
    step = added = 0
    while added < len(reqs) or eng.has_work():
        while added < len(reqs) and arrivals[added] <= step:
            eng.add_request(clone(reqs[added]))
            added += 1
        for ev in eng.step():
            events[ev.request_id].append(ev)
        step += 1
        assert step < max_steps, "no progress"
    for r in reqs:
        evs = events[r.request_id]
        assert [e.index for e in evs] == list(range(r.sampling.max_tokens))
        assert [e.finish_reason for e in evs] == [FinishReason.NONE] * (len(evs) - 1) + [FinishReason.LENGTH]
    assert eng.allocator.num_used == 0 and not eng.scheduler.pinned and not eng.seqs
    return {rid: [e.token_id for e in evs] for rid, evs in events.items()}


ARRIVALS = [0] * 8 + [2, 3, 5, 8, 13, 21, 34, 55]


@functools.lru_cache(maxsize=1)
def whole_run() -> tuple[dict[str, list[int]], int]:
    eng = make_whole()
    reqs = mixed_requests()
    out = drive(eng, reqs, ARRIVALS)
    w = weights_for(CFG)
    for r in reqs:  # the whole engine against the dense reference (teacher-forced, same oracle as greedy)
        ref, margins = reference_scores(CFG, w, r.prompt_token_ids, out[r.request_id])
        compare_greedy(out[r.request_id], ref, margins)
    return out, eng.scheduler.num_preemptions


@pytest.mark.parametrize("stages,max_inflight", [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)])
def test_group_tokens_equal_the_whole_engine(stages, max_inflight):
    single, single_preemptions = whole_run()
    assert single_preemptions > 0, "the mix must exercise preemption"
    eng, link = make_group(stages, max_inflight, seed=stages * 10 + max_inflight)
    got = drive(eng, mixed_requests(), ARRIVALS)
    assert got == single
    assert link.max_outstanding == max_inflight, "the head keeps max_inflight microbatches in flight"
    assert not link.outstanding and not any(link.queues) and not link.done
    assert eng.scheduler.num_preemptions > 0, "preemption happens in the group too"
    if stages == 3 and max_inflight > 1:
        assert link.out_of_order_stage_work > 0, "stages interleave (a later stage lags behind an earlier one)"
    st = eng.stats()
    assert st.generated_tokens_total == sum(len(v) for v in single.values())
    assert st.prompt_tokens_total == sum(len(r.prompt_token_ids) for r in mixed_requests())


def test_group_with_a_head_of_the_whole_cache_and_chunk_cap():
    """Another geometry: roomy cache, prefill chunks capped at 7 tokens (a chunk may leave one token)."""
    sched = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=7)
    reqs = mixed_requests(seed=5, n=6)
    single = drive(make_whole(200, sched), reqs)
    eng, _ = make_group(2, 2, seed=1, num_blocks=200, sched=sched)
    assert drive(eng, reqs) == single


# -- abort while in flight ----------------------------------------------------------------------------------

def test_abort_while_in_flight_drops_the_result_and_frees_the_blocks():
    rng = random.Random(3)
    reqs = [EngineRequest(f"r{i}", [rng.randrange(258, CFG.vocab_size) for _ in range(n)],
                          SamplingParams(max_tokens=m, ignore_eos=True)) for i, (n, m) in enumerate([(30, 30), (60, 25),
                                                                                                      (45, 10)])]
    alone = drive(make_whole(), [reqs[1]])["r1"]
    eng, link = make_group(2, 2, seed=4)
    eng.add_request(clone(reqs[0]))
    eng.add_request(clone(reqs[1]))
    events: list[TokenEvent] = []
    # run until r0 is decoding with a microbatch in flight
    for _ in range(200):
        events += eng.step()
        r0 = eng.seqs.get("r0")
        if r0 is not None and r0.generated and any(c.seq is r0 for shipped in eng._inflight for c in shipped.chunks):
            break
    else:
        pytest.fail("r0 never decoded with a microbatch in flight")
    used_before = eng.allocator.num_used
    r0_blocks = len(r0.block_table)
    n_r0 = sum(ev.request_id == "r0" for ev in events)
    assert eng.abort("r0") and not eng.abort("r0")
    assert eng.allocator.num_used == used_before - r0_blocks, "an aborted request's blocks are freed at once"
    assert "r0" not in eng.seqs and "r1" in eng.seqs
    assert any(c.seq is r0 for shipped in eng._inflight for c in shipped.chunks), "r0's microbatch is still out"
    eng.add_request(clone(reqs[2]))  # reuses r0's blocks while r0's microbatch may still be in flight
    while eng.has_work():
        events += eng.step()
    assert sum(ev.request_id == "r0" for ev in events) == n_r0, "no event for r0 after the abort"
    assert [ev.token_id for ev in events if ev.request_id == "r1"] == alone
    assert [ev.token_id for ev in events if ev.request_id == "r2"] == drive(make_whole(), [reqs[2]])["r2"]
    assert eng.allocator.num_used == 0 and not eng.scheduler.pinned and not link.outstanding


def test_abort_of_the_only_request_in_flight_lets_the_engine_go_idle():
    eng, link = make_group(2, 2)
    link.max_spontaneous = 0  # nothing runs on the stage until the head blocks for it
    eng.add_request(EngineRequest("a", list(range(300, 340)), SamplingParams(max_tokens=5, ignore_eos=True)))
    eng.step()
    assert eng._inflight and link.outstanding
    assert eng.abort("a")
    assert eng.allocator.num_used == 0
    for _ in range(20):
        if not eng.has_work():
            break
        assert eng.step() == []
    assert not eng.has_work()
    assert not eng.scheduler.pinned and not link.outstanding


# -- how the head forms microbatches: decodes spread over the microbatches in flight, lookahead on a long queue --

def make_recording_group(seed: int = 0, num_blocks: int = 400, sched: SchedulerConfig = SCHED,
                         former: MicrobatchFormer | None = None,
                         split: str = "on") -> tuple[Engine, FakeLink, list[tuple[int, list]]]:
    """A 2-stage group whose head records each microbatch it ships: (decodes, [(request, start, tokens) of its
    prompt chunks]). A decode is a chunk of a request that has generated tokens already. `split`: the head's
    DecodeSplit mode (fixed here: "auto" depends on timing)."""
    w = weights_for(CFG)
    eng = make_whole(num_blocks, sched)
    eng.use_weights(w, STAGE_RANGES[2][0])
    link = FakeLink(w, STAGE_RANGES[2], 2, seed, num_blocks)
    eng.become_head(link, num_blocks, [])
    eng.former = former
    eng.decode_split = DecodeSplit(split)
    shipped: list[tuple[int, list]] = []
    schedule = eng._next_microbatch

    def recording(inflight: int):
        chunks = schedule(inflight)
        if chunks:
            shipped.append((sum(1 for c in chunks if c.seq.generated),
                            [(c.seq.request_id, c.start, c.num_tokens) for c in chunks if not c.seq.generated]))
        return chunks

    eng._next_microbatch = recording
    return eng, link, shipped


COST = KunServeCostModel(alpha=2e-7, beta=1e-4, gamma=1e-3, lam=5e-4)


def long_queue(n: int = 6, seed: int = 21, max_tokens: int = 12) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"q{i}", [rng.randrange(258, CFG.vocab_size) for _ in range(rng.randint(40, 160))],
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


def test_pure_decode_is_split_across_the_microbatches_in_flight_or_not():
    """Six requests decoding in a 2-stage group with two microbatches in flight: each microbatch carries half of
    them (ceil(6 / 2) at most, not all six in one and none in the other), so both stages have a microbatch to
    run; tokens as the whole engine's."""
    reqs = long_queue(max_tokens=16)
    single = drive(make_whole(400), reqs)
    eng, link, shipped = make_recording_group(seed=3)
    assert drive(eng, reqs) == single
    assert max(d for d, _ in shipped) == 3
    pure = [d for d, prompts in shipped if not prompts]
    assert sum(d == 3 for d in pure) >= 6, "while all six decode, each microbatch carries three"
    assert link.max_outstanding == 2
    whole, _, shipped = make_recording_group(seed=3, split="off")  # the stages take turns: all six in one
    assert drive(whole, reqs) == single
    assert max(d for d, _ in shipped) == 6


def test_the_head_ships_the_lookahead_plan_on_a_long_queue():
    """A queue of 6 long prompts (far more than one microbatch's 40 tokens): the head's microbatches carry
    exactly the lookahead formulation's cost-balanced cuts of the whole queue, and the tokens are the whole
    engine's."""
    reqs = long_queue()
    single = drive(make_whole(400), reqs)
    former = MicrobatchFormer(COST)
    eng, link, shipped = make_recording_group(seed=5, former=former)
    for r in reqs:
        eng.add_request(clone(r))
    budget = eng.scheduler.budget.max_tokens_for(0) - eng.scheduler.decode_share(link.max_inflight)
    items = eng.scheduler.prompt_work()
    assert former.uses_lookahead(items, budget)
    plan = former.form(items, budget)
    assert plan != token_microbatches(items, budget), "the cost model cuts the queue differently from chunking"
    events: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while eng.has_work():
        for ev in eng.step():
            events[ev.request_id].append(ev.token_id)
    assert events == single
    prompts = [p for _, p in shipped if p]
    assert prompts[:len(plan)] == [[(c.request_id, c.start, c.num_tokens) for c in mb] for mb in plan]
    assert eng.planned_microbatches == len(plan)


@pytest.mark.parametrize("former", [None, MicrobatchFormer(None), MicrobatchFormer(COST, lookahead=False)],
                         ids=["no-former", "no-cost-model", "lookahead-off"])
def test_the_head_chunks_by_tokens_without_a_cost_model_or_with_lookahead_off(former):
    reqs = long_queue()
    ref, _, ref_shipped = make_recording_group(seed=7)
    got, _, shipped = make_recording_group(seed=7, former=former)
    assert drive(got, reqs) == drive(ref, reqs) == drive(make_whole(400), reqs)
    assert shipped == ref_shipped and got.planned_microbatches == 0
    assert max(sum(n for _, _, n in prompts) + d for d, prompts in shipped) <= 40  # the token budget


def test_a_short_queue_is_chunked_and_a_plan_gone_stale_is_dropped():
    """One microbatch's worth of prompt tokens: nothing to plan. A request aborted mid-plan: the next microbatch
    does not come out as planned, so the head drops the rest of the plan and chunks; tokens unchanged."""
    former = MicrobatchFormer(COST)
    eng, _, _ = make_recording_group(seed=2, former=former)
    short = EngineRequest("s", list(range(300, 330)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert drive(eng, [short]) == drive(make_whole(400), [short]) and eng.planned_microbatches == 0
    reqs = long_queue(seed=4)
    single = drive(make_whole(400), reqs[1:])
    eng, _, _ = make_recording_group(seed=2, former=former)
    for r in reqs:
        eng.add_request(clone(r))
    eng.step()
    assert eng.planned_microbatches == 1 and eng._plan
    eng.abort("q0")
    events: dict[str, list[int]] = {r.request_id: [] for r in reqs[1:]}
    while eng.has_work():
        for ev in eng.step():
            events[ev.request_id].append(ev.token_id)
    assert events == single
    assert not eng._plan and eng.allocator.num_used == 0


# -- snapshot / clear / install -------------------------------------------------------------------------------

SNAP_REQS = MID_DECODE_REQS
SNAP_SCHED = SchedulerConfig(max_num_batched_tokens=48)
SNAP_BLOCKS = 40


@functools.lru_cache(maxsize=1)
def uninterrupted() -> dict[str, list[int]]:
    eng = make_whole(SNAP_BLOCKS, SNAP_SCHED)
    return finish(eng, run_until_mid_decode(eng, SNAP_REQS))


def test_snapshot_clear_install_round_trip():
    eng = make_whole(SNAP_BLOCKS, SNAP_SCHED)
    out = run_until_mid_decode(eng, SNAP_REQS)
    used = eng.allocator.used_ids()
    snaps = eng.snapshot()
    assert [s.request.request_id for s in snaps] == sorted(eng.seqs, key=lambda r: eng.seqs[r].order)
    assert sorted(b for s in snaps for b in s.blocks) == used
    assert next(s for s in snaps if s.request.request_id == "s1").generator_state
    eng.clear()
    assert not eng.seqs and eng.allocator.num_used == 0 and not eng.has_work()
    eng.install(snaps)
    assert eng.allocator.used_ids() == used
    assert eng.snapshot() == snaps
    assert finish(eng, out) == uninterrupted()


def test_install_into_a_fresh_engine_with_renumbered_blocks():
    old = make_whole(SNAP_BLOCKS, SNAP_SCHED)
    out = run_until_mid_decode(old, SNAP_REQS)
    snaps = old.snapshot()
    new = make_whole(SNAP_BLOCKS + 13, SNAP_SCHED)
    # spread the blocks over the new id space, in a scrambled order
    used = old.allocator.used_ids()
    targets = list(range(new.allocator.num_blocks))
    random.Random(1).shuffle(targets)
    mapping = dict(zip(used, targets))
    src = torch.tensor(used, dtype=torch.long)
    dst = torch.tensor([mapping[b] for b in used], dtype=torch.long)
    for layer in range(CFG.num_layers):
        new.kv.layer_cache(layer).index_copy_(0, dst, old.kv.layer_cache(layer).index_select(0, src))
    moved = [SeqSnapshot(s.request, list(s.generated), s.num_computed, [mapping[b] for b in s.blocks],
                         s.generator_state, s.num_preemptions) for s in snaps]
    del old
    new.install(moved)
    assert new.allocator.used_ids() == sorted(mapping.values())
    assert finish(new, out) == uninterrupted()


def test_group_head_drains_then_hands_its_requests_to_a_whole_engine():
    """The restore path in miniature: drain the group's microbatches, snapshot the head, assemble a whole
    instance's KV from the head's layers and the stage's, install there: the tokens go on identically."""
    head, link = make_group(2, 2, seed=9, num_blocks=SNAP_BLOCKS, sched=SNAP_SCHED)
    for r in SNAP_REQS:
        head.add_request(clone(r))
    out: dict[str, list[int]] = {r.request_id: [] for r in SNAP_REQS}
    for _ in range(200):  # until some decode, some wait or prefill, and microbatches are in flight
        for ev in head.step():
            out[ev.request_id].append(ev.token_id)
        seqs = head.seqs.values()
        if (len(head._inflight) == 2 and any(len(s.generated) > 2 for s in seqs)
                and any(not s.generated for s in seqs)):
            break
    else:
        pytest.fail("never reached a mid-decode state with two microbatches in flight")
    for ev in head.drain_inflight():
        out[ev.request_id].append(ev.token_id)
    assert not head._inflight and not head.scheduler.pinned and not link.outstanding
    snaps = head.snapshot()
    whole = make_whole(SNAP_BLOCKS, SNAP_SCHED)
    (stage,) = link.stages
    for layer in range(CFG.num_layers):
        src = head.kv if layer < stage.runner.start else stage.kv
        whole.kv.layer_cache(layer).copy_(src.layer_cache(layer))
    head.clear()
    whole.install(snaps)
    assert finish(whole, out) == uninterrupted()


# -- serving, broken groups, pins -----------------------------------------------------------------------------

def test_not_serving_without_the_last_layer_and_no_link():
    eng = make_whole()
    eng.use_weights(weights_for(CFG), (0, 2))
    req = EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=2))
    assert not eng.serving
    with pytest.raises(NotServing, match=r"\[0, 2\)"):
        eng.add_request(req)
    assert not eng.seqs
    eng.become_head(FakeLink(weights_for(CFG), STAGE_RANGES[2], 1), NUM_BLOCKS, [])
    assert eng.serving
    eng.add_request(req)
    # a later stage never serves, link or not
    eng2 = make_whole()
    eng2.use_weights(weights_for(CFG), (2, 4))
    eng2.link = FakeLink(weights_for(CFG), STAGE_RANGES[2], 1)
    with pytest.raises(NotServing):
        eng2.add_request(req)


class BrokenLink:
    max_inflight = 2

    def __init__(self) -> None:
        self.sent = 0

    def send(self, batch, hidden) -> None:
        self.sent += 1

    def result(self, mb_id: int, block: bool):
        if block:
            raise GroupBroken("stage 1 lost")
        return None


def test_group_broken_propagates_out_of_step_and_preempt_all_recovers():
    eng = make_whole()
    eng.use_weights(weights_for(CFG), (0, 2))
    eng.become_head(link := BrokenLink(), NUM_BLOCKS, [])
    for i in range(3):
        eng.add_request(EngineRequest(f"b{i}", list(range(300 + 10 * i, 330 + 10 * i)),
                                      SamplingParams(max_tokens=4, ignore_eos=True)))
    with pytest.raises(GroupBroken, match="stage 1 lost"):
        for _ in range(10):
            eng.step()
    assert link.sent == 2
    # healing: back to a whole instance, every request re-prefills and finishes with the right tokens
    eng.leave_group()
    assert not eng._inflight and not eng.scheduler.pinned and eng.allocator.num_used == 0
    assert eng.link is None
    eng.use_weights(weights_for(CFG), (0, CFG.num_layers))
    got: dict[str, list[int]] = {f"b{i}": [] for i in range(3)}
    while eng.has_work():
        for ev in eng.step():
            got[ev.request_id].append(ev.token_id)
    want = make_whole().generate([EngineRequest(f"b{i}", list(range(300 + 10 * i, 330 + 10 * i)),
                                                SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(3)])
    assert got == want


def _running(sched: Scheduler, name: str, tokens: int, computed: int, blocks: list[int]) -> Sequence:
    seq = Sequence(EngineRequest(name, list(range(1, tokens + 1)), SamplingParams(max_tokens=50)),
                   list(range(1, tokens + 1)), BlockTable(4, blocks))
    seq.num_computed = computed
    sched.allocator.take(blocks)
    sched._insert(sched.running, seq)
    return seq


def test_scheduler_never_preempts_a_pinned_sequence():
    # decode path: the older request needs a block, the only newer one is pinned -> it preempts itself
    sched = Scheduler(BlockAllocator(3), 4)
    a = _running(sched, "a", 5, 4, [0])  # decoding, its next token needs a second block
    b = _running(sched, "b", 8, 8, [1, 2])  # newer, its completing chunk in flight (token not back yet)
    sched.pin(b)
    chunks = sched.schedule()
    assert b in sched.running and b.block_table.ids == [1, 2] and b.num_preemptions == 0
    assert a not in sched.running and a.num_preemptions == 1 and chunks == []
    # prompt-chunk path: a partly prefilled older request may only take blocks from unpinned newer ones
    sched = Scheduler(BlockAllocator(4), 4, SchedulerConfig(max_num_batched_tokens=64))
    a = _running(sched, "a", 20, 4, [0])
    b = _running(sched, "b", 8, 8, [1, 2])
    c = _running(sched, "c", 8, 4, [3])  # newer, partly prefilled, not in flight
    sched.pin(b)
    sched.pin(b)
    sched.unpin(b)  # pins count: still pinned once
    chunks = sched.schedule()
    assert b in sched.running and b.block_table.ids == [1, 2] and b.num_preemptions == 0
    assert c not in sched.running and c.num_preemptions == 1  # the unpinned newer one made room
    assert [(ch.seq.request_id, ch.start, ch.num_tokens) for ch in chunks] == [("a", 4, 4)]
    sched.unpin(b)
    assert not sched.pinned
    # unpinned, the same situation preempts the newest
    sched = Scheduler(BlockAllocator(3), 4)
    a = _running(sched, "a", 5, 4, [0])
    b = _running(sched, "b", 8, 8, [1, 2])
    chunks = sched.schedule()
    assert b.num_preemptions == 1 and [c.seq for c in chunks] == [a]


def test_scheduler_never_returns_a_chunk_of_a_sequence_it_preempted():
    sched = Scheduler(BlockAllocator(3), 4)
    _running(sched, "a", 6, 5, [0, 1])  # decoding; position 5 fits in its second block
    s = _running(sched, "s", 5, 4, [2])  # newer, prompt chunk [0, 4) in flight, one prompt token left
    sched.pin(s)
    chunks = sched.schedule()
    for ch in chunks:
        assert ch.seq in sched.running and ch.seq.num_computed == ch.start
        assert ch.seq.block_table.capacity >= ch.start + ch.num_tokens


def test_group_with_tiny_blocks_and_a_tight_cache():
    """Block size 4, prefill chunks of at most 5 tokens, a cache barely larger than the largest request: the
    head preempts often while microbatches are in flight."""
    rng = random.Random(18)
    reqs = [EngineRequest(f"r{i}", [rng.randrange(258, CFG.vocab_size) for _ in range(n)],
                          SamplingParams(max_tokens=m, ignore_eos=True)) for i, (n, m) in enumerate([(5, 8), (22, 4),
                                                                                                      (8, 8)])]
    sched = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=5)
    single = drive(make_whole(8, sched, block_size=4), reqs)
    found = False
    for seed in range(6):
        eng, _ = make_group(3, 2, seed=seed, num_blocks=8, sched=sched, block_size=4)
        assert drive(eng, reqs) == single
        found |= eng.scheduler.num_preemptions > 0
    assert found
