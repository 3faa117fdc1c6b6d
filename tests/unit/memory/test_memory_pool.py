"""The page pool itself (host backend) and backend selection.

No test here ever touches a view whose pages were unmapped: that would SIGSEGV the runner. The
lifetime guard is tested through the API's errors, and the one scenario that would crash if the
guard were broken runs in a subprocess.
"""

from __future__ import annotations

import gc
import importlib
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kunserve.shared.memory import (
    BackendUnavailable,
    MemoryPoolError,
    OutOfPagesError,
    ViewStillAliveError,
    create_pool,
    select_backend,
)
from kunserve.shared.memory.host import HostPagePool

P = 64 * 1024  # small pages, a multiple of 4 KiB


@pytest.fixture
def pool():
    p = HostPagePool(16, P)
    yield p
    gc.collect()
    if not p.closed:
        try:
            p.close()
        except ViewStillAliveError:
            pass  # a failed test's traceback still holds a view; the pool goes when it does


def _page_bytes(pool: HostPagePool, page: int, n: int = P) -> bytes:
    return os.pread(pool.fd, n, pool.page_offset(page))


def test_view_sees_exactly_the_bytes_of_its_pages(pool):
    vr = pool.reserve(4, "r")
    pages = [7, 2, 11]  # deliberately not consecutive, mapped into slots 0..2
    pool.map(vr, 0, pages)
    t = pool.view(vr, 0, (3 * P,), torch.uint8)
    assert t.data_ptr() == vr.base
    for slot, page in enumerate(pages):
        t[slot * P:(slot + 1) * P] = slot + 1
        assert _page_bytes(pool, page) == bytes([slot + 1]) * P
    # Writes through the file (another path to the same physical page) are seen by the view.
    os.pwrite(pool.fd, b"\xab" * 8, pool.page_offset(2) + 100)
    assert t[P + 100:P + 108].tolist() == [0xAB] * 8  # page 2 sits in slot 1
    # Other pages were never touched.
    assert _page_bytes(pool, 0, 64) == b"\0" * 64
    del t
    pool.check_invariants()


def test_second_mapping_of_the_same_page_shares_bytes(pool):
    vr = pool.reserve(2, "r")
    pool.map(vr, 1, [5])
    t = pool.view(vr, P, (P // 4,), torch.float32)
    m = mmap.mmap(pool.fd, P, offset=pool.page_offset(5))  # an independent mapping of page 5
    try:
        t[:4] = torch.tensor([1.5, -2.0, 3.25, 0.0])
        assert torch.equal(torch.frombuffer(bytearray(m[:16]), dtype=torch.float32),
                           torch.tensor([1.5, -2.0, 3.25, 0.0]))
        m[16:20] = torch.tensor([7.0]).numpy().tobytes()
        assert t[4].item() == 7.0
    finally:
        m.close()
    del t


def test_consecutive_pages_coalesce_into_one_map_call(pool):
    vr = pool.reserve(8, "r")
    before = pool.stats["map_calls"]
    pool.map(vr, 0, [3, 4, 5, 6, 9, 10])
    assert pool.stats["map_calls"] - before == 2
    assert vr.slots[:6] == [3, 4, 5, 6, 9, 10] and vr.mapped_prefix() == 6
    assert sorted(pool.unmap(vr, 0, 6)) == [3, 4, 5, 6, 9, 10]
    pool.check_invariants()


def test_unmapped_slot_keeps_reservation_and_remaps_with_new_page(pool):
    vr = pool.reserve(2, "r")
    pool.map(vr, 0, [0])
    t = pool.view(vr, 0, (8,), torch.uint8)
    t.fill_(1)
    del t
    assert pool.unmap(vr, 0, 1) == [0]
    pool.map(vr, 0, [1])  # same slot, another physical page: same address, other bytes
    t = pool.view(vr, 0, (8,), torch.uint8)
    assert t.data_ptr() == vr.base and t.tolist() == [0] * 8
    del t
    pool.check_invariants()


def test_bookkeeping_errors(pool):
    vr = pool.reserve(3, "r")
    pool.map(vr, 0, [1])
    with pytest.raises(MemoryPoolError, match="not free"):
        pool.map(vr, 1, [1])  # page already mapped
    with pytest.raises(MemoryPoolError, match="already mapped"):
        pool.map(vr, 0, [2])
    with pytest.raises(MemoryPoolError, match="twice"):
        pool.map(vr, 1, [3, 3])
    with pytest.raises(MemoryPoolError, match="outside"):
        pool.map(vr, 2, [4, 5])
    with pytest.raises(MemoryPoolError, match="not mapped"):
        pool.unmap(vr, 1, 1)
    with pytest.raises(OutOfPagesError):
        pool.take_free(100)
    pool.check_invariants()
    assert pool.free_count == 15 and pool.mapped_count == 1


def test_view_over_unmapped_slot_is_refused(pool):
    vr = pool.reserve(2, "r")
    pool.map(vr, 0, [0])
    with pytest.raises(MemoryPoolError, match="unmapped"):
        pool.view(vr, 0, (P + 1,), torch.uint8)  # spills into unmapped slot 1
    with pytest.raises(MemoryPoolError, match="item size"):
        pool.view(vr, 2, (4,), torch.float32)


def test_live_view_blocks_unmap_until_released(pool):
    vr = pool.reserve(2, "r")
    pool.map(vr, 0, [0, 1])
    t = pool.view(vr, P, (16,), torch.float32)  # over slot 1 only
    s = t[4:8]  # a slice shares the storage
    del t
    assert pool.unmap(vr, 0, 1) == [0]  # slot 0 carries no view: fine
    with pytest.raises(ViewStillAliveError, match=r"r\[1:2\]"):
        pool.unmap(vr, 1, 1)
    arr = s.numpy()  # numpy arrays pin the storage too
    del s
    with pytest.raises(ViewStillAliveError):
        pool.free_range(vr)
    del arr
    assert pool.unmap(vr, 1, 1) == [1]
    pool.check_invariants()


def test_view_in_reference_cycle_is_collected_before_refusing(pool):
    vr = pool.reserve(1, "r")
    pool.map(vr, 0, [0])

    class Holder:
        pass

    h = Holder()
    h.t = pool.view(vr, 0, (4,), torch.float32)
    h.me = h  # a cycle: dead after `del h`, but freed only by the GC
    del h
    assert pool.unmap(vr, 0, 1) == [0]


def test_free_range_and_close(pool):
    vr = pool.reserve(3, "r")
    pool.map(vr, 0, [4, 5])
    assert sorted(pool.free_range(vr)) == [4, 5]
    assert pool.free_count == 16
    with pytest.raises(MemoryPoolError, match="released"):
        pool.map(vr, 0, [1])
    vr2 = pool.reserve(1, "r2")
    pool.map(vr2, 0, [0])
    t = pool.view(vr2, 0, (1,), torch.uint8)
    with pytest.raises(ViewStillAliveError):
        pool.close()
    del t
    pool.close()
    assert pool.closed
    with pytest.raises(MemoryPoolError, match="closed"):
        pool.reserve(1)


def test_discard_releases_ram_of_free_pages(pool):
    vr = pool.reserve(4, "r")
    pool.map(vr, 0, [0, 1, 2, 3])
    t = pool.view(vr, 0, (4 * P,), torch.uint8)
    t.fill_(9)
    del t
    blocks_full = os.fstat(pool.fd).st_blocks
    pool.unmap(vr, 0, 4)
    assert pool.discard_free_pages() == 16
    assert os.fstat(pool.fd).st_blocks < blocks_full
    assert _page_bytes(pool, 2, 16) == b"\0" * 16  # a punched hole reads as zeros


def test_page_size_validation():
    with pytest.raises(ValueError, match="4096"):
        HostPagePool(4, 6000)
    with pytest.raises(ValueError):
        HostPagePool(0, P)
    p = HostPagePool(2, 12 * 1024)  # 12 KiB: a multiple of 4 KiB but not a power of two
    vr = p.reserve(2)
    assert vr.base % 4096 == 0
    p.close()


def test_reservation_is_page_aligned():
    p = HostPagePool(2, 2 << 20)
    try:
        for _ in range(3):
            assert p.reserve(1).base % (2 << 20) == 0
    finally:
        p.close()


def test_create_pool_sizes():
    p = create_pool("host", pool_bytes=10 * P + 5, page_size=P)
    assert p.num_pages == 10 and p.backend == "host"
    p.close()
    with pytest.raises(ValueError):
        create_pool("host", page_size=P)


def test_pool_outlives_its_views_even_when_dropped_unclosed():
    """If the guard were broken this would SIGSEGV, so it runs in a subprocess."""
    code = textwrap.dedent(
        """
        import gc, torch
        from kunserve.shared.memory.host import HostPagePool
        pool = HostPagePool(2, 65536)
        vr = pool.reserve(2)
        pool.map(vr, 0, [0, 1])
        t = pool.view(vr, 0, (2 * 16384,), torch.float32)
        t.fill_(4.0)
        del pool, vr
        gc.collect()
        print(float(t.sum()))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.strip()) == 4.0 * 2 * 16384


# ---------------------------------------------------------------------- backends
def test_auto_backend_is_host_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert select_backend("auto") == "host"
    assert select_backend("host") == "host"
    with pytest.raises(ValueError, match="unknown"):
        select_backend("tpu")


def test_cuda_backend_module_imports_without_cuda_python():
    mod = importlib.import_module("kunserve.shared.memory.cuda")
    assert mod.CudaPagePool.backend == "cuda"
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(BackendUnavailable):
        mod.CudaPagePool(1, 2 << 20)


def test_cuda_backend_reports_missing_cuda_python(monkeypatch):
    """With cuda.bindings hidden from import, the backend says so instead of failing obscurely."""
    mod = importlib.import_module("kunserve.shared.memory.cuda")
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # makes the import raise ImportError
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(BackendUnavailable, match="cuda-python"):
        mod.CudaPagePool(1, 2 << 20)
    from kunserve.shared.memory.pool import cuda_available

    assert cuda_available() is False
