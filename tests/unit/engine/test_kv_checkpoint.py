"""Incremental KV checkpointing of offline requests (ConServe §4.4, shared/engine/kv_checkpoint.py) on the embedded
CPU model, where the mechanism is real: a host region of its own and copies on a background thread.

Oracle: an offline request preempted by checkpoint and resumed (its KV copied back at re-admission, or prefetched
in the background) produces exactly the tokens it produces uninterrupted, and the reference's; and it computes no
token twice (the tokens the scheduler hands the model per request equal an uninterrupted run's). Then the host
region's accounting, the fallback to recompute when it is full, and no leak when requests leave with copies
pending."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from engine_testing import check_greedy, clone, one_torch_thread, weights_for  # noqa: F401 - fixture

from kunserve.services.worker.build import checkpoint_bytes
from kunserve.shared.config import ConfigError, config_from_dict, validate
from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.kv_checkpoint import Checkpoint, CheckpointStats, KVCheckpointStore, _Job
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import load_model_source

CFG = TINY_CONFIG  # 4 layers, 2 KV heads of 64
BS = 8
SCHED = SchedulerConfig(max_num_batched_tokens=128)
BLOCK_BYTES = CFG.num_layers * 2 * CFG.num_kv_heads * BS * CFG.head_dim * 4  # one block of every layer, float32


def offline(n: int, seed: int, max_tokens: int = 16, lo: int = 30, hi: int = 60) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"off{i}", [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(lo, hi))],
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), offline=True) for i in range(n)]


def engine(num_blocks: int = 96, checkpoint_blocks: int = 256, device: str = "cpu") -> Engine:
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=num_blocks, block_size=BS, scheduler_config=SCHED, device=device)
    eng.enable_kv_checkpoint(checkpoint_blocks * BLOCK_BYTES)
    return eng


def uninterrupted(reqs: list[EngineRequest]) -> dict[str, list[int]]:
    return Engine(CFG, weights_for(CFG), num_kv_blocks=96, block_size=BS, scheduler_config=SCHED).generate(
        [clone(r) for r in reqs])


class Computed:
    """Counts the tokens the scheduler hands the model per request (a recomputed prefix counts twice)."""

    def __init__(self, eng: Engine) -> None:
        self.tokens: dict[str, int] = {}
        inner = eng.scheduler.schedule

        def schedule(*args, **kwargs):
            chunks = inner(*args, **kwargs)
            for c in chunks:
                self.tokens[c.seq.request_id] = self.tokens.get(c.seq.request_id, 0) + c.num_tokens
            return chunks
        eng.scheduler.schedule = schedule  # type: ignore[method-assign]


def step(eng: Engine, out: dict[str, list[int]], n: int = 1) -> None:
    for _ in range(n):
        for ev in eng.step():
            out.setdefault(ev.request_id, []).append(ev.token_id)


def finish(eng: Engine, out: dict[str, list[int]]) -> dict[str, list[int]]:
    while eng.has_work():
        step(eng, out)
    return out


def settled(eng: Engine) -> CheckpointStats:
    """The counters once every copy is done (the slots of finished requests go back when their last copy is)."""
    store = eng.kv_checkpoint
    assert store is not None
    store.drain()
    return store.stats()


def assert_oracle(reqs: list[EngineRequest], got: dict[str, list[int]], computed: Computed) -> None:
    """The tokens of an uninterrupted run and the reference's, with no token computed twice."""
    want = uninterrupted(reqs)
    for r in reqs:
        assert got[r.request_id] == want[r.request_id], r.request_id
        assert not check_greedy(CFG, weights_for(CFG), r.prompt_token_ids, got[r.request_id])
        assert computed.tokens[r.request_id] == len(r.prompt_token_ids) + r.sampling.max_tokens - 1, r.request_id


def test_the_checkpoint_holds_exactly_the_device_kv_of_every_full_block_of_offline_requests_only():
    reqs = offline(3, seed=1) + [EngineRequest("on", list(range(100, 140)), SamplingParams(max_tokens=12, ignore_eos=True))]
    eng = engine()
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 7)
    store = eng.kv_checkpoint
    assert store is not None
    store.drain()
    layers = CFG.num_layers
    for rid, seq in eng.seqs.items():
        got = store.host_copy(rid)
        if not seq.request.offline:
            assert got is None, "online requests are never checkpointed"
            continue
        n = seq.num_computed // BS
        assert got is not None and got.shape == (n, layers, 2, CFG.num_kv_heads, BS, CFG.head_dim)
        dev = eng.export_blocks(seq.block_table.ids[:n], 0, layers)  # layer-major rows (layer, block)
        assert torch.equal(got, dev.view(layers, n, *dev.shape[1:]).transpose(0, 1))
    st = eng.checkpoint_stats()
    assert st is not None and st.blocks_checkpointed == st.host_blocks_used > 0


@pytest.mark.parametrize("back", ["at-readmission", "prefetch"])
def test_preempted_by_checkpoint_an_offline_request_resumes_with_its_uninterrupted_tokens_and_recomputes_nothing(back):
    """Preempted mid-decode (a partial last block): its blocks are freed at once and its KV waits in host memory.
    Re-admitted straight away, its KV is copied back at swap-in; re-admitted only once memory frees (an online
    request took it meanwhile), it is prefetched in the background first."""
    reqs = offline(2, seed=2)
    eng = engine(num_blocks=24)
    computed = Computed(eng)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 4)
    victim = eng.seqs["off1"]
    assert victim.num_computed % BS, "the test wants a partial last block"
    used = eng.allocator.num_used
    held = len(victim.block_table)
    if back == "at-readmission":
        eng.scheduler.preempt(victim)
        assert isinstance(victim.swapped, Checkpoint) and eng.allocator.num_used == used - held
    else:  # an online prompt that needs off1's blocks: the scheduler preempts the newest offline request for it
        online = EngineRequest("on", list(range(7, 7 + (24 - used + held - 2) * BS)), SamplingParams(max_tokens=3,
                               ignore_eos=True))
        eng.add_request(online)
        step(eng, out)
        assert isinstance(victim.swapped, Checkpoint), "the online prompt preempted off1 by checkpoint"
    finish(eng, out)
    st = settled(eng)
    assert st is not None and st.preemptions == 1 and st.fallbacks == 0 and st.tail_blocks == 1
    if back == "at-readmission":
        assert st.restores == 1 and st.prefetches == 0
    else:
        assert st.prefetches == 1 and st.restores == 0
        assert not check_greedy(CFG, weights_for(CFG), list(range(7, 7 + len(online.prompt_token_ids))), out["on"])
    assert eng.scheduler.num_checkpointed_out == 1
    assert_oracle(reqs, out, computed)
    assert eng.allocator.num_used == 0 and st.host_blocks_used == 0
    assert eng.stats().checkpoint_preemptions == 1


@pytest.mark.parametrize("lag_s", [0.0, 0.02])
def test_many_preemptions_by_checkpoint_under_online_bursts_keep_every_token(lag_s):
    """A tight cache where online bursts keep preempting offline requests (some several times): every preemption
    goes by checkpoint, nothing is recomputed and every token is the uninterrupted run's. With a copy thread that
    lags (lag_s per copy), requests are also preempted again while their KV is still coming back."""
    reqs = offline(4, seed=3, max_tokens=20)
    rng = random.Random(4)
    eng = engine(num_blocks=40)
    if lag_s:
        store = eng.kv_checkpoint
        assert store is not None
        inner = store._run_job

        def lagging(job):
            time.sleep(lag_s)
            inner(job)
        store._run_job = lagging  # type: ignore[method-assign]
    computed = Computed(eng)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    online = []
    for i in range(40):
        if i % 4 == 2:
            req = EngineRequest(f"on{i}", [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(80, 140))],
                                SamplingParams(max_tokens=8, ignore_eos=True))
            online.append(req)
            eng.add_request(clone(req))
        step(eng, out)
    finish(eng, out)
    st = settled(eng)
    assert st is not None and st.preemptions >= 5 and st.fallbacks == 0 and st.prefetches >= 2
    # each checkpoint comes back once: prefetched, copied at re-admission, or left on host by a preemption that came
    # before its prefetch started; no online request was preempted (offline ones always yield first)
    assert st.prefetches + st.restores + st.cancelled == st.preemptions == eng.scheduler.num_preemptions
    assert_oracle(reqs, out, computed)
    for r in online:
        check_greedy(CFG, weights_for(CFG), r.prompt_token_ids, out[r.request_id])
    assert eng.allocator.num_used == 0 and st.host_blocks_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_copies_run_on_their_own_stream_into_pinned_host_memory_and_keep_the_tokens():
    reqs = offline(4, seed=3, max_tokens=20)
    rng = random.Random(4)
    eng = engine(num_blocks=40, device="cuda")
    computed = Computed(eng)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    for i in range(40):
        if i % 4 == 2:
            eng.add_request(EngineRequest(f"on{i}", [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(80, 140))],
                                          SamplingParams(max_tokens=8, ignore_eos=True)))
        step(eng, out)
    finish(eng, out)
    st = settled(eng)
    assert st is not None and st.preemptions >= 3 and st.fallbacks == 0 and st.prefetches >= 1
    for r in reqs:
        assert computed.tokens[r.request_id] == len(r.prompt_token_ids) + r.sampling.max_tokens - 1
        check_greedy(CFG, weights_for(CFG), r.prompt_token_ids, out[r.request_id])
    store = eng.kv_checkpoint
    assert store is not None and all(c is None or c.is_pinned() for c in store._chunks)
    assert eng.allocator.num_used == 0 and st.host_blocks_used == 0


def test_the_host_region_is_bounded_allocated_lazily_and_reused():
    eng = engine(checkpoint_blocks=40)
    store = eng.kv_checkpoint
    assert store is not None and store.block_bytes == BLOCK_BYTES and store.capacity == 40
    assert eng.checkpoint_stats().host_bytes_allocated == 0, "nothing is allocated before an offline block completes"
    reqs = offline(3, seed=5)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 5)
    store.drain()
    st = eng.checkpoint_stats()
    full = sum(s.num_computed // BS for s in eng.seqs.values())
    assert st.host_blocks_used == st.blocks_checkpointed == full
    assert st.bytes_checkpointed == full * BLOCK_BYTES
    assert 0 < st.host_bytes_allocated <= store.capacity * BLOCK_BYTES
    assert eng.stats().checkpoint_host_blocks == full and eng.stats().checkpointed_blocks_total == full
    finish(eng, out)
    store.drain()
    allocated = eng.checkpoint_stats().host_bytes_allocated
    assert eng.checkpoint_stats().host_blocks_used == 0, "finished requests give their slots back"
    eng.generate([clone(r) for r in offline(3, seed=6)])
    store.drain()
    assert eng.checkpoint_stats().host_bytes_allocated == allocated, "the slots are reused, not allocated again"
    assert eng.checkpoint_stats().host_blocks_used == 0


def test_a_full_host_region_takes_the_oldest_requests_checkpoint_which_falls_back_to_recompute_with_the_same_tokens():
    """Room for 6 blocks: both requests' first 3 fit; when both complete a 4th, the older one finds no room (it falls
    behind) and the newer takes the older's slots. Preempting both, the older goes by recompute, the newer by
    checkpoint; the tokens are the uninterrupted ones either way."""
    reqs = offline(2, seed=7, max_tokens=12, lo=24, hi=24)
    eng = engine(checkpoint_blocks=6)
    computed = Computed(eng)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 10)  # 24 prompt tokens + 9 decodes: 33 tokens with KV, 4 full blocks each
    store = eng.kv_checkpoint
    assert store is not None
    store.drain()
    assert store.host_copy("off0") is None and store.host_copy("off1").shape[0] == 4
    st = eng.checkpoint_stats()
    assert st.evictions == 1 and st.behind >= 1 and st.host_blocks_used == 4
    old, new = eng.seqs["off0"], eng.seqs["off1"]
    eng.scheduler.preempt(new)
    eng.scheduler.preempt(old)
    assert isinstance(new.swapped, Checkpoint) and old.swapped is None and old.num_computed == 0
    finish(eng, out)
    st = settled(eng)
    assert st.preemptions == 1 and st.fallbacks == 1
    want = uninterrupted(reqs)
    assert out == want
    assert computed.tokens["off1"] == 24 + 12 - 1, "the checkpointed one recomputes nothing"
    assert computed.tokens["off0"] > 24 + 12 - 1, "the other re-prefills"
    assert eng.allocator.num_used == 0 and st.host_blocks_used == 0


class Gate:
    """Holds the copy thread before each device->host copy until opened."""

    def __init__(self, store: KVCheckpointStore) -> None:
        self.open = threading.Event()
        self.waiting = threading.Event()
        inner = store._run_job

        def run_job(job):
            if not job.inbound:
                self.waiting.set()
                self.open.wait()
            inner(job)
        store._run_job = run_job  # type: ignore[method-assign]


def test_preempted_again_before_its_prefetch_started_a_request_keeps_its_checkpoint_whole_on_host():
    """The copy thread is busy when memory frees and the request's prefetch is queued: it runs again (holding its new
    blocks) but computes nothing until its KV is there. Preempted meanwhile, the queued copy is dropped and its
    blocks are freed at once; its checkpoint is still whole, and it resumes from it later."""
    reqs = offline(2, seed=2)
    eng = engine(num_blocks=24)
    computed = Computed(eng)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 4)
    victim = eng.seqs["off1"]
    eng.scheduler.preempt(victim)
    store = eng.kv_checkpoint
    assert store is not None and isinstance(victim.swapped, Checkpoint)
    gate = Gate(store)
    store._submit(_Job(False, [], None))  # keeps the copy thread busy
    assert gate.waiting.wait(10)
    eng._checkpoint_iteration([], eng.scheduler.num_preemptions)  # what an iteration ends with: memory is free
    assert "off1" in eng._prefetching and victim in eng.scheduler.running and len(victim.block_table)
    before = eng.allocator.num_used
    eng.scheduler.preempt(victim)
    assert "off1" not in eng._prefetching and victim.swapped is not None and victim.swapped.on_host
    assert eng.allocator.num_used < before and not victim.block_table
    gate.open.set()
    finish(eng, out)
    st = settled(eng)
    assert st.cancelled == 1 and st.preemptions == 2 and st.tail_blocks == 1 and st.fallbacks == 0
    assert_oracle(reqs, out, computed)
    assert eng.allocator.num_used == 0 and st.host_blocks_used == 0


def test_requests_that_leave_with_copies_pending_leak_no_block_and_no_slot():
    """Aborted with their device->host copies still queued, or finished meanwhile, or aborted while their KV is
    being prefetched back: every device block and every host slot is free at the end."""
    reqs = offline(3, seed=8, max_tokens=6)
    eng = engine()  # room for all: no preemption (it would wait for the held copies)
    store = eng.kv_checkpoint
    assert store is not None
    gate = Gate(store)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 3)
    assert gate.waiting.wait(10) and store._jobs, "copies are pending"
    assert eng.abort("off0") and eng.allocator.num_used > 0
    while eng.has_work():  # off1 and off2 finish while their copies still wait
        step(eng, out)
    assert eng.allocator.num_used == 0
    assert eng.checkpoint_stats().host_blocks_used > 0, "slots with a pending copy are not reused yet"
    gate.open.set()
    store.drain()
    assert eng.checkpoint_stats().host_blocks_used == 0

    # aborted while its checkpoint is being prefetched back (the abort waits for the copy, then frees the blocks)
    reqs = offline(2, seed=9)
    eng = engine(num_blocks=24)
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 4)
    used = eng.allocator.num_used
    held = len(eng.seqs["off1"].block_table)
    eng.add_request(EngineRequest("on", list(range(7, 7 + (24 - used + held - 2) * BS)),
                                  SamplingParams(max_tokens=3, ignore_eos=True)))
    while "off1" not in eng._prefetching:
        step(eng, out)
        assert "on" in eng.seqs or "off1" in eng._prefetching, "off1 must be prefetched once the online request left"
    assert eng.abort("off1")
    finish(eng, out)
    assert eng.allocator.num_used == 0 and not eng._prefetching
    eng.kv_checkpoint.drain()
    assert eng.checkpoint_stats().host_blocks_used == 0


def test_checkpointing_in_the_memory_pool_keeps_the_tokens():
    """The pool's KV (read from the copy thread, written back by prefetch) with online bursts preempting offline
    requests by checkpoint."""
    src = load_model_source(None)
    inst = PooledInstance(src, layer_range=(0, 4), pool_bytes=24 * (1 << 20), page_size=256 * 1024, block_size=16,
                          backend="host", scheduler_config=SchedulerConfig(max_num_batched_tokens=128))
    try:
        eng = inst.engine
        eng.enable_kv_checkpoint(1 << 22)
        blocks = eng.allocator.num_blocks
        reqs = [EngineRequest(f"off{i}", [(13 * i + j) % 4000 + 4 for j in range(blocks * 16 // 4 - 20)],
                              SamplingParams(max_tokens=10, ignore_eos=True), offline=True) for i in range(3)]
        out: dict[str, list[int]] = {}
        for r in reqs:
            eng.add_request(clone(r))
        step(eng, out, 4)
        eng.add_request(EngineRequest("on", list(range(5, 5 + blocks * 16 // 2)), SamplingParams(max_tokens=2)))
        finish(eng, out)
        assert eng.checkpoint_stats().preemptions >= 1
        alone = Engine(src.config, src.load_weights(), num_kv_blocks=blocks, block_size=16,
                       scheduler_config=SchedulerConfig(max_num_batched_tokens=128)).generate([clone(r) for r in reqs])
        assert {r.request_id: out[r.request_id] for r in reqs} == alone
    finally:
        inst.close()


def test_the_config_key_bounds_the_host_region_and_only_conserve_checkpoints():
    cfg = config_from_dict({"engine": {"checkpoint_mib": 64}})
    validate(cfg)
    assert checkpoint_bytes(cfg) == 64 << 20
    assert checkpoint_bytes(config_from_dict({"engine": {"checkpoint_mib": 64, "coserving": "preemptive"}})) == 0
    assert config_from_dict({}).engine.checkpoint_mib > 0, "on by default"
    with pytest.raises(ConfigError, match="engine.checkpoint_mib"):
        validate(config_from_dict({"engine": {"checkpoint_mib": -1}}))
    eng = engine(checkpoint_blocks=0)
    assert eng.kv_checkpoint is None and eng.scheduler.checkpointer is None and eng.checkpoint_stats() is None


def test_one_iteration_that_fills_the_host_region_across_requests_does_not_hang():
    """Room for 4 blocks; two offline prompts of 3 full blocks each prefill in the same iteration. The older one is
    given 3 slots first, then the newer one takes them (older checkpoints yield to newer ones): the older one's copies
    had not been queued yet, so they are withdrawn rather than waited for. The iteration ends, the newer request holds
    the checkpoint and the tokens are the uninterrupted ones."""
    reqs = offline(2, seed=7, max_tokens=4, lo=24, hi=24)
    eng = engine(checkpoint_blocks=4)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    stepped = threading.Thread(target=step, args=(eng, out), daemon=True)
    stepped.start()
    stepped.join(30)
    assert not stepped.is_alive(), "the first iteration's checkpointing waits for copies that were never queued"
    store = eng.kv_checkpoint
    assert store is not None
    store.drain()
    assert store.host_copy("off0") is None and store.host_copy("off1").shape[0] == 3
    st = eng.checkpoint_stats()
    assert st.evictions == 1 and st.host_blocks_used == 3 and st.blocks_checkpointed == 3
    finish(eng, out)
    assert out == uninterrupted(reqs)
    assert eng.allocator.num_used == 0 and settled(eng).host_blocks_used == 0


@pytest.mark.parametrize("then", ["preempted-again", "adopted"])
def test_a_failed_prefetch_makes_its_request_re_prefill_and_never_swaps_or_computes_on_its_blocks(then):
    """The host->device copy of a prefetch raises: the request's new blocks hold garbage. Whether the engine finds
    that when it adopts the prefetch, or the request is preempted again first (with preemption = "swap", which
    would copy its device KV to host), it re-prefills from scratch and its tokens are the uninterrupted ones."""
    reqs = offline(2, seed=2)
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=24, block_size=BS,
                 scheduler_config=SchedulerConfig(max_num_batched_tokens=128, preemption="swap"))
    eng.enable_kv_checkpoint(256 * BLOCK_BYTES)
    computed = Computed(eng)
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(clone(r))
    step(eng, out, 4)
    victim = eng.seqs["off1"]
    eng.scheduler.preempt(victim)
    store = eng.kv_checkpoint
    assert store is not None and isinstance(victim.swapped, Checkpoint)
    inner = store._run_job

    def failing(job):
        if job.inbound:
            raise RuntimeError("injected: the host->device copy failed")
        inner(job)
    store._run_job = failing  # type: ignore[method-assign]
    eng._checkpoint_iteration([], eng.scheduler.num_preemptions)  # memory is free: its prefetch is queued
    assert "off1" in eng._prefetching
    store.drain()
    assert victim.swapped.failed
    if then == "preempted-again":
        eng.scheduler.preempt(victim)
        assert victim.swapped is None, "its garbage KV was swapped out"
        assert victim.num_computed == 0 and victim.swapped_tokens == 0
    else:
        prefilled = computed.tokens["off1"]
        step(eng, out)
        assert "off1" not in eng._prefetching and victim.swapped is None and victim.swapped_tokens == 0
        assert victim.num_computed == computed.tokens["off1"] - prefilled, "it computes from its first token again"
    store._run_job = inner  # type: ignore[method-assign]
    finish(eng, out)
    assert out == uninterrupted(reqs)
    assert computed.tokens["off1"] > len(reqs[1].prompt_token_ids) + reqs[1].sampling.max_tokens - 1, "it re-prefilled"
    assert eng.allocator.num_used == 0 and settled(eng).host_blocks_used == 0
