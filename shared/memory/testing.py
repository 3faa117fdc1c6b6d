"""Small fixtures for tests of the memory pool and of code built on it (engine, worker).

A tiny Llama-shaped weight set (names as in HF checkpoints) and deterministic contents, so a test
can drop, restore and compare byte for byte without keeping its own copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from .layer_memory import KVCacheSpec, LayerMemoryLayout, TensorSpec, WeightGroupSpec
from .pool import PagePool, create_pool


def tiny_llama_specs(hidden: int = 32, intermediate: int = 48, vocab: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2, dtype: torch.dtype = torch.float32,
                     ) -> tuple[Callable[[int], list[TensorSpec]], list[WeightGroupSpec]]:
    """(layer_specs, groups) of a Llama-shaped model with untied embeddings."""
    hd = hidden // num_heads

    def layer_specs(i: int) -> list[TensorSpec]:
        p = f"model.layers.{i}."
        return [
            TensorSpec(p + "input_layernorm.weight", (hidden,), dtype),
            TensorSpec(p + "self_attn.q_proj.weight", (num_heads * hd, hidden), dtype),
            TensorSpec(p + "self_attn.k_proj.weight", (num_kv_heads * hd, hidden), dtype),
            TensorSpec(p + "self_attn.v_proj.weight", (num_kv_heads * hd, hidden), dtype),
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, num_heads * hd), dtype),
            TensorSpec(p + "post_attention_layernorm.weight", (hidden,), dtype),
            TensorSpec(p + "mlp.gate_proj.weight", (intermediate, hidden), dtype),
            TensorSpec(p + "mlp.up_proj.weight", (intermediate, hidden), dtype),
            TensorSpec(p + "mlp.down_proj.weight", (hidden, intermediate), dtype),
        ]

    groups = [
        WeightGroupSpec("embed", (TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype),), "first"),
        WeightGroupSpec("head", (TensorSpec("model.norm.weight", (hidden,), dtype),
                                 TensorSpec("lm_head.weight", (vocab, hidden), dtype)), "last"),
    ]
    return layer_specs, groups


def weight_pattern(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic pseudo-random contents for the tensor called `name`."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def pattern_source(name: str) -> torch.Tensor:
    """A weight source (name -> tensor) that recomputes `weight_pattern` from the name alone.

    Shapes are looked up in `_SHAPES`, filled by `make_layout`; a test needing other shapes builds
    its own dict with `weight_pattern`.
    """
    shape, dtype = _SHAPES[name]
    return weight_pattern(name, shape, dtype)


_SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}


def make_layout(*, num_layers: int = 6, layer_start: int = 0, layer_end: int | None = None, num_pages: int = 48,
                page_size: int = 16 * 1024, head_dim: int = 16, num_kv_heads: int = 2, block_size: int = 4,
                dtype: torch.dtype = torch.float32, hidden: int = 32, intermediate: int = 48, vocab: int = 64,
                pool: PagePool | None = None, fill: bool = True) -> LayerMemoryLayout:
    """A host-backed layout of the tiny model, weights filled with `weight_pattern` when `fill`."""
    layer_specs, groups = tiny_llama_specs(hidden, intermediate, vocab, num_kv_heads=num_kv_heads, dtype=dtype)
    for i in range(num_layers):
        for s in layer_specs(i):
            _SHAPES[s.name] = (s.shape, s.dtype)
    for g in groups:
        for s in g.tensors:
            _SHAPES[s.name] = (s.shape, s.dtype)
    if pool is None:
        pool = create_pool("host", num_pages=num_pages, page_size=page_size)
    return LayerMemoryLayout(
        pool, num_layers_model=num_layers, layer_start=layer_start,
        layer_end=num_layers if layer_end is None else layer_end, layer_specs=layer_specs,
        kv=KVCacheSpec(num_kv_heads, head_dim, block_size, dtype), groups=groups,
        weight_source=pattern_source if fill else None)


def block_pattern(layout: LayerMemoryLayout, layer: int, tag: int) -> torch.Tensor:
    """Contents for one KV block of `layer`, distinct for every (layer, tag); exact in float types."""
    spec = layout.kv_spec
    n = 2 * spec.num_kv_heads * spec.block_size * spec.head_dim
    base = float((tag * 131 + layer * 17) % 4093)
    return (torch.arange(n, dtype=torch.float32) % 251 + base).to(spec.dtype).view(spec.block_shape)
