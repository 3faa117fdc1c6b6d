"""The physical page pool: one interface, two backends (host memfd, CUDA VMM).

KunServe §4.1 keeps weights and KV cache in one pool of fixed-size physical pages so that the pages
of dropped layers can be re-mapped, without copying, at the tail of the KV cache's virtual range.
This module holds the backend-independent half of that: page ownership bookkeeping, virtual ranges
("reservations") made of page-sized slots, and the lifetime of the tensor views handed out over
them. A backend supplies five primitives (reserve/free virtual address space, map/unmap a run of
pages, make a raw byte view) and the pool does everything else, so both backends share one set of
invariants and one test suite.

View-lifetime contract (why this module is so strict about views)
-----------------------------------------------------------------
A tensor view over a slot is a raw pointer. If the slot is unmapped while the view is alive,
touching the view kills the process with SIGSEGV (host) or an illegal-address fault (CUDA), not an
exception. The pool therefore owns view lifetimes:

1. Views are only made by `PagePool.view`, and only over slots that are mapped right now.
2. Each view keeps a small tracker object alive through its storage (torch holds the buffer /
   `__cuda_array_interface__` object until the last tensor sharing the storage — slices, `.view`,
   `.numpy()`, `nn.Parameter` — is gone). The pool keeps a weak reference to the tracker.
3. `unmap` and `free_range` refuse (ViewStillAliveError, nothing changed) while any live view
   overlaps the slots they would unmap.
4. Trackers hold a strong reference to the pool, so the pool (and every mapping) outlives all views
   even if the owner forgets to `close()` it.

So via this API a view can never point at unmapped memory; the worst a stale reference can do is
make a remap fail loudly. Raw `data_ptr()` integers (kernels, CUDA graphs) are outside this
protection: re-capture them after every remap (see `LayerMemoryLayout.generation`).
"""

from __future__ import annotations

import gc
import heapq
import importlib
import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .errors import BackendUnavailable, MemoryPoolError, OutOfPagesError, ViewStillAliveError

DEFAULT_PAGE_SIZE = 2 << 20  # 2 MiB: the CUDA VMM granularity on current GPUs, and MEASURED.md's host unit

BACKENDS = ("host", "cuda")


@dataclass(eq=False)
class VirtualRange:
    """A reserved virtual address range of `num_slots` page-sized slots.

    Slots are mapped to physical pages individually; an unmapped slot stays reserved (PROT_NONE on
    the host, reserved-but-unbacked on CUDA), so the range's base address never changes and a tensor
    over its head keeps its `data_ptr()` when pages are added at its tail.
    """

    rid: int
    tag: str
    base: int
    num_slots: int
    page_size: int
    slots: list[int | None] = field(repr=False)
    # (weakref to a view tracker, first slot, end slot) for every view handed out over this range
    views: list[tuple[weakref.ref[Any], int, int]] = field(default_factory=list, repr=False)
    released: bool = False

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.page_size

    def address(self, slot: int) -> int:
        return self.base + slot * self.page_size

    def mapped_count(self) -> int:
        return sum(1 for p in self.slots if p is not None)

    def mapped_prefix(self) -> int:
        """Number of leading slots that are mapped (the usable head of a KV range)."""
        n = 0
        for p in self.slots:
            if p is None:
                break
            n += 1
        return n

    def live_views(self, first_slot: int = 0, end_slot: int | None = None) -> int:
        """How many views overlapping slots [first_slot, end_slot) are still referenced."""
        end = self.num_slots if end_slot is None else end_slot
        alive = []
        n = 0
        for ref, a, b in self.views:
            if ref() is None:
                continue
            alive.append((ref, a, b))
            if a < end and first_slot < b:
                n += 1
        self.views = alive
        return n


class PagePool(ABC):
    """A fixed set of `num_pages` physical pages of `page_size` bytes, and the ranges they map into.

    Page ownership is exact: every page is either free or mapped into exactly one slot of one range
    (`check_invariants` verifies it). The pool never picks where a page goes; the layout does, using
    `take_free` / `map` / `unmap`. Single-threaded: callers serialize remaps (the engine pauses its
    step loop around drop/restore).
    """

    backend: ClassVar[str]
    #: smallest legal page size (host: the 4 KiB kernel page; cuda: the allocation granularity)
    min_page_size: int = 4096

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        if page_size <= 0 or page_size % self.min_page_size:
            raise ValueError(f"page_size must be a positive multiple of {self.min_page_size} bytes "
                             f"for the {self.backend} backend, got {page_size}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._owner: list[tuple[VirtualRange, int] | None] = [None] * self.num_pages
        self._free: set[int] = set(range(self.num_pages))
        self._ranges: dict[int, VirtualRange] = {}
        self._next_rid = 0
        self._closed = False
        #: cumulative counters for benchmarks and `memory_map()`
        self.stats: dict[str, int] = {"map_calls": 0, "unmap_calls": 0, "pages_mapped": 0, "pages_unmapped": 0,
                                      "pages_discarded": 0}

    # ------------------------------------------------------------------ backend primitives
    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where tensors over this pool live."""

    @abstractmethod
    def _reserve_va(self, nbytes: int, alignment: int) -> int:
        """Reserve `nbytes` of inaccessible virtual address space aligned to `alignment`; return its base."""

    @abstractmethod
    def _free_va(self, base: int, nbytes: int) -> None:
        """Give back a whole reservation (every slot already unmapped)."""

    @abstractmethod
    def _map_run(self, address: int, first_page: int, count: int) -> None:
        """Map physical pages [first_page, first_page + count) at `address` (read-write)."""

    @abstractmethod
    def _unmap_run(self, address: int, count: int) -> None:
        """Unmap `count` page slots starting at `address`, keeping them reserved."""

    @abstractmethod
    def _raw_view(self, address: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A uint8 tensor over [address, address + nbytes) and the object its storage keeps alive.

        The second value must support weak references and must hold a strong reference to `self`.
        """

    def _discard(self, pages: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Release the memory behind free pages, if the backend can (host: punch a hole in the memfd)."""

    def _before_unmap(self) -> None:  # noqa: B027 - optional hook
        """Wait until nothing in flight can still read the slots about to be unmapped (CUDA: synchronize)."""

    def _close_backend(self) -> None:  # noqa: B027 - optional hook
        """Release the physical pages themselves."""

    # ------------------------------------------------------------------ pages
    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def mapped_count(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_size

    def take_free(self, n: int) -> list[int]:
        """Pick the `n` lowest-numbered free pages (they stay free until `map`ped).

        Lowest-first keeps physically consecutive pages together, which lets the host backend map
        a run of them with one mmap call.
        """
        if n < 0:
            raise ValueError(f"page count must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        return heapq.nsmallest(n, self._free)

    def page_owner(self, page: int) -> tuple[VirtualRange, int] | None:
        """(range, slot) that page `page` is mapped into, or None when it is free."""
        return self._owner[page]

    def discard_free_pages(self) -> int:
        """Give the memory of every free page back to the system (host); returns pages discarded."""
        pages = sorted(self._free)
        if pages:
            self._discard(pages)
        return len(pages)

    # ------------------------------------------------------------------ ranges
    @property
    def ranges(self) -> list[VirtualRange]:
        return list(self._ranges.values())

    def reserve(self, num_slots: int, tag: str = "") -> VirtualRange:
        """Reserve a virtual range of `num_slots` page slots, all unmapped, aligned to the page size."""
        self._check_open()
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        nbytes = num_slots * self.page_size
        alignment = self.page_size & -self.page_size  # largest power of two dividing the page size
        base = self._reserve_va(nbytes, alignment)
        vr = VirtualRange(self._next_rid, tag, base, num_slots, self.page_size, [None] * num_slots)
        self._next_rid += 1
        self._ranges[vr.rid] = vr
        return vr

    def map(self, vr: VirtualRange, first_slot: int, pages: Sequence[int]) -> None:
        """Map free physical `pages` into slots [first_slot, first_slot + len(pages)) of `vr`.

        Runs of consecutive page ids are mapped with one backend call. Validation happens first:
        on error nothing is mapped.
        """
        self._check_range(vr)
        pages = [int(p) for p in pages]
        if not pages:
            return
        end = first_slot + len(pages)
        if first_slot < 0 or end > vr.num_slots:
            raise MemoryPoolError(f"slots [{first_slot}, {end}) outside range {vr.tag!r} of {vr.num_slots} slots")
        if len(set(pages)) != len(pages):
            raise MemoryPoolError(f"a page appears twice in one map call: {pages}")
        for s in range(first_slot, end):
            if vr.slots[s] is not None:
                raise MemoryPoolError(f"slot {s} of {vr.tag!r} is already mapped to page {vr.slots[s]}")
        for p in pages:
            if not (0 <= p < self.num_pages):
                raise MemoryPoolError(f"page {p} outside the pool of {self.num_pages} pages")
            if p not in self._free:
                owner = self._owner[p]
                where = f"{owner[0].tag!r} slot {owner[1]}" if owner else "?"
                raise MemoryPoolError(f"page {p} is not free (mapped at {where})")
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1:
                j += 1
            self._map_run(vr.address(first_slot + i), pages[i], j - i)
            self.stats["map_calls"] += 1
            i = j
        for k, p in enumerate(pages):
            vr.slots[first_slot + k] = p
            self._owner[p] = (vr, first_slot + k)
            self._free.discard(p)
        self.stats["pages_mapped"] += len(pages)

    def unmap(self, vr: VirtualRange, first_slot: int, count: int) -> list[int]:
        """Unmap slots [first_slot, first_slot + count) of `vr`; their pages become free.

        Raises ViewStillAliveError (and changes nothing) while a view overlapping those slots is
        referenced. Returns the freed page ids in slot order; the slots stay reserved.
        """
        self._check_range(vr)
        if count <= 0:
            return []
        end = first_slot + count
        if first_slot < 0 or end > vr.num_slots:
            raise MemoryPoolError(f"slots [{first_slot}, {end}) outside range {vr.tag!r} of {vr.num_slots} slots")
        for s in range(first_slot, end):
            if vr.slots[s] is None:
                raise MemoryPoolError(f"slot {s} of {vr.tag!r} is not mapped")
        self.ensure_no_views([(vr, first_slot, end)])
        self._before_unmap()
        self._unmap_run(vr.address(first_slot), count)
        self.stats["unmap_calls"] += 1
        freed: list[int] = []
        for s in range(first_slot, end):
            p = vr.slots[s]
            assert p is not None
            vr.slots[s] = None
            self._owner[p] = None
            self._free.add(p)
            freed.append(p)
        self.stats["pages_unmapped"] += count
        return freed

    def free_range(self, vr: VirtualRange) -> list[int]:
        """Unmap every mapped slot of `vr` and give the reservation back; returns the freed pages."""
        self._check_range(vr)
        self.ensure_no_views([(vr, 0, vr.num_slots)])
        freed: list[int] = []
        s = 0
        while s < vr.num_slots:
            if vr.slots[s] is None:
                s += 1
                continue
            e = s
            while e < vr.num_slots and vr.slots[e] is not None:
                e += 1
            freed += self.unmap(vr, s, e - s)
            s = e
        # Only now, with no slot mapped, is munmap of the whole reservation safe.
        self._free_va(vr.base, vr.nbytes)
        vr.released = True
        del self._ranges[vr.rid]
        return freed

    # ------------------------------------------------------------------ views
    def view(self, vr: VirtualRange, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-copy tensor of `shape`/`dtype` over bytes [offset, offset + nbytes) of `vr`.

        Every slot the view covers must be mapped now; the pool then refuses to unmap them while
        the view (or anything sharing its storage) is alive. `data_ptr()` == `vr.base + offset`.
        """
        self._check_range(vr)
        shape = tuple(int(d) for d in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if offset < 0 or offset % itemsize:
            raise MemoryPoolError(f"view offset {offset} is not a multiple of the {dtype} item size {itemsize}")
        if offset + nbytes > vr.nbytes:
            raise MemoryPoolError(f"view [{offset}, {offset + nbytes}) outside range {vr.tag!r} ({vr.nbytes} bytes)")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        first = offset // self.page_size
        end = -(-(offset + nbytes) // self.page_size)
        if None in vr.slots[first:end]:
            s = first + vr.slots[first:end].index(None)
            raise MemoryPoolError(f"view over unmapped slot {s} of {vr.tag!r} refused (it would fault on touch)")
        raw, tracker = self._raw_view(vr.address(0) + offset, nbytes)
        if len(vr.views) >= 64:
            vr.live_views()  # prunes dead entries
        vr.views.append((weakref.ref(tracker), first, end))
        return raw.view(dtype).view(shape)

    def ensure_no_views(self, spans: Iterable[tuple[VirtualRange, int, int]]) -> None:
        """Raise ViewStillAliveError when any view overlaps one of the (range, first_slot, end_slot) spans.

        Runs a garbage collection once before giving up, since views caught in reference cycles
        are dead but not yet freed.
        """
        spans = list(spans)

        def busy() -> list[str]:
            return [f"{vr.tag or vr.rid}[{a}:{b}]" for vr, a, b in spans if vr.live_views(a, b)]

        if not busy():
            return
        gc.collect()
        names = busy()
        if names:
            raise ViewStillAliveError(
                "tensor views over pages that would be unmapped are still referenced: "
                + ", ".join(names)
                + "; release them (model parameters, cached KV tensors, slices, numpy arrays) and retry",
                names,
            )

    # ------------------------------------------------------------------ checks & lifetime
    def check_invariants(self) -> None:
        """Verify the page bookkeeping: each page free xor mapped into exactly one live slot."""
        seen: dict[int, tuple[int, int]] = {}
        for vr in self._ranges.values():
            assert not vr.released, f"released range {vr.tag!r} still registered"
            assert len(vr.slots) == vr.num_slots
            for s, p in enumerate(vr.slots):
                if p is None:
                    continue
                assert 0 <= p < self.num_pages, f"{vr.tag!r} slot {s} holds page {p} outside the pool"
                assert p not in seen, f"page {p} mapped twice: range {seen[p]} and ({vr.rid}, {s})"
                seen[p] = (vr.rid, s)
                assert p not in self._free, f"page {p} is mapped and on the free list"
                owner = self._owner[p]
                assert owner is not None and owner[0] is vr and owner[1] == s, f"owner of page {p} is stale"
        for p, owner in enumerate(self._owner):
            if owner is None:
                assert p in self._free, f"page {p} is neither mapped nor free (lost)"
            else:
                assert p in seen, f"page {p} points at a slot that does not hold it"
        assert len(seen) + len(self._free) == self.num_pages, "mapped + free != total"

    def _check_open(self) -> None:
        if self._closed:
            raise MemoryPoolError(f"the {self.backend} page pool is closed")

    def _check_range(self, vr: VirtualRange) -> None:
        self._check_open()
        if vr.released or self._ranges.get(vr.rid) is not vr:
            raise MemoryPoolError(f"range {vr.tag!r} does not belong to this pool or was released")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap everything and release the pages. Refuses while any view is alive."""
        if self._closed:
            return
        self.ensure_no_views([(vr, 0, vr.num_slots) for vr in self._ranges.values()])
        for vr in list(self._ranges.values()):
            self.free_range(vr)
        self._close_backend()
        self._closed = True

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.free_count}, ranges={len(self._ranges)})")


# ---------------------------------------------------------------------- backend selection
def cuda_available() -> bool:
    """True when torch sees a GPU and cuda-python's driver API initializes.

    Without a driver, `cuInit` raises (a RuntimeError subclass) rather than returning an error
    code (MEASURED.md), so both are caught.
    """
    try:
        if not torch.cuda.is_available():
            return False
        driver = importlib.import_module("cuda.bindings.driver")
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return False
    try:
        (err,) = driver.cuInit(0)
    except Exception:  # noqa: BLE001
        return False
    return int(err) == 0


def select_backend(name: str = "auto") -> str:
    """Resolve "auto" | "host" | "cuda" to a backend name; "auto" picks cuda only when it works."""
    if name == "auto":
        return "cuda" if cuda_available() else "host"
    if name not in BACKENDS:
        raise ValueError(f"unknown memory backend {name!r}; expected auto, host or cuda")
    return name


def create_pool(backend: str = "auto", *, num_pages: int | None = None, pool_bytes: int | None = None,
                page_size: int = DEFAULT_PAGE_SIZE, **kwargs: Any) -> PagePool:
    """Make a pool of `num_pages` pages (or `pool_bytes` rounded down to whole pages)."""
    if (num_pages is None) == (pool_bytes is None):
        raise ValueError("give exactly one of num_pages or pool_bytes")
    if num_pages is None:
        assert pool_bytes is not None
        num_pages = pool_bytes // page_size
    name = select_backend(backend)
    if name == "host":
        from .host import HostPagePool

        return HostPagePool(num_pages, page_size, **kwargs)
    from .cuda import CudaPagePool

    try:
        return CudaPagePool(num_pages, page_size, **kwargs)
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise BackendUnavailable(f"cuda backend needs cuda-python: {e}") from e
