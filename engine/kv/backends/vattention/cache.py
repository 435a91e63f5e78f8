"""The vAttention KV cache (kv_backend="vattention"): each sequence's KV virtually contiguous, physical
pages mapped on demand, and shared between sequences by mapping one page at several addresses.

Memory (engine/vmm.py does the mapping):

    physical pool   num_blocks pages; page b is block b of the block pool:
                    [block_size tokens, K|V, num_layers, num_kv_heads, head_dim]
    virtual         one reservation [num_slots, slot_len, K|V, num_layers, num_kv_heads, head_dim]
                    (slot_len = pages_per_slot * block_size >= max_model_len); page j of slot s holds
                    positions [j * block_size, (j + 1) * block_size) of the sequence in slot s

Per layer, K (and V) is the strided view [num_slots, slot_len, num_kv_heads, head_dim] of that
reservation: position p of the sequence in slot s is row (s, p), with no block table. The layout is
token-major (a token's K and V rows of every layer are adjacent) so that one page holds whole tokens
for every layer and one mapping serves all layers: a mapping is a kernel VMA, a process has 65,530 of
them (vm.max_map_count), and per-layer pages would spend 2 x num_layers of them per block (60 for
SmolLM2), which the CPU's 4 KiB pages turn into a hard limit long before memory runs out.
A page's bytes, block_size x 2 x layers x heads x head_dim x dtype, must be a whole number of OS pages:
`page_block_size` rounds the block size up to the smallest size that makes it so (16 stays 16 for
SmolLM2 in fp32: 720 KiB pages).

Prefix sharing is physical: a prefix-cache hit (or a fork's shared prompt) maps the cached blocks'
pages into the new sequence's slot, so one page is seen at two virtual addresses; copy-on-write of a
fork's partial page copies the physical page. Hashes, ref counts, pins and the LRU are the block pool's,
page for block, unchanged.

Mapping off the critical path (vAttention's overlap): a decoding sequence about to fill its last page
gets its next block early (EngineCore grows it `map_ahead_tokens` ahead), and `addressing` hands pages a
step does not read yet to a mapper thread, which maps them while the forward pass runs. Pages a step
needs that are not mapped yet are mapped synchronously and counted (`sync_maps`); slots keep their
mappings when their sequence ends (deferred reclamation, engine/slots.py).

NOTE: ownership. `SlotTable` is touched only on the engine thread; the mapper thread only makes
mmap calls on pages `addressing` gave it, and `addressing` waits for it before reading the table.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.kv.backends.base import Addressing, KVStat
from engine.kv.backends.vattention.slots import SlotTable
from engine.kv.backends.vattention.vmm import OS_PAGE_BYTES, HostVirtualMemory, mapping_budget
from engine.kv.block_manager import Placement
from engine.models.llama import ModelArgs


def page_block_size(args: ModelArgs, dtype: torch.dtype, block_size: int) -> int:
    """The smallest multiple of the granule >= block_size whose page is a whole number of OS pages."""
    token_bytes = 2 * args.num_layers * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
    granule = OS_PAGE_BYTES // math.gcd(OS_PAGE_BYTES, token_bytes)
    return -(-block_size // granule) * granule


class VAttentionCache:
    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 max_model_len: int, num_slots: int, ahead_tokens: int = 0) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError("kv_backend='vattention' runs on the CPU only for now (its CUDA VMM implementation "
                             "is not written yet); use kv_backend='paged' on GPUs")
        assert page_block_size(args, dtype, block_size) == block_size, "use page_block_size()"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.dims = (2, args.num_layers, args.num_kv_heads, args.head_dim)      # one token's row
        self.page_bytes = block_size * math.prod(self.dims) * torch.empty((), dtype=dtype).element_size()
        self.pages_per_slot = -(-max_model_len // block_size)
        self.slot_len = self.pages_per_slot * block_size
        self.vm = HostVirtualMemory(num_blocks, self.page_bytes)
        phys = self.vm.physical_view(dtype).view(num_blocks, block_size, *self.dims)
        self.pages = phys                                     # [num_blocks, block_size, 2, L, Hkv, D]
        # the pool seen as a paged cache [L, num_blocks, block_size, Hkv, D] (tests, copies)
        self.key = phys[:, :, 0].permute(2, 0, 1, 3, 4)
        self.value = phys[:, :, 1].permute(2, 0, 1, 3, 4)
        self.slots = SlotTable(num_slots, self.pages_per_slot)
        self.placement: Placement | None = self.slots     # a sequence's blocks go where its slot maps them
        self.ahead_tokens = ahead_tokens
        self._addr = 0
        self._reserved = 0
        self._reserve(num_slots)
        self.budget = mapping_budget()
        self._mapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vattention-map")
        self._pending: tuple[Future[list[tuple[int, int]]], list[tuple[int, int, int]]] | None = None
        self.sync_maps = self.decode_stalls = self.ahead_maps = self.reused_pages = self.reclaimed_pages = 0
        self.sync_map_seconds = 0.0

    # -- virtual memory ---------------------------------------------------------------------------
    def _page_addr(self, slot: int, page: int) -> int:
        return self._addr + (slot * self.pages_per_slot + page) * self.page_bytes

    def _reserve(self, num_slots: int) -> None:
        """(Re)build the reservation for `num_slots` slots; what was mapped is mapped again in place
        (no data moves: the pages are the pool's)."""
        nbytes = num_slots * self.pages_per_slot * self.page_bytes
        old = (self._addr, self._reserved * self.pages_per_slot * self.page_bytes) if self._reserved else None
        self._addr = self.vm.reserve(nbytes)
        self._reserved = num_slots
        for s, row in enumerate(self.slots.mapped[:num_slots]):
            for j, b in enumerate(row):
                if b >= 0:
                    self.vm.map(self._page_addr(s, j), b)
        if old is not None:
            self.vm.release(*old)
        virt = self.vm.view(self._addr, nbytes, self.dtype).view(num_slots, self.slot_len, *self.dims)
        # per layer [num_slots, slot_len, Hkv, D] (strided: a token row is 2 * L * Hkv * D apart)
        self.key_virtual = virt[:, :, 0].permute(2, 0, 1, 3, 4)
        self.value_virtual = virt[:, :, 1].permute(2, 0, 1, 3, 4)

    # -- one step ---------------------------------------------------------------------------------
    def layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_virtual, self.value_virtual

    def addressing(self, seq_ids: list[int], tables: list[list[int]], seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        """Maps what the step reads (synchronously where not done yet), hands what it does not read yet to
        the mapper; returns each new token's row in the flattened [num_slots * slot_len] view, and the slots."""
        self._finish_ahead()
        if self.slots.num_slots > self._reserved:           # forks outnumbered the slots: the table grew
            self._reserve(self.slots.num_slots)
        slots = [self.slots.slot_of[sid] for sid in seq_ids]
        work = [(slot, self.slots.missing(slot, table), -(-n // self.block_size), len(table), dec)
                for slot, table, n, dec in zip(slots, tables, seq_lens, decoding)]
        new = sum(len(w[1]) for w in work)
        if self.slots.num_mapped + new > self.budget:
            self._reclaim(new, {w[0]: w[3] for w in work})
        ahead: list[tuple[int, int, int]] = []
        t0 = time.perf_counter()
        for slot, missing, needed, _, decode in work:
            self.reused_pages += needed - sum(1 for j, _ in missing if j < needed)
            for j, b in missing:
                if j < needed:
                    self.vm.map(self._page_addr(slot, j), b)
                    self.slots.set_mapped(slot, j, b)
                    self.sync_maps += 1
                    self.decode_stalls += decode
                else:
                    ahead.append((slot, j, b))
        self.sync_map_seconds += time.perf_counter() - t0
        if ahead:
            for slot, j, b in ahead:                        # recorded now; undone if the mapper fails
                self.slots.set_mapped(slot, j, b)
            self._pending = (self._mapper.submit(self._map_all, [(self._page_addr(s, j), b) for s, j, b in ahead]),
                             ahead)
        rows = np.asarray(slots, dtype=np.int64)[seq_of_token] * self.slot_len + positions
        return Addressing(rows, None, slots)

    def _map_all(self, jobs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """On the mapper thread: map each (address, page); returns the ones that failed."""
        failed = []
        for addr, page in jobs:
            try:
                self.vm.map(addr, page)
            except OSError:
                failed.append((addr, page))
        return failed

    def _finish_ahead(self) -> None:
        if self._pending is None:
            return
        fut, jobs = self._pending
        self._pending = None
        failed = set(fut.result())
        for slot, j, b in jobs:
            if (self._page_addr(slot, j), b) in failed:
                self.slots.set_mapped(slot, j, -1)          # mapped synchronously when a step needs it
            else:
                self.ahead_maps += 1

    def _reclaim(self, wanted: int, busy: dict[int, int]) -> None:
        """Undo stale mappings, the most stale first, until `wanted` new ones fit the budget with room."""
        goal = max(0, int(self.budget * 0.75) - wanted)
        for slot, first, count in self.slots.reclaimable(busy):
            if self.slots.num_mapped <= goal:
                break
            self.vm.unmap(self._page_addr(slot, first), count * self.page_bytes)
            before = self.slots.num_mapped
            self.slots.clear(slot, first, count)
            self.reclaimed_pages += before - self.slots.num_mapped

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: whole physical pages (every layer's K and V) src -> dst."""
        if pairs:
            self.pages[torch.tensor([d for _, d in pairs])] = self.pages[torch.tensor([s for s, _ in pairs])]

    def stats(self, blocks_of: Callable[[int], int]) -> dict[str, KVStat]:
        live = sum(blocks_of(seq_id) for seq_id in self.slots.slot_of)
        return {
            "page_bytes": KVStat("gauge", self.page_bytes, "Bytes of one page (block_size tokens, all layers)"),
            "num_slots": KVStat("gauge", self._reserved, "vAttention slots reserved (virtual address space)"),
            "busy_slots": KVStat("gauge", len(self.slots.slot_of), "vAttention slots held by a sequence"),
            "mapped_pages": KVStat("gauge", self.slots.num_mapped, "vAttention page mappings in place (in use and "
                                   "kept for reuse)"),
            "live_pages": KVStat("gauge", live, "Of those, pages the sequences holding slots use"),
            "sync_maps": KVStat("counter", self.sync_maps, "Pages mapped on the critical path (a step needed them "
                                "unmapped)"),
            "decode_stalls": KVStat("counter", self.decode_stalls, "Of those, the page of a decoding request's next "
                                    "token (mapping ahead should make this 0)"),
            "ahead_maps": KVStat("counter", self.ahead_maps, "Pages mapped ahead of need by the mapper thread, "
                                 "during a forward pass"),
            "reused_pages": KVStat("counter", self.reused_pages, "Pages a step needed that were already mapped in "
                                   "place"),
            "reclaimed_pages": KVStat("counter", self.reclaimed_pages, "Stale mappings undone for want of mappings "
                                      "(vm.max_map_count)"),
            "sync_map_seconds": KVStat("counter", self.sync_map_seconds, "Seconds spent mapping pages on the "
                                       "critical path"),
        }

    def close(self) -> None:
        self._finish_ahead()
        self._mapper.shutdown(wait=True)


__all__ = ["VAttentionCache", "page_block_size"]
