"""A worker's instance in the unified memory pool: drop and restore layers under a real engine."""

from __future__ import annotations

import hashlib

import pytest
import torch
from oracle import compare_greedy

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.cpu_kernels import from_panels
from kunserve.shared.engine.pooled import InstanceBusy, PooledInstance
from kunserve.shared.memory.errors import KVCapacityError, LayerRangeError
from kunserve.shared.model.pool_placement import fused_source
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.model.weights import load_model_source

MIB = 1 << 20
PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture
def inst():
    src = load_model_source(None)
    i = PooledInstance(src, layer_range=(0, 4), pool_bytes=24 * MIB, page_size=256 * 1024, block_size=16,
                       backend="host")
    yield i
    i.close()


def generate(inst, rid, n=8):
    return inst.engine.generate([EngineRequest(rid, PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))])[rid]


def reference(inst, n=8):
    return reference_greedy(inst.cfg, inst.source.load_weights(), PROMPT, n)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_engine_in_the_pool_matches_the_reference(inst):
    ref, margins = reference(inst)
    compare_greedy(generate(inst, "a"), ref, margins)
    # weights are views of pool pages, not copies: on a CPU in float32 the linear layers' panels
    q = inst.engine.runner.layers[0].qkv.w
    stored = inst.layout.layer_weights(0)["model.layers.0.self_attn.qkv_proj.weight.panels"]
    assert q.data_ptr() == stored.data_ptr()
    head = inst.engine.runner.lm_head.w
    assert head.data_ptr() == inst.layout.group_weights("head")["lm_head.weight.panels"].data_ptr()
    del q, stored, head


def test_drop_grows_capacity_keeps_kv_and_restore_brings_back_identical_weights(inst):
    before = {n: t.clone() for n, t in inst.layout.weights().items()}
    old_blocks = inst.engine.allocator.num_blocks
    # put recognizable KV into the layers that stay
    kv_sums, ptrs = {}, {}
    for layer in (0, 1):
        cache = inst.layout.layer_cache(layer)
        cache[: old_blocks].copy_(torch.randn_like(cache[: old_blocks]))
        kv_sums[layer] = digest(cache[: old_blocks])
        ptrs[layer] = cache.data_ptr()
        del cache
    plan = inst.layout.plan_drop([2, 3])
    change = inst.drop([2, 3])
    assert change.result.new_num_blocks == plan.num_blocks > old_blocks
    assert inst.engine.allocator.num_blocks == plan.num_blocks and not inst.serving
    for layer in (0, 1):
        cache = inst.layout.layer_cache(layer)
        assert digest(cache[: old_blocks]) == kv_sums[layer], "a drop must not move or change KV bytes"
        assert cache.data_ptr() == ptrs[layer], "kernels keep seeing one static tensor per layer"
        del cache
    inst.restore([2, 3], "host")
    after = inst.layout.weights()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert inst.serving and inst.engine.allocator.num_blocks == old_blocks
    ref, margins = reference(inst)
    compare_greedy(generate(inst, "b"), ref, margins)


def test_restore_from_checkpoint_and_prefix_drop(inst):
    inst.drop([0])  # embeddings go with layer 0
    assert "embed" not in inst.layout.held_groups
    inst.restore([0], "checkpoint")
    ref, margins = reference(inst)
    compare_greedy(generate(inst, "c"), ref, margins)


def test_restore_compacts_live_tail_blocks(inst):
    inst.drop([3])
    n = inst.engine.allocator.num_blocks
    # a pipeline stage's KV living in the tail (as after a KV exchange): take every block, free all but the tail
    ids = inst.engine.allocator.allocate(n)
    tail = ids[-3:]
    inst.engine.allocator.free(ids[:-3])
    cache = inst.layout.layer_cache(0)
    for b in tail:
        cache[b].fill_(float(b))
    del cache
    # block tables of live sequences are rewritten through Engine.apply_compaction; none here
    change = inst.restore([3], "host")
    assert change.compaction_moves == 3
    used = inst.engine.allocator.used_ids()
    assert len(used) == 3 and max(used) < inst.engine.allocator.num_blocks
    cache = inst.layout.layer_cache(0)
    assert sorted(float(cache[b].flatten()[0]) for b in used) == sorted(float(b) for b in tail)


def test_refusals_leave_everything_unchanged(inst):
    with pytest.raises(LayerRangeError):
        inst.drop([0, 1, 2, 3])  # every layer
    with pytest.raises(LayerRangeError):
        inst.drop([1])  # non-contiguous remainder
    with pytest.raises(LayerRangeError):
        inst.drop([7])  # not in the model
    inst.engine.add_request(EngineRequest("busy", PROMPT, SamplingParams(max_tokens=4)))
    with pytest.raises(InstanceBusy):
        inst.drop([3])
    inst.engine.abort("busy")
    inst.drop([3])
    with pytest.raises(LayerRangeError):
        inst.restore([1], "host")  # already held
    with pytest.raises(ValueError, match="source"):
        inst.restore([3], "peer")
    # more KV in use than the restored layout can hold
    ids = inst.engine.allocator.allocate(inst.engine.allocator.num_blocks)
    with pytest.raises(KVCapacityError):
        inst.restore([3], "host")
    inst.engine.allocator.free(ids)
    inst.restore([3], "host")
    ref, margins = reference(inst)
    compare_greedy(generate(inst, "d"), ref, margins)


def test_fused_source_concatenates_hf_tensors():
    src = load_model_source(None)
    w = src.load_weights((0, 1))
    get = fused_source(w)
    qkv = get("model.layers.0.self_attn.qkv_proj.weight")
    assert torch.equal(qkv[: w["model.layers.0.self_attn.q_proj.weight"].shape[0]],
                       w["model.layers.0.self_attn.q_proj.weight"])
    # the panels name gives the same matrix in the CPU kernel's layout
    panels = get("model.layers.0.self_attn.qkv_proj.weight.panels")
    assert panels.shape == (-(-qkv.shape[0] // 64), qkv.shape[1], 64)
    assert torch.equal(from_panels(panels, qkv.shape[0]), qkv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a lent GPU machine)")
def test_worker_instance_on_the_cuda_pool():
    """The worker's path on a GPU: cuda VMM pool, engine on device views, drop/restore, reference tokens."""
    src = load_model_source(None)
    inst = PooledInstance(src, layer_range=(0, 4), pool_bytes=256 * MIB, page_size=2 * MIB, block_size=16,
                          backend="cuda", device="cuda")
    try:
        assert inst.layout.layer_cache(0).device.type == "cuda"
        ref, margins = reference(inst, 12)
        compare_greedy(generate(inst, "g0", 12), ref, margins)
        change = inst.drop([2, 3])
        assert change.result.new_num_blocks > change.result.old_num_blocks
        inst.restore([2, 3], "host")
        compare_greedy(generate(inst, "g1", 12), ref, margins)
        inst.drop([0])
        inst.restore([0], "checkpoint")
        compare_greedy(generate(inst, "g2", 12), ref, margins)
    finally:
        inst.close()


def test_swap_preemption_in_the_pool_keeps_the_reference_tokens():
    """The swap baseline on the real pool: a cache too small for all requests at once swaps KV out to host
    memory and back (the pool's KV views are made inside forward passes) and the tokens stay the same."""
    from kunserve.shared.policy.batch_scheduler import SchedulerConfig

    src = load_model_source(None)
    # 24 MiB pool with 256 KiB pages: fill most of the KV with a padding request's worth of capacity
    i = PooledInstance(src, layer_range=(0, 4), pool_bytes=24 * MIB, page_size=256 * 1024, block_size=16,
                       backend="host", scheduler_config=SchedulerConfig(max_num_batched_tokens=64, preemption="swap"))
    try:
        blocks = i.engine.allocator.num_blocks
        n = 6
        per = (blocks * 16) // (n - 2) - 24  # n requests whose whole lives cannot all fit at once
        prompts = [[(7 * k + j) % 4000 + 4 for j in range(per)] for k in range(n)]
        out = i.engine.generate([EngineRequest(f"s{k}", p, SamplingParams(max_tokens=24, ignore_eos=True))
                                 for k, p in enumerate(prompts)])
        assert i.engine.scheduler.num_swapped_out > 0
        for k, p in enumerate(prompts):
            ref, margins = reference_greedy(i.cfg, src.load_weights(), p, 24)
            compare_greedy(out[f"s{k}"], ref, margins)
    finally:
        i.close()
