"""Paged KV storage: per local layer one tensor [num_blocks, 2, num_kv_heads, block_size, head_dim]
(FlashInfer's HND layout with K/V second), a strided view over blocks laid out header-centric in memory,
`[num_kv_heads, 2, block_size, head_dim]` (`shared/memory/kv_layout.py`). Which blocks hold what is
`kv_blocks`' bookkeeping.

Storage is pluggable: `TorchKVStorage` allocates plain tensors; the unified memory pool's
`LayerMemoryLayout` satisfies the same protocol and can grow or shrink num_blocks at runtime, so the
engine re-fetches `layer_cache(layer)` every step instead of caching tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from kunserve.shared.memory import kv_layout


class LayerCaches(Protocol):
    """What a forward pass reads: one layer's cache view at a time."""

    def layer_cache(self, layer: int) -> torch.Tensor: ...


class KVStorage(LayerCaches, Protocol):
    """Where the KV tensors live. `num_blocks` may change at runtime (a drop maps pages at the tail of
    every layer's range, a restore takes them back), so callers must re-read it and re-fetch
    `layer_cache(layer)` after any remap instead of holding tensors across one."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def kv_heads_per_block(self) -> int:
        """KV heads each block holds: the model's, or 1/degree of them after a tensor-parallel head split."""
        ...

    def layer_cache(self, layer: int) -> torch.Tensor: ...

    def split_kv_heads(self, degree: int) -> object:
        """Read every block at `kv_heads_per_block / degree` heads, in place (an in-place TP scale-up)."""
        ...

    def merge_kv_heads(self, degree: int) -> object:
        """The inverse of split_kv_heads (an in-place TP scale-down)."""
        ...


class TorchKVStorage:
    """KV tensors allocated by torch (no remapping), header-centric like the pool's."""

    def __init__(
        self,
        layers: Iterable[int],
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self._num_blocks = num_blocks
        self._caches = {layer: kv_layout.allocate(num_blocks, num_kv_heads, block_size, head_dim, dtype, device) for layer in layers}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def kv_heads_per_block(self) -> int:
        return next(iter(self._caches.values())).shape[2] if self._caches else 0

    def layer_cache(self, layer: int) -> torch.Tensor:
        return self._caches[layer]

    def split_kv_heads(self, degree: int) -> None:
        """Read every layer's blocks at `num_kv_heads / degree` heads, in place (as `LayerMemoryLayout.split_kv_heads`):
        the heads of rank r of block b become block `b * degree + r`, at the same bytes."""
        first = next(iter(self._caches.values()), None)
        if first is None:
            return
        heads = first.shape[2]
        if degree < 2 or heads % degree:
            raise ValueError(f"degree {degree}: a head split needs a degree >= 2 that divides the {heads} KV heads per block")
        self._regroup(self._num_blocks * degree, heads // degree)

    def merge_kv_heads(self, degree: int) -> None:
        """The inverse of `split_kv_heads`: read every layer's blocks at `degree` times the heads, in place; sub-blocks
        `b * degree + r` (heads of rank r) become block b again, at the same bytes. Sub-blocks past the last whole
        block are left out, as the pool's layout does."""
        first = next(iter(self._caches.values()), None)
        if first is None:
            return
        heads, sub_blocks = first.shape[2], first.shape[0]
        whole = sub_blocks // degree if degree >= 2 else 0
        if whole < 1:
            raise ValueError(f"degree {degree}: a head merge needs a degree >= 2 and at least {degree} sub-blocks, got {sub_blocks}")
        self._regroup(whole, heads * degree)

    def _regroup(self, num_blocks: int, heads: int) -> None:
        """Read every layer's bytes as `num_blocks` blocks of `heads` heads (header-centric: a block is its heads one
        after another), from the start; no byte moves."""
        for layer, cache in self._caches.items():
            self._caches[layer] = kv_layout.regroup(cache, num_blocks, heads)
        self._num_blocks = num_blocks
