"""Page-aligned MLP shards in the pool (Gyges §4.2; LayerMemoryLayout.release_shards / reclaim_shards): the padded
MLP computes what Hugging Face's does, a release gives the shards a TP member no longer keeps to the KV tails in whole
pages with no KV byte or base address moved, and a reclaim takes them back and refills them; bad requests change
nothing."""

from __future__ import annotations

import pytest
import torch

from kunserve.shared.memory import KVCapacityError, ViewStillAliveError, create_pool
from kunserve.shared.model.pool_placement import FFN_SHARDS, build_model_layout
from kunserve.shared.model.tp_padding import SHARDS, swiglu_shards
from kunserve.shared.model.weights import load_model_source

PAGE = 64 << 10


@pytest.fixture()
def padded():
    src = load_model_source(None)
    pool = create_pool("host", pool_bytes=22 << 20, page_size=PAGE)
    layout = build_model_layout(pool, src.config, (0, src.config.num_layers), 8, src.load_weights(), padded_mlp=True)
    yield src, layout
    layout.close()
    pool.close()


def _kv_bytes(layout) -> dict[int, torch.Tensor]:
    return {x: layout.layer_cache(x).clone() for x in layout.layers}


def test_the_padded_mlp_is_hugging_faces_and_every_shard_starts_on_a_page(padded):
    src, layout = padded
    cfg, hf = src.config, src.load_weights()
    x = torch.randn(5, cfg.hidden_size)
    for layer in layout.layers:
        p = f"model.layers.{layer}."
        units = layout.weights()[p + FFN_SHARDS]
        assert units.shape == (SHARDS, 3, cfg.intermediate_size // SHARDS, cfg.hidden_size)
        assert all(units[s].data_ptr() % PAGE == 0 for s in range(SHARDS))
        want = torch.nn.functional.linear(torch.nn.functional.silu(x @ hf[p + "mlp.gate_proj.weight"].T)
                                          * (x @ hf[p + "mlp.up_proj.weight"].T), hf[p + "mlp.down_proj.weight"])
        torch.testing.assert_close(swiglu_shards(x, units), want, rtol=1e-5, atol=1e-5)
    layout.check_invariants()


@pytest.mark.parametrize("keep", [range(0, 2), range(2, 4), range(1, 2)])
def test_a_release_gives_the_other_shards_pages_to_the_kv_and_a_reclaim_takes_them_back(padded, keep):
    src, layout = padded
    pool = layout.pool
    before = layout.weights()
    kept_bytes = {k: v[keep].clone() for k, v in before.items() if k.endswith(FFN_SHARDS)}
    whole_bytes = {k: v.clone() for k, v in before.items() if k.endswith(FFN_SHARDS)}
    del before
    for x in layout.layers:
        layout.layer_cache(x).copy_(torch.randn_like(layout.layer_cache(x)))
    kv = _kv_bytes(layout)
    bases = [layout.kv_data_ptr(x) for x in layout.layers]
    mapped, weight_pages, blocks = pool.mapped_count, layout.weight_pages, layout.num_blocks
    plan = layout.plan_shard_release(keep)

    result = layout.release_shards(keep)
    layout.check_invariants()
    per_layer = result.pages_unmapped // len(layout.layers)
    assert result.pages_unmapped > 0 and layout.weight_pages == weight_pages - result.pages_unmapped
    assert pool.mapped_count == mapped  # every released page went to the KV or stays spare: nothing new mapped
    assert layout.num_blocks == plan.num_blocks > blocks and layout.kv_pages_per_layer >= per_layer
    assert [layout.kv_data_ptr(x) for x in layout.layers] == bases
    for x in layout.layers:  # the blocks that were there hold the same bytes
        assert torch.equal(layout.layer_cache(x)[:blocks], kv[x])
    views = layout.weights()
    for k, v in kept_bytes.items():
        assert torch.equal(views[k], v)  # the kept shards, read where they were
    assert layout.kept_shards == keep and layout.memory_map()["kept_shards"] == [keep.start, keep.stop]
    del views

    result = layout.reclaim_shards({k: v for k, v in whole_bytes.items()}, used_block_ids=range(blocks))
    layout.check_invariants()
    assert layout.num_blocks == blocks and layout.weight_pages == weight_pages and pool.mapped_count == mapped
    assert layout.kept_shards == range(SHARDS)
    views = layout.weights()
    for k, v in whole_bytes.items():
        assert torch.equal(views[k], v)
    for x in layout.layers:
        assert torch.equal(layout.layer_cache(x), kv[x])


def test_bad_releases_and_reclaims_change_nothing(padded):
    src, layout = padded
    state = (layout.pool.mapped_count, layout.num_blocks, layout.weight_pages)
    for keep in (range(0, 5), range(0, 4, 2), range(3, 3)):
        with pytest.raises(ValueError, match="not a contiguous part"):
            layout.release_shards(keep)
    with pytest.raises(ValueError, match="no shard is released"):
        layout.reclaim_shards({}, used_block_ids=())
    pinned = layout.weights()[f"model.layers.0.{FFN_SHARDS}"]  # a view over every shard
    with pytest.raises(ViewStillAliveError):
        layout.release_shards(range(0, 2))
    del pinned
    assert (layout.pool.mapped_count, layout.num_blocks, layout.weight_pages) == state
    layout.check_invariants()

    whole = layout.host_copy()
    layout.release_shards(range(0, 2))
    released = (layout.pool.mapped_count, layout.num_blocks, layout.weight_pages)
    with pytest.raises(ValueError, match="not all mapped"):
        layout.shard_views(range(0, 4))
    with pytest.raises(ValueError, match="reclaim them first"):
        layout.drop_layers([3])
    with pytest.raises(ValueError, match="reclaim them first"):
        layout.load_weights(whole)
    with pytest.raises(KVCapacityError, match="beyond it are in use"):
        layout.reclaim_shards(whole, used_block_ids=[layout.num_blocks - 1])
    assert (layout.pool.mapped_count, layout.num_blocks, layout.weight_pages) == released
    layout.check_invariants()
    layout.reclaim_shards(whole, used_block_ids=[0])
    assert (layout.pool.mapped_count, layout.num_blocks, layout.weight_pages) == state
    layout.drop_layers([3])  # whole again: drops work
    layout.check_invariants()
