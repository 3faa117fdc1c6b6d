"""Host backend: physical pages in one memfd, virtual ranges as PROT_NONE reservations.

The same mechanism as CUDA VMM, on the CPU (MEASURED.md, "Host memory pool"):

- physical page i is the file range [i*P, (i+1)*P) of one memfd (`memfd_create` + `ftruncate`,
  sparse until touched);
- a virtual range is `mmap(NULL, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`, trimmed to
  a page-aligned start;
- mapping a page into a slot is `mmap(slot, P, RW, MAP_SHARED|MAP_FIXED, memfd, i*P)` (~3.5 us;
  consecutive pages go in one call), optionally with MAP_POPULATE to pre-fault it;
- unmapping a slot maps anonymous PROT_NONE|MAP_NORESERVE memory with MAP_FIXED over it. munmap
  is never used inside a reservation: the hole could be handed to any later allocation and a later
  MAP_FIXED would silently overwrite that allocation;
- the RAM of a free page is released with fallocate(PUNCH_HOLE|KEEP_SIZE) (MADV_DONTNEED does not
  free shared memfd pages).

Tensors over a range come from `torch.frombuffer` on a ctypes array built `from_address`, so
`data_ptr()` is the slot address and no byte is copied.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .errors import BackendUnavailable, MemoryPoolError, OutOfPagesError
from .pool import DEFAULT_PAGE_SIZE, PagePool

# Linux values (identical on x86-64 and aarch64).
PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_POPULATE = 0x8000
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
KERNEL_PAGE = 4096


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        raise BackendUnavailable("the host memory backend needs Linux memfd_create")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value


def _os_error(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


@functools.lru_cache(maxsize=512)
def _buffer_type(nbytes: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    """A ctypes byte-array type of `nbytes` that accepts attributes (to hold the pool) and weakrefs."""
    return type(f"PoolView{nbytes}", (ctypes.c_ubyte * nbytes,), {})


class HostPagePool(PagePool):
    """Pages in one memfd; see the module docstring for the mechanism and why each step is as it is.

    `populate=True` pre-faults pages at map time (MAP_POPULATE: ~190 us per 2 MiB page, about 4x
    cheaper than taking the 512 first-touch faults later, but it commits the RAM immediately).
    """

    backend = "host"
    min_page_size = KERNEL_PAGE

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, *, populate: bool = False,
                 name: str = "kunserve-pool") -> None:
        super().__init__(num_pages, page_size)
        self._libc = _libc()
        self.populate = populate
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.num_pages * self.page_size)
        except OSError as e:
            os.close(self._fd)
            raise OutOfPagesError(f"cannot size the memfd to {self.num_pages} pages: {e}") from e
        self._discarded: set[int] = set(range(self.num_pages))  # a fresh memfd is all holes

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def fd(self) -> int:
        """The memfd holding the pages: pass it (or /proc/<pid>/fd/<n>) to share pages with another process."""
        return self._fd

    def page_offset(self, page: int) -> int:
        """Byte offset of physical page `page` in the memfd (for pread-based checks and sharing)."""
        return page * self.page_size

    # -------------------------------------------------------------- primitives
    def _reserve_va(self, nbytes: int, alignment: int) -> int:
        alignment = max(alignment, KERNEL_PAGE)
        span = nbytes + alignment
        addr = self._libc.mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            raise _os_error(f"reserving {nbytes} bytes of address space")
        base = -(-addr // alignment) * alignment
        # Trim the slack at both ends; these munmaps are outside the reservation we keep.
        if base > addr:
            self._libc.munmap(addr, base - addr)
        tail = addr + span - (base + nbytes)
        if tail > 0:
            self._libc.munmap(base + nbytes, tail)
        return base

    def _free_va(self, base: int, nbytes: int) -> None:
        if self._libc.munmap(base, nbytes) != 0:
            raise _os_error("releasing a reservation")

    def _map_run(self, address: int, first_page: int, count: int) -> None:
        flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if self.populate else 0)
        size = count * self.page_size
        got = self._libc.mmap(address, size, PROT_READ | PROT_WRITE, flags, self._fd, first_page * self.page_size)
        if got is None or got == _MAP_FAILED:
            err = ctypes.get_errno()
            if err == errno.ENOMEM:
                raise MemoryPoolError(f"mmap ENOMEM mapping {count} pages (too many mappings? "
                                      f"vm.max_map_count limits them)")
            raise _os_error(f"mapping {count} pages at {address:#x}")
        if got != address:  # MAP_FIXED guarantees this; keep the check cheap and loud
            raise MemoryPoolError(f"mmap placed pages at {got:#x}, asked for {address:#x}")
        self._discarded.difference_update(range(first_page, first_page + count))

    def _unmap_run(self, address: int, count: int) -> None:
        size = count * self.page_size
        got = self._libc.mmap(address, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                              -1, 0)
        if got is None or got == _MAP_FAILED or got != address:
            raise _os_error(f"unmapping {count} slots at {address:#x}")

    def _raw_view(self, address: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        buf = _buffer_type(nbytes).from_address(address)
        setattr(buf, "_pool", self)  # noqa: B010 - the mapping's owner lives as long as any tensor over it
        return torch.frombuffer(buf, dtype=torch.uint8), buf

    def _discard(self, pages: Sequence[int]) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        todo = sorted(set(pages) - self._discarded)
        i = 0
        while i < len(todo):  # one fallocate per run of consecutive pages
            j = i + 1
            while j < len(todo) and todo[j] == todo[j - 1] + 1:
                j += 1
            rc = self._libc.fallocate(self._fd, mode, todo[i] * self.page_size, (j - i) * self.page_size)
            if rc != 0:
                raise _os_error("fallocate(PUNCH_HOLE)")
            i = j
        self._discarded.update(todo)
        self.stats["pages_discarded"] += len(todo)

    def _close_backend(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # Reached only when no view is alive: every view's buffer holds a strong reference to us.
        try:
            if not self._closed:
                for vr in list(self._ranges.values()):
                    self._libc.munmap(vr.base, vr.nbytes)
                self._close_backend()
                self._closed = True
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
