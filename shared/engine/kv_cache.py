"""Paged KV cache: per local layer one tensor [num_blocks, 2, num_kv_heads, block_size, head_dim]
(head-major blocks, FlashInfer's HND layout), a block allocator, and per-request block tables.

Storage is pluggable: `TorchKVStorage` allocates plain tensors; the unified memory pool's
`LayerMemoryLayout` satisfies the same protocol and can grow or shrink num_blocks at runtime, so the
engine re-fetches `layer_cache(layer)` every step instead of caching tensors.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Protocol

import torch


class KVStorage(Protocol):
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


class BlockAllocatorError(RuntimeError):
    pass


class BlockAllocator:
    """Hands out the lowest free block ids first, so the tail of every layer's KV range stays free
    for a later restore (which takes pages back from the tail)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a sorted list is a valid min-heap
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BlockAllocatorError(f"need {n} blocks, {len(self._free)} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        self._free_set.difference_update(out)
        return out

    def free(self, ids: Iterable[int]) -> None:
        for i in ids:
            if not (0 <= i < self.num_blocks):
                raise BlockAllocatorError(f"block {i} does not belong to this allocator (0..{self.num_blocks - 1})")
            if i in self._free_set:
                raise BlockAllocatorError(f"block {i} freed twice")
            self._free_set.add(i)
            heapq.heappush(self._free, i)

    def used_ids(self) -> list[int]:
        return sorted(set(range(self.num_blocks)) - self._free_set)

    def grow(self, n: int) -> None:
        """New blocks appended at the tail (a drop mapped more pages there)."""
        for i in range(self.num_blocks, self.num_blocks + n):
            self._free_set.add(i)
            heapq.heappush(self._free, i)
        self.num_blocks += n

    def can_shrink_to(self, new_num_blocks: int) -> bool:
        return all(i in self._free_set for i in range(new_num_blocks, self.num_blocks))

    def shrink_to(self, new_num_blocks: int) -> None:
        if not self.can_shrink_to(new_num_blocks):
            raise BlockAllocatorError(f"blocks at or above {new_num_blocks} are in use; compact first")
        self._free_set = {i for i in self._free_set if i < new_num_blocks}
        self._free = sorted(self._free_set)
        self.num_blocks = new_num_blocks

    def remap(self, mapping: dict[int, int]) -> None:
        """Apply a compaction (old id -> new id) to the allocator's own bookkeeping."""
        used = set(self.used_ids())
        for old, new in mapping.items():
            if old not in used or (new in used and new not in mapping):
                raise BlockAllocatorError(f"bad compaction move {old} -> {new}")
        new_used = (used - set(mapping)) | set(mapping.values())
        self._free_set = set(range(self.num_blocks)) - new_used
        self._free = sorted(self._free_set)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
