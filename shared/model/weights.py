"""Weights as a flat dict with Hugging Face names; seeded random weights for the embedded model;
reading and writing HF-format checkpoints (config.json + *.safetensors) for any layer range."""

from __future__ import annotations

import json
import pathlib
from typing import Iterable

import torch

from kunserve.shared.model.config import ModelConfig

Weights = dict[str, torch.Tensor]


def layer_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{layer}."
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = {
        p + "self_attn.q_proj.weight": (cfg.num_heads * hd, h),
        p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
        p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h),
        p + "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
        p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }
    if cfg.qkv_bias:
        shapes[p + "self_attn.q_proj.bias"] = (cfg.num_heads * hd,)
        shapes[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * hd,)
        shapes[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * hd,)
    return shapes


def tensor_shapes(cfg: ModelConfig, layer_range: tuple[int, int] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor a stage holding layer_range needs: embeddings on the first stage, norm + lm_head on
    the last (a tied lm_head is the embedding matrix, so the last stage then needs that too)."""
    start, end = layer_range or (0, cfg.num_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    embed = (cfg.vocab_size, cfg.hidden_size)
    if start == 0 or (end == cfg.num_layers and cfg.tie_word_embeddings):
        shapes["model.embed_tokens.weight"] = embed
    for layer in range(start, end):
        shapes.update(layer_tensor_shapes(cfg, layer))
    if end == cfg.num_layers:
        shapes["model.norm.weight"] = (cfg.hidden_size,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = embed
    return shapes


def random_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    """Deterministic random weights with logits spread widely enough that greedy decoding has clear
    top-1/top-2 margins (the token-identity oracle needs them). Each tensor gets its own generator
    seeded from (seed, name) so any layer range materializes the same values as the full model."""
    out: Weights = {}
    for name, shape in tensor_shapes(cfg).items():
        g = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % (2**63))
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=g) * (2.0 / shape[1] ** 0.5)
        else:
            t = torch.randn(shape, generator=g) / shape[1] ** 0.5
        out[name] = t.to(cfg.torch_dtype)
    return out


def _stable_hash(s: str) -> int:
    h = 1469598103934665603
    for b in s.encode():
        h = ((h ^ b) * 1099511628211) % (2**64)
    return h


def select(weights: Weights, cfg: ModelConfig, layer_range: tuple[int, int] | None) -> Weights:
    names = tensor_shapes(cfg, layer_range)
    return {n: weights[n] for n in names}


def save_checkpoint(directory: str | pathlib.Path, cfg: ModelConfig, weights: Weights,
                    tokenizer_json: str | None = None, shard_size: int | None = None) -> pathlib.Path:
    """Write config.json and model.safetensors (or several shards when shard_size is given)."""
    from safetensors.torch import save_file

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    items = sorted(weights.items())
    if shard_size is None:
        save_file({k: v.contiguous() for k, v in items}, str(d / "model.safetensors"))
    else:
        for i in range(0, len(items), shard_size):
            save_file({k: v.contiguous() for k, v in items[i:i + shard_size]},
                      str(d / f"model-{i // shard_size:05d}.safetensors"))
    if tokenizer_json is not None:
        (d / "tokenizer.json").write_text(tokenizer_json)
    return d


def read_config(directory: str | pathlib.Path, dtype: str | None = None) -> ModelConfig:
    d = pathlib.Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a model directory needs a Hugging Face config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_path}: not valid JSON: {exc}") from None
    return ModelConfig.from_hf_dict(raw, name=d.name, dtype=dtype)


def load_checkpoint(directory: str | pathlib.Path, layer_range: tuple[int, int] | None = None,
                    dtype: str | None = None) -> tuple[ModelConfig, Weights]:
    """Read only the tensors a stage holding layer_range needs, from every *.safetensors file."""
    from safetensors import safe_open

    d = pathlib.Path(directory)
    cfg = read_config(d, dtype)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    wanted = tensor_shapes(cfg, layer_range)
    found: Weights = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name in wanted:
                    found[name] = fh.get_tensor(name)
    if cfg.tie_word_embeddings is False and "lm_head.weight" in wanted and "lm_head.weight" not in found \
            and "model.embed_tokens.weight" in found:
        found["lm_head.weight"] = found["model.embed_tokens.weight"]  # some checkpoints omit a tied head
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(f"{d}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, shape in wanted.items():
        if tuple(found[name].shape) != shape:
            raise ValueError(f"{d}: tensor {name} has shape {tuple(found[name].shape)}, expected {shape}")
        found[name] = found[name].to(cfg.torch_dtype)
    return cfg, found


def total_bytes(weights: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights)
