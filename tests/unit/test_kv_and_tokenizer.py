from __future__ import annotations

import pytest

from kunserve.shared.engine.kv_cache import BlockAllocator, BlockAllocatorError
from kunserve.shared.model.tokenizer import ByteTokenizer


def test_allocator_hands_out_lowest_ids_first():
    a = BlockAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    a.free([1])
    assert a.allocate(2) == [1, 3]
    assert a.num_used == 4 and a.num_free == 4


def test_allocator_errors():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free(ids)
    with pytest.raises(BlockAllocatorError, match="freed twice"):
        a.free([0])
    with pytest.raises(BlockAllocatorError, match="does not belong"):
        a.free([9])
    with pytest.raises(BlockAllocatorError, match="need 5"):
        a.allocate(5)


def test_allocator_grow_shrink_and_remap():
    a = BlockAllocator(4)
    a.allocate(4)
    a.grow(4)
    assert a.allocate(1) == [4] and a.num_blocks == 8
    assert not a.can_shrink_to(4)
    a.free([4])
    a.shrink_to(5)
    assert a.num_blocks == 5 and a.num_free == 1
    a.free([3])
    a.remap({2: 3})
    assert a.used_ids() == [0, 1, 3]


def test_byte_tokenizer_round_trip_and_streaming_utf8():
    tok = ByteTokenizer()
    text = "héllo, 世界"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    streamed = "".join(tok.decode_token(ids[:i], ids[i]) for i in range(len(ids)))
    assert streamed == text
    assert tok.decode([258, 259]) == " !"
    assert tok.decode([256, 104, 257]) == "h"
