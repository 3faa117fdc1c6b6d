"""The simulated memory is the worker's pool, and the time models are the fitted cost models."""

from __future__ import annotations

import pytest

from kunserve.shared.memory import create_pool
from kunserve.shared.model.pool_placement import build_model_layout
from kunserve.shared.policy.costmodel import BatchShape
from kunserve.sim.hardware import ACCELERATORS, accelerator
from kunserve.sim.shapes import SHIPPED, Memory, ModelShape, load_model_config
from kunserve.sim.timing import roofline_profile, roofline_seconds


@pytest.mark.parametrize("layers", [(0, 4), (0, 2), (2, 4), (1, 3)])
def test_kv_capacity_equals_a_real_pool_layout(layers):
    """The embedded model in a real host page pool: the simulator's block count is the layout's."""
    cfg = load_model_config("embedded")
    pool = create_pool("host", pool_bytes=36 << 20, page_size=64 << 10)
    layout = build_model_layout(pool, cfg, layers, 16)
    try:
        assert Memory(ModelShape(cfg), 36 << 20, 64 << 10).blocks(*layers) == layout.num_blocks
    finally:
        layout.close()


def test_shipped_shapes_load():
    assert set(SHIPPED) >= {"qwen2.5-14b", "qwen2.5-72b", "llama-3.1-8b", "llama-3.1-70b"}
    shape = ModelShape(load_model_config("qwen2.5-14b"))
    assert 26 < shape.weight_bytes / 2**30 < 30  # 14.7B parameters in bf16
    assert shape.kv_bytes_per_token * shape.num_layers == 2 * 8 * 128 * 2 * 48  # K and V, 8 KV heads, 48 layers


def test_roofline_prices_decode_by_memory_and_prefill_by_compute():
    shape = ModelShape(load_model_config("llama-3.1-8b"))
    h100 = accelerator("h100")
    decode = roofline_seconds([(1, 1023)], shape, h100)
    assert decode == pytest.approx(
        shape.weight_bytes / h100.bandwidth + 1024 * shape.kv_bytes_per_token * 32 / h100.bandwidth + h100.iteration_overhead_s, rel=0.05
    )
    prefill = roofline_seconds([(4096, 0)], shape, h100)
    assert prefill > 10 * decode
    assert roofline_seconds([(4096, 0)], shape, accelerator("A100")) > prefill  # a slower chip is slower


def test_roofline_profile_is_a_fitted_profile_close_to_its_samples():
    shape = ModelShape(load_model_config("qwen2.5-14b"))
    prof = roofline_profile(shape, ACCELERATORS["A800"])
    assert prof.model == "qwen2.5-14b" and prof.layers == (0, 48)
    assert prof.fit["conserve"]["mean_rel_err"] < 0.2
    for s in prof.samples:
        assert prof.conserve.shape_cost(BatchShape.of(s.chunks)) == pytest.approx(s.seconds, rel=0.5)


def test_tensor_parallel_instances_hold_a_72b_model():
    shape = ModelShape(load_model_config("qwen2.5-72b"), tp=4)
    memory = Memory(shape, int(80 * 2**30 * 0.9) * 4, 2 << 20)
    assert memory.undropped_blocks > 0
    assert memory.blocks(0, 40) > 2 * memory.undropped_blocks  # half the layers leave more than twice the KV
