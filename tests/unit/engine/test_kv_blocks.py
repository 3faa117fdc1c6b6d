"""Block allocator (lowest ids first, so a restore finds the tail free), block tables, KV storage."""

from __future__ import annotations

import pytest
import torch

from kunserve.shared.engine.kv_blocks import BlockAllocator, BlockAllocatorError, BlockTable
from kunserve.shared.engine.kv_storage import TorchKVStorage


def test_allocator_hands_out_lowest_ids_first():
    a = BlockAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    a.free([1])
    assert a.allocate(2) == [1, 3]
    assert a.num_used == 4 and a.num_free == 4
    a.free([0, 2])
    assert a.allocate(3) == [0, 2, 4]
    assert a.used_ids() == [0, 1, 2, 3, 4]


def test_allocator_errors_change_nothing():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free(ids)
    with pytest.raises(BlockAllocatorError, match="freed twice"):
        a.free([0])
    with pytest.raises(BlockAllocatorError, match="does not belong"):
        a.free([9])
    with pytest.raises(BlockAllocatorError, match="need 5"):
        a.allocate(5)
    with pytest.raises(BlockAllocatorError, match="cannot allocate -1"):
        a.allocate(-1)
    a.allocate(2)
    with pytest.raises(BlockAllocatorError, match="freed twice"):
        a.free([1, 1])  # a duplicate inside one call
    with pytest.raises(BlockAllocatorError, match="does not belong"):
        a.free([0, 7])  # block 0 must not be freed by a call that fails
    assert a.num_used == 2 and a.used_ids() == [0, 1]


def test_allocator_grow_shrink_and_remap():
    a = BlockAllocator(4)
    a.allocate(4)
    a.grow(4)
    assert a.allocate(1) == [4] and a.num_blocks == 8
    assert a.can_shrink(3) and not a.can_shrink(4) and not a.can_shrink_to(4)
    a.free([4])
    assert a.can_shrink(4)
    a.shrink_to(5)
    assert a.num_blocks == 5 and a.num_free == 1
    with pytest.raises(BlockAllocatorError, match="in use"):
        a.shrink_to(3)
    a.free([3])
    a.remap({2: 3})
    assert a.used_ids() == [0, 1, 3]
    with pytest.raises(BlockAllocatorError, match="bad compaction"):
        a.remap({2: 4})  # 2 is free now


def test_block_table_slots():
    t = BlockTable(4, [7, 2, 9])
    assert t.capacity == 12 and len(t) == 3
    assert t.slots(3, 3) == ([7, 2, 2], [3, 0, 1])
    assert t.extra_blocks_for(12) == 0 and t.extra_blocks_for(13) == 1
    t.remap({9: 5})
    assert t.ids == [7, 2, 5]
    assert t.clear() == [7, 2, 5] and not t


def test_torch_storage_layout_is_head_major():
    s = TorchKVStorage(range(2, 4), num_blocks=6, num_kv_heads=2, block_size=8, head_dim=16)
    assert s.num_blocks == 6
    assert s.layer_cache(3).shape == (6, 2, 2, 8, 16)  # [block, K/V, kv_head, token, dim]
    assert s.layer_cache(2).dtype == torch.float32
    with pytest.raises(KeyError):
        s.layer_cache(0)
