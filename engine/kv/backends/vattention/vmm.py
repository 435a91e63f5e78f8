"""Virtual memory for the vAttention KV backend: reserve address space, map physical pages into it.

One small interface, `VirtualMemory` (reserve / map / unmap, and a tensor view of a range), over a pool
of equal physical pages. Sharing is mapping: the same physical page mapped at two virtual addresses is
one memory seen twice, which is how a cached prefix is shared between requests without a copy.

`HostVirtualMemory` is the CPU implementation over Linux virtual memory, through libc (ctypes):

    physical pool   one memfd of num_pages * page_bytes (tmpfs: memory is taken on first touch)
    reserve         mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE): address space only
    map             mmap(addr, page_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, memfd, page * page_bytes)
    unmap           the PROT_NONE anonymous mapping put back over the range (the reservation stays whole)

A read or write of a reserved range that has no page mapped is a SIGSEGV, as a CUDA VMM range without
a mapping is an illegal address: callers touch only what they mapped. On GPUs the same interface is
CUDA's VMM (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess, 2 MiB granularity); that
implementation is not written yet (no GPU was at hand to test it), see README.md.

NOTE: every mapping is a kernel VMA, and a process has at most vm.max_map_count of them (65,530 by
default); `mapping_budget()` says how many page mappings this process may hold.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from pathlib import Path
from typing import Protocol

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
# Linux values (the same on x86-64 and arm64) that Python's mmap module does not export.
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE

OS_PAGE_BYTES = mmap.PAGESIZE


class VirtualMemory(Protocol):
    page_bytes: int      # the mapping unit: one physical page
    num_pages: int       # physical pages in the pool

    def reserve(self, nbytes: int) -> int:
        """Address space for `nbytes` (a multiple of page_bytes), nothing mapped. Returns its address."""
        ...

    def release(self, addr: int, nbytes: int) -> None:
        """Give a reservation (and whatever is mapped in it) back. Views of it must be gone first."""
        ...

    def map(self, addr: int, page: int) -> None:
        """Map physical page `page` at `addr` (page-aligned, inside a reservation), replacing what was there."""
        ...

    def unmap(self, addr: int, nbytes: int) -> None:
        """Leave `nbytes` at `addr` reserved but unmapped."""
        ...

    def view(self, addr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor over [addr, addr + nbytes). Touch only mapped pages of it."""
        ...

    def physical_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole pool, page after page, as one flat tensor (copies and checks go through it)."""
        ...


def _check(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return addr


class _Mappings:
    """Owns the process resources (the memfd and every range still mapped); released when the last tensor
    view and the VirtualMemory are gone (views keep it alive through their buffer).

    NOTE: what this does not cover: `HostVirtualMemory.release(addr, n)` unmaps a reservation at once,
    whatever views of it still exist; a view of a released range (or of a page unmapped back to
    PROT_NONE) faults when touched. Callers drop their views of a range before releasing it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ranges: dict[int, int] = {}     # addr -> nbytes, every mmap we must undo

    @staticmethod
    def release(fd: int, ranges: dict[int, int]) -> None:
        for addr, nbytes in ranges.items():
            _libc.munmap(addr, nbytes)
        os.close(fd)


class HostVirtualMemory:
    """VirtualMemory over Linux virtual memory: a memfd page pool mapped with MAP_FIXED (module docstring)."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if page_bytes % OS_PAGE_BYTES:
            raise ValueError(f"page_bytes ({page_bytes}) must be a multiple of the OS page ({OS_PAGE_BYTES})")
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        fd = os.memfd_create("prefixserve-kv", os.MFD_CLOEXEC)
        os.ftruncate(fd, num_pages * page_bytes)
        self._owner = _Mappings(fd)
        self._finalizer = weakref.finalize(self._owner, _Mappings.release, fd, self._owner.ranges)
        self._physical_addr = _check(_libc.mmap(None, num_pages * page_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                                                mmap.MAP_SHARED, fd, 0), "mmap of the page pool")
        self._owner.ranges[self._physical_addr] = num_pages * page_bytes

    def reserve(self, nbytes: int) -> int:
        assert nbytes > 0 and nbytes % self.page_bytes == 0
        addr = _check(_libc.mmap(None, nbytes, _PROT_NONE, _RESERVE_FLAGS, -1, 0), "address space reservation")
        self._owner.ranges[addr] = nbytes
        return addr

    def release(self, addr: int, nbytes: int) -> None:
        assert self._owner.ranges.get(addr) == nbytes, "not a reservation of this pool"
        del self._owner.ranges[addr]
        _libc.munmap(addr, nbytes)

    def map(self, addr: int, page: int) -> None:
        assert 0 <= page < self.num_pages and addr % OS_PAGE_BYTES == 0
        _check(_libc.mmap(addr, self.page_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                          self._owner.fd, page * self.page_bytes), f"mapping page {page}")

    def unmap(self, addr: int, nbytes: int) -> None:
        _check(_libc.mmap(addr, nbytes, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0), "unmapping")

    def view(self, addr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        buf = (ctypes.c_byte * nbytes).from_address(addr)
        buf._owner = self._owner         # type: ignore[attr-defined]  # the view keeps the memory alive
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)

    def physical_view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.view(self._physical_addr, self.num_pages * self.page_bytes, dtype)


def mapping_budget(headroom: float = 0.5) -> int:
    """Page mappings this process may add: a share of the VMAs it has left under vm.max_map_count
    (each mapping can cost two: itself, and the split of the reservation around it)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        used = sum(1 for _ in Path("/proc/self/maps").open())
    except OSError:
        limit, used = 65530, 1000
    return max(0, int((limit - used) * headroom) // 2)
