"""The co-serving mode switch (engine.coserving): ConServe and the two baselines `kunserve bench coserve` runs it
against (ConServe §6). "non-preemptive" must schedule a mix of online and offline requests exactly as the class-blind
scheduler schedules the same requests all online; "preemptive" keeps Algorithm 1's order and offline-first
preemption but admits offline work greedily (so online arrivals preempt it by recompute); the worker gives both
baselines the fixed budget and no layer-wise preemption, whatever engine.budget and safepoint_layers say."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch_scheduler_classes import CON, BlindScheduler, HostSwapper, ids, mk
from test_scheduler import advance

from kunserve.services.worker.build import layerwise_every, make_token_budget
from kunserve.shared.config import ConfigError, config_from_dict, validate
from kunserve.shared.engine.kv_blocks import BlockAllocator, blocks_needed
from kunserve.shared.policy.batch_scheduler import COSERVING_MODES, FixedTokenBudget, Scheduler, SchedulerConfig
from kunserve.shared.policy.costmodel import KunServeCostModel
from kunserve.shared.policy.token_budget import SLOTokenBudget
from kunserve.shared.profile_files import Profile, device_signature


@settings(max_examples=120, deadline=None)
@given(reqs=st.lists(st.tuples(st.booleans(), st.integers(1, 60), st.integers(1, 10), st.integers(0, 20)),
                     min_size=1, max_size=10),
       bs=st.sampled_from([1, 4, 8]), slack=st.integers(0, 20), cap=st.sampled_from([3, 16, 64]),
       max_seqs=st.sampled_from([2, 64]), chunk=st.sampled_from([0, 5]),
       preemption=st.sampled_from(["recompute", "swap", "none"]))
def test_non_preemptive_is_the_class_blind_schedule(reqs, bs, slack, cap, max_seqs, chunk, preemption):
    largest = max(blocks_needed(n + m - 1, bs) for _, n, m, _ in reqs)
    base = dict(max_num_batched_tokens=cap, max_num_seqs=max_seqs, max_prefill_chunk=chunk, preemption=preemption,
                offline_free_watermark=0.3)
    pair = []
    for cls, cfg, classes in ((Scheduler, SchedulerConfig(**base, coserving="non-preemptive"), True),
                              (BlindScheduler, SchedulerConfig(**base), False)):
        alloc = BlockAllocator(largest + slack)
        sch = cls(alloc, bs, cfg, FixedTokenBudget(cap))
        sch.swapper = HostSwapper()
        seqs = [mk(f"r{i}", n, m, bs, float(i), offline=off and classes) for i, (off, n, m, _) in enumerate(reqs)]
        pair.append((sch, alloc, seqs))
    (new, new_alloc, new_seqs), (old, old_alloc, old_seqs) = pair
    submitted = [s.request for s in new_seqs]
    last = max(a for *_, a in reqs)
    for step in range(5000):
        for i, (*_, a) in enumerate(reqs):
            if a == step:
                new.add(new_seqs[i])
                old.add(old_seqs[i])
        if not (old.running or old.waiting) and step > last:
            break
        a, b = new.schedule(), old.schedule()
        assert ids(a) == ids(b)
        assert [(x.request_id, x.num_computed) for x in new.running] == [(x.request_id, x.num_computed) for x in old.running]
        assert (new.num_preemptions, new_alloc.num_free) == (old.num_preemptions, old_alloc.num_free)
        advance(new, a)
        advance(old, b)
    assert new.num_offline_preemptions == 0
    # the scheduler dropped the class of its own copy only: what the caller submitted keeps it
    assert [r.offline for r in submitted] == [off for off, *_ in reqs]


def _mixed(coserving: str) -> tuple[Scheduler, BlockAllocator]:
    """20 blocks of 4 tokens, a running online request holding 14 (its next decode takes a 15th: 5 stay free, the
    25% offline watermark), and an offline request of 8 tokens (2 blocks) waiting."""
    alloc = BlockAllocator(20)
    s = Scheduler(alloc, 4, SchedulerConfig(max_num_batched_tokens=200, offline_free_watermark=0.25, coserving=coserving))
    s.add(mk("on", 56, max_tokens=8, arrival=0.0))
    advance(s, s.schedule())
    s.add(mk("off", 8, max_tokens=8, arrival=1.0, offline=True))
    return s, alloc


def test_conserve_holds_offline_admission_at_the_watermark_preemptive_admits_greedily():
    conserve, _ = _mixed("conserve")
    assert ids(conserve.schedule()) == [("on", 56, 1)] and [x.request_id for x in conserve.waiting] == ["off"]
    preemptive, alloc = _mixed("preemptive")
    assert ids(preemptive.schedule()) == [("on", 56, 1), ("off", 0, 8)] and alloc.num_free == 3
    advance(preemptive, preemptive.schedule())
    # an online arrival short of memory takes it from the offline request, whose KV is lost (recompute)
    preemptive.add(mk("on-new", 16, max_tokens=2, arrival=2.0))
    chunks = preemptive.schedule()
    off = next(x for x in preemptive.waiting if x.request_id == "off")
    assert ("on-new", 0, 16) in ids(chunks) and off.num_preemptions == 1 and off.num_computed == 0
    assert preemptive.num_offline_preemptions == 1


def test_preemptive_keeps_online_first():
    for mode in ("conserve", "preemptive"):
        s = Scheduler(BlockAllocator(100), 4, SchedulerConfig(max_num_batched_tokens=10, coserving=mode))
        s.add(mk("off", 12, arrival=0.0, offline=True))
        s.add(mk("on", 12, arrival=1.0))
        assert ids(s.schedule()) == [("on", 0, 10)], mode


def test_unknown_mode_is_refused():
    assert COSERVING_MODES == ("conserve", "preemptive", "non-preemptive")
    with pytest.raises(ValueError, match="coserving"):
        SchedulerConfig(coserving="fifo")
    with pytest.raises(ConfigError, match="engine.coserving"):
        validate(config_from_dict({"engine": {"coserving": "vllm"}}))


def _profile() -> Profile:
    return Profile(model="kunserve-tiny", dtype="float32", layers=(0, 4), device=device_signature("cpu", 1),
                   kunserve=KunServeCostModel(1e-7, 1e-4, 1e-3), conserve=CON, fit={}, samples=[])


@pytest.mark.parametrize("mode", COSERVING_MODES)
def test_the_worker_gives_the_baselines_the_fixed_budget_and_no_safepoints(mode):
    cfg = config_from_dict({"engine": {"max_num_batched_tokens": 96, "safepoint_layers": 2, "coserving": mode}})
    validate(cfg)
    budget, why = make_token_budget(cfg, _profile(), "profile p")
    if mode == "conserve":
        assert isinstance(budget, SLOTokenBudget) and layerwise_every(cfg) == 2
    else:
        assert budget == FixedTokenBudget(96) and mode in why and layerwise_every(cfg) == 0
