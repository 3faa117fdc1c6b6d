"""Unified memory pool: weights and KV cache share physical pages (KunServe §4.1).

- `PagePool` (pool.py): physical pages + virtual ranges + tracked tensor views; backends
  `HostPagePool` (host.py, memfd) and `CudaPagePool` (cuda.py, CUDA VMM via cuda-python, imported
  lazily). `create_pool` / `select_backend` pick one.
- `LayerMemoryLayout` (layout.py): one worker's layer range — per-layer weight arenas, weight groups,
  one KV range per layer; `drop_layers` / `restore_layers` / compaction / `memory_map`; `split_kv_heads`.
- `kv_layout.py`: the header-centric physical KV block and the kernels' permuted view of it (Gyges §4.1);
  `kv_head_split.py`: the pure plan of a TP1 -> TP2/TP4 merge's in-place head split and phased exchange.

Typical worker use::

    pool = create_pool("auto", pool_bytes=cfg.engine.pool_mib << 20)
    layout = LayerMemoryLayout(pool, num_layers_model=L, layer_start=s, layer_end=e,
                               layer_specs=model_layer_specs, kv=KVCacheSpec(kvh, hd, bs, dtype),
                               groups=[WeightGroupSpec("embed", ..., "first"), WeightGroupSpec("head", ..., "last")],
                               weight_source=checkpoint_reader)
    kv = layout.layer_cache(layer)   # [num_blocks, 2, kvh, block_size, head_dim]; re-fetch after remaps
"""

from .errors import (
    BackendUnavailable,
    KVCapacityError,
    LayerRangeError,
    MemoryPoolError,
    OutOfPagesError,
    ViewStillAliveError,
    WeightSourceError,
)
from .layer_memory import (
    CapacityPlan,
    HeadSplitResult,
    KVCacheSpec,
    LayerMemoryLayout,
    RemapResult,
    TensorSpec,
    WeightGroupSpec,
    WeightSource,
    arena_pages,
    kv_capacity,
    pack_tensors,
    plan_compaction,
    uniform_layer_specs,
)
from .pool import BACKENDS, DEFAULT_PAGE_SIZE, PagePool, VirtualRange, create_pool, cuda_available, select_backend

__all__ = [
    "BACKENDS", "DEFAULT_PAGE_SIZE", "BackendUnavailable", "CapacityPlan", "HeadSplitResult", "KVCacheSpec", "KVCapacityError",
    "LayerMemoryLayout", "LayerRangeError", "MemoryPoolError", "OutOfPagesError", "PagePool", "RemapResult",
    "TensorSpec", "ViewStillAliveError", "VirtualRange", "WeightGroupSpec", "WeightSource", "WeightSourceError",
    "arena_pages", "create_pool", "cuda_available", "kv_capacity", "pack_tensors", "plan_compaction",
    "select_backend", "uniform_layer_specs",
]
