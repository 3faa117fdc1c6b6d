"""The KV capacity a whole-model worker would have as one rank of a TP2 / TP4 instance, by the pool layout's own rule.

Transformation-aware routing (Gyges Algorithm 1) needs each degree's capacity before any instance runs at it. Rather
than a byte model of the weights, a worker applies the rule its pool applies when it starts as a member
(`pool_placement.build_model_layout` on `tp_shard.shard_config`): the same tensor specs packed into whole pages, the
rest split evenly between the layers' KV ranges in whole blocks (`layer_memory.kv_capacity`). Every member of an
instance lays out the same shard in the same pool, so rank 0's block count is the instance's, and a block holds
`block_size` tokens of the rank's heads: the instance holds `blocks * block_size` tokens.

An instance formed in place (`in_place_kv_tokens`) keeps every member's whole-model pool: its KV is the whole
instances' pages read at 1/d of the heads, plus, in a pool with the padded MLP, the pages of the shards each member
released (`LayerMemoryLayout.plan_shard_release`'s rule, computed the same way here).
"""

from __future__ import annotations

from kunserve.shared.memory.layer_memory import KVCacheSpec, arena_pages, kv_capacity
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.pool_placement import fused_layer_specs, uses_panels, weight_groups
from kunserve.shared.model.tp_degree import TP_DEGREES, degree_error, shard_config
from kunserve.shared.model.tp_padding import SHARDS


def instance_kv_tokens(cfg: ModelConfig, degree: int, *, num_pages: int, page_size: int, block_size: int, device_type: str) -> int:
    """KV tokens of an instance of `degree` members whose pools each have `num_pages` pages of `page_size` bytes, the
    whole model's layers on every member (0: the weights leave no KV block). ValueError: `degree` cannot shard cfg."""
    shard = shard_config(cfg, degree)
    panels = uses_panels(shard, device_type)
    specs = fused_layer_specs(shard, panels)
    weight = sum(arena_pages(specs(layer), page_size) for layer in range(shard.num_layers))
    weight += sum(arena_pages(g.tensors, page_size) for g in weight_groups(shard, panels))
    block_bytes = KVCacheSpec(shard.num_kv_heads, shard.head_dim, block_size, shard.torch_dtype).block_bytes
    return kv_capacity(num_pages, weight, shard.num_layers, page_size, block_bytes).num_blocks * block_size


def kv_tokens_by_degree(cfg: ModelConfig, *, num_pages: int, page_size: int, block_size: int, device_type: str) -> dict[int, int]:
    """`instance_kv_tokens` at every degree the model shards at (1 included)."""
    return {
        d: instance_kv_tokens(cfg, d, num_pages=num_pages, page_size=page_size, block_size=block_size, device_type=device_type)
        for d in TP_DEGREES
        if degree_error(cfg, d) is None
    }


def in_place_kv_tokens(cfg: ModelConfig, degree: int, *, num_pages: int, page_size: int, block_size: int,
                       device_type: str, padded_mlp: bool) -> int:
    """KV tokens of a TP`degree` instance formed in place from whole instances with these pools (`padded_mlp`: each
    member released the MLP shards it no longer keeps to its KV). ValueError: `degree` cannot shard cfg."""
    error = degree_error(cfg, degree)
    if error is not None:
        raise ValueError(error)
    panels = uses_panels(cfg, device_type)
    specs = fused_layer_specs(cfg, panels, padded_mlp)
    weight = sum(arena_pages(specs(layer), page_size) for layer in range(cfg.num_layers))
    weight += sum(arena_pages(g.tensors, page_size) for g in weight_groups(cfg, panels))
    if padded_mlp and degree > 1:
        (units,) = [s for s in specs(0) if s.page_shards]
        weight -= (SHARDS - SHARDS // degree) * (units.shard_stride(page_size) // page_size) * cfg.num_layers
    sub_block = KVCacheSpec(cfg.num_kv_heads // degree, cfg.head_dim, block_size, cfg.torch_dtype).block_bytes
    return kv_capacity(num_pages, weight, cfg.num_layers, page_size, sub_block).num_blocks * block_size


def in_place_kv_tokens_by_degree(cfg: ModelConfig, *, num_pages: int, page_size: int, block_size: int,
                                 device_type: str, padded_mlp: bool) -> dict[int, int]:
    """`in_place_kv_tokens` at every degree the model shards at (1 included: a whole instance)."""
    return {
        d: in_place_kv_tokens(cfg, d, num_pages=num_pages, page_size=page_size, block_size=block_size,
                              device_type=device_type, padded_mlp=padded_mlp)
        for d in TP_DEGREES
        if degree_error(cfg, d) is None
    }
