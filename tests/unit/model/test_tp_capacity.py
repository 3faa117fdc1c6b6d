"""A worker's would-be KV capacity at TP2 / TP4 equals what the pool lays out when it starts as such a member."""

from __future__ import annotations

import pytest
from engine_testing import TP4_CONFIG

from kunserve.shared.memory import create_pool
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.pool_placement import build_model_layout
from kunserve.shared.model.tp_capacity import in_place_kv_tokens_by_degree, instance_kv_tokens, kv_tokens_by_degree
from kunserve.shared.model.tp_degree import shard_config
from kunserve.shared.model.tp_padding import shards_of

PAGE = 64 * 1024
BLOCK = 16


def laid_out_tokens(cfg, degree: int, pool_bytes: int) -> int:
    shard = shard_config(cfg, degree)
    pool = create_pool("host", pool_bytes=pool_bytes, page_size=PAGE)
    try:
        layout = build_model_layout(pool, shard, (0, shard.num_layers), BLOCK)
        try:
            return layout.num_blocks * BLOCK
        finally:
            layout.release_views()
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("cfg", "degree", "pool_mib"), [(TINY_CONFIG, 1, 32), (TINY_CONFIG, 2, 32), (TP4_CONFIG, 1, 8), (TP4_CONFIG, 2, 8), (TP4_CONFIG, 4, 8)]
)
def test_the_rule_matches_the_pool_layout(cfg, degree, pool_mib):
    pool_bytes = pool_mib * 1024 * 1024
    got = instance_kv_tokens(cfg, degree, num_pages=pool_bytes // PAGE, page_size=PAGE, block_size=BLOCK, device_type="cpu")
    assert got == laid_out_tokens(cfg, degree, pool_bytes)
    assert got > 0


def test_degrees_the_model_cannot_shard_at_are_left_out_and_capacity_grows_with_the_degree():
    by_degree = kv_tokens_by_degree(TINY_CONFIG, num_pages=512, page_size=PAGE, block_size=BLOCK, device_type="cpu")
    assert sorted(by_degree) == [d for d in (1, 2, 4) if TINY_CONFIG.num_kv_heads % d == 0]
    values = [by_degree[d] for d in sorted(by_degree)]
    assert values == sorted(values) and values[-1] >= 2 * values[0]


def test_weights_that_fill_the_pool_leave_no_kv():
    assert instance_kv_tokens(TINY_CONFIG, 1, num_pages=1, page_size=PAGE, block_size=BLOCK, device_type="cpu") == 0


@pytest.mark.parametrize(("cfg", "degree", "pool_mib"), [(TINY_CONFIG, 2, 24), (TP4_CONFIG, 2, 8), (TP4_CONFIG, 4, 8)])
@pytest.mark.parametrize("padded", [False, True], ids=["whole-weights", "padded-mlp"])
def test_the_in_place_rule_matches_a_whole_pool_read_at_split_heads_with_its_shards_released(cfg, degree, pool_mib,
                                                                                              padded):
    """An instance formed in place keeps its members' whole-model pools: the rule equals such a pool read at 1/d of
    the heads, with (padded) the MLP shards rank 0 no longer keeps released to its KV."""
    pool = create_pool("host", pool_bytes=pool_mib << 20, page_size=PAGE)
    try:
        layout = build_model_layout(pool, cfg, (0, cfg.num_layers), BLOCK, padded_mlp=padded)
        whole = layout.num_blocks * BLOCK
        layout.split_kv_heads(degree)
        if padded:
            layout.release_shards(shards_of(0, degree))
        laid_out = layout.num_blocks * BLOCK
        layout.release_views()
    finally:
        pool.close()
    got = in_place_kv_tokens_by_degree(cfg, num_pages=(pool_mib << 20) // PAGE, page_size=PAGE, block_size=BLOCK,
                                       device_type="cpu", padded_mlp=padded)
    assert got[1] == whole and got[degree] == laid_out
    assert (got[degree] > degree * whole) if padded else (got[degree] == degree * whole)
