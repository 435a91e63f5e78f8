"""HostVirtualMemory: reserved address space, physical pages mapped into it, one page at two addresses."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kv.backends.vattention.vmm import OS_PAGE_BYTES, HostVirtualMemory, map_areas_left

PAGE = 2 * OS_PAGE_BYTES


def test_one_page_mapped_twice_is_one_memory() -> None:
    """Sharing is physical: a write through one virtual address is read through the other, and in the pool."""
    vm = HostVirtualMemory(num_pages=4, page_bytes=PAGE)
    base = vm.reserve(8 * PAGE)
    vm.map(base + 1 * PAGE, 2)
    vm.map(base + 6 * PAGE, 2)
    vm.map(base + 7 * PAGE, 3)
    virt = vm.view(base, 8 * PAGE, torch.float32).view(8, -1)
    phys = vm.physical_view(torch.float32).view(4, -1)
    assert virt[1].eq(0).all()                           # a fresh page reads as zeros
    virt[1] = torch.arange(virt.shape[1], dtype=torch.float32)
    assert torch.equal(virt[6], virt[1]) and torch.equal(phys[2], virt[1])
    phys[2, 5] = -1.0
    assert virt[1, 5] == virt[6, 5] == -1.0
    assert virt[7].eq(0).all() and phys[3].eq(0).all()  # page 3 is another memory


def test_map_replaces_what_was_there() -> None:
    vm = HostVirtualMemory(num_pages=2, page_bytes=PAGE)
    phys = vm.physical_view(torch.int32).view(2, -1)
    phys[0], phys[1] = 10, 11
    base = vm.reserve(PAGE)
    view = vm.view(base, PAGE, torch.int32)
    vm.map(base, 0)
    assert view.eq(10).all()
    vm.map(base, 1)                                      # remap in place: the same view now shows page 1
    assert view.eq(11).all()


_TOUCH = """
import torch
from engine.kv.backends.vattention.vmm import HostVirtualMemory
vm = HostVirtualMemory(num_pages=1, page_bytes={page})
base = vm.reserve(2 * {page})
vm.map(base, 0)
view = vm.view(base, 2 * {page}, torch.uint8)
view[0] = 1                                   # mapped: fine
{then}
print("survived", flush=True)
"""


@pytest.mark.parametrize("then", ["view[{page}] = 1", "vm.unmap(base, {page}); view[0] = 1"],
                         ids=["never-mapped", "unmapped"])
def test_an_unmapped_page_is_no_memory(then: str) -> None:
    """A reserved page with nothing mapped is not memory (as an unmapped CUDA VMM range is not): touching it
    kills the process with SIGSEGV. Run in a child process."""
    code = _TOUCH.format(page=PAGE, then=then.format(page=PAGE))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == -11 and "survived" not in proc.stdout, (proc.returncode, proc.stderr[-500:])


_FORK = """
import os, signal, torch
from engine.kv.backends.vattention.vmm import HostVirtualMemory
vm = HostVirtualMemory(num_pages=1, page_bytes={page})
base = vm.reserve({page})
vm.map(base, 0)
view = vm.view(base, {page}, torch.uint8)
pool = vm.physical_view(torch.uint8)
view[0] = 1
pid = os.fork()
if pid == 0:
    try:
        {write}[0] = 7                  # the KV pages are not the child's: no mapping there
    finally:
        os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", "parent", int(view[0]), int(pool[0]))
"""


@pytest.mark.parametrize("write", ["view", "pool"])
def test_a_forked_child_does_not_share_the_kv_pages(write: str) -> None:
    """MADV_DONTFORK: a child of fork() has no mapping at the KV pages (its write faults), so it can neither
    read nor corrupt the parent's KV."""
    code = _FORK.format(page=PAGE, write=write)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[5])
    assert proc.stdout.split() == ["child", str(int(signal.SIGSEGV)), "parent", "1", "1"], (proc.stdout,
                                                                                           proc.stderr[-500:])


def test_a_released_reservation_stays_mapped_while_a_view_of_it_lives() -> None:
    """release() never unmaps under a live view: the range goes when its last view does."""
    vm = HostVirtualMemory(num_pages=2, page_bytes=PAGE)
    base = vm.reserve(2 * PAGE)
    vm.map(base, 1)
    view = vm.view(base, PAGE, torch.int32)
    view[:] = 5
    vm.release(base, 2 * PAGE)
    assert vm.holds(base) and view.eq(5).all()          # still mapped: the view reads the page
    del view
    gc.collect()
    assert not vm.holds(base)
    with pytest.raises(ValueError):
        vm.release(base, 2 * PAGE)                       # once only


def test_views_keep_the_memory_alive_and_then_release_it() -> None:
    vm = HostVirtualMemory(num_pages=1, page_bytes=PAGE)
    fd = vm.fd
    view = vm.physical_view(torch.int64)
    view[0] = 42
    del vm
    gc.collect()
    assert view[0] == 42                                 # the view holds the mapping
    os.fstat(fd)                                         # and the pool's file is still open
    del view
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)                                     # last view gone: unmapped and closed


def test_page_size_must_be_whole_os_pages() -> None:
    with pytest.raises(ValueError, match="multiple of the OS page"):
        HostVirtualMemory(num_pages=1, page_bytes=OS_PAGE_BYTES + 512)


def test_map_areas_left_is_under_the_kernel_limit() -> None:
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    assert 0 < map_areas_left() <= limit // 2
