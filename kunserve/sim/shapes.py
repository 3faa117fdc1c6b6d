"""The model the simulated cluster serves, and what its layers and KV cost in the memory pool.

A model is a Hugging Face ``config.json`` (read by the engine's own ``ModelConfig``, so a shape the engine would
refuse is refused here too): a name shipped with the simulator (``SHIPPED``: Qwen-2.5-14B/72B, Llama-3.1-8B/70B,
under kunserve/sim/models/<name>/config.json), a directory holding one, the file itself, or ``embedded`` (the tiny
model the local cluster serves, for ``--validate``).

Memory follows the worker's unified pool exactly: each layer's weights are packed into whole pages (the fused
tensor layout of ``pool_placement``), the embedding / head groups too, and the KV capacity of a layer range is
the pool's capacity rule (``memory.layer_memory.kv_capacity``). An instance of ``tp`` GPUs is one worker whose pool
is ``tp`` GPUs' worth of memory (tensor parallelism shards every layer evenly).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from kunserve.shared.memory.layer_memory import KVCacheSpec, arena_pages, kv_capacity
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.pool_placement import fused_layer_specs, weight_groups
from kunserve.shared.model.weights import read_config

MODELS_DIR = pathlib.Path(__file__).parent / "models"
SHIPPED: tuple[str, ...] = tuple(sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file()))
EMBEDDED = "embedded"


class ShapeError(ValueError):
    """The model shape cannot be read, or does not fit the memory it is given (one line for the CLI)."""


def model_directory(name: str) -> pathlib.Path | None:
    """The directory of a shipped shape (case-insensitive), None for another name."""
    for shipped in SHIPPED:
        if shipped.lower() == name.strip().lower():
            return MODELS_DIR / shipped
    return None


def load_model_config(model: str, dtype: str | None = None) -> ModelConfig:
    """`model`: a shipped name, ``embedded``, a model directory or a config.json path."""
    if model == EMBEDDED:
        return TINY_CONFIG if dtype is None else TINY_CONFIG.replace(dtype=dtype)
    shipped = model_directory(model)
    path = shipped if shipped is not None else pathlib.Path(model)
    try:
        if path.is_file():
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError(f"{path}: not a JSON object")
            return ModelConfig.from_hf_dict(raw, name=path.parent.name or path.stem, dtype=dtype, source=str(path))
        if path.is_dir():
            return read_config(path, dtype)
    except (OSError, ValueError) as exc:
        raise ShapeError(f"model {model}: {exc}") from None
    raise ShapeError(
        f"unknown model {model!r}: not a shipped shape ({', '.join(SHIPPED)}), '{EMBEDDED}', a model directory or a config.json"
    )


@dataclass(frozen=True)
class ModelShape:
    """A model's sizes as the pool and the time models need them. ``tp``: GPUs per instance."""

    config: ModelConfig
    block_size: int = 16
    tp: int = 1
    _layer_bytes: tuple[int, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ShapeError(f"tensor parallelism must be >= 1, got {self.tp}")
        specs = fused_layer_specs(self.config)
        object.__setattr__(self, "_layer_bytes", tuple(sum(t.nbytes for t in specs(layer)) for layer in range(self.config.num_layers)))

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        """Weight bytes of each layer (the fused tensors the pool places)."""
        return self._layer_bytes

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.config.dtype]

    @property
    def kv_spec(self) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(c.num_kv_heads, c.head_dim, self.block_size, c.torch_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token in one layer."""
        return self.kv_spec.block_bytes // self.block_size

    @property
    def block_bytes_all_layers(self) -> int:
        """KV bytes of one block over the whole model: what a swap or a migration moves per block."""
        return self.kv_spec.block_bytes * self.num_layers

    @property
    def group_bytes(self) -> int:
        return sum(t.nbytes for g in weight_groups(self.config) for t in g.tensors)

    @property
    def weight_bytes(self) -> int:
        return sum(self._layer_bytes) + self.group_bytes

    @property
    def hidden_bytes_per_token(self) -> int:
        """Activations one pipeline stage hands the next, per token."""
        return self.config.hidden_size * self.dtype_bytes

    @property
    def logits_bytes_per_row(self) -> int:
        """The float32 logits a group's last stage sends back to its head, per sampled row."""
        return self.config.vocab_size * 4

    def weight_pages(self, start: int, end: int, page_size: int) -> int:
        """Pages the weights of layers [start, end) and the groups that range holds take (the pool's rule)."""
        specs = fused_layer_specs(self.config)
        pages = sum(arena_pages(specs(layer), page_size) for layer in range(start, end))
        return pages + sum(arena_pages(g.tensors, page_size) for g in weight_groups(self.config) if g.held_for(start, end, self.num_layers))

    def kv_blocks(self, start: int, end: int, pool_bytes: int, page_size: int) -> int:
        """KV blocks a worker holding layers [start, end) has in a pool of `pool_bytes` (LayerMemoryLayout's plan)."""
        plan = kv_capacity(
            pool_bytes // page_size, self.weight_pages(start, end, page_size), end - start, page_size, self.kv_spec.block_bytes, start
        )
        return plan.num_blocks


@dataclass(frozen=True)
class Memory:
    """One worker's pool and what each layer range leaves for KV, cached (the planner asks often)."""

    shape: ModelShape
    pool_bytes: int
    page_size: int
    _cache: dict[tuple[int, int], int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        whole = self.blocks(0, self.shape.num_layers)
        if whole < 1:
            gib = 1024**3
            raise ShapeError(
                f"{self.shape.name} does not fit one instance: its weights take "
                f"{self.shape.weight_pages(0, self.shape.num_layers, self.page_size) * self.page_size / gib:.1f} GiB "
                f"of a {self.pool_bytes / gib:.1f} GiB pool ({self.shape.tp} GPU(s) per instance), leaving no KV block"
            )

    def blocks(self, start: int, end: int) -> int:
        key = (start, end)
        if key not in self._cache:
            self._cache[key] = self.shape.kv_blocks(start, end, self.pool_bytes, self.page_size)
        return self._cache[key]

    @property
    def undropped_blocks(self) -> int:
        return self.blocks(0, self.shape.num_layers)
