"""CUDA backend: physical pages from cuMemCreate, virtual ranges from cuMemAddressReserve.

This is what KunServe §4.1 (Fig. 7b) describes: each physical page is its own `cuMemCreate`
allocation of `page_size` bytes (cuMemMap maps a whole allocation — its offset argument must be 0 —
so one allocation per page is what lets any page go into any slot); a virtual range is a
`cuMemAddressReserve`; a slot is mapped with `cuMemMap` + `cuMemSetAccess` and unmapped with
`cuMemUnmap`, which leaves the address range reserved. Torch sees a mapped range through an
object exposing `__cuda_array_interface__` (`torch.as_tensor(obj, device="cuda")`), so no byte is
copied and `data_ptr()` is the slot address.

cuda-python (`cuda.bindings.driver`, 12.9 or 13.x) is imported lazily: this module imports on a
machine without it, and `CudaPagePool(...)` raises BackendUnavailable there. Without a driver,
`cuInit` raises instead of returning an error code (MEASURED.md); that is caught too.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from .errors import BackendUnavailable, MemoryPoolError, OutOfPagesError
from .pool import DEFAULT_PAGE_SIZE, PagePool


def _load_driver() -> Any:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as e:
        raise BackendUnavailable(f"the cuda memory backend needs cuda-python (cuda.bindings): {e}") from e


class _CudaArray:
    """The object torch keeps alive for a view: exposes the range as a flat uint8 CUDA array.

    It holds the pool so the pool (and its mappings) outlives every tensor over it; the pool keeps
    only a weak reference to it, to know whether a view is still alive before unmapping.
    """

    __slots__ = ("__cuda_array_interface__", "_pool", "__weakref__")

    def __init__(self, address: int, nbytes: int, pool: CudaPagePool) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }
        self._pool = pool


class CudaPagePool(PagePool):
    """`num_pages` device pages of `page_size` bytes on `device` (default: the current CUDA device).

    The page size must be a multiple of the allocation granularity (2 MiB on current GPUs).
    Unmapping synchronizes the device first so no queued kernel still reads the slot.
    """

    backend = "cuda"
    min_page_size = 1  # checked against the real granularity in __init__

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, *,
                 device: torch.device | str | int | None = None) -> None:
        drv = _load_driver()
        self._drv = drv
        self._handles: list[Any] = []
        try:
            (err,) = drv.cuInit(0)
        except Exception as e:  # no driver library: cuInit raises (cuda-python 12.9 and 13.x)
            raise BackendUnavailable(f"CUDA driver not available: {e}") from e
        if int(err) != 0:
            raise BackendUnavailable(f"cuInit failed: {self._err_name(err)}")
        if not torch.cuda.is_available():
            raise BackendUnavailable("torch does not see a CUDA device")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"cuda backend needs a cuda device, got {dev}")
        self._device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        ordinal = self._device.index
        # torch works in the device's primary context; make it current for the driver calls too.
        torch.cuda.init()
        with torch.cuda.device(ordinal):
            torch.empty(1, device=self._device)  # forces torch to create/bind the primary context
        (cu_dev,) = self._check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        (ctx,) = self._check(drv.cuDevicePrimaryCtxRetain(cu_dev), "cuDevicePrimaryCtxRetain")
        self._ctx_dev = cu_dev
        self._check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        (gran,) = self._check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        self.granularity = int(gran)
        if page_size <= 0 or page_size % self.granularity:
            raise ValueError(f"page_size must be a multiple of the CUDA allocation granularity "
                             f"({self.granularity} bytes), got {page_size}")
        super().__init__(num_pages, page_size)
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        try:
            for _ in range(self.num_pages):
                (h,) = self._check(drv.cuMemCreate(self.page_size, prop, 0), "cuMemCreate")
                self._handles.append(h)
        except MemoryPoolError:
            self._release_handles()
            raise

    # -------------------------------------------------------------- helpers
    def _err_name(self, err: Any) -> str:
        try:
            e2, name = self._drv.cuGetErrorName(err)
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001
            return str(err)

    def _check(self, result: Any, what: str) -> tuple[Any, ...]:
        """cuda-python returns (CUresult, *values); raise on an error, return the values."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            name = self._err_name(err)
            if "OUT_OF_MEMORY" in name:
                raise OutOfPagesError(f"{what}: {name}")
            raise MemoryPoolError(f"{what} failed: {name}")
        return tuple(values)

    def _ptr(self, address: int) -> Any:
        return self._drv.CUdeviceptr(address)

    @property
    def device(self) -> torch.device:
        return self._device

    # -------------------------------------------------------------- primitives
    def _reserve_va(self, nbytes: int, alignment: int) -> int:
        (ptr,) = self._check(self._drv.cuMemAddressReserve(nbytes, max(alignment, self.granularity),
                                                           self._ptr(0), 0), "cuMemAddressReserve")
        return int(ptr)

    def _free_va(self, base: int, nbytes: int) -> None:
        self._check(self._drv.cuMemAddressFree(self._ptr(base), nbytes), "cuMemAddressFree")

    def _map_run(self, address: int, first_page: int, count: int) -> None:
        done = 0
        try:
            for i in range(count):
                self._check(self._drv.cuMemMap(self._ptr(address + i * self.page_size), self.page_size, 0,
                                               self._handles[first_page + i], 0), "cuMemMap")
                done += 1
            # One access call may span several mappings.
            self._check(self._drv.cuMemSetAccess(self._ptr(address), count * self.page_size, self._access, 1),
                        "cuMemSetAccess")
        except MemoryPoolError:
            for i in range(done):  # leave the slots as they were
                self._drv.cuMemUnmap(self._ptr(address + i * self.page_size), self.page_size)
            raise

    def _unmap_run(self, address: int, count: int) -> None:
        # cuMemUnmap must cover whole mappings; each page is its own mapping.
        for i in range(count):
            self._check(self._drv.cuMemUnmap(self._ptr(address + i * self.page_size), self.page_size), "cuMemUnmap")

    def _before_unmap(self) -> None:
        torch.cuda.synchronize(self._device)

    def _raw_view(self, address: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        arr = _CudaArray(address, nbytes, self)
        return torch.as_tensor(arr, device=self._device), arr

    def _discard(self, pages: Sequence[int]) -> None:
        # Device pages stay committed to the pool; their contents are simply irrelevant while free.
        return None

    def _release_handles(self) -> None:
        for h in self._handles:
            try:
                self._drv.cuMemRelease(h)
            except Exception:  # noqa: BLE001
                pass
        self._handles = []

    def _close_backend(self) -> None:
        self._release_handles()
        try:
            self._drv.cuDevicePrimaryCtxRelease(self._ctx_dev)
        except Exception:  # noqa: BLE001
            pass
