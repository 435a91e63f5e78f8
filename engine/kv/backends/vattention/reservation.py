"""The slots' virtual range of the vAttention KV backend: one reservation [num_slots, slot_len, K|V, L, Hkv, D],
its per-layer views, and the move to a bigger one when the slot table grows.

A move never leaves the views on a range that is not whole: the new range is reserved and every page
given to it is mapped first; only then do the views switch to it, in plain assignments that cannot fail,
and the old range is released (unmapped once no view of it is left: vmm.py). A failure before the
switch gives the new range back (or abandons it if it may hold a hole) and changes nothing else.

Ranges still in the address space after they were left (a view outlived the switch, or munmap failed)
keep their mappings counted (`retired_areas`) until they are gone.
"""
from __future__ import annotations

import torch

from engine.kv.backends.vattention.vmm import ReservationDamaged, VirtualMemory


class Reservation:
    def __init__(self, vm: VirtualMemory, num_slots: int, pages_per_slot: int, block_size: int,
                 dims: tuple[int, ...], dtype: torch.dtype) -> None:
        self.vm = vm
        self.pages_per_slot = pages_per_slot
        self.slot_len = pages_per_slot * block_size
        self.dims = dims                                   # one token's row: (K|V, layers, kv heads, head dim)
        self.dtype = dtype
        self.addr = vm.reserve(self._bytes(num_slots))     # OSError: nothing reserved
        self.num_slots = num_slots
        self.key, self.value = self._views(self.addr, num_slots)
        self._retired: dict[int, int] = {}                 # old ranges still in the address space -> mappings

    def _bytes(self, num_slots: int) -> int:
        return num_slots * self.pages_per_slot * self.vm.page_bytes

    def page_addr(self, slot: int, page: int, base: int | None = None) -> int:
        return (self.addr if base is None else base) + (slot * self.pages_per_slot + page) * self.vm.page_bytes

    def _views(self, addr: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        virt = self.vm.view(addr, self._bytes(num_slots), self.dtype).view(num_slots, self.slot_len, *self.dims)
        # per layer [num_slots, slot_len, Hkv, D] (strided: a token row is 2 * L * Hkv * D apart)
        return virt[:, :, 0].permute(2, 0, 1, 3, 4), virt[:, :, 1].permute(2, 0, 1, 3, 4)

    def retired_areas(self) -> int:
        """Memory mappings still held by ranges this reservation has left."""
        for addr in [a for a in self._retired if not self.vm.holds(a)]:
            del self._retired[addr]
        return sum(self._retired.values())

    def move(self, num_slots: int, runs: list[tuple[int, int, int, int]], new_areas: int, old_areas: int) -> None:
        """To a range of `num_slots` slots, with `runs` (slot, first page, first block, count) mapped in it
        (`new_areas` mappings; the range left holds `old_areas` until it is gone). Raises OSError or
        ReservationDamaged with nothing changed."""
        nbytes = self._bytes(num_slots)
        addr = self.vm.reserve(nbytes)
        try:
            for s, j, b, k in runs:
                self.vm.map(self.page_addr(s, j, addr), b, k)
            views = self._views(addr, num_slots)
        except ReservationDamaged:               # never touched again; counted for as long as the process lives
            self.vm.abandon(addr)
            self._retired[addr] = new_areas
            raise
        except BaseException:
            self.vm.release(addr, nbytes)        # nothing views it yet: unmapped now
            self._retired[addr] = new_areas      # (until it is gone; for good if munmap failed)
            raise
        old = (self.addr, self._bytes(self.num_slots))
        self.addr, self.num_slots = addr, num_slots
        self.key, self.value = views
        self._retired[old[0]] = old_areas
        self.vm.release(*old)                    # unmapped once no view of it is left


__all__ = ["Reservation"]
