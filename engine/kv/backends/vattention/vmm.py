"""Virtual memory for the vAttention KV backend: reserve address space, map physical pages into it.

One small interface, `VirtualMemory` (reserve / map / unmap / release, and a tensor view of a range), over
a pool of equal physical pages. Sharing is mapping: the same physical page mapped at two virtual
addresses is one memory seen twice, which is how a cached prefix is shared between requests without a copy.

`HostVirtualMemory` is the CPU implementation over Linux virtual memory, through libc (ctypes):

    physical pool   one memfd of num_pages * page_bytes (tmpfs: memory is taken on first touch)
    reserve         mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE): address space only
    map             mmap(addr, k * page_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, memfd,
                    page * page_bytes): k consecutive pages with one call, then madvise(MADV_DONTFORK)
    unmap           the PROT_NONE anonymous mapping put back over the range (the reservation stays whole)
    release         munmap of the whole reservation, once no tensor view of it is left

A read or write of a reserved range that has no page mapped is a SIGSEGV, as a CUDA VMM range without
a mapping is an illegal address: callers touch only what they mapped. On GPUs the same interface is
CUDA's VMM (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess, 2 MiB granularity); that
implementation is not written yet (no GPU was at hand to test it), see README.md.

NOTE: failures. Every syscall goes through `sys_mmap` / `sys_munmap` / `sys_madvise` (tests make them fail
at every step). A `map` or `unmap` that fails puts PROT_NONE back over its range before it raises OSError,
so the reservation never keeps a hole: a hole is address space the kernel may hand to any other mmap of
the process, which the next MAP_FIXED into it would then overwrite. A hole is refilled with
MAP_FIXED_NOREPLACE (which never overwrites anything); a range still mapped by us (the kernel refused the
call without touching it, as Linux >= 6.12 always does) is replaced with MAP_FIXED. When PROT_NONE cannot
be put back, `ReservationDamaged` says so: nothing may be mapped into that reservation again.

NOTE: forks. The KV pages are mapped MADV_DONTFORK: a child process made by fork() does not inherit
them (the addresses are unmapped in the child), so it can neither read nor write another request's KV.
The reservations themselves are PROT_NONE anonymous memory, copied harmlessly.

NOTE: every mapping is a kernel VMA, and a process has at most vm.max_map_count of them (65,530 by
default); `map_areas_left()` says how many this process may still add. Consecutive pages of the pool
mapped at consecutive addresses are merged by the kernel into one VMA.
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
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
# Linux values (the same on x86-64 and arm64) that Python's mmap module does not export.
MAP_FIXED = 0x10
MAP_FIXED_NOREPLACE = 0x100000
_MAP_NORESERVE = 0x4000
_MADV_DONTFORK = 10
PROT_NONE = 0
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE

OS_PAGE_BYTES = mmap.PAGESIZE


# -- the syscalls, one wrapper each (tests replace them to fail at any step) -------------------------
def sys_mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _libc.mmap(addr, nbytes, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    return int(got)


def sys_munmap(addr: int, nbytes: int) -> None:
    if _libc.munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap: {os.strerror(err)}")


def sys_madvise(addr: int, nbytes: int, advice: int) -> None:
    if _libc.madvise(addr, nbytes, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise: {os.strerror(err)}")


class ReservationDamaged(RuntimeError):
    """PROT_NONE could not be put back over a range: it may hold a hole, which other mappings of the process
    may fill. Nothing may be mapped into that reservation again."""


class VirtualMemory(Protocol):
    page_bytes: int      # the mapping unit: one physical page
    num_pages: int       # physical pages in the pool

    def reserve(self, nbytes: int) -> int:
        """Address space for `nbytes` (a multiple of page_bytes), nothing mapped. Returns its address.
        Raises OSError (nothing reserved)."""
        ...

    def release(self, addr: int, nbytes: int) -> None:
        """Give a reservation (and whatever is mapped in it) back, once no view of it is left."""
        ...

    def abandon(self, addr: int) -> None:
        """Forget a damaged reservation without unmapping it (whatever fills its hole is not ours)."""
        ...

    def holds(self, addr: int) -> bool:
        """The reservation at `addr` is still in the address space (not released, still viewed, or leaked)."""
        ...

    def map(self, addr: int, page: int, count: int = 1) -> None:
        """Map physical pages page .. page + count - 1 at addr .. (page-aligned, inside a reservation),
        replacing what was there. Raises OSError with the range left PROT_NONE, or ReservationDamaged."""
        ...

    def unmap(self, addr: int, nbytes: int) -> None:
        """Leave `nbytes` at `addr` reserved but unmapped. Raises ReservationDamaged if it cannot."""
        ...

    def view(self, addr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor over [addr, addr + nbytes) of one reservation; the reservation lives as long as it."""
        ...

    def physical_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole pool, page after page, as one flat tensor (copies and checks go through it)."""
        ...


class _Pool:
    """The memfd; closed once the VirtualMemory and every range mapped from it are gone."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.leaked: dict[int, int] = {}          # addr -> nbytes of ranges whose munmap failed (still mapped)
        weakref.finalize(self, os.close, fd)


class _Range:
    """One range mmap'd by us (the pool's mapping, or a reservation). Unmapped when the last holder goes: the
    VirtualMemory until it releases it, and every tensor view of it (views hold it through their buffer),
    so that a released range is never unmapped under a live view."""

    def __init__(self, addr: int, nbytes: int, pool: _Pool) -> None:
        self.addr, self.nbytes, self.pool = addr, nbytes, pool
        self.finalizer = weakref.finalize(self, _Range._unmap, addr, nbytes, pool.leaked)

    @staticmethod
    def _unmap(addr: int, nbytes: int, leaked: dict[int, int]) -> None:
        try:
            sys_munmap(addr, nbytes)
        except OSError:
            leaked[addr] = nbytes                 # still in the address space: its owner keeps counting it


class HostVirtualMemory:
    """VirtualMemory over Linux virtual memory: a memfd page pool mapped with MAP_FIXED (module docstring)."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if page_bytes % OS_PAGE_BYTES:
            raise ValueError(f"page_bytes ({page_bytes}) must be a multiple of the OS page ({OS_PAGE_BYTES})")
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self._pool = _Pool(os.memfd_create("prefixserve-kv", os.MFD_CLOEXEC))
        os.ftruncate(self._pool.fd, num_pages * page_bytes)
        self._held: dict[int, _Range] = {}                                   # ranges not released
        self._alive: weakref.WeakValueDictionary[int, _Range] = weakref.WeakValueDictionary()   # and viewed ones
        nbytes = num_pages * page_bytes
        self._physical_addr = sys_mmap(None, nbytes, PROT_RW, mmap.MAP_SHARED, self._pool.fd, 0)
        self._hold(self._physical_addr, nbytes)
        sys_madvise(self._physical_addr, nbytes, _MADV_DONTFORK)    # on failure the range goes with self

    @property
    def fd(self) -> int:
        return self._pool.fd

    def _hold(self, addr: int, nbytes: int) -> None:
        rng = _Range(addr, nbytes, self._pool)
        self._held[addr] = rng
        self._alive[addr] = rng

    def reserve(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.page_bytes:
            raise ValueError(f"a reservation is whole pages, got {nbytes} bytes")
        addr = sys_mmap(None, nbytes, PROT_NONE, RESERVE_FLAGS, -1, 0)
        self._hold(addr, nbytes)
        return addr

    def release(self, addr: int, nbytes: int) -> None:
        rng = self._held.get(addr)
        if rng is None or rng.nbytes != nbytes or addr == self._physical_addr:
            raise ValueError("not a reservation of this pool")
        del self._held[addr]                    # unmapped now, or when its last view goes

    def abandon(self, addr: int) -> None:
        """Forget a damaged reservation without unmapping it (whatever fills its hole is not ours)."""
        rng = self._held.pop(addr, None)
        if rng is not None:
            rng.finalizer.detach()
            self._pool.leaked[addr] = rng.nbytes

    def holds(self, addr: int) -> bool:
        return addr in self._alive or addr in self._pool.leaked

    def map(self, addr: int, page: int, count: int = 1) -> None:
        nbytes = count * self.page_bytes
        if not (0 <= page and page + count <= self.num_pages and count >= 1 and addr % OS_PAGE_BYTES == 0):
            raise ValueError(f"pages {page}..{page + count - 1} at {addr:#x}: out of the pool or unaligned")
        try:
            sys_mmap(addr, nbytes, PROT_RW, mmap.MAP_SHARED | MAP_FIXED, self._pool.fd, page * self.page_bytes)
            sys_madvise(addr, nbytes, _MADV_DONTFORK)
        except OSError:
            self._restore(addr, nbytes)
            raise

    def unmap(self, addr: int, nbytes: int) -> None:
        try:
            sys_mmap(addr, nbytes, PROT_NONE, RESERVE_FLAGS | MAP_FIXED, -1, 0)
        except OSError:
            self._restore(addr, nbytes)

    def _restore(self, addr: int, nbytes: int) -> None:
        """PROT_NONE back over a range a failed call may have left as it was, emptied, or (older kernels)
        as a hole; raises ReservationDamaged if it cannot."""
        try:
            got = sys_mmap(addr, nbytes, PROT_NONE, RESERVE_FLAGS | MAP_FIXED_NOREPLACE, -1, 0)
            if got == addr:
                return                          # it was a hole, now reserved again; nothing overwritten
            sys_munmap(got, nbytes)             # a kernel without NOREPLACE (< 4.17) placed it elsewhere
        except OSError:
            pass                                # EEXIST: (some of) our mapping is still there
        try:
            sys_mmap(addr, nbytes, PROT_NONE, RESERVE_FLAGS | MAP_FIXED, -1, 0)
        except OSError as exc:
            raise ReservationDamaged(f"cannot put PROT_NONE back over a range of {nbytes} bytes: {exc}") from exc

    def view(self, addr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        rng = next((r for r in self._held.values() if r.addr <= addr and addr + nbytes <= r.addr + r.nbytes), None)
        if rng is None:
            raise ValueError(f"[{addr:#x}, +{nbytes}) is not inside a range of this pool")
        buf = (ctypes.c_byte * nbytes).from_address(addr)
        buf._range = rng                 # type: ignore[attr-defined]  # the view keeps the range mapped
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)

    def physical_view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.view(self._physical_addr, self.num_pages * self.page_bytes, dtype)


def map_areas_left(share: float = 0.5) -> int:
    """A share of the memory mappings (VMAs) this process may still add under vm.max_map_count."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except OSError:
        limit, used = 65530, 1000
    return max(0, int((limit - used) * share))
