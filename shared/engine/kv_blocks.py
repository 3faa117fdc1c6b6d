"""KV block bookkeeping: which block ids are free, and each request's block table. Pure ints, no torch,
so the request scheduler (a pure policy) and the simulator use it without the tensors it describes
(those live in `kv_storage`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kunserve.shared.engine.api import EngineRequest


class BlockAllocatorError(RuntimeError):
    """Misuse of the allocator (double free, foreign id, over-allocation): a bookkeeping bug upstream."""


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
        """n block ids, lowest first."""
        if n < 0:
            raise BlockAllocatorError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockAllocatorError(f"need {n} blocks, {len(self._free)} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        self._free_set.difference_update(out)
        return out

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks. All ids are checked before any is freed, so a bad call changes nothing."""
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if not (0 <= i < self.num_blocks):
                raise BlockAllocatorError(f"block {i} does not belong to this allocator (0..{self.num_blocks - 1})")
            if i in self._free_set or i in seen:
                raise BlockAllocatorError(f"block {i} freed twice")
            seen.add(i)
        for i in ids:
            self._free_set.add(i)
            heapq.heappush(self._free, i)

    def take(self, ids: Iterable[int]) -> None:
        """Mark specific free blocks used (a transition installs requests with their new tables)."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._free_set]
        if bad or len(set(ids)) != len(ids):
            raise BlockAllocatorError(f"blocks {sorted(set(bad))[:8] or ids[:8]} are not free (or given twice)")
        self._free_set.difference_update(ids)
        self._free = sorted(self._free_set)

    def used_ids(self) -> list[int]:
        return sorted(set(range(self.num_blocks)) - self._free_set)

    def grow(self, n: int) -> None:
        """New blocks appended at the tail (a drop mapped more pages there)."""
        for i in range(self.num_blocks, self.num_blocks + n):
            self._free_set.add(i)
            heapq.heappush(self._free, i)
        self.num_blocks += n

    def can_shrink(self, n: int) -> bool:
        """Whether the last n blocks are all free, i.e. a restore may take them back without compaction."""
        return 0 <= n <= self.num_blocks and self.can_shrink_to(self.num_blocks - n)

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
    """Blocks that hold num_tokens tokens (ceil division)."""
    return -(-num_tokens // block_size)


def life_blocks(request: EngineRequest, block_size: int) -> int:
    """Blocks a request holds at its longest: prompt + max_tokens - 1 tokens (the last sampled token gets no KV)."""
    return blocks_needed(len(request.prompt_token_ids) + request.sampling.max_tokens - 1, block_size)


class BlockTable:
    """One request's blocks in order: token at position p lives in block ids[p // block_size] at
    offset p % block_size. Plain ints (the scheduler edits it every step); the engine turns the tables
    of one step into tensors once."""

    __slots__ = ("block_size", "ids")

    def __init__(self, block_size: int, ids: Iterable[int] = ()) -> None:
        self.block_size = block_size
        self.ids: list[int] = list(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __bool__(self) -> bool:
        return bool(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    @property
    def capacity(self) -> int:
        """Tokens the current blocks can hold."""
        return len(self.ids) * self.block_size

    def extra_blocks_for(self, num_tokens: int) -> int:
        """Blocks to add so the table holds num_tokens tokens in all (0 when it already does)."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(self.ids))

    def extend(self, ids: Iterable[int]) -> None:
        self.ids.extend(ids)

    def slots(self, start: int, n: int) -> tuple[list[int], list[int]]:
        """(block ids, offsets) of positions start .. start+n-1."""
        bs, ids = self.block_size, self.ids
        return [ids[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)]

    def clear(self) -> list[int]:
        """Forget every block and return them (for the allocator to free)."""
        out, self.ids = self.ids, []
        return out

    def remap(self, mapping: dict[int, int]) -> None:
        """Apply a compaction (old id -> new id) after the KV bytes were moved."""
        self.ids = [mapping.get(i, i) for i in self.ids]
