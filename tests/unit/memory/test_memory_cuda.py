"""The CUDA backend on a real GPU (skipped where there is none, e.g. CI).

Same contract as the host backend: exact page bookkeeping, zero-copy views whose data_ptr is the
slot address, physical pages keep their bytes across remaps, views pin their pages.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kunserve.shared.memory import ViewStillAliveError, create_pool, cuda_available, select_backend
from kunserve.shared.memory.testing import block_pattern, make_layout, pattern_source

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU, its driver and cuda-python")

P = 2 << 20


@pytest.fixture
def pool():
    p = create_pool("cuda", num_pages=8, page_size=P)
    yield p
    gc.collect()
    try:
        p.close()
    except ViewStillAliveError:
        pass


def test_auto_selects_cuda():
    assert select_backend("auto") == "cuda"


def test_views_and_page_contents_survive_remap(pool):
    a = pool.reserve(2, "a")
    b = pool.reserve(2, "b")
    pool.map(a, 0, [3, 5])
    t = pool.view(a, 0, (2 * P // 4,), torch.float32)
    assert t.is_cuda and t.data_ptr() == a.base
    t[: P // 4] = 1.5
    t[P // 4:] = -2.0
    del t
    assert pool.unmap(a, 0, 2) == [3, 5]
    pool.map(b, 0, [5, 3])  # same physical pages, other order, other range
    u = pool.view(b, 0, (2 * P // 4,), torch.float32)
    assert u.data_ptr() == b.base
    assert torch.all(u[: P // 4] == -2.0) and torch.all(u[P // 4:] == 1.5)
    del u
    pool.check_invariants()


def test_torch_keeps_the_interface_object_alive(pool):
    a = pool.reserve(1, "a")
    pool.map(a, 0, [0])
    t = pool.view(a, 0, (16,), torch.float32)
    ref = a.views[-1][0]
    assert isinstance(ref, weakref.ref) and ref() is not None
    s = t[2:4]
    del t
    gc.collect()
    assert ref() is not None  # the slice still shares the storage
    with pytest.raises(ViewStillAliveError):
        pool.unmap(a, 0, 1)
    del s
    gc.collect()
    assert ref() is None
    pool.unmap(a, 0, 1)


def test_layout_drop_restore_on_gpu():
    pool = create_pool("cuda", num_pages=24, page_size=P)
    lay = make_layout(num_layers=4, pool=pool)
    lay.check_invariants()
    original = {n: t.clone() for n, t in lay.weights().items()}
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert kv.is_cuda
        for blk in range(0, lay.num_blocks, 97):
            kv[blk] = block_pattern(lay, x, blk).cuda()
        del kv
    ptrs = {x: lay.kv_data_ptr(x) for x in lay.layers}
    old = lay.num_blocks
    lay.drop_layers([3])
    lay.check_invariants()
    assert lay.num_blocks > old
    for x in lay.layers:
        kv = lay.layer_cache(x)
        assert kv.data_ptr() == ptrs[x]
        for blk in range(0, old, 97):
            assert torch.equal(kv[blk].cpu(), block_pattern(lay, x, blk))
        del kv
    lay.restore_layers([3], {n: t.cpu() for n, t in original.items()}, used_block_ids=())
    lay.check_invariants()
    for n, t in lay.weights().items():
        assert torch.equal(t, original[n]), n
        assert torch.equal(t.cpu(), pattern_source(n))
    del t
    lay.close()
    pool.close()
