"""Places a Llama/Qwen2 model's layer range in the unified memory pool.

Weights are stored *fused* (q|k|v and gate|up concatenated) and in the form the model runner's kernels
consume, so the runner computes on views of pool pages and no weight byte lives outside the pool: the
pages a drop frees are the pages the weights really occupied. On a CPU pool of float32 weights every
linear layer's matrix is stored as column panels (``<name>.weight.panels``, [ceil(out/64), in, 64], the
layout the CPU GEMM kernel of shared/engine/cpu_kernels.py reads); elsewhere it keeps nn.Linear's
[out, in] (``<name>.weight``). The layout depends only on the pool's device type and the dtype, so two
workers of one cluster pack every arena identically and exchange weights as raw bytes. `fused_source`
turns any HF-named weight source (a checkpoint, random weights, a peer) into a source of the stored names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kunserve.shared.engine.cpu_kernels import panels_shape, to_panels
from kunserve.shared.memory.layer_memory import KVCacheSpec, LayerMemoryLayout, TensorSpec, WeightGroupSpec, WeightSource
from kunserve.shared.memory.pool import PagePool
from kunserve.shared.model import tp_padding
from kunserve.shared.model.architecture import ModelConfig

QKV = "self_attn.qkv_proj"
GATE_UP = "mlp.gate_up_proj"
PANELS = ".panels"  # suffix of a matrix stored as column panels
FFN_SHARDS = "mlp.shards"  # the padded MLP of a pool laid out for in-place TP changes (tp_padding.py)


def uses_panels(cfg: ModelConfig, device_type: str) -> bool:
    """Whether a pool on `device_type` stores cfg's linear weights as column panels (CPU float32)."""
    return device_type == "cpu" and cfg.dtype == "float32"


def _matrix(name: str, shape: tuple[int, int], dt: torch.dtype, panels: bool) -> TensorSpec:
    return TensorSpec(name + PANELS, panels_shape(*shape), dt) if panels else TensorSpec(name, shape, dt)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def fused_layer_specs(cfg: ModelConfig, panels: bool = False,
                      padded_mlp: bool = False) -> Callable[[int], list[TensorSpec]]:
    """A layer's stored tensors. With `padded_mlp` the MLP is one page-sharded tensor (`FFN_SHARDS`,
    `[SHARDS, 3, I/SHARDS, hidden]`: tp_padding.py), placed last in the layer's arena so its shards' pages follow
    the other tensors'."""
    dt, h, hd, inter = cfg.torch_dtype, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    if padded_mlp and inter % tp_padding.SHARDS:
        raise ValueError(f"intermediate size {inter} does not split into {tp_padding.SHARDS} page-aligned shards")

    def specs(layer: int) -> list[TensorSpec]:
        p = layer_prefix(layer)
        out = [
            TensorSpec(p + "input_layernorm.weight", (h,), dt),
            _matrix(p + QKV + ".weight", (qkv_rows, h), dt, panels),
            _matrix(p + "self_attn.o_proj.weight", (h, cfg.num_heads * hd), dt, panels),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), dt),
        ]
        if not padded_mlp:
            out += [_matrix(p + GATE_UP + ".weight", (2 * inter, h), dt, panels),
                    _matrix(p + "mlp.down_proj.weight", (h, inter), dt, panels)]
        if cfg.qkv_bias:
            out.append(TensorSpec(p + QKV + ".bias", (qkv_rows,), dt))
        if cfg.o_bias:  # Llama's attention_bias also biases o_proj
            out.append(TensorSpec(p + "self_attn.o_proj.bias", (h,), dt))
        if padded_mlp:
            out.append(TensorSpec(p + FFN_SHARDS, tp_padding.shards_shape(inter, h), dt, tp_padding.SHARDS))
        return out

    return specs


def weight_groups(cfg: ModelConfig, panels: bool = False) -> list[WeightGroupSpec]:
    """The embeddings (rows are looked up: always [vocab, hidden]) and the final norm with the lm_head (panels
    when `panels`, unless it is the tied embedding matrix)."""
    dt, embed = cfg.torch_dtype, (cfg.vocab_size, cfg.hidden_size)
    if cfg.tie_word_embeddings:  # the embedding matrix is also the lm_head: both ends need it
        return [WeightGroupSpec("embed", (TensorSpec("model.embed_tokens.weight", embed, dt),), "ends"),
                WeightGroupSpec("head", (TensorSpec("model.norm.weight", (cfg.hidden_size,), dt),), "last")]
    return [WeightGroupSpec("embed", (TensorSpec("model.embed_tokens.weight", embed, dt),), "first"),
            WeightGroupSpec("head", (TensorSpec("model.norm.weight", (cfg.hidden_size,), dt),
                                     _matrix("lm_head.weight", embed, dt, panels)), "last")]


def fused_source(source: WeightSource) -> Callable[[str], torch.Tensor]:
    """name -> tensor for the stored names (fused, and panels for names ending in PANELS), built from a source
    with Hugging Face names."""
    get = source.__getitem__ if isinstance(source, Mapping) else source

    def fused(name: str) -> torch.Tensor:
        if name.endswith(PANELS):
            return to_panels(fused(name.removesuffix(PANELS)))
        if name.endswith(FFN_SHARDS):
            prefix = name.removesuffix(FFN_SHARDS)
            return tp_padding.pack_shards(*(get(f"{prefix}mlp.{m}_proj.weight") for m in ("gate", "up", "down")))
        for part, pieces in ((QKV, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             (GATE_UP, ("mlp.gate_proj", "mlp.up_proj"))):
            if f".{part}." in name:
                prefix, suffix = name.split(f"{part}.")
                return torch.cat([get(f"{prefix}{p}.{suffix}") for p in pieces], 0)
        return get(name)

    return fused


def padded_mlp_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights with every layer's MLP as the padded layout's `FFN_SHARDS` tensor instead of gate / up / down
    (contiguous, no page gaps): what a runner computing like a padded pool is built from (the worker's profile)."""
    out = dict(weights)
    for name in [n for n in weights if n.endswith("mlp.gate_proj.weight")]:
        prefix = name.removesuffix("mlp.gate_proj.weight")
        parts = [out.pop(f"{prefix}mlp.{m}_proj.weight") for m in ("gate", "up", "down")]
        out[prefix + FFN_SHARDS] = tp_padding.pack_shards(*parts)
    return out


def build_model_layout(pool: PagePool, cfg: ModelConfig, layer_range: tuple[int, int], block_size: int,
                       source: WeightSource | None = None, *, padded_mlp: bool = False) -> LayerMemoryLayout:
    """A LayerMemoryLayout for cfg's [start, end), filled from an HF-named source when given; `padded_mlp` lays the
    MLP out in page-aligned shards (for in-place TP changes)."""
    start, end = layer_range
    panels = uses_panels(cfg, pool.device.type)
    return LayerMemoryLayout(
        pool, num_layers_model=cfg.num_layers, layer_start=start, layer_end=end,
        layer_specs=fused_layer_specs(cfg, panels, padded_mlp),
        kv=KVCacheSpec(cfg.num_kv_heads, cfg.head_dim, block_size, cfg.torch_dtype),
        groups=weight_groups(cfg, panels),
        weight_source=fused_source(source) if source is not None else None,
    )
