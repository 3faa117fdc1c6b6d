"""Paged KV storage: per local layer one tensor [num_blocks, 2, num_kv_heads, block_size, head_dim]
(head-major blocks, FlashInfer's HND layout). Which blocks hold what is `kv_blocks`' bookkeeping.

Storage is pluggable: `TorchKVStorage` allocates plain tensors; the unified memory pool's
`LayerMemoryLayout` satisfies the same protocol and can grow or shrink num_blocks at runtime, so the
engine re-fetches `layer_cache(layer)` every step instead of caching tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class KVStorage(Protocol):
    """Where the KV tensors live. `num_blocks` may change at runtime (a drop maps pages at the tail of
    every layer's range, a restore takes them back), so callers must re-read it and re-fetch
    `layer_cache(layer)` after any remap instead of holding tensors across one."""

    @property
    def num_blocks(self) -> int: ...

    def layer_cache(self, layer: int) -> torch.Tensor: ...


class TorchKVStorage:
    """KV tensors allocated by torch (no remapping)."""

    def __init__(self, layers: Iterable[int], num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self._num_blocks = num_blocks
        self._caches = {layer: torch.zeros(num_blocks, 2, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
                        for layer in layers}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def layer_cache(self, layer: int) -> torch.Tensor:
        return self._caches[layer]
