"""Megatron-style tensor-parallel shards of a Llama / Qwen2 model (Gyges §2: TP splits the heads and the MLP).

Rank r of degree d holds, in every layer:

- q / k / v projections (and their biases): the rows of its heads, column-parallel. Query heads
  [r*H/d, (r+1)*H/d) and KV heads [r*KVH/d, (r+1)*KVH/d): with grouped-query attention query head h reads KV head
  h // (H/KVH), so an even split keeps every rank's query heads with their KV heads and the local ratio unchanged;
- o_proj: the input columns of its query heads, row-parallel: its output is a partial sum;
- gate / up: rows [r*I/d, (r+1)*I/d) of the intermediate dimension; down_proj: those input columns (a partial sum).

Embeddings, norms and lm_head are replicated. The partial sums of o_proj and down_proj are summed across the ranks
(all-reduce) before the residual add. o_proj's bias (Llama's attention_bias) is added once: rank 0 keeps it and the
others hold zeros, so the sum carries it exactly once.

A shard is an ordinary model to everything downstream: `shard_config` (shared/model/tp_degree.py) is the config of
one rank's shard (local heads, local intermediate size), so the memory pool lays out only the shard's weights and a
KV cache of the local KV heads (KV bytes per token divided by d), and the model runner computes it unchanged apart
from the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kunserve.shared.engine.cpu_kernels import from_panels
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.pool_placement import FFN_SHARDS, PANELS, QKV
from kunserve.shared.model.tp_degree import shard_config
from kunserve.shared.model.weights import ModelSource, Weights

# per-layer HF tensors and how each splits: "rows" of its heads / intermediate slice, "cols" likewise (its input)
_ROW_SPLIT_HEADS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_ROW_SPLIT_INTER = ("mlp.gate_proj", "mlp.up_proj")


def _rows(t: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    n = t.shape[0] // degree
    return t[rank * n : (rank + 1) * n].contiguous()


def _cols(t: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    n = t.shape[1] // degree
    return t[:, rank * n : (rank + 1) * n].contiguous()


def shard_tensor(name: str, t: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    """Rank `rank`'s part of the HF-named tensor `name` (the whole tensor when it is replicated)."""
    if degree == 1:
        return t
    if not name.startswith("model.layers."):
        return t  # embeddings, final norm, lm_head
    if any(f".{p}." in name for p in _ROW_SPLIT_HEADS + _ROW_SPLIT_INTER):
        return _rows(t, rank, degree)  # weights [out, in] and biases [out] alike
    if name.endswith("self_attn.o_proj.weight") or name.endswith("mlp.down_proj.weight"):
        return _cols(t, rank, degree)
    if name.endswith("self_attn.o_proj.bias"):
        return t if rank == 0 else torch.zeros_like(t)
    return t  # layer norms


def shard_weights(weights: Weights, rank: int, degree: int) -> Weights:
    """Every tensor of an HF-named weight dict, as rank `rank` of `degree` holds it."""
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {degree}")
    return {name: shard_tensor(name, t, rank, degree) for name, t in weights.items()}


@dataclass
class ShardedModelSource(ModelSource):
    """A model source whose weights are one rank's shard and whose config is the shard's (`shard_config`): what a
    tensor-parallel member's memory pool and engine are built from. `full` is the whole model's source."""

    full: ModelSource | None = None
    rank: int = 0
    degree: int = 1

    def load_weights(self, layer_range: tuple[int, int] | None = None) -> Weights:
        assert self.full is not None
        return shard_weights(self.full.load_weights(layer_range), self.rank, self.degree)


def sharded_source(source: ModelSource, rank: int, degree: int) -> ShardedModelSource:
    """Rank `rank` of `degree`'s view of `source` (ValueError when the degree does not fit the model). Its name tells
    the shard apart from the whole model (cost-model profiles are kept per name)."""
    cfg = shard_config(source.config, degree)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {degree}")
    return ShardedModelSource(
        f"{source.name}@tp{degree}", cfg, source.path, source.seed, source.tokenizer, full=source, rank=rank, degree=degree
    )


def shard_stored_attention(stored: Weights, cfg: ModelConfig, rank: int, degree: int) -> Weights:
    """Rank `rank` of `degree`'s attention weights cut from the pool's stored (fused, maybe panel) whole ones by
    `shard_tensor`'s rules, as [out, in] copies under their stored names without the panel suffix (the runner lays them
    out again). Every other stored tensor is left out: the caller keeps it as it is (replicated) or gives the shard's
    MLP (`FFN_SHARDS` views)."""
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if nh % degree or nkv % degree:
        raise ValueError(f"TP{degree} does not divide {nh} heads / {nkv} KV heads")
    sizes = [nh * hd, nkv * hd, nkv * hd]  # the fused q | k | v rows

    def matrix(name: str, n: int) -> torch.Tensor:
        return from_panels(stored[name + PANELS], n) if name + PANELS in stored else stored[name]

    def split_qkv(p: str, fused: torch.Tensor, part: str) -> torch.Tensor:
        return torch.cat([shard_tensor(f"{p}self_attn.{x}_proj.{part}", t, rank, degree)
                          for x, t in zip("qkv", fused.split(sizes), strict=True)])

    out: Weights = {}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        if p + FFN_SHARDS not in stored:
            continue  # a layer this pool does not hold
        out[p + QKV + ".weight"] = split_qkv(p, matrix(p + QKV + ".weight", sum(sizes)), "weight")
        o = p + "self_attn.o_proj.weight"
        out[o] = shard_tensor(o, matrix(o, cfg.hidden_size), rank, degree)
        if p + QKV + ".bias" in stored:
            out[p + QKV + ".bias"] = split_qkv(p, stored[p + QKV + ".bias"], "bias")
        if p + "self_attn.o_proj.bias" in stored:
            b = p + "self_attn.o_proj.bias"
            out[b] = shard_tensor(b, stored[b], rank, degree).clone()
    return out
