"""Weights as a flat dict with Hugging Face names; seeded random weights for the embedded model;
reading and writing HF-format checkpoints (config.json + *.safetensors) for any layer range; and
`load_model_source`, the one entry point for "the model a worker serves".

HF names are kept end to end (model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.*,
model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.layers.{i}.{input,post_attention}_layernorm.weight,
model.norm.weight, lm_head.weight) so a real checkpoint, the memory pool's weight arenas and a peer's
weight transfer all speak the same names; the engine fuses q/k/v and gate/up itself at load time."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.tokenizer import Tokenizer, load_tokenizer

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
    if cfg.o_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
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
    seeded from (seed, name) so any layer range materializes the same values as the full model.

    Scales: embeddings std 1, projections std 1/sqrt(fan_in) (activations keep unit scale through the
    residual stream), norms ~1, lm_head std 4/sqrt(hidden) so logits have std ~4: on the tiny model the
    top-1/top-2 gap is > 1e-2 at ~99% of positions and < 1e-3 at ~0.1% (float32 engine-vs-reference
    differences are ~1e-5)."""
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
            t = torch.randn(shape, generator=g) * (4.0 / shape[1] ** 0.5)
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
    """The subset of a full weight dict that a stage holding layer_range needs."""
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
    """The ModelConfig of an HF model directory (FileNotFoundError / ValueError name the file)."""
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
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    return ModelConfig.from_hf_dict(raw, name=d.name, dtype=dtype, source=str(cfg_path))


INDEX_FILE = "model.safetensors.index.json"


def _check_index(d: pathlib.Path) -> None:
    """A sharded checkpoint's index names the file of every tensor: a shard it names that is not there
    is reported with the first tensor it should hold."""
    index = d / INDEX_FILE
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{index}: not a valid index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: missing key 'weight_map'")
    for name, shard in sorted(weight_map.items()):
        if not (d / str(shard)).is_file():
            raise ValueError(f"{index}: shard {shard} (holding {name}) is missing from {d}")


def load_checkpoint(directory: str | pathlib.Path, layer_range: tuple[int, int] | None = None,
                    dtype: str | None = None) -> tuple[ModelConfig, Weights]:
    """Read only the tensors a stage holding layer_range needs, from every *.safetensors file."""
    from safetensors import safe_open

    d = pathlib.Path(directory)
    cfg = read_config(d, dtype)
    _check_index(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    wanted = tensor_shapes(cfg, layer_range)
    found: Weights = {}
    where: dict[str, pathlib.Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name in wanted:
                        found[name] = fh.get_tensor(name)
                        where[name] = f
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{f}: not a readable safetensors file: {exc}") from None
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(f"{d}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"(searched {', '.join(f.name for f in files)})")
    for name, shape in wanted.items():
        if tuple(found[name].shape) != shape:
            raise ValueError(f"{where[name]}: tensor {name} has shape {tuple(found[name].shape)}, expected {shape}")
        found[name] = found[name].to(cfg.torch_dtype)
    return cfg, found


def total_bytes(weights: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights)


@dataclass
class ModelSource:
    """What a worker serves: its config, a way to materialize any layer range's weights, a tokenizer.

    Unpacks as ``cfg, load_weights, tokenizer = load_model_source(path)``; `load_weights(layer_range)`
    reads only the tensors that range needs (random weights are generated per tensor, so a sub-range
    has exactly the values of the full model)."""

    name: str
    config: ModelConfig
    path: str | None  # None = the embedded tiny model
    seed: int = 0
    _tokenizer: Tokenizer | None = field(default=None, repr=False)

    def load_weights(self, layer_range: tuple[int, int] | None = None) -> Weights:
        if self.path is None:
            return select(random_weights(self.config, self.seed), self.config, layer_range)
        return load_checkpoint(self.path, layer_range, dtype=self.config.dtype)[1]

    @property
    def tokenizer(self) -> Tokenizer | None:
        """ByteTokenizer for the embedded model; tokenizer.json for a directory; None when neither fits."""
        return self._tokenizer

    def __iter__(self) -> Iterator:
        loader: Callable[..., Weights] = self.load_weights
        return iter((self.config, loader, self.tokenizer))


def load_model_source(path: str | pathlib.Path | None, *, seed: int = 0, dtype: str | None = None) -> ModelSource:
    """None -> the embedded tiny model (random weights from `seed`, ByteTokenizer); a directory -> its HF
    checkpoint (config.json + *.safetensors) and tokenizer.json when present (else ByteTokenizer when the
    vocabulary holds its 258 ids, else no tokenizer: token-id prompts only). `dtype` overrides the
    checkpoint's torch_dtype ("float32", "bfloat16", "float16")."""
    if not path:
        cfg = TINY_CONFIG if dtype is None else TINY_CONFIG.replace(dtype=dtype)
        return ModelSource(cfg.name, cfg, None, seed, load_tokenizer(None))
    cfg = read_config(path, dtype)
    _check_index(pathlib.Path(path))
    if not sorted(pathlib.Path(path).glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return ModelSource(cfg.name, cfg, str(path), seed, load_tokenizer(str(path)))
